"""celery_lease.stores.postgres_async: the whole store contract, through
:class:`tests.stores.async_contract.SyncOverAsync`, on the shared PostgreSQL (a scratch
database, one new table per store)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from celery_lease.stores.base import AsyncLockStore, LockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from tests.stores.async_contract import AsyncStoreContract, SyncOverAsync, wait_for


@pytest.mark.postgres
class TestAsyncPostgresContract(AsyncStoreContract):
    """AsyncPostgresLockStore on the shared server, one new table per store (real clock)."""

    fake_clock = False
    stateful_examples = 10

    @pytest.fixture
    def store_backend(self, pg_database_dsn: str, pg_table: str) -> None:
        self.dsn = pg_database_dsn
        self.base_table = pg_table
        self.count = 0

    def make_async_store(self) -> AsyncLockStore:
        self.count += 1
        self.table = f"{self.base_table}_{self.count}"
        return AsyncPostgresLockStore(self.dsn, table=self.table)

    def async_store_factory(self) -> Callable[[], AsyncLockStore]:
        return functools.partial(AsyncPostgresLockStore, self.dsn, table=self.table)

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        assert isinstance(store, SyncOverAsync)
        inner = store.async_store
        assert isinstance(inner, AsyncPostgresLockStore)
        wait_for(lambda: inner.waiting() >= count, f"{count} waiters")
