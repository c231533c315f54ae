"""Worker signal receivers (connected by :func:`celery_lease._celery.wiring.install`): our
bootsteps at ``worker_init``, a pool child's reset and ``inspect leases`` server, hard time
limits for the reaper; and the running task as the default of owner ids (:func:`running_task`)."""

from __future__ import annotations

import logging
import os

from celery_lease import _forking as forking
from celery_lease._celery import compat, control, pool, reaper, startup
from celery_lease._core import owners

logger = logging.getLogger("celery_lease.worker")

METRICS_STEP = "celery_lease.metrics:MetricsStep"  # by the name Celery's blueprint resolves
_main_pid: int | None = None


def reset_process_state() -> None:
    """Forget every per-process cache; a refusal recorded at worker start is kept."""
    forking.reset_child_state()


def on_worker_init(sender: object = None, **_: object) -> None:
    """``worker_init``: note the main process and its node; add our bootsteps."""
    global _main_pid
    _main_pid = os.getpid()
    node = getattr(sender, "hostname", None)
    owners.set_node(node if isinstance(node, str) else None)
    app = getattr(sender, "app", None)
    if app is not None:
        app.steps["worker"].add(startup.LeaseCheck)  # read by the blueprint right after this signal
        app.steps["worker"].add(reaper.DeadHolders)
        app.steps["worker"].add(METRICS_STEP)  # by name: a layer above; a no-op unless enabled


def on_worker_process_init(**_: object) -> None:
    """``worker_process_init``: forget inherited state; in a pool child, check and serve."""
    child = _main_pid is not None and os.getpid() != _main_pid
    pool.set_pool_child(child)
    reset_process_state()
    if child:
        startup.recheck_in_pool_process()
        control.serve_in_child()


def on_worker_shutdown(**_: object) -> None:
    """``worker_shutdown``: in the main process, remove the ``inspect leases`` sockets."""
    if os.getpid() == _main_pid:
        control.cleanup_main()


def running_task() -> tuple[str | None, str | None] | None:
    """The ``(name, id)`` of the task Celery's tracer runs in this thread, or None: the default
    task of owner ids made now.

    The innermost request on Celery's task stack that was not called directly: a task called as
    a function inside a body is skipped, also where that call pushed a request of its own onto the
    running task's request stack (Celery 5.4 does for a task calling itself). A thread the body
    starts has no task stack of its own: owner ids made there name no task (pass ``holder=`` or
    take the lease in the body's thread).
    """
    found = compat.current_worker_request()
    if found is None:
        return None
    task, request = found
    name = getattr(task, "name", None)
    task_id = getattr(request, "id", None)
    return (name if isinstance(name, str) else None, task_id if isinstance(task_id, str) else None)


def on_task_failure(
    sender: object = None, task_id: str | None = None, exception: object = None, **_: object
) -> None:
    """In the main process: tell the reaper of tasks ended by a hard time limit."""
    if os.getpid() == _main_pid:
        reaper.note_task_failure(sender, task_id, exception)
