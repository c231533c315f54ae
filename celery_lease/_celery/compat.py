"""Every reach into Celery's and billiard's internals (read in celery 5.7.0, billiard 4.3.2),
each headed by the behaviour it relies on: an upgrade that moves one breaks only this module."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeGuard, cast

# billiard 4.x: the exit code of a child that left on purpose (--max-tasks-per-child...); any
# other nonzero one is a killed child.
from billiard.pool import EX_RECYCLE
from celery import _state
from celery.app import base as _app_base
from celery.worker import state as _worker_state

if TYPE_CHECKING:
    from pydantic import BaseModel

    from celery_lease._celery.protocols import (
        BilliardPool,
        CeleryApp,
        CeleryTask,
        EventLoopHub,
        PoolJob,
        PoolProcess,
        SignalLike,
        TaskStack,
        WorkerRequest,
    )

try:
    # celery 5.7 (read): the per-request ignore_result rule, in celery.app.task.
    from celery.app.task import get_actual_ignore_result
except ImportError:  # pragma: no cover  # Celery < 5.7
    try:
        # celery 5.6.3 to 5.6.x (read): the same rule, in celery.app.trace (5.6.0-5.6.2 have
        # none: the fallback's rule is theirs).
        from celery.app.trace import get_actual_ignore_result
    except ImportError:  # Celery < 5.6: no per-request override (see deferral._result_ignored)
        get_actual_ignore_result = None

__all__ = [
    "EX_RECYCLE",
    "PydanticWrapperCells",
    "billiard_pool",
    "child_processes",
    "current_worker_request",
    "event_process_exit",
    "get_actual_ignore_result",
    "get_current_app",
    "get_current_task",
    "job_pids",
    "join_exited_workers",
    "live_receivers",
    "live_receivers_of",
    "may_have_dead_receivers",
    "pool_jobs",
    "pydantic_wrapper_closure",
    "reapable",
    "request_cancelled",
    "request_job",
    "set_event_process_exit",
    "set_join_exited_workers",
    "task_meta_reader",
    "task_stack",
    "worker_requests",
]

# celery 5.x: the stack of running tasks that current_task reads; Task.__call__ pushes onto it.
task_stack: TaskStack = _state._task_stack
# celery 5.x: the app of this thread (the default app when none was set).
get_current_app: Callable[[], CeleryApp] = _state.get_current_app
# celery 5.x: the task running in this thread, or None.
get_current_task: Callable[[], CeleryTask | None] = _state.get_current_task


# celery 5.x: the task Celery's tracer runs in this thread (tasks called as functions skipped).
def current_worker_request() -> tuple[CeleryTask, object] | None:
    """``(task, request)``: the innermost request on the task stack (celery 5.x ``_task_stack``,
    each task's ``request_stack``) that was not called directly, or None.

    Celery's ``get_current_worker_task`` looks at each stacked task's current request only, so
    it misses the worker request below one a direct call pushed on the same task (celery 5.4's
    ``push_request`` makes a fresh ``called_directly`` context).
    """
    tasks: list[CeleryTask] = list(getattr(task_stack, "stack", ()))
    for task in reversed(tasks):
        requests = getattr(getattr(task, "request_stack", None), "stack", None) or ()
        for request in reversed(requests):
            if not getattr(request, "called_directly", True):
                return task, request
    return None


class PydanticWrapperCells(TypedDict, total=False):
    """The free variables of Celery's ``pydantic_wrapper`` we read (any may be missing)."""

    task_signature: inspect.Signature
    type_hints: dict[str, object]
    strict: bool
    context: dict[str, object] | None
    get_argument_model: Callable[[str, object], type[BaseModel] | None]
    """celery 5.7: the model class an argument's value is validated with, or None."""
    validate_argument: Callable[[type[BaseModel], object], object]
    """celery 5.7: the value validated with that model."""


def pydantic_wrapper_closure(func: object) -> PydanticWrapperCells | None:
    """The free variables of ``func`` if its code is Celery's ``pydantic_wrapper``, else None."""
    code = getattr(func, "__code__", None)
    if not (
        inspect.isfunction(func)
        and code is not None
        and code.co_name == "wrapper"
        and "task_fun" in code.co_freevars
        and code.co_filename == _app_base.__file__
    ):
        return None
    values: dict[str, object] = {}
    for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return cast(PydanticWrapperCells, values)  # the wrapper's cells, as celery 5.5 to 5.7 make them


def live_receivers(signal: SignalLike) -> list[object]:
    """The live receivers of a ``Signal`` (weak ones dereferenced unless ``weak=False``)."""
    return live_receivers_of(signal.receivers)


def live_receivers_of(entries: Iterable[tuple[object, object]]) -> list[object]:
    """The live receivers among ``entries``, a copy of a ``Signal``'s ``receivers`` list
    (``(lookup key, receiver or weak reference)`` pairs; weak ones dereferenced)."""
    alive: list[object] = []
    for _, receiver in entries:
        if isinstance(receiver, weakref.ReferenceType):
            receiver = receiver()
            if receiver is None:
                continue
        alive.append(receiver)
    return alive


def may_have_dead_receivers(*signals: SignalLike) -> bool:
    """Whether a weak receiver of one of ``signals`` may have been collected since its receivers
    were last swept (celery 5.x ``Signal._dead_receivers``; True when a signal has no such
    flag)."""
    for signal in signals:  # noqa: SIM110 (a loop: no generator made per task)
        if getattr(signal, "_dead_receivers", True):
            return True
    return False


_ProcessExit = Callable[["EventLoopHub", "PoolProcess"], object]


def billiard_pool(task_pool: object) -> object:
    """billiard's ``Pool`` (``TaskPool._pool``), or ``None`` for other pools."""
    return getattr(task_pool, "_pool", None)


def reapable(pool: object) -> TypeGuard[BilliardPool]:
    """Whether ``pool`` has the billiard 4.x internals the dead-holder reaper wraps."""
    return all(
        hasattr(pool, name) for name in ("_join_exited_workers", "mark_as_worker_lost", "_pool")
    )


def child_processes(pool: object) -> list[PoolProcess] | None:
    """billiard 4.x ``Pool._pool``: the live children (a reaped child leaves it), or ``None``."""
    processes = getattr(pool, "_pool", None)
    return processes if isinstance(processes, list) else None


def join_exited_workers(pool: BilliardPool) -> Callable[..., object]:
    """billiard 4.x: reaps dead children and calls ``mark_as_worker_lost`` for their jobs."""
    return pool._join_exited_workers


def set_join_exited_workers(pool: BilliardPool, method: Callable[..., object]) -> None:
    pool._join_exited_workers = method


def event_process_exit(pool: BilliardPool) -> _ProcessExit | None:
    """celery 5.x ``AsynPool._event_process_exit`` (a child's sentinel closed), else ``None``."""
    return getattr(pool, "_event_process_exit", None)


def set_event_process_exit(pool: Any, method: _ProcessExit) -> None:  # Any: AsynPool's own
    pool._event_process_exit = method


def pool_jobs(pool: object) -> list[PoolJob]:
    """billiard 4.x ``Pool._cache``: uncollected jobs (their ``correlation_id`` is the task id)."""
    cache = getattr(pool, "_cache", None)
    return list(cache.values()) if isinstance(cache, dict) else []


def job_pids(job: PoolJob) -> set[int]:
    """The children a job was accepted by, written to (``_write_to``) or scheduled for."""
    pids = {pid for pid in job.worker_pids() if pid}
    for attr in ("_write_to", "_scheduled_for"):
        pid = getattr(getattr(job, attr, None), "pid", None)
        if pid:
            pids.add(pid)
    return pids


def worker_requests() -> list[WorkerRequest]:
    """celery 5.x ``worker.state``: the active, then reserved, requests."""
    return [*_worker_state.active_requests, *_worker_state.reserved_requests]


def request_cancelled(request: WorkerRequest) -> bool:
    """celery 5.x ``Request._already_cancelled`` (its message is redelivered)."""
    return bool(getattr(request, "_already_cancelled", False))


def request_job(request: WorkerRequest) -> PoolJob | None:
    """celery 5.x ``Request._apply_result``: a weak reference to the job, once sent to the pool."""
    ref = getattr(request, "_apply_result", None)
    return ref() if ref is not None else None


def task_meta_reader(backend: object) -> Callable[[str], Mapping[str, object]] | None:
    """``backend._get_task_meta_for`` (uncached, unlike ``get_task_meta``), or ``None``."""
    return getattr(backend, "_get_task_meta_for", None)


# The steps of a key-value backend's result write (Celery 5.4 - 5.7): ``mark_as_done`` ->
# ``store_result`` -> ``_store_result`` (builds the result, reads the task's current state) ->
# ``_set_with_state`` (the write).
RESULT_WRITE_STEPS = ("mark_as_done", "store_result", "_store_result", "_set_with_state")


def writes_results_through_set_with_state(backend_class: type) -> bool:
    """Whether every result a backend of ``backend_class`` writes goes through its
    ``_set_with_state``: a key-value backend whose ``mark_as_done``, ``store_result`` and
    ``_store_result`` are Celery's own."""
    from celery.backends.base import Backend, BaseKeyValueStoreBackend

    return (
        issubclass(backend_class, BaseKeyValueStoreBackend)
        and getattr(backend_class, "mark_as_done", None) is Backend.mark_as_done
        and getattr(backend_class, "store_result", None) is Backend.store_result
        and getattr(backend_class, "_store_result", None) is BaseKeyValueStoreBackend._store_result
    )


def call_before_result_writes(backend: object, before: Callable[[], None]) -> None:
    """Make ``backend`` (a key-value backend, :func:`writes_results_through_set_with_state`)
    call ``before`` just before each write, on this instance only."""
    write = backend._set_with_state  # type: ignore[attr-defined]  # a key-value backend's

    def _set_with_state(key: object, value: object, state: object) -> object:
        before()
        return write(key, value, state)

    vars(backend)["_set_with_state"] = _set_with_state
