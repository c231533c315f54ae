"""Worker hooks: the per-process state rebuilt in each pool process, and the receivers that
tie celery-lease into the worker's life (connected by :func:`celery_lease._celery.wiring.install`):

- ``worker_init`` (main process): remember the main process id and add
  :class:`~celery_lease._celery.startup.LeaseCheck`,
  :class:`~celery_lease._celery.reaper.DeadHolders` and
  :class:`celery_lease.metrics.MetricsStep` (by name, :data:`METRICS_STEP`: the metrics add-on
  sits above this layer, which does not import it) to the worker's bootsteps
  (``app.steps["worker"]``, read by Celery right after this signal);
- ``worker_process_init`` (each prefork child; the main process under solo): forget stores and
  caches inherited from the parent (:func:`celery_lease._forking.reset_child_state`; the at-fork
  hooks of :mod:`celery_lease._forking` already forget the stores after every fork; the signal
  also covers pools that start processes otherwise), note whether this process is a pool
  child (:func:`celery_lease._celery.pool.set_pool_child`), and check again there
  (:func:`celery_lease._celery.startup.recheck_in_pool_process`);
- ``worker_shutdown`` (main process): remove the socket directory of ``inspect leases``;
- ``task_failure`` (main process): a task ended by its hard time limit is noted for the reaper
  (:func:`celery_lease._celery.reaper.note_task_failure`).

What runs at start: :mod:`celery_lease._celery.startup` (the configuration and store checks,
:class:`~celery_lease._celery.startup.LeaseCheck`). The leases of dead pool children:
:mod:`celery_lease._celery.reaper` (:class:`~celery_lease._celery.reaper.DeadHolders`).

Who holds what. ``worker_init`` makes the worker's node name (``w1@host``) the default node of
every owner id made in the worker's processes (:func:`celery_lease._core.owners.set_node`), and
``task_prerun`` / ``task_postrun`` make the running task's name and id the default task of owner
ids made during it (:func:`celery_lease._core.owners.push_task`), so a ``lease()`` inside a task
body names its task too. Every pool child serves its snapshot for ``celery inspect leases``
(:mod:`celery_lease._celery.control`).

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

from celery_lease import _forking as forking
from celery_lease._celery import control, pool, reaper, startup
from celery_lease._core import owners

__all__ = [
    "METRICS_STEP",
    "on_task_failure",
    "on_task_postrun",
    "on_task_prerun",
    "on_worker_init",
    "on_worker_process_init",
    "on_worker_shutdown",
    "reset_process_state",
]

logger = logging.getLogger("celery_lease.worker")

METRICS_STEP = "celery_lease.metrics:MetricsStep"
"""The metrics bootstep, by the name Celery's blueprint resolves (``module:attribute``)."""

_main_pid: int | None = None


def reset_process_state() -> None:
    """Forget every per-process cache (settings, stores resolved from settings and URLs).

    Runs the resets registered with :func:`celery_lease._forking.on_new_process`. A refusal
    recorded at worker start (:func:`celery_lease._celery.settings.refuse`) is kept.
    """
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
        # By name: Celery imports the metrics add-on when it builds the worker (it sits above
        # this layer, which never imports it). A no-op unless lease_metrics / install().
        app.steps["worker"].add(METRICS_STEP)


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


# The running task, as the default of owner ids made during it (owners.push_task) --------------

_OwnerToken = contextvars.Token[tuple[str | None, str | None] | None]
"""What :func:`celery_lease._core.owners.push_task` returns."""

_task_tokens: contextvars.ContextVar[list[tuple[str, _OwnerToken]] | None] = contextvars.ContextVar(
    "celery_lease_task_tokens", default=None
)


def on_task_prerun(task_id: str | None = None, task: object = None, **_: object) -> None:
    """``task_prerun``: the running task is the default task of owner ids made now."""
    stack = _task_tokens.get()
    if stack is None:
        stack = []
        _task_tokens.set(stack)
    name = getattr(task, "name", None)
    stack.append((str(task_id), owners.push_task(name if isinstance(name, str) else None, task_id)))


def on_task_postrun(task_id: str | None = None, **_: object) -> None:
    """``task_postrun``: undo what :func:`on_task_prerun` did for this task id."""
    stack = _task_tokens.get()
    if not stack or stack[-1][0] != str(task_id):
        return
    token = stack.pop()[1]
    with contextlib.suppress(ValueError):  # made in another context (should not happen)
        owners.pop_task(token)


def on_task_failure(
    sender: object = None, task_id: str | None = None, exception: object = None, **_: object
) -> None:
    """In the main process: tell the reaper of tasks ended by a hard time limit."""
    if os.getpid() == _main_pid:
        reaper.note_task_failure(sender, task_id, exception)
