"""celery_lease.stores.redis_async: the whole store contract, slots and replace included, through
:class:`tests.stores.async_contract.SyncOverAsync`, against a real throwaway redis-server."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable

import pytest

from celery_lease.errors import LeaseConfigError, RestartGraceError
from celery_lease.stores.base import AsyncLockStore, LockStore
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.fixtures_redis import RedisServer, blocked_clients
from tests.stores.async_contract import AsyncStoreContract, SyncOverAsync, wait_for
from tests.stores.slot_contract import ReplaceContract, SlotContract


class SlotsOverAsync(SyncOverAsync):
    """:class:`SyncOverAsync` that also runs the async Redis store's ``acquire_slot``,
    ``release_owned_slots`` and ``mark_replaced`` coroutines on its loop."""

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        store = self.async_store
        assert isinstance(store, AsyncRedisLockStore)
        return self.run(store.acquire_slot(key, owner, ttl_ms, limit))

    def release_owned_slots(self, key: str, owner: str) -> None:
        store = self.async_store
        assert isinstance(store, AsyncRedisLockStore)
        self.run(store.release_owned_slots(key, owner))

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        store = self.async_store
        assert isinstance(store, AsyncRedisLockStore)
        return self.run(store.mark_replaced(key, ticket, holder))


@pytest.mark.redis
class TestAsyncRedisContract(SlotContract, ReplaceContract, AsyncStoreContract):
    """AsyncRedisLockStore built from a URL, slots and replace included; each store gets its own
    prefix, so it starts empty."""

    fake_clock = False
    release_wakes_one = True
    stateful_examples = 10

    @pytest.fixture
    def store_backend(self, redis_server: RedisServer, redis_url: str) -> None:
        self.server = redis_server
        self.url = redis_url

    def make_async_store(self) -> AsyncLockStore:
        self.prefix = f"async-contract-{uuid.uuid4().hex[:8]}:"
        return AsyncRedisLockStore(self.url, prefix=self.prefix)

    def async_store_factory(self) -> Callable[[], AsyncLockStore]:
        return functools.partial(AsyncRedisLockStore, self.url, prefix=self.prefix)

    def make_store(self) -> LockStore:
        return SlotsOverAsync(self.make_async_store)

    def store_factory(self) -> Callable[[], LockStore]:
        return functools.partial(SlotsOverAsync, self.async_store_factory())

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        wait_for(lambda: blocked_clients(self.server) >= count, f"{count} waiters")


@pytest.mark.redis
class TestAsyncRestartGrace:
    def test_a_young_server_without_the_marker_refuses_free_keys_as_the_sync_twin_does(
        self, redis_server_factory: Callable[..., RedisServer], redis_url: str
    ) -> None:
        """On a server started moments ago without the marker the async store refuses a free
        key with RestartGraceError, as its twin does (the server decides); its grace is its
        twin's, and a different one is refused at construction."""
        server = redis_server_factory()

        async def main() -> None:
            store = AsyncRedisLockStore(server.url, restart_grace=3600)
            try:
                twin = store.sync
                assert isinstance(twin, RedisLockStore) and twin.restart_grace == 3600.0
                with pytest.raises(RestartGraceError, match="lease_restart_grace=0"):
                    await store.acquire("k", "a", 60_000)
                with pytest.raises(RestartGraceError):
                    twin.acquire("k", "a", 60_000)
                assert twin.get("k") is None  # free: the grace refused it
            finally:
                await store.aclose()

        asyncio.run(main())
        twin = RedisLockStore(redis_url, restart_grace=5)
        try:
            with pytest.raises(LeaseConfigError, match="restart_grace=7 differs"):
                AsyncRedisLockStore(redis_url, sync=twin, restart_grace=7)
        finally:
            twin.close()
