"""celery_lease.stores.threaded: the thread adapter runs a sync store's calls off the event
loop. The whole store contract, through :class:`tests.stores.async_contract.SyncOverAsync`, over
the memory and SQLite stores."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_lease.stores import threaded as _aio_store
from celery_lease.stores.base import AsyncLockStore, LockStore
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.sqlite import SQLiteLockStore
from celery_lease.stores.threaded import ThreadedAsyncStore
from tests.stores.async_contract import AsyncStoreContract, SyncOverAsync, wait_for


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
