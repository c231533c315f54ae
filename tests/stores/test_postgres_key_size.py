"""Keys of every size either work end to end in the PostgreSQL stores or are refused up front.

A key over the NOTIFY payload limit (8000 bytes) is announced by its digest, so its release
succeeds and wakes its waiters; a key the primary-key index cannot hold (about 2.7 kB after
compression: a random key of that size) is refused by acquire with a ``LeaseConfigError``
naming the store, the key's size and the limit, and nothing is taken.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Iterator

import pytest

from celery_lease import lease
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.postgres import PostgresLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from tests.stores.contract import DEADLINE, LONG_MS

pytestmark = pytest.mark.postgres

LONG_KEY = "ho:" + "x" * 9000
"""Over the NOTIFY payload limit, yet small in the index (it compresses)."""


@pytest.fixture
def store(pg_database_dsn: str, pg_table: str) -> Iterator[PostgresLockStore]:
    store = PostgresLockStore(pg_database_dsn, table=pg_table)
    yield store
    store.close()


def _random_key(size: int) -> str:
    """A key of ``size`` ASCII bytes that does not compress."""
    return secrets.token_urlsafe(size)[:size]


class TestKeysOverTheNotifyLimit:
    def test_release_succeeds_and_wakes_the_waiter(self, store: PostgresLockStore) -> None:
        assert store.acquire(LONG_KEY, "holder", LONG_MS) is not None
        woke: list[bool] = []
        waiter = threading.Thread(target=lambda: woke.append(store.wait_for_release(LONG_KEY, 10)))
        waiter.start()
        deadline = time.monotonic() + DEADLINE
        while store.waiting() < 1:
            assert time.monotonic() < deadline, "the waiter never blocked"
            time.sleep(0.002)
        store.release(LONG_KEY, "holder")
        waiter.join(DEADLINE)
        assert woke == [True]
        assert store.get(LONG_KEY) is None

    def test_a_release_of_a_long_key_wakes_only_its_waiters(self, store: PostgresLockStore) -> None:
        """Two long keys that differ only at their end: each is announced by its own digest."""
        other = LONG_KEY + "y"
        assert store.acquire(LONG_KEY, "holder", LONG_MS) is not None
        assert store.wait_for_release(other, 0.01) is False  # starts the listener
        store.release(LONG_KEY, "holder")
        assert store.wait_for_release(other, 0.3) is False

    def test_the_async_store_releases_it_and_wakes_its_waiter(self, pg_database_dsn: str) -> None:
        async def run(table: str) -> None:
            store = AsyncPostgresLockStore(pg_database_dsn, table=table)
            try:
                assert await store.acquire(LONG_KEY, "holder", LONG_MS) is not None
                waiter = asyncio.ensure_future(store.wait_for_release(LONG_KEY, 10))
                while store.waiting() < 1:
                    await asyncio.sleep(0.002)
                await store.release(LONG_KEY, "holder")
                assert await asyncio.wait_for(waiter, DEADLINE) is True
                assert await store.acquire(LONG_KEY, "next", LONG_MS) is not None
            finally:
                await store.aclose()

        asyncio.run(run(f"lease_async_{secrets.token_hex(6)}"))


class TestKeysOverTheIndexLimit:
    def test_acquire_refuses_it_naming_store_size_and_limit(self, store: PostgresLockStore) -> None:
        key = _random_key(4000)
        with pytest.raises(LeaseConfigError) as raised:
            store.acquire(key, "o", LONG_MS)
        message = str(raised.value)
        assert repr(store) in message
        assert "key of 4000 bytes" in message and "2704" in message
        assert store.last_token(key) is None, "nothing was taken"
        assert store.list() == []

    def test_lease_refuses_it_before_anything_is_taken(self, store: PostgresLockStore) -> None:
        key = _random_key(4000)
        with pytest.raises(LeaseConfigError, match="key of 4000 bytes"), lease(key, store=store):
            pytest.fail("the body must not run")  # pragma: no cover
        assert store.last_token(key) is None

    def test_the_async_store_refuses_it(self, pg_database_dsn: str) -> None:
        async def run(table: str) -> None:
            store = AsyncPostgresLockStore(pg_database_dsn, table=table)
            try:
                with pytest.raises(LeaseConfigError, match="key of 4000 bytes"):
                    await store.acquire(_random_key(4000), "o", LONG_MS)
            finally:
                await store.aclose()

        asyncio.run(run(f"lease_async_{secrets.token_hex(6)}"))

    def test_the_refused_acquire_is_not_retried(
        self, store: PostgresLockStore, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The limit error (SQLSTATE 54000, an OperationalError in psycopg) is not taken for a
        dropped connection: the statement is not run again on another connection."""
        with caplog.at_level(logging.INFO), pytest.raises(LeaseConfigError):
            store.acquire(_random_key(4000), "o", LONG_MS)
        assert not [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]

    def test_the_async_stores_refused_acquire_is_not_retried(
        self, pg_database_dsn: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        async def run(table: str) -> None:
            store = AsyncPostgresLockStore(pg_database_dsn, table=table)
            try:
                with pytest.raises(LeaseConfigError):
                    await store.acquire(_random_key(4000), "o", LONG_MS)
            finally:
                await store.aclose()

        with caplog.at_level(logging.INFO):
            asyncio.run(run(f"lease_async_{secrets.token_hex(6)}"))
        assert not [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
