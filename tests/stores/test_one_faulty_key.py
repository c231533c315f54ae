"""One faulty key in a store costs only that key: the others in its batch keep their leases, and
a key a store cannot handle is refused up front, never left held.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_lease import lease
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.postgres import PostgresLockStore
from celery_lease.stores.redis import RedisLockStore

LONG_MS = 60_000


@pytest.mark.redis
class TestRedisPoisonedKey:
    @pytest.fixture
    def store(self, redis_url: str) -> Iterator[RedisLockStore]:
        store = RedisLockStore(redis_url, prefix=f"p-{uuid.uuid4().hex[:8]}:")
        yield store
        store.close()

    def test_a_key_of_the_wrong_type_fails_only_itself_in_renew_many(
        self, store: RedisLockStore, redis_url: str
    ) -> None:
        """A foreign writer turns one lease key into a string: ``renew_many`` reports that one as
        not renewed and renews the other 2,499."""
        keys = [f"job:{i}" for i in range(2500)]
        owners = [f"o{i}" for i in range(2500)]
        for key, owner in zip(keys, owners, strict=True):
            assert store.acquire(key, owner, LONG_MS) is not None
        client = redis.Redis.from_url(redis_url)
        try:
            poisoned = store.lease_key(keys[1234])
            client.set(poisoned, "foreign value")
        finally:
            client.close()
        results = store.renew_many([(k, o, LONG_MS) for k, o in zip(keys, owners, strict=True)])
        assert results[1234] is False
        assert results[:1234] + results[1235:] == [True] * 2499


class TestPostgresKeySize:
    @pytest.fixture
    def store(self, pg_database_dsn: str, pg_table: str) -> Iterator[PostgresLockStore]:
        store = PostgresLockStore(pg_database_dsn, table=pg_table)
        yield store
        store.close()

    def test_a_long_key_is_released_or_refused_before_it_is_taken(
        self, store: PostgresLockStore
    ) -> None:
        """A 9,000-character key is either refused with a LeaseConfigError before anything is
        taken, or taken and released: never left held for its ttl."""
        key = "ho:" + "x" * 9000
        try:
            with lease(key, store=store, ttl=60):
                pass
        except LeaseConfigError as exc:
            assert "key" in str(exc)
        assert store.acquire(key, "someone-else", LONG_MS) is not None
