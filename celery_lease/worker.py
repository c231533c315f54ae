"""Worker hooks: per-process state rebuilt in each pool process, the configuration checked at start.

Connected when :mod:`celery_lease.task` is imported (before the pool forks, so prefork children
inherit the receivers):

- ``worker_init`` (main process): remember the main process id and add :class:`LeaseCheck` to
  the worker's bootsteps (``app.steps["worker"]``, read by Celery right after this signal);
- ``worker_process_init`` (each prefork child; the main process under solo): forget stores and
  caches inherited from the parent (``os.register_at_fork`` already does this for every fork;
  the signal also covers pools that start processes otherwise) and note whether this process
  is a pool child.

Refusing a bad configuration. Celery's ``Signal.send`` logs and swallows what a receiver raises
(``except Exception``), so an error raised in ``worker_init`` does not stop the worker. A worker
bootstep does: :class:`LeaseCheck` runs :func:`check_worker` while Celery builds the worker's
blueprint (after logging is set up, before any step starts: no pool process is forked, no broker
connection made, no message consumed) and raises the error from there, as Celery itself raises
``ImproperlyConfigured`` for an unknown queue while the worker is built. ``celery worker`` then
exits with status 1 (the message is logged at CRITICAL, the traceback goes to stderr), and
``celery.contrib.testing.worker.start_worker`` raises it at once. (Raising from the step's
``start`` instead goes through Celery's "Unrecoverable error" path, also exit 1, but only after
the pool started, and ``start_worker`` then waits forever for a worker that never becomes
ready.) The refusal is also recorded with :func:`celery_lease.config.refuse`, so a worker that
went on anyway would fail every locked execution of the app, in every pool process, with the
same :class:`~celery_lease.LeaseConfigError`. It refuses:

- a misspelled or bad ``lease_*`` setting (:func:`celery_lease.config.get_settings`);
- a process-local store (``MemoryLockStore``, ``memory://``) as ``lease_store`` or as a task's
  ``lock_store`` when the worker runs tasks in more than one process (prefork with concurrency,
  or ``--autoscale`` maximum, above 1; a pool we do not know counts as one process per slot).
  solo, threads, gevent and eventlet run every task in the main process: a memory store then
  excludes within this worker, and a warning says that other worker processes (a second worker
  on this host, or on another) are not excluded: those the worker cannot see;
- a misspelled store URL scheme (``reddis://``).

Every build of a worker checks afresh (a refusal left by an earlier build in this process is
forgotten first). A multi-process worker's pool processes check again when they start
(:func:`recheck_in_pool_process`): a task registered after the start-up check with a
process-local ``lock_store`` fails in every pool process forked after it (by
``--max-tasks-per-child`` or ``--autoscale``) instead of running unexcluded. Under ``celery
multi`` each node is a worker of its own and checks itself; a refused node logs the refusal and
exits, although ``celery multi start`` (which detaches) has already printed ``OK``.

A child that dies holding a lease (hard time limit, ``SIGKILL``, ``revoke(terminate=True)``) is
not released by the main process: its key frees itself when its ttl runs out, at the latest one
ttl after the last renewal. Releasing on the child's behalf would need the child's owner id in
the main process; nothing here ever releases a lease for another owner.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from celery import bootsteps
from celery.signals import worker_init, worker_process_init

from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import LockStore

__all__ = [
    "LeaseCheck",
    "check_worker",
    "in_pool_child",
    "on_process_reset",
    "pool_processes",
    "recheck_in_pool_process",
    "reset_process_state",
]

logger = logging.getLogger(__name__)

_main_pid: int | None = None
_pool_child = False
_resets: list[Callable[[], None]] = []
_app: weakref.ref[Any] | None = None
"""The app of the worker whose check passed in this process (inherited by pool processes)."""
_processes = 0
"""How many processes that worker runs tasks in (:func:`pool_processes`), 0 before a check."""
_pool_label = ""

IN_PROCESS_POOLS = (
    "celery.concurrency.solo",
    "celery.concurrency.thread",
    "celery.concurrency.gevent",
    "celery.concurrency.eventlet",
)
"""Modules of Celery's pools that run every task inside the worker's main process."""


def on_process_reset(callback: Callable[[], None]) -> None:
    """Run ``callback()`` in every new pool process (and in every forked child)."""
    _resets.append(callback)
    os.register_at_fork(after_in_child=callback)


def reset_process_state() -> None:
    """Forget every per-process cache (stores resolved from settings and URLs).

    A refusal recorded at worker start (:func:`celery_lease.config.refuse`) is kept.
    """
    from celery_lease import config

    config.reset(refusals=False)
    for callback in _resets:
        callback()


def in_pool_child() -> bool:
    """True in a prefork pool child process (where terminating the process is like revoke)."""
    return _pool_child


def _pool_name(pool_cls: Any) -> str:
    """``prefork``, ``thread``... for Celery's pools, else the class's repr."""
    module = str(getattr(pool_cls, "__module__", ""))
    if module.startswith("celery.concurrency."):
        return module.rsplit(".", 1)[-1]
    return repr(pool_cls)


def pool_processes(pool_cls: Any, concurrency: int, autoscale: Any = None) -> int:
    """How many processes may run this worker's tasks at once.

    Args:
        pool_cls: the worker's pool class (``WorkController.pool_cls`` once resolved).
        concurrency: ``-c`` (an int; 0 or ``None`` count as 1).
        autoscale: ``--autoscale`` as Celery passes it (``"10,3"`` or ``(10, 3)``), or ``None``.

    Returns:
        1 for a pool that runs tasks in the main process (solo, threads, gevent, eventlet, or a
        subclass of one), else the larger of ``concurrency`` and the autoscale maximum (prefork,
        and any pool this function does not know: counted on the safe side).
    """
    modules = {getattr(cls, "__module__", "") for cls in getattr(pool_cls, "__mro__", (pool_cls,))}
    if modules.intersection(IN_PROCESS_POOLS):
        return 1
    most = int(concurrency or 1)
    if isinstance(autoscale, str):
        autoscale = autoscale.partition(",")[0]
    if isinstance(autoscale, Sequence) and not isinstance(autoscale, str):
        autoscale = autoscale[0] if autoscale else None
    if autoscale:
        most = max(most, int(autoscale))
    return most


def _stores_in_use(
    app: Any, configured: str | LockStore | None
) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(where, store option)`` for the app's ``lease_store`` and every task's ``lock_store``."""
    yield "lease_store", configured
    for name, task in sorted(app.tasks.items()):
        # LockedTask keeps its validated options on the class; a @locked body may carry them
        # on the function (see the module of the task layer).
        for holder in (type(task), getattr(task, "run", None)):
            options = getattr(holder, "_lock_options", None)
            store: str | LockStore | None = getattr(options, "store", None)
            if store is not None:
                yield f"task {name!r} lock_store", store
                break


def _describe(store: str | LockStore | None) -> str:
    return repr(store) if isinstance(store, str) else f"{type(store).__name__}()"


def check_worker(
    app: Any, pool_cls: Any, concurrency: int, autoscale: Any = None
) -> LeaseConfigError | None:
    """The reason ``app``'s lease configuration cannot run on this worker, or ``None``.

    Checks the ``lease_*`` settings (values and names) and, when tasks run in more than one
    process (:func:`pool_processes`), that no store in use keeps its leases in one process's
    memory. Logs a warning when a process-local store is accepted (one process): it cannot
    exclude other worker processes, which this worker cannot see.
    """
    return _check(app, pool_processes(pool_cls, concurrency, autoscale), _pool_name(pool_cls))


def _check(app: Any, processes: int, pool: str, *, warn: bool = True) -> LeaseConfigError | None:
    from celery_lease import config

    try:
        settings = config.get_settings(app)
    except LeaseConfigError as exc:
        return exc
    local = [
        (where, store)
        for where, store in _stores_in_use(app, settings.store)
        if config.is_process_local(store)
    ]
    if not local:
        return None
    uses = ", ".join(f"{where}={_describe(store)}" for where, store in local)
    if processes > 1:
        return LeaseConfigError(
            f"celery-lease: {uses} keeps leases in one process's memory, but this worker runs"
            f" tasks in {processes} processes ({pool} pool): they would not"
            " exclude each other and two bodies of one key would run at the same time. Use a"
            " store shared by every worker (lease_store='redis://...' or 'postgresql://...',"
            " or 'sqlite:////abs/path.db' on one host), or run tasks in one process"
            " (-P solo, -P threads, or -c 1)"
        )
    if warn:
        logger.warning(
            "celery-lease: %s is process-local: it excludes only tasks of this worker process;"
            " another worker process (on this host or another) using it is not excluded",
            uses,
        )
    return None


class LeaseCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: refuse to build the worker when the lease configuration cannot exclude.

    Raises :func:`check_worker`'s error from ``__init__`` (Celery builds every step of the
    blueprint before starting any), after logging it and recording it as a refusal of the app.
    Each build checks afresh: a refusal recorded by an earlier build of a worker in this process
    (one that never started) is forgotten first. An accepted check is remembered, so that every
    pool process started later checks again the tasks registered since (see
    :func:`recheck_in_pool_process`).
    """

    label = "celery-lease check"

    def __init__(self, parent: Any, autoscale: Any = None, **kwargs: Any) -> None:
        global _app, _processes, _pool_label
        super().__init__(parent, **kwargs)
        from celery_lease import config

        app = parent.app
        config.recheck(app)
        processes = pool_processes(parent.pool_cls, parent.concurrency, autoscale)
        error = _check(app, processes, _pool_name(parent.pool_cls))
        if error is not None:
            config.refuse(app, str(error))
            logger.critical(
                "Refusing to start worker %s: %s", getattr(parent, "hostname", "?"), error
            )
            raise error
        _app, _processes, _pool_label = weakref.ref(app), processes, _pool_name(parent.pool_cls)

    def start(self, parent: Any) -> None:
        """Nothing to start: the check ran when the worker was built."""

    def stop(self, parent: Any) -> None:
        """Nothing to stop."""

    def terminate(self, parent: Any) -> None:
        """Nothing to terminate."""


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    global _main_pid
    _main_pid = os.getpid()
    app = getattr(sender, "app", None)
    if app is not None:
        app.steps["worker"].add(LeaseCheck)  # read by the blueprint right after this signal


def recheck_in_pool_process() -> None:
    """In a new pool process of a multi-process worker: check the stores again, refuse if bad.

    A task registered after the worker's start-up check (a module imported late, in a process
    that pool children are forked from again by ``--max-tasks-per-child`` or ``--autoscale``)
    was never checked: when it (or ``lease_store``, changed since) keeps leases in process
    memory, every locked execution of the app in this process fails with the refusal instead of
    running unexcluded.
    """
    app = _app() if _app is not None else None
    if app is None or _processes <= 1:
        return
    error = _check(app, _processes, _pool_label, warn=False)
    if error is not None:
        from celery_lease import config

        config.refuse(app, str(error))
        logger.critical(
            "celery-lease: pool process %d refuses locked tasks: %s", os.getpid(), error
        )


def _on_worker_process_init(**_: Any) -> None:
    global _pool_child
    _pool_child = _main_pid is not None and os.getpid() != _main_pid
    reset_process_state()
    if _pool_child:
        recheck_in_pool_process()


worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_lease.worker_init")
worker_process_init.connect(
    _on_worker_process_init, weak=False, dispatch_uid="celery_lease.worker_process_init"
)
