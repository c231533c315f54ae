"""A row locked by another session (an open transaction, ``SELECT ... FOR UPDATE``) costs the
PostgreSQL stores at most their ``statement_timeout``: the statement that meets it fails with a
``StoreUnavailableError`` saying so, instead of waiting for the other session to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores.postgres import PostgresLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from tests.stores.contract import LONG_MS

pytestmark = pytest.mark.postgres

BOUND = 1.0
"""The statement_timeout (seconds) of the stores under test."""

SLACK = 5.0
"""Real seconds past the bound a failing statement may take (a slow, shared CI machine)."""


@pytest.fixture
def store(pg_database_dsn: str, pg_table: str) -> Iterator[PostgresLockStore]:
    store = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=BOUND)
    yield store
    store.close()


@pytest.fixture
def row_locker(pg_database_dsn: str, pg_table: str) -> Iterator[Any]:
    """Another session; ``lock(key)`` takes that row ``FOR UPDATE`` in a transaction kept open
    until the test ends."""
    conn = psycopg.connect(pg_database_dsn)

    def lock(key: str) -> None:
        query = sql.SQL("SELECT key FROM {} WHERE key = %s FOR UPDATE").format(
            sql.Identifier(pg_table)
        )
        assert conn.execute(query, [key]).fetchone() is not None, "the row to lock exists"

    try:
        yield lock
    finally:
        conn.rollback()
        conn.close()


class TestALockedRow:
    def test_a_renewal_batch_meeting_a_locked_row_fails_within_the_bound(
        self, store: PostgresLockStore, row_locker: Any
    ) -> None:
        """One of two rows is locked: the batch raises StoreUnavailableError naming the
        statement_timeout, within the bound (not retried), instead of hanging."""
        assert store.acquire("a", "holder", LONG_MS) is not None
        assert store.acquire("b", "holder", LONG_MS) is not None
        row_locker("a")
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="statement_timeout") as caught:
            store.renew_many([("a", "holder", LONG_MS), ("b", "holder", LONG_MS)])
        took = time.monotonic() - started
        assert took < BOUND + SLACK, f"the batch took {took:.1f} s"
        assert "renew" in str(caught.value)

    def test_the_store_works_again_once_the_row_is_free(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """The timeout ends that statement only: the connection serves the next call."""
        store = PostgresLockStore(
            pg_database_dsn, table=pg_table, statement_timeout=BOUND, max_connections=1
        )
        try:
            assert store.acquire("a", "holder", LONG_MS) is not None
            with psycopg.connect(pg_database_dsn) as other:
                query = sql.SQL("SELECT key FROM {} WHERE key = 'a' FOR UPDATE").format(
                    sql.Identifier(pg_table)
                )
                other.execute(query)
                with pytest.raises(StoreUnavailableError):
                    store.renew("a", "holder", LONG_MS)
                other.rollback()
            assert store.renew_many([("a", "holder", LONG_MS)]) == [True]
        finally:
            store.close()

    def test_the_async_stores_renewals_are_bounded_too(
        self, pg_database_dsn: str, pg_table: str, row_locker: Any
    ) -> None:
        """The async store's leases renew through its sync twin, which gets its
        statement_timeout."""

        async def main() -> None:
            store = AsyncPostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=BOUND)
            try:
                assert await store.acquire("a", "holder", LONG_MS) is not None
                assert store.sync.statement_timeout == BOUND
                row_locker("a")
                started = time.monotonic()
                with pytest.raises(StoreUnavailableError, match="statement_timeout"):
                    await asyncio.get_running_loop().run_in_executor(
                        None, store.sync.renew_many, [("a", "holder", LONG_MS)]
                    )
                assert time.monotonic() - started < BOUND + SLACK
            finally:
                await store.aclose()

        asyncio.run(main())


class TestTheOption:
    def test_the_default_is_five_seconds(self, pg_database_dsn: str) -> None:
        store = PostgresLockStore(pg_database_dsn)
        assert store.statement_timeout == 5.0
        store.close()

    @pytest.mark.parametrize("bad", [0, -1, "5s", True, None, float("nan")])
    def test_a_bad_value_is_refused_at_construction(self, pg_database_dsn: str, bad: Any) -> None:
        with pytest.raises(LeaseConfigError, match=r"statement_timeout=.* must be a number"):
            PostgresLockStore(pg_database_dsn, statement_timeout=bad)
