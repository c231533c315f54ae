"""Worker hooks: the per-process state rebuilt in each pool process, and the wiring of
celery-lease into Celery's signals and the worker's bootsteps.

Connected when :mod:`celery_lease._celery.task` is imported (before the pool forks, so prefork
children inherit the receivers):

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
- ``task_failure`` (main process): a task ended by its hard time limit is noted for the reaper
  (:func:`celery_lease._celery.reaper.note_task_failure`).

When that happens, whatever the layout of the project. ``celery worker`` imports the app's task
modules (``include``, ``imports``, and ``autodiscover_tasks()``, Django's included, through the
``import_modules`` signal) in ``loader.init_worker()``, the first thing ``WorkController``
does, before it sends ``worker_init``; it reads ``app.steps["worker"]`` after ``worker_init``,
and builds every step (their ``__init__``) before any step starts: before the pool forks. So a
task module that defines a locked task has imported this module (through
:mod:`celery_lease._celery.task`) before ``worker_init``, whichever module ``-A`` names. The
``celery`` program itself loads :mod:`celery_lease.cli` (the ``celery.commands`` entry point)
in every invocation, ``celery inspect`` included, which registers the remote-control command
``leases`` there (:mod:`celery_lease._celery.control`): the inspect client checks the name
against its own registry, and imports only the ``-A`` module, never the task modules.

Every receiver is connected by :func:`connect_receivers`, once, when this module is imported.
What runs at start: :mod:`celery_lease._celery.startup` (the configuration and store checks,
:class:`~celery_lease._celery.startup.LeaseCheck`). The leases of dead pool children:
:mod:`celery_lease._celery.reaper` (:class:`~celery_lease._celery.reaper.DeadHolders`).

Who holds what. ``worker_init`` makes the worker's node name (``w1@host``) the default node of
every owner id made in the worker's processes (:func:`celery_lease._core.owners.set_node`), and
``task_prerun`` / ``task_postrun`` make the running task's name and id the default task of owner
ids made during it (:func:`celery_lease._core.owners.push_task`), so a ``lease()`` inside a task
body names its task too. :mod:`celery_lease._celery.control` (imported here) registers
``celery inspect leases``; every pool child serves its snapshot for it (see there).

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_shutdown,
)

from celery_lease import _forking as forking
from celery_lease._celery import control, pool, reaper, startup
from celery_lease._core import owners

__all__ = ["METRICS_STEP", "connect_receivers", "reset_process_state"]

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


def _on_worker_init(sender: object = None, **_: object) -> None:
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


def _on_worker_process_init(**_: object) -> None:
    child = _main_pid is not None and os.getpid() != _main_pid
    pool.set_pool_child(child)
    reset_process_state()
    if child:
        startup.recheck_in_pool_process()
        control.serve_in_child()


def _on_worker_shutdown(**_: object) -> None:
    if os.getpid() == _main_pid:
        control.cleanup_main()


# The running task, as the default of owner ids made during it (owners.push_task) --------------

_OwnerToken = contextvars.Token[tuple[str | None, str | None] | None]
"""What :func:`celery_lease._core.owners.push_task` returns."""

_task_tokens: contextvars.ContextVar[list[tuple[str, _OwnerToken]] | None] = contextvars.ContextVar(
    "celery_lease_task_tokens", default=None
)


def _on_task_prerun(task_id: str | None = None, task: object = None, **_: object) -> None:
    stack = _task_tokens.get()
    if stack is None:
        stack = []
        _task_tokens.set(stack)
    name = getattr(task, "name", None)
    stack.append((str(task_id), owners.push_task(name if isinstance(name, str) else None, task_id)))


def _on_task_postrun(task_id: str | None = None, **_: object) -> None:
    stack = _task_tokens.get()
    if not stack or stack[-1][0] != str(task_id):
        return
    token = stack.pop()[1]
    with contextlib.suppress(ValueError):  # made in another context (should not happen)
        owners.pop_task(token)


def _on_task_failure(
    sender: object = None, task_id: str | None = None, exception: object = None, **_: object
) -> None:
    """In the main process: tell the reaper of tasks ended by a hard time limit."""
    if os.getpid() == _main_pid:
        reaper.note_task_failure(sender, task_id, exception)


def connect_receivers() -> None:
    """Connect every receiver of Celery's signals (once: at import of this module).

    Strong references (``weak=False``), each under a fixed ``dispatch_uid``, so connecting again
    adds nothing.
    """
    worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_lease.worker_init")
    worker_process_init.connect(
        _on_worker_process_init, weak=False, dispatch_uid="celery_lease.worker_process_init"
    )
    worker_shutdown.connect(
        _on_worker_shutdown, weak=False, dispatch_uid="celery_lease.worker_shutdown"
    )
    task_prerun.connect(_on_task_prerun, weak=False, dispatch_uid="celery_lease.task_prerun")
    task_postrun.connect(_on_task_postrun, weak=False, dispatch_uid="celery_lease.task_postrun")
    task_failure.connect(_on_task_failure, weak=False, dispatch_uid="celery_lease.task_failure")


connect_receivers()
