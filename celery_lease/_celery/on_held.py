"""The ``on_held`` policies: what a locked execution does when its key stays held past ``wait``.

``"raise"`` (the default) raises :class:`~celery_lease.LockNotAcquiredError`; ``"retry"``
raises the task's ``retry()`` with the configured countdown; ``"skip"`` returns ``None``, and
a worker execution whose own body was skipped ends REVOKED with a reason that says skipped
(stored as Celery stores a revoked task, announced with a ``task-revoked`` event). Before any
of them, ``lock_rejected`` is sent and the task's ``on_lock_rejected`` hook is called.
Called by the run engine (:func:`celery_lease._celery.execution.run_locked`).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, cast

from celery.exceptions import Ignore

from celery_lease import signals
from celery_lease._celery import compat, held_by
from celery_lease._core.options import LockOptions, retry_countdown
from celery_lease.errors import LockNotAcquiredError

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest

__all__ = ["apply_policy", "skip_quietly"]

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
    then apply ``options.on_held`` (``"skip"``: return ``None``, or end a worker execution as
    REVOKED; ``"retry"``: raise the task's retry; ``"raise"``: raise ``exc``).

    ``nested``: this execution runs inside another locked run of the same task id (its skip
    returns ``None`` to the enclosing body). ``store`` and ``ttl`` (seconds, the task's lease
    ttl): for a skip, who keeps the key is read from ``store``
    (:func:`celery_lease._celery.held_by.look_up`) so that the skip says ``cooldown``, until
    when and after which execution, or which execution holds it; the other policies read
    nothing more.
    """
    policy = options.on_held
    found = (
        held_by.look_up(store, key, task, ttl) if policy == "skip" and store is not None else None
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


# A skipped run, visible as skipped ---------------------------------------------------------

skip_quietly: ContextVar[bool] = ContextVar("celery_lease_skip_quietly", default=False)
"""True while a ``@locked`` helper that is not its task's body runs (set by
:func:`celery_lease.locked`): a skip there returns ``None`` to the calling body, which goes on,
instead of marking the whole execution skipped."""


def _marks_skipped(task: CeleryTask | None, request: TaskRequest | None, nested: bool) -> bool:
    """Whether a skip ends a worker execution (marked REVOKED) rather than returning ``None``.

    Only the execution's own body: not a direct call, an eager run (``apply()``, ``always
    eager``), a ``@locked`` helper called from a body, nor a run nested in another locked run of
    the same execution.
    """
    if task is None or request is None or getattr(request, "id", None) is None:
        return False
    if getattr(request, "called_directly", True) or getattr(request, "is_eager", False):
        return False
    return not skip_quietly.get() and not nested


def _mark_skipped(task: CeleryTask, request: TaskRequest, key: str, what: str) -> None:
    """End a skipped worker execution as REVOKED, with a reason that says skipped and ``what``
    keeps the key (``held by another execution...``, ``in its cooldown until...``).

    Stored in the result backend as Celery stores a revoked task (``AsyncResult.get()`` raises
    ``TaskRevokedError(reason)`` at once), announced with a ``task-revoked`` event (Flower shows
    the task REVOKED), then ``Ignore`` so that the tracer stores nothing over it and the message
    is acknowledged. A backend error propagates (the run then fails, never a silent success); a
    failed event is logged. The event goes out from the process that ran the task, as
    ``Task.send_event`` sends it (Celery's own ``task-revoked`` comes from the main process,
    which never learns of this one), also when the worker runs without ``-E`` (Flower turns
    events on remotely, and the pool process cannot tell); ``send_events = False`` on the task
    turns it off.
    """
    reason = f"skipped: {key!r} {what} (on_held='skip')"
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
                "celery-lease: could not send task-revoked for skipped %s[%s]",
                getattr(task, "name", "?"),
                request.id,
                exc_info=True,
            )
    raise Ignore(reason)
