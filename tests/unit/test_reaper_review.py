"""Review attacks on the dead-holder reaper (``celery_lease.worker._Reaper``) and the worker hooks.

Each test forces one order or one failure the reaper must survive: a pid recycled by a new pool
child, a task id remembered from a hard time limit, a store that hangs, the reaper's own
bookkeeping failing inside billiard's maintenance, and a socket directory that cannot be made.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_lease import LeaseInfo, MemoryLockStore, worker
from celery_lease.dispatch import drain
from celery_lease.owners import make_owner
from celery_lease.worker import _Death, _Reaper

TTL_MS = 30_000
NODE = "w1@host"
DEAD = 4242  # the dead child's pid (never signalled: only written into owner ids)
REAL_TIMEOUT = 10.0  # real seconds a test waits for a background thread before it fails


class NoBackendApp:
    """An app without a result backend (the common case: ``succeeded()`` cannot say SUCCESS)."""

    def __init__(self) -> None:
        self.tasks: dict[str, Any] = {}
        self.backend = None


def owner(task_id: str, pid: int = DEAD, at_ms: int | None = None) -> str:
    """An owner id as pool child ``pid`` of this host would make it for ``task_id``."""
    made = make_owner(node=NODE, task="t.run", task_id=task_id)
    head, _, fields = made.partition(";")
    _, _, hex_part = head.split("/")
    if at_ms is not None:
        fields = fields.rpartition(";at=")[0] + f";at={at_ms}"
    return f"{socket.gethostname()}/{pid}/{hex_part};{fields}"


class Process:
    def __init__(self, pid: int, exitcode: int | None) -> None:
        self.pid = pid
        self.exitcode = exitcode


class Pool:
    """The part of billiard's pool the reaper touches: ``_pool`` and the two wrapped methods."""

    def __init__(self, *processes: Process) -> None:
        self._pool = list(processes)
        self.joined = 0

    def _join_exited_workers(self, shutdown: bool = False) -> list[int]:
        self.joined += 1
        gone = [p for p in self._pool if p.exitcode is not None]
        self._pool = [p for p in self._pool if p.exitcode is None]
        return [p.exitcode for p in gone if p.exitcode is not None]

    def mark_as_worker_lost(self, job: Any, exitcode: Any) -> None:
        pass


def reaper_over(store: Any, pool: Any = None) -> _Reaper:
    reaper = _Reaper(NoBackendApp(), NODE, pool)
    reaper._stores = lambda: [store]  # type: ignore[method-assign]
    return reaper


@pytest.fixture
def clean_timed_out() -> Iterator[dict[str, tuple[str | None, float]]]:
    saved = dict(worker._timed_out)
    worker._timed_out.clear()
    try:
        yield worker._timed_out
    finally:
        worker._timed_out.clear()
        worker._timed_out.update(saved)


class TestPidReuse:
    def test_a_lease_taken_after_the_child_was_reaped_is_not_its_lease(self) -> None:
        """A new child forked with the dead child's pid runs the redelivered task (same task id)
        and takes its key before the release thread lists: that lease was made after the death,
        so it cannot be the dead child's, and stays."""
        store = MemoryLockStore()
        death = _Death(DEAD, -9, {"t1": "t.run"})
        later_ms = int((time.time() + 5) * 1000)  # the new child made its owner id after
        store.acquire("k", owner("t1", at_ms=later_ms), TTL_MS)
        reaper_over(store).release(death)
        assert drain()
        info = store.get("k")
        assert info is not None, "the recycled pid's live lease of the redelivery was released"

    def test_a_lease_the_dead_child_took_before_it_died_still_goes(self) -> None:
        """The same check keeps releasing what the dead child itself took."""
        store = MemoryLockStore()
        store.acquire("k", owner("t1", at_ms=int((time.time() - 5) * 1000)), TTL_MS)
        reaper_over(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
        assert drain()
        assert store.get("k") is None


class TestTimedOutIds:
    def test_a_remembered_hard_time_limit_does_not_follow_into_a_later_childs_exit(
        self, clean_timed_out: dict[str, tuple[str | None, float]]
    ) -> None:
        """t1 hit its hard time limit on child A, whose death is handled next. t1 is then
        redelivered (same id) to child B, succeeds and keeps its cooldown; B exits normally
        (``--max-tasks-per-child``). B's exit must not count t1 as a task B was running: without
        a result backend that would release t1's cooldown."""
        store = MemoryLockStore()
        store.acquire("cooldown", owner("t1", pid=DEAD), TTL_MS)  # child B's cooldown of t1
        clean_timed_out["t1"] = ("t.run", time.monotonic())
        a, b = Process(DEAD - 1, -9), Process(DEAD, 0)
        pool = Pool()
        reaper = reaper_over(store, pool)
        reaper.running = {}
        handled: list[_Death] = []
        release = reaper.release

        def record(death: _Death) -> None:
            handled.append(death)
            release(death)

        reaper.release = record  # type: ignore[method-assign]
        reaper.reaped(a.pid, a, wait=True)  # child A's death: t1's entry is used here
        reaper.handled = set()
        reaper.reaped(b.pid, b, wait=True)
        assert drain()
        assert [d.pid for d in handled if "t1" in d.tasks] == [a.pid]
        assert store.get("cooldown") is not None, "a normal exit released a cooldown of t1"


class HangingStore(MemoryLockStore):
    """``list()`` blocks until ``go`` is set (a store that stopped answering)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.listing = threading.Event()

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        self.listing.set()
        self.go.wait(REAL_TIMEOUT)
        return super().list(prefix)


class TestHungStore:
    def test_a_hung_store_costs_the_event_loop_one_wait_not_one_per_death(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The first lost child's requeue waits for the release and gives up; while the release
        thread is still stuck, later deaths do not make the loop wait again (an OOM storm over
        32 children must not freeze the consumer for 32 s)."""
        waits: list[float | None] = []

        class Done(threading.Event):
            def wait(self, timeout: float | None = None) -> bool:
                waits.append(timeout)
                return super().wait(timeout)

        class Death(_Death):
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                self.done = Done()

        monkeypatch.setattr(worker, "_Death", Death)
        monkeypatch.setattr(worker, "DEAD_HOLDER_WAIT", 0.01)
        store = HangingStore()
        first, second = Process(DEAD, -9), Process(DEAD + 1, -9)
        pool = Pool()
        reaper = reaper_over(store, pool)
        reaper.running = {DEAD: {"t1": "t.run"}, DEAD + 1: {"t2": "t.run"}}
        try:
            reaper.reaped(first.pid, first, wait=True)
            assert store.listing.wait(REAL_TIMEOUT)
            assert waits == [0.01]
            reaper.reaped(second.pid, second, wait=True)
            assert waits == [0.01], "the loop waited again for a release thread known stuck"
        finally:
            store.go.set()


class TestErrorsNeverReachBilliard:
    def test_a_failing_snapshot_of_running_tasks_does_not_stop_the_pools_join(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The reaper's bookkeeping raising inside billiard's ``_join_exited_workers`` must not
        stop the pool from reaping and replacing children (nor propagate into the event loop)."""
        pool = Pool(Process(DEAD, -9))
        reaper = _Reaper(NoBackendApp(), NODE, pool)
        reaper.install()

        def broken(pool: Any = None) -> dict[int, dict[str, str | None]]:
            raise RuntimeError("boom")

        monkeypatch.setattr(worker, "_running_by_pid", broken)
        assert pool._join_exited_workers() == [-9]
        assert pool.joined == 1 and pool._pool == []

    def test_a_failing_release_start_does_not_replace_the_joins_result(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The thread that releases cannot start (``can't start new thread``): billiard still
        gets the exit codes of the children it joined."""
        dead = Process(DEAD, -9)
        pool = Pool(dead)
        reaper = _Reaper(NoBackendApp(), NODE, pool)
        reaper.install()
        monkeypatch.setattr(worker, "_running_by_pid", lambda pool=None: {DEAD: {"t1": "t.run"}})

        class NoThreads:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def start(self) -> None:
                raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading, "Thread", NoThreads)
        assert pool._join_exited_workers() == [-9]

    def test_a_failing_exit_watch_does_not_reach_the_event_loop(self) -> None:
        """The pidfd watch cannot be registered (the hub refuses the fd): the pool's own handling
        of the exited child has run, and nothing propagates into the hub's callback."""
        calls: list[Any] = []

        class AsynLike(Pool):
            def _event_process_exit(self, hub: Any, process: Any) -> None:
                calls.append(process)  # billiard untracks the sentinel; the child stays listed

        class RefusingHub:
            def add_reader(self, fd: int, callback: Any) -> None:
                raise ValueError("bad fd")

            def call_later(self, delay: float, callback: Any) -> None:
                raise RuntimeError("hub closed")

        child = Process(os.getpid(), None)  # a pid that exists: pidfd_open succeeds
        pool = AsynLike(child)
        _Reaper(NoBackendApp(), NODE, pool).install()
        pool._event_process_exit(RefusingHub(), child)
        assert calls == [child]


class TestSocketDirectory:
    def test_an_unwritable_temp_dir_still_installs_the_worker_steps(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``worker_init`` adds the configuration check (and the reaper) although the socket
        directory of ``inspect leases`` cannot be made: Celery swallows a receiver's error, so
        raising there would silently skip the refusal of a bad configuration."""
        from celery_lease import control

        def no_dir(*args: Any, **kwargs: Any) -> str:
            raise PermissionError(13, "Permission denied", "/tmp")

        monkeypatch.setattr(tempfile, "mkdtemp", no_dir)
        monkeypatch.setattr(control, "_dir", None)
        monkeypatch.setattr(control, "_dir_pid", None)
        monkeypatch.setattr(worker, "_main_pid", worker._main_pid)

        class Steps:
            def __init__(self) -> None:
                self.added: list[Any] = []

            def add(self, step: Any) -> None:
                self.added.append(step)

        class App:
            def __init__(self) -> None:
                self.steps = {"worker": Steps()}

        class Sender:
            hostname = NODE
            app = App()

        from celery_lease import owners

        monkeypatch.setattr(owners, "_node", owners._node)
        worker._on_worker_init(sender=Sender())
        assert worker.LeaseCheck in Sender.app.steps["worker"].added
        assert worker.DeadHolders in Sender.app.steps["worker"].added
        assert control.socket_path(1) is None  # no directory: `inspect` says so per child


class TestPoolsWithoutChildren:
    @pytest.mark.parametrize("pool", [None, object()])
    def test_the_step_installs_nothing_without_billiard_internals(self, pool: Any) -> None:
        """solo / threads / gevent: no ``_pool`` of children, so no reaper and no wrapping."""

        class Parent:
            app = NoBackendApp()
            hostname = NODE

        Parent.pool = pool  # type: ignore[attr-defined]
        step = worker.DeadHolders.__new__(worker.DeadHolders)
        step.reaper = None
        step.start(Parent())
        assert step.reaper is None


class TestRunningTasks:
    def test_a_terminated_request_is_still_found_through_the_pools_job(self) -> None:
        """``revoke(terminate=True)`` removes the request from the worker's active requests before
        the child is reaped; the pool's unfinished job (``correlation_id`` = task id) still names
        the child, so the child's lease of that task is released."""

        class Job:
            correlation_id = "t1"
            _write_to = None
            _scheduled_for = None

            def worker_pids(self) -> list[int]:
                return [DEAD]

            def ready(self) -> bool:
                return False

        class Finished(Job):
            correlation_id = "t-done"

            def ready(self) -> bool:
                return True

        class PoolWithJobs:
            _cache = {1: Job(), 2: Finished()}

        assert worker._running_by_pid(PoolWithJobs()) == {DEAD: {"t1": None}}
