"""The prefork worker's reaper (``celery_lease._celery.reaper._Reaper``) without a worker.

Which leases of a dead pool child it releases (owner-checked, only that child's running tasks',
never a succeeded task's cooldown) and how it makes the event loop reap a child at once (a pidfd,
or retries without one). The real worker is in ``tests/integration/test_dead_holders.py``.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_lease import LeaseInfo, MemoryLockStore, StoreUnavailableError
from celery_lease._celery import reaper as reaper_module
from celery_lease._celery.reaper import _Death, _Reaper
from celery_lease._core.dispatch import drain
from celery_lease._core.owners import make_owner
from celery_lease.signals import lock_released
from celery_lease.stores.slots import marked

TTL_MS = 30_000
NODE = "w1@host"
DEAD = 4242  # the dead child's pid (never signalled: only written into owner ids)


class FakeBackend:
    def __init__(self, states: dict[str, str]) -> None:
        self.states = states

    def as_uri(self) -> str:
        return "redis://fake"

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        return {"status": self.states.get(task_id, "PENDING")}


class FakeApp:
    def __init__(self, states: dict[str, str] | None = None) -> None:
        self.tasks: dict[str, Any] = {}
        self.backend = FakeBackend(states or {})


def owner(task_id: str, pid: int = DEAD, host: str | None = None, node: str = NODE) -> str:
    """An owner id as a pool child ``pid`` on ``host`` would have made it for ``task_id``."""
    made = make_owner(node=node, task="t.run", task_id=task_id)
    head, _, fields = made.partition(";")
    _, _, hex_part = head.split("/")
    return f"{host or socket.gethostname()}/{pid}/{hex_part};{fields}"


@pytest.fixture
def released() -> Iterator[list[dict[str, Any]]]:
    """``lock_released`` as the reaper sends it (from the dispatcher thread), collected."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **named: Any) -> None:
        if named.get("reason") == "holder_died":
            seen.append(named)

    lock_released.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        lock_released.disconnect(receiver)


def reaper_over(store: Any, app: FakeApp | None = None) -> _Reaper:
    reaper = _Reaper(app or FakeApp(), NODE, pool=None)
    reaper._stores = lambda: [store]  # type: ignore[method-assign]
    return reaper


class TestWhatIsReleased:
    def test_only_the_dead_childs_leases_of_its_running_tasks_go(
        self, released: list[dict[str, Any]]
    ) -> None:
        """Released: the dead pid's lease of a task it ran. Kept: its lease of a task it did not
        run (a cooldown), and leases of another pid, host or node."""
        store = MemoryLockStore()
        leases = {
            "running": owner("t1"),
            "cooldown": owner("t-finished"),
            "other-pid": owner("t1", pid=DEAD + 1),
            "other-host": owner("t1", host="elsewhere"),
            "other-node": owner("t1", node="w2@host"),
        }
        tokens = {key: store.acquire(key, who, TTL_MS) for key, who in leases.items()}
        reaper_over(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
        assert drain()
        assert store.get("running") is None
        for key in ("cooldown", "other-pid", "other-host", "other-node"):
            info = store.get(key)
            assert info is not None and info.owner == leases[key], key
        (sent,) = released
        assert (sent["key"], sent["token"], sent["pid"], sent["exitcode"], sent["task_id"]) == (
            "running", tokens["running"], DEAD, -9, "t1",
        )  # fmt: skip

    def test_a_task_whose_success_is_stored_keeps_its_key(
        self, released: list[dict[str, Any]]
    ) -> None:
        """Killed after storing SUCCESS but before the pool read it: its key is its cooldown."""
        store = MemoryLockStore()
        store.acquire("k", owner("t1"), TTL_MS)
        reaper_over(store, FakeApp({"t1": "SUCCESS"})).release(_Death(DEAD, -9, {"t1": "t.run"}))
        assert drain()
        assert store.get("k") is not None
        assert released == []

    def test_a_key_retaken_after_the_listing_is_left_to_its_new_owner(self) -> None:
        """The key changes hands between ``list()`` and ``release()``: the owner-checked release
        removes nothing of the new owner's."""

        class Retaken(MemoryLockStore):
            def list(self, prefix: str = "") -> list[LeaseInfo]:
                infos = super().list(prefix)
                self.force_release("k")
                self.token = self.acquire("k", "someone/1/else", TTL_MS)
                return infos

        store = Retaken()
        store.acquire("k", owner("t1"), TTL_MS)
        reaper_over(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
        info = store.get("k")
        assert info is not None and (info.owner, info.token) == ("someone/1/else", store.token)


class FakeHub:
    """The event loop's ``add_reader`` / ``remove_reader`` / ``call_later``, run by hand."""

    def __init__(self) -> None:
        self.readers: dict[int, Callable[[], None]] = {}
        self.later: list[tuple[float, Callable[[], None]]] = []

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        del self.readers[fd]

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.later.append((delay, callback))


class FakePool:
    """A pool whose maintenance reaps the process once it is told it may."""

    def __init__(self, process: Any) -> None:
        self._pool = [process]
        self.maintained = 0
        self.reapable = threading.Event()

    def maintain_pool(self) -> None:
        self.maintained += 1
        if self.reapable.is_set():
            self._pool.clear()


class TestReapAtOnce:
    def test_a_pidfd_wakes_the_loop_once_the_child_can_be_reaped(self) -> None:
        """With a pidfd the loop watches the child: readable once it is a zombie, then the
        pool's maintenance runs (and reaps it) and the fd is closed."""
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            pool = FakePool(child)
            hub = FakeHub()
            reaper = _Reaper(FakeApp(), NODE, pool)
            reaper.watch_exit(hub, child)
            ((fd, readable),) = hub.readers.items()
            assert select.select([fd], [], [], 0)[0] == []  # alive: nothing to reap yet
            os.kill(child.pid, signal.SIGKILL)
            assert select.select([fd], [], [], 10)[0] == [fd]  # a zombie now
            pool.reapable.set()
            readable()
            assert pool.maintained == 1 and pool._pool == []
            assert hub.readers == {}
            with pytest.raises(OSError):
                os.fstat(fd)  # closed
        finally:
            child.kill()
            child.wait()

    def test_without_pidfd_the_maintenance_is_retried_with_backoff(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """No pidfd: the maintenance runs again after 5, 10, 20 ms ... until the child is gone."""
        monkeypatch.delattr(os, "pidfd_open", raising=False)
        process = object()
        pool = FakePool(process)
        hub = FakeHub()
        _Reaper(FakeApp(), NODE, pool).watch_exit(hub, process)
        delays = []
        for _ in range(3):
            ((delay, retry),) = hub.later
            hub.later.clear()
            delays.append(delay)
            retry()
        assert delays == [0.005, 0.01, 0.02]
        pool.reapable.set()
        ((delay, retry),) = hub.later
        hub.later.clear()
        retry()
        assert pool._pool == [] and hub.later == []  # reaped: no more retries

    def test_the_retries_stop_after_five_seconds(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A child that never becomes reapable is left to billiard's own 5 s maintenance."""
        monkeypatch.delattr(os, "pidfd_open", raising=False)
        pool = FakePool(object())
        hub = FakeHub()
        _Reaper(FakeApp(), NODE, pool).watch_exit(hub, pool._pool[0])
        waited = 0.0
        while hub.later:
            ((delay, retry),) = hub.later
            hub.later.clear()
            waited += delay
            retry()
        assert 5.0 <= waited < 11.0


# Orders and failures the reaper must survive -----------------------------------------------------
#
# A pid recycled by a new pool child, a task id remembered from a hard time limit, a store that
# hangs, the reaper's own bookkeeping failing inside billiard's maintenance, pools without children.


REAL_TIMEOUT = 10.0  # real seconds a test waits for a background thread before it fails


class NoBackendApp:
    """An app without a result backend (the common case: ``succeeded()`` cannot say SUCCESS)."""

    def __init__(self) -> None:
        self.tasks: dict[str, Any] = {}
        self.backend = None


def owner_made_at(task_id: str, pid: int = DEAD, at_ms: int | None = None) -> str:
    """An owner id as pool child ``pid`` of this host would make it for ``task_id`` (at
    ``at_ms``, milliseconds since the epoch, when given)."""
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


def reaper_without_backend(store: Any, pool: Any = None) -> _Reaper:
    """A reaper over ``store`` (and ``pool``) for an app without a result backend."""
    reaper = _Reaper(NoBackendApp(), NODE, pool)
    reaper._stores = lambda: [store]  # type: ignore[method-assign]
    return reaper


@pytest.fixture
def clean_timed_out() -> Iterator[dict[str, tuple[str | None, float]]]:
    saved = dict(reaper_module._timed_out)
    reaper_module._timed_out.clear()
    try:
        yield reaper_module._timed_out
    finally:
        reaper_module._timed_out.clear()
        reaper_module._timed_out.update(saved)


class TestPidReuse:
    def test_a_lease_taken_after_the_child_was_reaped_is_not_its_lease(self) -> None:
        """A new child forked with the dead child's pid runs the redelivered task (same task id)
        and takes its key before the release thread lists: that lease was made after the death,
        so it cannot be the dead child's, and stays."""
        store = MemoryLockStore()
        death = _Death(DEAD, -9, {"t1": "t.run"})
        later_ms = int((time.time() + 5) * 1000)  # the new child made its owner id after
        store.acquire("k", owner_made_at("t1", at_ms=later_ms), TTL_MS)
        reaper_without_backend(store).release(death)
        assert drain()
        info = store.get("k")
        assert info is not None, "the recycled pid's live lease of the redelivery was released"

    def test_a_lease_the_dead_child_took_before_it_died_still_goes(self) -> None:
        """The same check keeps releasing what the dead child itself took."""
        store = MemoryLockStore()
        store.acquire("k", owner_made_at("t1", at_ms=int((time.time() - 5) * 1000)), TTL_MS)
        reaper_without_backend(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
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
        store.acquire("cooldown", owner_made_at("t1", pid=DEAD), TTL_MS)  # child B's cooldown of t1
        clean_timed_out["t1"] = ("t.run", time.monotonic())
        a, b = Process(DEAD - 1, -9), Process(DEAD, 0)
        pool = Pool()
        reaper = reaper_without_backend(store, pool)
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

        monkeypatch.setattr(reaper_module, "_Death", Death)
        monkeypatch.setattr(reaper_module, "DEAD_HOLDER_WAIT", 0.01)
        store = HangingStore()
        first, second = Process(DEAD, -9), Process(DEAD + 1, -9)
        pool = Pool()
        reaper = reaper_without_backend(store, pool)
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

        monkeypatch.setattr(reaper_module, "_running_by_pid", broken)
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
        monkeypatch.setattr(
            reaper_module, "_running_by_pid", lambda pool=None: {DEAD: {"t1": "t.run"}}
        )

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


class TestPoolsWithoutChildren:
    @pytest.mark.parametrize("pool", [None, object()])
    def test_the_step_installs_nothing_without_billiard_internals(self, pool: Any) -> None:
        """solo / threads / gevent: no ``_pool`` of children, so no reaper and no wrapping."""

        class Parent:
            app = NoBackendApp()
            hostname = NODE

        Parent.pool = pool  # type: ignore[attr-defined]
        step = reaper_module.DeadHolders.__new__(reaper_module.DeadHolders)
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

        assert reaper_module._running_by_pid(PoolWithJobs()) == {DEAD: {"t1": None}}


class TestOneStoreFails:
    def test_a_store_whose_list_raises_or_cannot_list_is_skipped_and_the_others_handled(
        self, released: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
    ) -> None:
        """Three stores: the first's ``list()`` raises, the second has no ``list()``; the dead
        child's lease in the third is released all the same, and each skip is logged."""

        class Unlistable(MemoryLockStore):
            def list(self, prefix: str = "") -> list[LeaseInfo]:
                raise StoreUnavailableError("the listing failed")

        class NoListing:
            """A store that cannot list (not SupportsInspection)."""

        failing, healthy = Unlistable(), MemoryLockStore()
        failing.acquire("k-failing", owner("t1"), TTL_MS)
        healthy.acquire("k-healthy", owner("t1"), TTL_MS)
        reaper = _Reaper(FakeApp(), NODE, pool=None)
        reaper._stores = lambda: [failing, NoListing(), healthy]  # type: ignore[method-assign,list-item]
        reaper.release(_Death(DEAD, -9, {"t1": "t.run"}))
        assert drain()
        assert healthy.get("k-healthy") is None
        assert failing.get("k-failing") is not None, "left to its ttl"
        assert [sent["key"] for sent in released] == ["k-healthy"]
        assert "the listing failed" in caplog.text and "cannot list leases" in caplog.text


class TestAMarkedLease:
    """A dead child's lease that a newer ``on_held="replace"`` call asked to stop (stored with
    the replace mark) is read as that child's."""

    def test_it_is_released_for_the_dead_child(self) -> None:
        store = MemoryLockStore()
        store.acquire("k", owner_made_at("t1", at_ms=int((time.time() - 5) * 1000)), TTL_MS)
        store.mark_replaced("k")
        reaper_without_backend(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
        assert drain()
        assert store.get("k") is None

    def test_one_made_after_the_child_was_reaped_is_kept(self) -> None:
        """The recycled-pid guard reads the marked owner's ``at``."""
        store = MemoryLockStore()
        made = owner_made_at("t1", at_ms=int((time.time() + 5) * 1000))
        store.acquire("k", made, TTL_MS)
        store.mark_replaced("k")
        reaper_without_backend(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
        assert drain()
        info = store.get("k")
        assert info is not None and info.owner == marked(made)
