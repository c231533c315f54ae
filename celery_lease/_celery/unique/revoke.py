"""The revoke receiver: a revoked (or expired) unique copy frees its queued key."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from celery_lease._celery.settings import get_settings
from celery_lease._celery.spec import options_of
from celery_lease._celery.store_resolution import store_for
from celery_lease._celery.unique import common
from celery_lease._celery.unique.common import logger

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest


def on_task_revoked(sender: object = None, request: TaskRequest | None = None, **_: object) -> None:
    """``task_revoked`` (also ``expires``): free a unique copy's queued key, owner-checked."""
    task = cast("CeleryTask", sender)  # the Task; ``request``: its Context (headers as attributes)
    options = options_of(type(task))
    if request is None or options is None or options.unique is None:
        return
    owner = common.header_owner(request, getattr(request, "id", None), None)
    if owner is None:
        return
    qkey = cast("list[str]", getattr(request, common.HEADER))[0]  # checked by header_owner
    try:
        prefix = get_settings(task.app).key_prefix
        if not qkey.startswith(prefix + common.NAMESPACE):  # a forged header naming another key
            return
        store = store_for(options.store, task.app)
    except Exception:
        logger.exception("celery-lease: no store to free the queued key of %s", request.id)
        return
    common.release_quietly(store, qkey, owner, "the copy was revoked")
