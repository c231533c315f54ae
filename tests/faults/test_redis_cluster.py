"""A Redis Cluster of three masters: the store contract, and renewals spread over every node.

The one-node cluster of tests/stores/test_redis.py catches cross-slot scripts; here the keys of
one batch really live on different servers, so ``renew_many`` and ``list`` must split their work
per node and put the results back in order.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from redis.cluster import ClusterNode, RedisCluster

from celery_lease.stores.base import LockStore
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import ClusterNodes
from tests.stores.contract import DEADLINE, LONG_MS, StoreContract

pytestmark = pytest.mark.redis


def _client(cluster: ClusterNodes) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.seeds])


class _ClosingStore(RedisLockStore):
    """A store that also closes the cluster client built for it."""

    def close(self) -> None:
        super().close()
        self.client.close()


def _cluster_store(cluster: ClusterNodes, prefix: str) -> LockStore:
    return _ClosingStore(_client(cluster), prefix=prefix)


class TestThreeMasterCluster(StoreContract):
    """The whole store contract on a three-master cluster (one client per store)."""

    fake_clock = False
    release_wakes_one = True
    stateful_examples = 5

    @pytest.fixture
    def store_backend(self, redis_three_masters: ClusterNodes) -> None:
        self.cluster = redis_three_masters
        redis_three_masters.flush()

    def make_store(self) -> LockStore:
        self.prefix = f"c3-{uuid.uuid4().hex[:8]}:"
        return _cluster_store(self.cluster, self.prefix)

    def store_factory(self) -> Callable[[], LockStore]:
        return functools.partial(_cluster_store, self.cluster, self.prefix)

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        """Poll every node until ``count`` clients block (in BLPOP) in total."""
        deadline = time.monotonic() + DEADLINE
        while True:
            blocked = 0
            for node in self.cluster.nodes:
                client = node.client()
                try:
                    blocked += int(client.info("clients")["blocked_clients"])
                finally:
                    client.close()
            if blocked >= count:
                return
            assert time.monotonic() < deadline, f"{count} waiters never blocked"
            time.sleep(0.005)


@pytest.fixture
def store(redis_three_masters: ClusterNodes) -> Iterator[RedisLockStore]:
    redis_three_masters.flush()
    store = _ClosingStore(_client(redis_three_masters))
    yield store
    store.close()


def _keys_on_every_node(store: RedisLockStore, per_node: int) -> list[str]:
    """``per_node`` user keys on each of the three masters, interleaved."""
    client = store.client
    assert isinstance(client, RedisCluster)
    by_node: dict[str, list[str]] = {}
    i = 0
    while len(by_node) < 3 or any(len(v) < per_node for v in by_node.values()):
        key = f"job:{i}"
        node = client.get_node_from_key(store.lease_key(key))
        bucket = by_node.setdefault(node.name, [])
        if len(bucket) < per_node:
            bucket.append(key)
        i += 1
    return [key for group in zip(*by_node.values(), strict=True) for key in group]


def test_renew_many_across_three_nodes_keeps_each_result_in_place(store: RedisLockStore) -> None:
    """A batch whose keys live on three servers renews each one; strangers' items come back
    False at their own place and leave the leases alone."""
    keys = _keys_on_every_node(store, per_node=4)
    for key in keys:
        assert store.acquire(key, "o", 1000) is not None
    items = [(key, "o" if i % 5 else "stranger", LONG_MS) for i, key in enumerate(keys)]
    assert store.renew_many(items) == [bool(i % 5) for i in range(len(keys))]
    for i, key in enumerate(keys):
        info = store.get(key)
        assert info is not None and info.owner == "o"
        assert (info.expires_in > 1.0) is bool(i % 5)
    assert [i.key for i in store.list("job:")] == sorted(keys)


def test_every_node_floors_tokens_and_hands_off(store: RedisLockStore) -> None:
    """On each node: release, re-acquire by another owner with a higher token, one waiter
    woken per release."""
    for key in _keys_on_every_node(store, per_node=1):
        first = store.acquire(key, "a", LONG_MS)
        assert first is not None and store.acquire(key, "b", LONG_MS) is None
        assert store.acquire(key, "a", LONG_MS) == first  # idempotent for its owner
        store.release(key, "a")
        assert store.wait_for_release(key, 1.0) is True
        second = store.acquire(key, "b", LONG_MS)
        assert second is not None and second > first
        assert store.last_token(key) == second
