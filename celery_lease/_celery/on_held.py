"""The ``on_held`` policies: ``"raise"`` (default) raises ``LockNotAcquiredError``, ``"retry"``
the task's ``retry()``, ``"skip"`` returns ``None`` (a skipped worker execution ends REVOKED);
``lock_rejected`` and ``on_lock_rejected`` come first. ``"replace"`` (its loop:
:mod:`~celery_lease._celery.replace`) raises past its wait as ``"raise"`` does, and an execution
a newer one overtook ends as a skip does, with the reason ``"replaced"`` (:func:`superseded`), as
does one whose running body a newer call replaced under ``on_lost="revoke"`` (:func:`replaced`)."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, cast

from celery.exceptions import Ignore

from celery_lease import signals
from celery_lease._celery import compat, held_by
from celery_lease._core.options import LockOptions, retry_countdown
from celery_lease._core.owners import Holder
from celery_lease.errors import LockLostError, LockNotAcquiredError

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest

logger = logging.getLogger("celery_lease.engine")


def apply_policy(
    task: CeleryTask | None,
    request: TaskRequest | None,
    key: str,
    options: LockOptions,
    exc: LockNotAcquiredError,
    *,
    nested: bool,
    store: object = None,
    ttl: float = 0.0,
) -> None:
    """The key stayed held past ``wait``: send ``lock_rejected``, call ``on_lock_rejected``,
    apply ``options.on_held``. ``nested``: inside another run of the same task id; ``store``
    and ``ttl`` (s): a skip says who keeps the key."""
    policy = options.on_held
    found = (
        held_by.look_up(store, key, task, ttl, limited=options.limit is not None)
        if policy == "skip" and store is not None
        else None
    )
    signals.send(
        signals.lock_rejected,
        task,
        key=key,
        task_id=getattr(request, "id", None),
        reason=None if policy != "skip" else "held" if found is None else found.reason,
        until=None if found is None else found.until,
        holder_task_id=None if found is None else found.holder.task_id,
    )
    hook = getattr(task, "on_lock_rejected", None)
    if hook is not None:
        hook(key)
    if policy == "skip":
        what = "held by another execution" if found is None else found.describe()
        logger.info(
            "celery-lease: %s[%s] skipped: %r is %s",
            getattr(task, "name", "?"),
            getattr(request, "id", None),
            key,
            what,
        )
        if task is not None and request is not None and _marks_skipped(task, request, nested):
            _mark_skipped(task, request, key, what)  # raises Ignore: the REVOKED state stays
        return None
    if policy == "retry" and task is not None and request is not None:
        retries = int(getattr(request, "retries", 0) or 0)
        raise task.retry(countdown=retry_countdown(options, retries), exc=exc)
    raise exc


def superseded(
    task: CeleryTask | None,
    request: TaskRequest | None,
    key: str,
    newer: Holder,
    *,
    nested: bool,
) -> None:
    """A newer ``on_held="replace"`` call took or asked for ``key`` since this one asked: end as
    a skip does (``lock_rejected`` with reason ``"replaced"`` and the newer holder's task id,
    ``on_lock_rejected``; a worker execution ends REVOKED, else ``None`` is returned)."""
    signals.send(
        signals.lock_rejected,
        task,
        key=key,
        task_id=getattr(request, "id", None),
        reason="replaced",
        until=None,
        holder_task_id=newer.task_id,
    )
    hook = getattr(task, "on_lock_rejected", None)
    if hook is not None:
        hook(key)
    by = "" if newer.task_id is None else f" ({newer.task or '?'}[{newer.task_id}])"
    what = f"wanted by a newer call{by}"
    logger.info(
        "celery-lease: %s[%s] gave up: %r is %s",
        getattr(task, "name", "?"),
        getattr(request, "id", None),
        key,
        what,
    )
    if task is not None and request is not None and _marks_skipped(task, request, nested):
        _mark_skipped(task, request, key, what, policy="replace")  # raises Ignore


def replaced(
    task: CeleryTask | None, request: TaskRequest | None, error: LockLostError, *, nested: bool
) -> None:
    """A running execution's lease was lost because a newer ``on_held="replace"`` call asked
    for its key (``error``: its ``LockLostError``, reason ``"replaced"``): a worker execution's
    own body ends REVOKED as a skip does (``Ignore``: neither stored as a failure nor retried,
    so it never comes back to take the key from the newer call); else nothing (the caller
    raises ``error``)."""
    if task is None or request is None or not _marks_skipped(task, request, nested):
        return
    logger.info(
        "celery-lease: %s[%s] stopped: a newer call replaced it on %r",
        getattr(task, "name", "?"),
        getattr(request, "id", None),
        error.key,
    )
    reason = f"replaced: a newer call took over {error.key!r} (on_held='replace')"
    _end_revoked(task, request, reason)


# True while a ``@locked`` helper that is not its task's body runs: a skip there returns ``None`` to
# the body instead of marking the execution skipped.
skip_quietly: ContextVar[bool] = ContextVar("celery_lease_skip_quietly", default=False)


def _marks_skipped(task: CeleryTask | None, request: TaskRequest | None, nested: bool) -> bool:
    """Whether a skip ends the execution REVOKED: only a worker execution's own, un-nested body."""
    if task is None or request is None or getattr(request, "id", None) is None:
        return False
    if getattr(request, "called_directly", True) or getattr(request, "is_eager", False):
        return False
    return not skip_quietly.get() and not nested


def _mark_skipped(
    task: CeleryTask, request: TaskRequest, key: str, what: str, *, policy: str = "skip"
) -> None:
    """End a skipped worker execution REVOKED (:func:`_end_revoked`)."""
    _end_revoked(task, request, f"skipped: {key!r} {what} (on_held={policy!r})")


def _end_revoked(task: CeleryTask, request: TaskRequest, reason: str) -> None:
    """End a worker execution REVOKED with ``reason``, send ``task-revoked`` (also without
    ``-E``), then ``Ignore`` so nothing is stored over it. A backend error propagates."""
    if compat.get_actual_ignore_result is not None:
        ignore_result = bool(compat.get_actual_ignore_result(task, request))
    else:  # an older Celery without the helper
        ignore_result = bool(getattr(request, "ignore_result", False) or task.ignore_result)
    task.backend.mark_as_revoked(
        cast(str, request.id),  # _marks_skipped checked it
        reason,
        request=request,
        store_result=not ignore_result or bool(task.store_errors_even_if_ignored),
    )
    if task.send_events:
        try:
            task.send_event(
                "task-revoked", terminated=False, signum=None, expired=False, reason=reason
            )
        except Exception:
            logger.warning(
                "celery-lease: could not send task-revoked for %s[%s]",
                getattr(task, "name", "?"),
                request.id,
                exc_info=True,
            )
    raise Ignore(reason)
