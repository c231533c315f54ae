"""The dead-holder reaper: the leases of a pool child that dies running a task, freed at once
(``docs/operations.md#dead-holders-freed-at-once`` says which leases). Releases run on a thread
of their own; only an ``acks_late`` requeue waits (:data:`DEAD_HOLDER_WAIT` s) for them. Errors
are logged, never raised into billiard.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, cast

from celery import bootsteps
from celery.exceptions import TimeLimitExceeded

from celery_lease import signals
from celery_lease._celery import compat, control, startup
from celery_lease._celery.settings import get_settings
from celery_lease._celery.store_resolution import store_for
from celery_lease._celery.unique import queued_key
from celery_lease._core import owners
from celery_lease._core.dispatch import get_dispatcher
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import LeaseInfo, LockStore, SupportsInspection, conforms
from celery_lease.stores.slots import split_slot

if TYPE_CHECKING:
    from celery_lease._celery.protocols import (
        BilliardPool,
        CeleryApp,
        CeleryTask,
        EventLoopHub,
        PoolJob,
        PoolProcess,
        WorkerLike,
    )

logger = logging.getLogger("celery_lease.worker")

# Seconds the requeue of a task lost with its child waits for the child's leases to be released.
DEAD_HOLDER_WAIT = 1.0
_REAP_RETRY_FIRST = 0.005  # seconds before the first retry of a reap without pidfd
_REAP_RETRY_FOR = 5.0  # seconds of retries at most (then billiard's own 5 s timer reaps it)
_TIMED_OUT_KEEP = 600.0  # seconds a hard-time-limited task id is remembered for its child's death
_timed_out: dict[str, tuple[str | None, float]] = {}  # hard-time-limited id -> (task name, when)


def note_task_failure(sender: object, task_id: str | None, exception: object) -> None:
    """In the main process: note a task ended by a hard time limit (its child is killed next)."""
    if not isinstance(exception, TimeLimitExceeded) or not task_id:
        return
    now = time.monotonic()
    for old in [k for k, (_, at) in _timed_out.items() if now - at > _TIMED_OUT_KEEP]:
        del _timed_out[old]
    name = getattr(sender, "name", None)
    _timed_out[task_id] = (name if isinstance(name, str) else None, now)


def _runs_again(task: object, retries: int = 0, *, timed_out: bool = False) -> bool:
    """Whether Celery runs a task again when its child dies."""
    if task is None:
        return False
    acks_late = bool(getattr(task, "acks_late", False))
    if timed_out:
        acks = getattr(task, "acks_on_timeout", None)
        if acks is None:
            acks = getattr(task, "acks_on_failure_or_timeout", None)
        return acks_late and acks is not None and not acks
    if getattr(task, "retry_on_worker_lost", False):
        most = getattr(task, "max_retries", None)
        if most is None or retries < int(most):
            return True
    return acks_late and bool(getattr(task, "reject_on_worker_lost", False))


def _ends_failed_ids() -> set[str]:
    """Ids of tracked, uncancelled requests that end FAILURE if their child dies."""
    fails: set[str] = set()
    for request in compat.worker_requests():
        if compat.request_cancelled(request):
            continue
        retries = (getattr(request, "request_dict", None) or {}).get("retries") or 0
        if not _runs_again(getattr(request, "task", None), int(retries)):
            fails.add(request.id)
    return fails


def _running_by_pid(pool: object = None) -> dict[int, dict[str, str | None]]:
    """pid -> {task id: name}, from the worker's requests and the pool's unfinished jobs."""
    running: dict[int, dict[str, str | None]] = {}
    for request in compat.worker_requests():
        pids = set()
        if request.worker_pid:
            pids.add(request.worker_pid)
        job = compat.request_job(request)
        if job is not None:
            pids.update(compat.job_pids(job))
        for pid in pids:
            running.setdefault(pid, {})[request.id] = request.name
    for job in compat.pool_jobs(pool):
        task_id = getattr(job, "correlation_id", None)
        if isinstance(task_id, str) and task_id and not job.ready():
            for pid in compat.job_pids(job):
                running.setdefault(pid, {}).setdefault(task_id, None)
    return running


class _Death:
    """A reaped child and its tasks; ``fails``: those that end FAILURE."""

    __slots__ = ("at", "done", "exitcode", "fails", "pid", "tasks")

    def __init__(
        self, pid: int, exitcode: int, tasks: dict[str, str | None], fails: Collection[str] = ()
    ) -> None:
        self.pid = pid
        self.exitcode = exitcode
        self.tasks = tasks
        self.fails = frozenset(fails)
        self.done = threading.Event()
        self.at = time.time()  # made once reaped: no owner id of the dead child is newer


_REAPER_FAILED = (
    "celery-lease: handling a dead pool process failed; its leases free themselves at their ttl"
)


class _Reaper:
    """Releases the leases of reaped pool children of one prefork pool (see the module)."""

    def __init__(self, app: CeleryApp, node: str | None, pool: BilliardPool) -> None:
        self.app = app
        self.node = node
        self.pool = pool
        self.host = socket.gethostname()
        self.deaths: queue.SimpleQueue[_Death] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.before: dict[int, PoolProcess] = {}  # pid -> process, during a join
        self.running: dict[int, dict[str, str | None]] = {}
        self.fails: set[str] = set()  # of the running tasks: the ids that end FAILURE
        self.handled: set[int] = set()
        self.stuck = False  # the release thread overran a requeue's wait and is still busy

    def install(self) -> None:
        join = compat.join_exited_workers(self.pool)
        mark = self.pool.mark_as_worker_lost

        def join_exited_workers(*args: object, **kwargs: object) -> object:
            self._note_children()
            try:
                return join(*args, **kwargs)
            finally:
                self._release_joined()

        def mark_as_worker_lost(job: PoolJob, exitcode: int) -> object:
            self._release_lost(job)
            return mark(job, exitcode)

        compat.set_join_exited_workers(self.pool, join_exited_workers)
        self.pool.mark_as_worker_lost = mark_as_worker_lost
        exited = compat.event_process_exit(self.pool)
        if exited is not None:  # billiard's AsynPool (the event loop); the hub looks it up later

            def event_process_exit(hub: EventLoopHub, process: PoolProcess) -> object:
                try:
                    return exited(hub, process)
                finally:
                    self._watch_closed(hub, process)

            compat.set_event_process_exit(self.pool, event_process_exit)

    def _note_children(self) -> None:
        self.handled = set()
        try:
            self.before = {p.pid: p for p in list(self._children()) if p.pid}
            self.running = _running_by_pid(self.pool)
            self.fails = _ends_failed_ids()
        except Exception:
            logger.exception("celery-lease: cannot note the pool's running tasks")
            self.running = {}
            self.fails = set()

    def _release_joined(self) -> None:
        try:
            present = {id(p) for p in self._children()}
            for pid, process in self.before.items():
                if id(process) not in present and pid not in self.handled:
                    self.reaped(pid, process, wait=False)
        except Exception:
            logger.exception(_REAPER_FAILED)
        self.before = {}

    def _release_lost(self, job: PoolJob) -> None:
        try:
            for pid in job.worker_pids():
                process = self.before.get(pid)
                if process is not None and pid not in self.handled:
                    self.reaped(pid, process, wait=True)
        except Exception:
            logger.exception(_REAPER_FAILED)

    def _watch_closed(self, hub: EventLoopHub, process: PoolProcess) -> None:
        try:
            if process in self._children():  # closed its files, not yet reapable
                self.watch_exit(hub, process)
        except Exception:
            logger.exception(
                "celery-lease: cannot watch pool process %s exit; billiard's timer"
                " reaps it within 5 s",
                getattr(process, "pid", "?"),
            )

    def _children(self) -> list[PoolProcess]:
        return compat.child_processes(self.pool) or []

    def watch_exit(self, hub: EventLoopHub, process: PoolProcess) -> None:
        """Run the pool's maintenance as soon as ``process`` can be reaped (operations.md)."""
        try:
            fd = os.pidfd_open(cast(int, process.pid))  # a child the loop watched: started
        except (AttributeError, OSError):  # no pidfd here: retry on the loop's timer
            self._retry_reap(hub, process, _REAP_RETRY_FIRST, 0.0)
            return

        def readable() -> None:
            hub.remove_reader(fd)
            os.close(fd)
            self.pool.maintain_pool()

        try:
            hub.add_reader(fd, readable)
        except BaseException:
            os.close(fd)
            raise

    def _retry_reap(
        self, hub: EventLoopHub, process: PoolProcess, delay: float, waited: float
    ) -> None:
        def retry() -> None:
            self.pool.maintain_pool()
            if process in self._children() and waited + delay < _REAP_RETRY_FOR:
                self._retry_reap(hub, process, delay * 2, waited + delay)

        hub.call_later(delay, retry)

    def reaped(self, pid: int, process: PoolProcess, *, wait: bool) -> None:
        self.handled.add(pid)
        if process in self._children():
            return
        exitcode = process.exitcode  # not None only once waitpid() returned for it: reaped
        if exitcode is None:
            logger.debug("celery-lease: pool process %d left the pool unreaped", pid)
            return
        control.forget_child(pid)
        tasks = dict(self.running.get(pid, {}))
        fails = {task_id for task_id in tasks if task_id in self.fails}
        if exitcode not in (0, compat.EX_RECYCLE):  # killed: the next death after a hard time limit
            for task_id in list(_timed_out):  # used once, so a later exit cannot reuse it
                name = tasks[task_id] = _timed_out.pop(task_id)[0]
                task = self.app.tasks.get(name) if name else None
                if task is not None and not _runs_again(task, timed_out=True):
                    fails.add(task_id)
                else:
                    fails.discard(task_id)
        if not tasks:
            return
        death = _Death(pid, exitcode, tasks, fails)
        self.deaths.put(death)
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(
                target=self._run, name="celery-lease dead holders", daemon=True
            )
            self.thread.start()
        if wait and not self.stuck and not death.done.wait(DEAD_HOLDER_WAIT):
            self.stuck = not death.done.is_set()  # until it ends a death, requeues do not wait
            logger.warning(
                "celery-lease: the leases of dead pool process %d are not released after %gs;"
                " its tasks are requeued now (a redelivery may find its key still held)",
                pid,
                DEAD_HOLDER_WAIT,
            )

    def _run(self) -> None:
        while True:
            death = self.deaths.get()
            try:
                self.release(death)
            except Exception:
                logger.exception(
                    "celery-lease: releasing the leases of dead pool process %d failed; "
                    "its keys free themselves at their ttl",
                    death.pid,
                )
            finally:
                death.done.set()
                self.stuck = False

    def _stores(self) -> list[LockStore]:
        try:
            settings = get_settings(self.app)
        except LeaseConfigError:
            return []
        stores: dict[int, LockStore] = {}
        for where, option in startup.stores_in_use(self.app, settings.store):
            try:
                store = store_for(option, self.app)
            except Exception as exc:
                logger.warning("celery-lease: cannot open the store of %s: %s", where, exc)
                continue
            stores.setdefault(id(store), store)
        return list(stores.values())

    def succeeded(self, task_id: str | None) -> bool:
        """Whether the backend holds SUCCESS for ``task_id`` (its key is then a cooldown)."""
        if not task_id:
            return False
        backend = getattr(self.app, "backend", None)
        get = compat.task_meta_reader(backend)
        as_uri = getattr(backend, "as_uri", None)
        if get is None or type(backend).__name__ == "DisabledBackend":
            return False
        try:
            if callable(as_uri) and str(as_uri()).startswith("rpc://"):
                return False  # results live on the caller's queue
            return bool(get(task_id).get("status") == "SUCCESS")
        except Exception as exc:
            logger.debug("celery-lease: cannot read the state of task %s: %s", task_id, exc)
            return False

    def release(self, death: _Death) -> None:
        """Release the dead child's leases, and the queued keys of copies not run again."""
        for store in self._stores():
            if not conforms(store, SupportsInspection):
                logger.warning(
                    "celery-lease: %s cannot list leases: the leases of dead pool process %d"
                    " (if any) free themselves at their ttl",
                    type(store).__name__,
                    death.pid,
                )
                continue
            inspect = cast(SupportsInspection, store)
            try:
                infos = inspect.list()
            except Exception as exc:
                logger.warning(
                    "celery-lease: cannot list the leases of dead pool process %d (%s); they"
                    " free themselves at their ttl",
                    death.pid,
                    exc,
                )
                continue
            by_key = {info.key: info for info in infos}
            for info in infos:
                owner = owners.parse_owner(info.owner)
                if (
                    owner.host != self.host
                    or owner.pid != death.pid
                    or owner.task_id not in death.tasks
                    or (owner.node is not None and owner.node != self.node)
                    # made after the reap: a new child with the recycled pid took it
                    or (owner.taken_at is not None and owner.taken_at > death.at)
                ):
                    continue
                if self.succeeded(owner.task_id):
                    logger.info(
                        "celery-lease: pool process %d died after task %s[%s] succeeded: its"
                        " lease on %r (a cooldown) is kept",
                        death.pid,
                        owner.task,
                        owner.task_id,
                        info.key,
                    )
                    continue
                try:
                    store.release(info.key, owner.raw)  # without a replace mark
                except Exception as exc:
                    logger.warning(
                        "celery-lease: releasing %r of dead pool process %d failed (%s); it"
                        " frees itself within %.1fs",
                        info.key,
                        death.pid,
                        exc,
                        info.expires_in,
                    )
                    continue
                _timed_out.pop(owner.task_id or "", None)
                held = None if owner.taken_at is None else max(0.0, time.time() - owner.taken_at)
                logger.warning(
                    "celery-lease: pool process %d died (exit code %s) holding %r for task"
                    " %s[%s]; released it (owner %s, token %d)",
                    death.pid,
                    death.exitcode,
                    info.key,
                    owner.task,
                    owner.task_id,
                    info.owner,
                    info.token,
                )
                task = self.app.tasks.get(owner.task) if owner.task else None
                key, slot = split_slot(info.key)  # a slot's store key: its key and slot
                named = {
                    "key": key,
                    "slot": slot or 0,
                    "token": info.token,
                    "held_seconds": held,
                    "task_id": owner.task_id,
                    "reason": "holder_died",
                    "pid": death.pid,
                    "exitcode": death.exitcode,
                }
                get_dispatcher().submit(
                    _send_released, (task, named), f"lock_released of {info.key!r} (holder died)"
                )
                if owner.task_id in death.fails:
                    self._release_queued(store, by_key, info.key, owner.task_id, death)

    def _release_queued(
        self,
        store: LockStore,
        by_key: dict[str, LeaseInfo],
        key: str,
        task_id: str | None,
        death: _Death,
    ) -> None:
        qkey = queued_key(key, self._prefix())
        info = by_key.get(qkey)
        if (
            info is None
            or not owners.is_queued_owner(info.owner)
            or owners.parse_owner(info.owner).task_id != task_id
        ):
            return
        try:
            store.release(qkey, info.owner)
        except Exception as exc:
            logger.warning(
                "celery-lease: releasing the queued key %r of dead pool process %d failed (%s);"
                " it frees itself within %.1fs",
                qkey,
                death.pid,
                exc,
                info.expires_in,
            )
            return
        logger.warning(
            "celery-lease: pool process %d died running unique copy %s[%s], which is not run"
            " again; released its queued key %r (owner %s)",
            death.pid,
            death.tasks.get(task_id or ""),
            task_id,
            qkey,
            info.owner,
        )

    def _prefix(self) -> str:
        try:
            return get_settings(self.app).key_prefix
        except Exception:
            return ""


def _send_released(args: tuple[CeleryTask | None, dict[str, object]]) -> None:
    task, named = args
    signals.send(signals.lock_released, task, **named)


class DeadHolders(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: release the leases of prefork children that die running a task."""

    name = "celery_lease.worker.DeadHolders"  # a fixed step name, wherever the class lives
    label = "celery-lease dead holders"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: WorkerLike, **kwargs: object) -> None:
        super().__init__(parent, **kwargs)
        self.reaper: _Reaper | None = None

    def start(self, parent: WorkerLike) -> None:
        inner = compat.billiard_pool(getattr(parent, "pool", None))
        if not compat.reapable(inner):
            return
        self.reaper = _Reaper(parent.app, getattr(parent, "hostname", None), inner)
        self.reaper.install()
