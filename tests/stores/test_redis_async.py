"""celery_lease.stores.redis_async: the whole store contract, through
:class:`tests.stores.async_contract.SyncOverAsync`, against a real throwaway redis-server."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable

import pytest

from celery_lease.stores.base import AsyncLockStore, LockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.fixtures_redis import RedisServer, blocked_clients
from tests.stores.async_contract import AsyncStoreContract, wait_for


@pytest.mark.redis
class TestAsyncRedisContract(AsyncStoreContract):
    """AsyncRedisLockStore built from a URL; each store gets its own prefix, so it starts empty."""

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

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        wait_for(lambda: blocked_clients(self.server) >= count, f"{count} waiters")
