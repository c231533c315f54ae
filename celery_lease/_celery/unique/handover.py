"""The hand-over (:func:`on_start`): a copy that holds its run lease, its body about to start,
frees its queued lease (``"while_queued"``) or keeps it renewed (``"until_done"``)."""

from __future__ import annotations

import functools
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from celery_lease._celery.protocols import can_renew_deferred
from celery_lease._celery.settings import LeaseSettings
from celery_lease._celery.unique import common
from celery_lease._celery.unique.common import header_owner, logger, ms, queue_ttl, queued_key
from celery_lease._celery.unique.hold import QueuedHold, holding, queued_lost
from celery_lease._celery.unique.redelivery import defer, deferrals, drop_finished
from celery_lease._core.held_key import HeldKey
from celery_lease._core.owners import parse_owner
from celery_lease._core.unique_options import UniqueOptions
from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.stores.base import LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import TaskRequest, UniqueTask


def on_start(
    task: UniqueTask,
    request: TaskRequest,
    store: LockStore,
    key: str,
    settings: LeaseSettings,
    unique: UniqueOptions,
    ttl: float,
    cooldown: float,
) -> QueuedHold | None:
    """The copy holds its run lease, its body about to start: hand the queued key over.
    ``"until_done"`` (without debounce) keeps it under its owner, renewed with the run ``ttl``
    until :meth:`QueuedHold.end` (a loss is only logged); otherwise it is released. Raises
    ``Ignore`` for a second delivery that is done or re-sent."""
    if getattr(request, "is_eager", False):
        return None
    task_id = getattr(request, "id", None)
    deferred = deferrals(request)
    if deferred and task_id is not None:
        _second_delivery(task, request, task_id, key, ttl, deferred)
    qkey = queued_key(key, settings.key_prefix)
    owner = header_owner(request, task_id, qkey)
    if owner is None or task_id is None:
        return None  # not published through apply_unique (send_task, or before lock_unique)
    if unique.debounce is not None:
        return None  # freed at its arrival (on_arrival)
    if unique.unique != "until_done":
        store.release(qkey, owner)
        return None
    # A copy that may have outlived its queued lease (a second delivery, or started half its
    # queue_ttl after its eta) takes the key back: a call made during the body must find it held.
    late = common.clock.time() >= _queued_since(owner, request) + queue_ttl(unique, settings) / 2
    retaken = None
    if deferred or late:
        retaken = store.acquire(qkey, owner, ms(ttl))
        if retaken is None:
            logger.info(
                "celery-lease: %r is held by another copy; %s runs all the same", qkey, task_id
            )
    return _hold(store, qkey, owner, task_id, ttl, cooldown, renewed=retaken is not None)


def _second_delivery(
    task: UniqueTask, request: TaskRequest, task_id: str, key: str, ttl: float, deferred: int
) -> None:
    """A second delivery runs only once its copy was seen not done twice, a ttl apart (a dead
    copy is still not done a ttl later). Else ``Ignore``."""
    done = common.finished(task, task_id)
    if done:
        drop_finished(task, task_id)  # the body ran already
    if done is None or deferred < 2:
        defer(
            task,
            request,
            key,
            ttl,
            deferred + (done is False),
            unfinished=done is False,
            ends_copy=True,  # the run key was free: no copy is known to run
        )


def _hold(
    store: LockStore,
    qkey: str,
    owner: str,
    task_id: str,
    ttl: float,
    cooldown: float,
    *,
    renewed: bool,
) -> QueuedHold:
    now = SYSTEM_CLOCK.monotonic()
    held = HeldKey(
        store=store,
        key=qkey,
        owner=owner,
        ttl=ttl,
        sent_at=now,
        max_hold_at=None,
        on_lost=functools.partial(queued_lost, qkey),
        # The owner is shared with a retry or redelivery: a loss must not free it under them.
        free_on_loss=False,
    )
    # Expiry set to ``ttl`` now, so a worker dying mid-body frees it within ``ttl``: sent
    # unanswered where the store can, else renewed at once on the renewer's thread.
    renew_now = not renewed and not (
        can_renew_deferred(store) and store.renew_deferred(qkey, owner, ms(ttl))
    )
    hold = QueuedHold(store, qkey, owner, task_id, held, cooldown)
    held.start(SYSTEM_CLOCK, renew_at=now if renew_now else None)
    holding[task_id] = hold
    return hold


def _queued_since(owner: str, request: TaskRequest) -> float:
    """When (wall clock, s) ``queue_ttl`` began: the eta or the call's ``at``; else ``-inf``."""
    taken_at = parse_owner(owner).taken_at
    eta = _wall_time(getattr(request, "eta", None))
    if taken_at is None:
        return float("-inf")
    return taken_at if eta is None else max(taken_at, eta)


def _wall_time(value: object) -> float | None:
    """Epoch seconds of an ``eta`` (ISO text or ``datetime``; naive means UTC), else ``None``."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()
