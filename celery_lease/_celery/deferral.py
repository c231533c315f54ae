"""Release without waiting for the reply (``lease_defer_release``, default on): an outermost
worker execution whose success publishes nothing (no chord, hooks or other ``task_success`` /
``task_postrun`` receiver; its result ignored, or written by a backend that reads the replies
first: :mod:`~celery_lease._celery.result_write`) sends it unanswered; the reply is read before
the next command on that connection, before any publish of this process, before any write of a
result backend a deferring execution's result was written through, and at exit."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery.signals import task_postrun, task_success

from celery_lease import signals
from celery_lease._celery import compat, pool, result_write
from celery_lease._celery.protocols import can_release_deferred
from celery_lease._core.lease import LeaseContext
from celery_lease.stores.base import SupportsDeferredRelease

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, SignalLike, TaskRequest

logger = logging.getLogger("celery_lease.deferral")

# Stores this process sent deferred releases to, by id (read before a publish).
deferring: dict[int, SupportsDeferredRelease] = {}
_HOOKS = ("on_success", "after_return")
_hookless: dict[type, bool] = {}
# id(signal) -> (the signal, its receivers' entries when asked, :func:`only_ours`'s answer).
_answers: dict[int, tuple[SignalLike, list[tuple[object, object]], bool]] = {}
_Entries = list[tuple[object, object]]
# The receivers of task_success, task_postrun and lock_released when last judged, and the answer.
_after_success: tuple[_Entries, _Entries, _Entries, bool] | None = None


def defer_on(context: LeaseContext) -> None:
    """Let ``context`` release unanswered where its store can."""
    store = context.store
    if can_release_deferred(store):
        deferring[id(store)] = store
        context.release_without_reply()


def flush_deferred_releases() -> None:
    """Read this process's deferred release replies now; never raises a store error."""
    for store in list(deferring.values()):
        try:
            store.flush_deferred()
        except Exception:  # the store logs each release's outcome; this is a bug guard
            logger.exception("celery-lease: reading deferred release replies failed")


def publishes_nothing(task: CeleryTask | None, request: TaskRequest | None) -> bool:
    """Whether nothing that may depend on the key being free follows this successful execution."""
    if request is None or task is None:
        return False
    if not pool.runs_one_task_at_a_time():
        # Another execution here may acquire the key on another connection before the server
        # read the release, and be turned away.
        return False
    if request.id is None or getattr(request, "is_eager", False):
        return False
    if not getattr(request, "delivery_info", None) or getattr(request, "chord", None):
        return False
    if not _result_ignored(task, request) and not _result_written_after_replies(task):
        return False
    hookless = _hookless.get(type(task))
    if hookless is None:
        hookless = _hookless[type(task)] = not any(user_defines(type(task), h) for h in _HOOKS)
    return hookless and _only_ours_after_success()


def _only_ours_after_success() -> bool:
    """:func:`only_ours` of ``task_success``, ``task_postrun`` and ``lock_released`` ("released":
    user code that may act on it), answered in one step: the answer is kept with the snapshots
    it judged, and holds while each signal's receivers equal them and none may have died."""
    global _after_success  # one tuple, replaced whole: a reader sees one snapshot
    kept = _after_success
    if (
        kept is not None
        and kept[0] == task_success.receivers
        and kept[1] == task_postrun.receivers
        and kept[2] == signals.lock_released.receivers
        and not compat.may_have_dead_receivers(task_success, task_postrun, signals.lock_released)
    ):
        return kept[3]
    success = list(task_success.receivers)
    postrun = list(task_postrun.receivers)
    released = list(signals.lock_released.receivers)
    answer = _all_ours(success) and _all_ours(postrun) and _all_ours(released)
    _after_success = (success, postrun, released, answer)
    return answer


def _result_written_after_replies(task: CeleryTask) -> bool:
    """Whether ``task``'s result backend reads the deferred replies before it writes; False
    when the backend cannot even be built here (the execution then releases and waits)."""
    try:
        backend = task.backend
    except Exception:
        return False
    return result_write.reads_releases_first(backend, flush_deferred_releases)


def _result_ignored(task: CeleryTask, request: TaskRequest) -> bool:
    if compat.get_actual_ignore_result is not None:
        return bool(compat.get_actual_ignore_result(task, request))
    # Celery 5.4 and 5.5 (build_tracer, mark_as_done): a result is stored only when neither
    # the task's nor the request's ignore_result is set.
    return bool(task.ignore_result) or bool(getattr(request, "ignore_result", False))


def user_defines(cls: type, name: str) -> bool:
    """Whether a class below Celery's ``Task`` (ours excluded) defines hook ``name``."""
    return any(
        name in vars(klass)
        for klass in cls.__mro__
        if klass is not object
        # None for a class made by code run through exec() without __name__ in its globals
        and not (klass.__module__ or "").startswith(("celery.", "celery_lease."))
    )


def only_ours(signal: SignalLike) -> bool:
    """Whether every live receiver of ``signal`` is ours; the answer is kept while the signal's
    receivers are the same entries and none of its weak receivers was collected."""
    receivers = signal.receivers
    kept = _answers.get(id(signal))
    if (
        kept is not None
        and kept[0] is signal
        and kept[1] == receivers
        and not compat.may_have_dead_receivers(signal)
    ):
        return kept[2]
    # One snapshot, both judged and kept: a receiver changed meanwhile (even one taken away and
    # put back) makes the list differ from it next time, and the answer is that snapshot's.
    seen = list(receivers)
    answer = _all_ours(seen)
    _answers[id(signal)] = (signal, seen, answer)
    return answer


def _all_ours(entries: list[tuple[object, object]]) -> bool:
    """Whether every live receiver among a signal's ``entries`` is celery-lease's."""
    return all(
        (getattr(receiver, "__module__", None) or "").startswith("celery_lease.")
        for receiver in compat.live_receivers_of(entries)
    )
