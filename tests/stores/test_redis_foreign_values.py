"""A lease key that holds another type (a value some other writer SET there) fails only itself.

Renewals answer it as not renewed (it is not the owner's lease) and renew the others of their
batch; acquire, release, force-release and inspection refuse it with an error naming the key and
leave the foreign value as it is; a listing leaves it out and lists the others.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores._redis_fast import fast_path_for
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.stores.contract import LONG_MS

pytestmark = pytest.mark.redis

FOREIGN = b"a value some other writer SET"


class _OwnConnection(redis.Connection):
    """A connection class of the user's own: the store then goes through redis-py's pool."""


@pytest.fixture(params=["fast path", "redis-py pool"])
def store(request: pytest.FixtureRequest, redis_url: str) -> Iterator[RedisLockStore]:
    prefix = f"foreign-{uuid.uuid4().hex[:8]}:"
    client: redis.Redis | None = None
    if request.param == "fast path":
        store = RedisLockStore(redis_url, prefix=prefix)
        assert fast_path_for(store.client) is not None
    else:
        pool = redis.ConnectionPool.from_url(redis_url, connection_class=_OwnConnection)
        client = redis.Redis(connection_pool=pool)
        store = RedisLockStore(client, prefix=prefix)
        assert fast_path_for(client) is None
    yield store
    store.close()
    if client is not None:
        client.close()


@pytest.fixture
def writer(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _poison(store: RedisLockStore, writer: redis.Redis, key: str) -> str:
    lease_key = store.lease_key(key)
    writer.set(lease_key, FOREIGN)
    return lease_key


class TestRenewals:
    def test_renew_answers_false(self, store: RedisLockStore, writer: redis.Redis) -> None:
        """A single renewal of a key holding a foreign value is refused, the value kept."""
        assert store.acquire("job", "o", LONG_MS) is not None
        lease_key = _poison(store, writer, "job")
        assert store.renew("job", "o", LONG_MS) is False
        assert writer.get(lease_key) == FOREIGN

    def test_renew_many_fails_only_that_key(
        self, store: RedisLockStore, writer: redis.Redis
    ) -> None:
        """The other keys of the batch are renewed: their expiry is set again."""
        for key in ("a", "b", "c"):
            assert store.acquire(key, f"o-{key}", 1000) is not None
        _poison(store, writer, "b")
        results = store.renew_many([(k, f"o-{k}", LONG_MS) for k in ("a", "b", "c")])
        assert results == [True, False, True]
        assert writer.pttl(store.lease_key("a")) > 1000
        assert writer.pttl(store.lease_key("c")) > 1000


class TestRefusals:
    def test_acquire_refuses_it_and_leaves_the_value(
        self, store: RedisLockStore, writer: redis.Redis
    ) -> None:
        lease_key = _poison(store, writer, "job")
        with pytest.raises(StoreUnavailableError, match=r"acquire 'job'.*another type"):
            store.acquire("job", "o", LONG_MS)
        assert writer.get(lease_key) == FOREIGN
        assert store.last_token("job") is None, "nothing was written"

    def test_release_refuses_it_and_leaves_the_value(
        self, store: RedisLockStore, writer: redis.Redis
    ) -> None:
        assert store.acquire("job", "o", LONG_MS) is not None
        lease_key = _poison(store, writer, "job")
        with pytest.raises(StoreUnavailableError, match=r"release 'job'.*another type"):
            store.release("job", "o")
        assert writer.get(lease_key) == FOREIGN

    def test_get_and_force_release_refuse_it(
        self, store: RedisLockStore, writer: redis.Redis
    ) -> None:
        lease_key = _poison(store, writer, "job")
        with pytest.raises(StoreUnavailableError, match=r"'job'.*another type"):
            store.get("job")
        with pytest.raises(StoreUnavailableError, match=r"force-release 'job'.*another type"):
            store.force_release("job")
        assert writer.get(lease_key) == FOREIGN


class TestListing:
    def test_list_leaves_it_out_and_lists_the_others(
        self, store: RedisLockStore, writer: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        for key in ("a", "b", "c"):
            assert store.acquire(key, f"o-{key}", LONG_MS) is not None
        lease_key = _poison(store, writer, "b")
        with caplog.at_level(logging.WARNING, logger="celery_lease.stores.redis"):
            listed = store.list()
        assert [(info.key, info.owner) for info in listed] == [("a", "o-a"), ("c", "o-c")]
        assert lease_key in caplog.text and "not a lease" in caplog.text


class TestAsyncTwin:
    def test_acquire_refuses_it_and_renew_answers_false(
        self, redis_url: str, writer: redis.Redis
    ) -> None:
        """The asyncio store runs the same scripts: the same answers."""

        async def run() -> None:
            store = AsyncRedisLockStore(redis_url, prefix=f"foreign-{uuid.uuid4().hex[:8]}:")
            try:
                twin = store.sync
                assert isinstance(twin, RedisLockStore)
                assert await store.acquire("held", "o", LONG_MS) is not None
                _poison(twin, writer, "held")
                assert await store.renew("held", "o", LONG_MS) is False
                _poison(twin, writer, "free")
                with pytest.raises(StoreUnavailableError, match="another type"):
                    await store.acquire("free", "o", LONG_MS)
                with pytest.raises(StoreUnavailableError, match="another type"):
                    await store.release("held", "o")
            finally:
                await store.aclose()

        asyncio.run(run())
