"""celery_lease.stores.threaded: the thread adapter runs a sync store's calls off the event
loop. The whole store contract, through :class:`tests.stores.async_contract.SyncOverAsync`, over
the memory and SQLite stores."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_lease.stores import threaded as _aio_store
from celery_lease.stores.base import AsyncLockStore, LockStore
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.slots import slot_key
from celery_lease.stores.sqlite import SQLiteLockStore
from celery_lease.stores.threaded import ThreadedAsyncStore
from tests.stores.async_contract import AsyncStoreContract, SyncOverAsync, wait_for
from tests.stores.contract import DEADLINE


def _threaded_sqlite(path: str) -> AsyncLockStore:
    """A ThreadedAsyncStore owning a SQLiteLockStore on ``path`` (picklable through partial)."""
    return ThreadedAsyncStore(SQLiteLockStore(path), close_store=True)


class _ThreadedContract(AsyncStoreContract):
    """The thread adapter over a sync store, on the real clock: its ``wait_for_release`` times
    out on the event loop's clock, so a fake clock would not move it."""

    fake_clock = False

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        assert isinstance(store, SyncOverAsync)
        slot = id(store.sync)

        def waiting() -> int:
            with _aio_store._waiters_lock:
                return sum(len(v) for (s, _), v in _aio_store._waiters.items() if s == slot)

        wait_for(lambda: waiting() >= count, f"{count} waiters")


class TestThreadedMemoryContract(_ThreadedContract):
    """ThreadedAsyncStore over a MemoryLockStore (one process)."""

    supports_processes = False

    def make_async_store(self) -> AsyncLockStore:
        return ThreadedAsyncStore(MemoryLockStore(), close_store=True)


class TestThreadedSQLiteContract(_ThreadedContract):
    """ThreadedAsyncStore over a SQLiteLockStore, one new file per store."""

    stateful_examples = 10

    @pytest.fixture
    def store_backend(self, tmp_path: Path) -> None:
        self.directory = tmp_path
        self.count = 0

    def make_async_store(self) -> AsyncLockStore:
        self.count += 1
        self.path = self.directory / f"leases-{self.count}.db"
        return _threaded_sqlite(str(self.path))

    def async_store_factory(self) -> Callable[[], AsyncLockStore]:
        return functools.partial(_threaded_sqlite, str(self.path))


class TestSlotsThroughTheAdapter:
    """``acquire_slot`` runs the sync store's on a thread; a slot's release wakes the waiters of
    its key."""

    def test_acquire_slot_is_the_sync_stores(self) -> None:
        sync = MemoryLockStore()
        astore = ThreadedAsyncStore(sync)

        async def scenario() -> None:
            first = await astore.acquire_slot("k", "a", 30_000, 2)
            second = await astore.acquire_slot("k", "b", 30_000, 2)
            assert first is not None and second is not None
            assert (first[0], second[0]) == (0, 1) and second[1] > first[1]
            assert await astore.acquire_slot("k", "c", 30_000, 2) is None
            assert await astore.acquire_slot("k", "a", 30_000, 2) == first  # its own again
            info = sync.get(slot_key("k", 1))
            assert info is not None and info.owner == "b"

        asyncio.run(asyncio.wait_for(scenario(), DEADLINE))

    def test_a_slots_release_wakes_a_waiter_for_its_key(self) -> None:
        """A coroutine waiting for "k" is woken by the release of slot 1 of "k" through the
        adapter, long before its timeout."""
        sync = MemoryLockStore()
        astore = ThreadedAsyncStore(sync)

        async def scenario() -> bool:
            got = await astore.acquire_slot("k", "a", 30_000, 2)
            assert got is not None
            waiter = asyncio.create_task(astore.wait_for_release("k", 3600))
            await asyncio.to_thread(self._wait_for_waiter, sync)
            await astore.release(slot_key("k", got[0]), "a")
            return await waiter

        assert asyncio.run(asyncio.wait_for(scenario(), DEADLINE)) is True

    @staticmethod
    def _wait_for_waiter(sync: MemoryLockStore) -> None:
        slot = (id(sync), "k")
        wait_for(lambda: bool(_aio_store._waiters.get(slot)), "the waiter of k")

    def test_a_cancelled_acquire_slot_releases_what_it_took(self) -> None:
        """Cancelled while the sync call runs: once it ends, its slot is released (owner-checked:
        another owner's slot stays)."""
        entered, go = threading.Event(), threading.Event()

        class Gated(MemoryLockStore):
            def acquire_slot(
                self, key: str, owner: str, ttl_ms: int, limit: int
            ) -> tuple[int, int] | None:
                if owner == "gated":
                    entered.set()
                    assert go.wait(DEADLINE)
                return super().acquire_slot(key, owner, ttl_ms, limit)

        sync = Gated()
        assert sync.acquire_slot("k", "other", 30_000, 3) is not None
        astore = ThreadedAsyncStore(sync)

        async def scenario() -> None:
            task = asyncio.create_task(astore.acquire_slot("k", "gated", 30_000, 3))
            assert await asyncio.to_thread(entered.wait, DEADLINE)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            go.set()

        asyncio.run(asyncio.wait_for(scenario(), DEADLINE))
        wait_for(lambda: [i.key for i in sync.list("k")] == [slot_key("k", 0)], "the undo")
        info = sync.get(slot_key("k", 0))
        assert info is not None and info.owner == "other"
