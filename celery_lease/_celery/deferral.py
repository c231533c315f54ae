"""Release without waiting for the reply: which worker executions may, and reading the replies.

A worker's execution whose success publishes nothing (its result is ignored, it is not part of a
chord, its class adds no ``on_success`` / ``after_return`` and no ``task_success`` /
``task_postrun`` receiver but ours is connected) sends its release without
waiting for the reply, on a store that can (:class:`~celery_lease.stores.base.
SupportsDeferredRelease`: the Redis store on a standalone server). The reply is read before the
next reply on that connection (the next task's acquire: one wait instead of two), before any
message this process publishes (``before_task_publish``: callbacks, chains, ``delay()`` from a
hook), and at process exit. So nothing this process publishes can be seen before the key is free
on the server. What it does not order: the broker ack and the ``task-succeeded`` event that the
worker sends after the task returns may leave before the lock server has read the release it
was already sent. ``app.conf.lease_defer_release = False`` waits for every release's reply.

A nested run is decided by its caller (:mod:`celery_lease._celery.execution`: the outermost
execution
only). The stores that can are the ones with
:class:`~celery_lease.stores.base.SupportsDeferredRelease`.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING

from celery.signals import task_postrun, task_success, worker_process_shutdown, worker_shutdown

from celery_lease import signals
from celery_lease._celery import compat, pool
from celery_lease._celery.protocols import can_release_deferred
from celery_lease._core.lease import LeaseContext
from celery_lease.stores.base import SupportsDeferredRelease

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, SignalLike, TaskRequest

__all__ = ["defer_on", "deferring", "flush_deferred_releases", "only_ours", "publishes_nothing"]

logger = logging.getLogger("celery_lease.deferral")

deferring: dict[int, SupportsDeferredRelease] = {}
"""Stores this process sent deferred releases to, by id: their replies are read before a publish."""

_HOOKS = ("on_success", "after_return")
_hookless: dict[type, bool] = {}


def defer_on(context: LeaseContext) -> None:
    """Let ``context`` release without waiting, where its store can (noting the store, whose
    replies :func:`flush_deferred_releases` reads)."""
    store = context.store
    if can_release_deferred(store):
        deferring[id(store)] = store
        context.release_without_reply()


def flush_deferred_releases() -> None:
    """Read the replies of this process's deferred releases now; never raises a store error."""
    for store in list(deferring.values()):
        try:
            store.flush_deferred()
        except Exception:  # the store logs each release's outcome; this is a bug guard
            logger.exception("celery-lease: reading deferred release replies failed")


def publishes_nothing(task: CeleryTask | None, request: TaskRequest | None) -> bool:
    """Whether nothing is published or run after this successful worker execution that could
    depend on its key being free, before the next store call or publish reads the reply."""
    if request is None or task is None:
        return False
    if not pool.runs_one_task_at_a_time():
        # threads, gevent, eventlet: another execution of this process may acquire the same
        # key on another connection (redis-py's pool, while the fast one is busy) before the
        # server read the release: it would be turned away.
        return False
    if request.id is None or getattr(request, "is_eager", False):
        return False
    if not getattr(request, "delivery_info", None) or getattr(request, "chord", None):
        return False
    if not _result_ignored(task, request):
        return False
    hookless = _hookless.get(type(task))
    if hookless is None:
        hookless = _hookless[type(task)] = not any(_custom(type(task), h) for h in _HOOKS)
    return (
        hookless
        and only_ours(task_success)
        and only_ours(task_postrun)
        and only_ours(signals.lock_released)  # "released": user code that may act on it
    )


def _result_ignored(task: CeleryTask, request: TaskRequest) -> bool:
    if compat.get_actual_ignore_result is not None:
        return bool(compat.get_actual_ignore_result(task, request))
    # Celery 5.4 and 5.5 (read): the tracer publishes a result only when the task's
    # ignore_result is off, and the backend stores it only when the request's is off too
    # (celery.app.trace.build_tracer, celery.backends.base.mark_as_done): a request cannot ask
    # for the result of a task that ignores it, and its ignore_result defaults to False.
    return bool(task.ignore_result) or bool(getattr(request, "ignore_result", False))


def _custom(cls: type, name: str) -> bool:
    """Whether a class below Celery's ``Task`` (ours excluded) defines hook ``name``."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("celery.", "celery_lease.")) or klass is object:
            continue
        if name in vars(klass):
            return True
    return False


def only_ours(signal: SignalLike) -> bool:
    """Whether every live receiver of ``signal`` is celery-lease's own (a few per signal at
    most: looked at each time, never cached, so a receiver connected later is always seen)."""
    return all(
        (getattr(receiver, "__module__", None) or "").startswith("celery_lease.")
        for receiver in compat.live_receivers(signal)
    )


def _flush_at_exit(**_: object) -> None:
    flush_deferred_releases()


worker_process_shutdown.connect(
    _flush_at_exit, weak=False, dispatch_uid="celery_lease.flush_deferred_process"
)
worker_shutdown.connect(_flush_at_exit, weak=False, dispatch_uid="celery_lease.flush_deferred")
atexit.register(flush_deferred_releases)
