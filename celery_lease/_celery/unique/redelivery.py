"""A copy refused its run lease (:func:`on_rejected`), and a second delivery of a running copy,
re-sent to wait for it (:func:`defer`). Rules: the package docstring and
``docs/celery.md#unique-at-enqueue``."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, cast

from celery import states
from celery.exceptions import Ignore, Reject

from celery_lease._celery.protocols import is_inspectable
from celery_lease._celery.settings import LeaseSettings
from celery_lease._celery.unique import common
from celery_lease._celery.unique.common import logger
from celery_lease._core.owners import parse_owner
from celery_lease.stores.base import LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import TaskRequest, UniqueTask


def on_rejected(
    request: TaskRequest | None,
    store: LockStore,
    key: str,
    settings: LeaseSettings,
    *,
    task: UniqueTask | None = None,
    ttl: float | None = None,
    policy: str = "raise",
    refused_by: str | None = None,
) -> None:
    """The run lease stayed held: free the copy's queued key (not under ``on_held="retry"``).
    Held by this task id, or read free (the refuser cannot be told), the delivery is handled
    as a second one: re-sent to wait (``Ignore``; ``Reject`` if that fails for ``acks_late``),
    the policy not applied. A done copy's delivery ends."""
    if request is None or getattr(request, "is_eager", False):
        return
    task_id = getattr(request, "id", None)
    deferred = deferrals(request)
    if deferred and task_id is not None and task is not None and ttl is not None:
        # Re-sent earlier: never the policy (its copy may have succeeded), never its queued key.
        # Unless the refusal named its own running copy, a failed re-send ends it.
        own = refused_by is None or parse_owner(refused_by).task_id == task_id
        defer(task, request, key, ttl, deferred, ends_copy=not own)
    qkey = common.queued_key(key, settings.key_prefix)
    owner = common.header_owner(request, task_id, qkey)
    if owner is None and task is None:
        return
    if refused_by is not None or is_inspectable(store):
        try:
            holder = refused_by if refused_by is not None else _run_holder(store, key)
        except Exception as exc:
            logger.warning("celery-lease: reading %r failed (%s); %r is kept", key, exc, qkey)
            return  # frees itself within its ttl: never freed while its own body may run
        if task_id is not None and _refused_by_own_copy(request, task_id, key, holder, task, ttl):
            return
    if owner is not None and policy != "retry":
        common.release_quietly(store, qkey, owner, "the copy was rejected")


def _run_holder(store: LockStore, key: str) -> str | None:
    run = store.get(key) if is_inspectable(store) else None
    return run.owner if run is not None else None


def _refused_by_own_copy(
    request: TaskRequest,
    task_id: str,
    key: str,
    holder: str | None,
    task: UniqueTask | None,
    ttl: float | None,
) -> bool:
    """Whether ``holder`` is this copy's own run lease (a second delivery: re-sent or ended)."""
    engine = task is not None and ttl is not None
    if holder is not None and parse_owner(holder).task_id == task_id:
        # acks_late redelivery of the running copy: the queued key is the body's.
        if engine:
            defer(cast("UniqueTask", task), request, key, cast(float, ttl), 1)
        return True
    if holder is None and engine:
        # Free when read: the refuser may have been this very copy, just finished (on_held
        # would fail a copy that succeeded), so handle it as a second delivery.
        defer(cast("UniqueTask", task), request, key, cast(float, ttl), 1, ends_copy=True)
    # Held by another copy, maybe taken after this copy finished: a done copy's delivery ends.
    if engine and common.finished(cast("UniqueTask", task), task_id):
        drop_finished(cast("UniqueTask", task), task_id)
    return False


def deferrals(request: TaskRequest) -> int:
    """The ``lease_deferred`` header: how often this delivery was re-sent to wait for its copy."""
    value = getattr(request, common.DEFERRED, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def drop_finished(task: UniqueTask, task_id: str) -> NoReturn:
    """End a delivery of a copy that is done: ``Ignore``, nothing stored."""
    reason = "delivered again after it finished"
    logger.info("celery-lease: %s[%s] %s: body not run, nothing stored", task.name, task_id, reason)
    raise Ignore(reason)


def defer(
    task: UniqueTask,
    request: TaskRequest,
    key: str,
    ttl: float,
    count: int,
    *,
    unfinished: bool = False,
    ends_copy: bool = False,
) -> NoReturn:
    """Re-send this delivery ``ttl`` later with ``lease_deferred=count`` and raise ``Ignore``;
    drop it if its copy is done. A failed re-send of an ``acks_late`` message raises
    ``Reject(requeue=True)``; any other ends, its error stored as FAILURE only with
    ``ends_copy`` (no copy known to run)."""
    task_id = cast(str, request.id)  # every caller checked it
    if not unfinished and common.finished(task, task_id):  # in its cooldown, or releasing its key
        drop_finished(task, task_id)
    headers = {k: v for k, v in (getattr(request, "headers", None) or {}).items() if k != "x-death"}
    headers[common.DEFERRED] = count
    # As retry() re-sends, without ``expires`` (the copy started in time) and past unique's
    # checks (this is the copy itself).
    signature = task.signature_from_request(request, countdown=ttl, expires=None, headers=headers)
    try:
        options = {k: v for k, v in signature.options.items() if k != "task_id"}  # request.id
        task.publish_copy(signature.args, signature.kwargs, task_id, **options)
    except Exception as exc:
        _resend_failed(task, request, task_id, exc, ends_copy)
    logger.info(
        "celery-lease: %s[%s] delivered again while its own copy is not done (key %r): re-sent"
        " to come back in %gs, nothing stored",
        task.name,
        task_id,
        key,
        ttl,
    )
    raise Ignore("delivered again while its own copy runs")


def _resend_failed(
    task: UniqueTask, request: TaskRequest, task_id: str, exc: Exception, ends_copy: bool
) -> NoReturn:
    if getattr(request, "acks_late", None) or getattr(task, "acks_late", False):
        logger.warning(
            "celery-lease: re-sending the second delivery of %s[%s] failed (%s); rejected"
            " back to the broker",
            task.name,
            task_id,
            exc,
        )
        raise Reject(exc, requeue=True) from exc
    outcome = (
        "no copy of it is known to run: the error is stored as its failure"
        if ends_copy
        else "it ends here (acked on arrival: the copy that still runs carries its work)"
    )
    logger.error(
        "celery-lease: re-sending the second delivery of %s[%s] failed (%s); %s",
        task.name,
        task_id,
        exc,
        outcome,
    )
    if ends_copy:
        _fail_unless_stored(task, task_id, exc)
    raise Ignore("second delivery not re-sent") from exc


def _fail_unless_stored(task: UniqueTask, task_id: str, exc: Exception) -> None:
    """Store ``exc`` as the copy's FAILURE unless a ready state or RETRY is stored; never raises."""
    try:
        state = task.backend.get_state(task_id)
    except Exception as error:  # no backend (NotImplementedError), or it is down
        logger.debug("celery-lease: reading the state of %s failed (%s)", task_id, error)
        return
    if state not in states.READY_STATES and state != states.RETRY:
        common.fail_quietly(task, task_id, exc)
