"""The prefork worker's reaper (``celery_lease.worker._Reaper``) without a worker.

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
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_lease import LeaseInfo, MemoryLockStore
from celery_lease.dispatch import drain
from celery_lease.owners import make_owner
from celery_lease.signals import lock_released
from celery_lease.worker import _Death, _Reaper

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
