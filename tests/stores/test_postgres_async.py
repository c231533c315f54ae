"""celery_lease.stores.postgres_async: the whole store contract, through
:class:`tests.stores.async_contract.SyncOverAsync`, on the shared PostgreSQL (a scratch
database, one new table per store)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import socket
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from celery_lease.stores.base import AsyncLockStore, LockStore
from celery_lease.stores.postgres import PostgresLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from celery_lease.stores.slots import slot_key
from tests.stores.async_contract import AsyncStoreContract, SyncOverAsync, wait_for
from tests.stores.contract import LONG_MS
from tests.stores.slot_contract import ReplaceContract, SlotContract
from tests.stores.sql_slots import SqlSlotChecks


@pytest.mark.postgres
class TestAsyncPostgresContract(SlotContract, ReplaceContract, AsyncStoreContract):
    """AsyncPostgresLockStore on the shared server, one new table per store (real clock); its
    slots through the coroutine, replace through the sync twin (on the same rows)."""

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

    def make_store(self) -> LockStore:
        return _SlotsOverAsync(self.make_async_store)

    def store_factory(self) -> Callable[[], LockStore]:
        return _SlotsOverAsyncFactory(self.dsn, self.table)

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        assert isinstance(store, SyncOverAsync)
        inner = store.async_store
        assert isinstance(inner, AsyncPostgresLockStore)
        wait_for(lambda: inner.waiting() >= count, f"{count} waiters")


class _SlotsOverAsync(SyncOverAsync):
    """SyncOverAsync plus ``acquire_slot`` and ``release_owned_slots`` (the async store's
    coroutines) and ``mark_replaced`` (the sync twin's: replace is a task option, driven by a
    sync store)."""

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> Any:
        store = self.async_store
        assert isinstance(store, AsyncPostgresLockStore)
        return self.run(store.acquire_slot(key, owner, ttl_ms, limit))

    def release_owned_slots(self, key: str, owner: str) -> None:
        store = self.async_store
        assert isinstance(store, AsyncPostgresLockStore)
        self.run(store.release_owned_slots(key, owner))

    def mark_replaced(self, key: str, ticket: int | None = None, holder: str | None = None) -> Any:
        twin = self.async_store.sync
        assert isinstance(twin, PostgresLockStore)
        return twin.mark_replaced(key, ticket, holder)


class _SlotsOverAsyncFactory:
    """Picklable: a :class:`_SlotsOverAsync` over a new store on ``dsn`` and ``table``."""

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn, self.table = dsn, table

    def __call__(self) -> _SlotsOverAsync:
        return _SlotsOverAsync(
            functools.partial(AsyncPostgresLockStore, self.dsn, table=self.table)
        )


@pytest.mark.postgres
class TestAsyncPostgresSlots(SqlSlotChecks):
    """acquire_slot as a coroutine, on the same rows as the sync store's."""

    @pytest.fixture
    def slot_store(self, pg_database_dsn: str, pg_table: str) -> Iterator[_SlotsOverAsync]:
        self.dsn, self.table = pg_database_dsn, pg_table
        store = _SlotsOverAsyncFactory(pg_database_dsn, pg_table)()
        try:
            yield store
        finally:
            store.close()

    def _update(self, statement: str, params: list[Any]) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            query = sql.SQL(statement).format(sql.Identifier(self.table))
            assert conn.execute(query, params).rowcount == 1

    def make_expired(self, store: Any, store_key: str) -> None:
        self._update(
            "UPDATE {} SET expires = clock_timestamp() - interval '1 second' WHERE key = %s",
            [store_key],
        )

    def set_token(self, store: Any, store_key: str, token: int) -> None:
        self._update("UPDATE {} SET token = %s WHERE key = %s", [token, store_key])

    def slot_store_factory(self) -> Callable[[], Any]:
        return _SlotsOverAsyncFactory(self.dsn, self.table)

    def unreachable_store(self, tmp_path: Any) -> Any:
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dsn = f"postgresql://postgres@127.0.0.1:{port}/x"
        return _SlotsOverAsync(functools.partial(AsyncPostgresLockStore, dsn, connect_timeout=1))

    def wait_until_waiting(self, store: _SlotsOverAsync, count: int) -> None:
        inner = store.async_store
        assert isinstance(inner, AsyncPostgresLockStore)
        wait_for(lambda: inner.waiting() >= count, f"{count} waiters")

    def test_a_cancelled_acquire_slot_releases_what_it_took(
        self, slot_store: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Cancelled once its transaction committed (the reply never reached the caller): the
        slot it took is released, so the limit is not left short by one for a ttl."""
        store = slot_store.async_store
        assert isinstance(store, AsyncPostgresLockStore)
        drive = store._drive
        taken: list[object] = []

        async def drive_then_cancel(conn: Any, plan: Any) -> Any:
            taken.append(await drive(conn, plan))
            raise asyncio.CancelledError

        monkeypatch.setattr(store, "_drive", drive_then_cancel)
        with pytest.raises(concurrent.futures.CancelledError):  # as the loop thread reports it
            slot_store.acquire_slot("k", "a", LONG_MS, 1)
        assert taken == [(0, taken[0][1])]  # type: ignore[index]
        assert slot_store.get(slot_key("k", 0)) is None
        monkeypatch.undo()
        assert slot_store.acquire_slot("k", "b", LONG_MS, 1) is not None
