"""One dead Redis Cluster master costs only the leases whose keys live on it.

Renewal batches span every node; a node that is gone must fail only its own keys (retried while
their validity lasts, then lost), never the leases on the nodes that answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
from redis.cluster import ClusterNode, RedisCluster

from celery_lease import lease
from celery_lease.stores.redis import RedisLockStore
from tests.faults.cluster_batches import HELD_MS, assert_only_these_failed, keys_on
from tests.fixtures_redis import ClusterNodes

pytestmark = pytest.mark.redis

WAIT = 30.0
"""Real seconds the test waits for the dead node's leases to read lost before it fails."""


@pytest.fixture
def store(redis_three_masters: ClusterNodes) -> Iterator[RedisLockStore]:
    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in redis_three_masters.seeds],
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
    )
    store = RedisLockStore(client)
    yield store
    store.close()
    client.close()


def test_a_dead_master_fails_only_the_leases_on_it(
    store: RedisLockStore, redis_three_masters: ClusterNodes
) -> None:
    client = store.client
    assert isinstance(client, RedisCluster)
    victim = redis_three_masters.nodes[0]
    keys = [f"job:{i}" for i in range(12)]
    on_victim = {
        key for key in keys if client.get_node_from_key(store.lease_key(key)).port == victim.port
    }
    assert 0 < len(on_victim) < len(keys), "the keys must span the dead node and the others"
    contexts = [lease(key, store=store, ttl=3) for key in keys]
    held = {key: context.__enter__() for key, context in zip(keys, contexts, strict=True)}
    try:
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        for key in sorted(on_victim):
            assert held[key].wait_lost(WAIT), f"{key} lives on the dead node: it must read lost"
        # Every lease on the dead node is lost, so at least one ttl has passed: the others had
        # to be renewed through failing batches to still be held.
        survivors = {key: held[key].lost_reason for key in keys if key not in on_victim}
        assert survivors == {key: None for key in survivors}
    finally:
        for context in contexts:
            with contextlib.suppress(Exception):  # the dead node's leases fail to release
                context.__exit__(None, None, None)


def test_renew_many_answers_the_dead_nodes_keys_in_place(
    redis_three_masters: ClusterNodes,
) -> None:
    """One batch across three masters, one of them dead: its keys get a StoreUnavailableError
    naming the key in their places, the others are renewed."""
    _revive(redis_three_masters)  # a test before may have left a node dead
    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in redis_three_masters.seeds],
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
    )
    store = RedisLockStore(client)
    assert isinstance(client, RedisCluster)
    victim = redis_three_masters.nodes[0]
    keys = [f"job:{i}" for i in range(12)]
    on_victim = keys_on(store, keys, victim)
    for key in keys:
        assert store.acquire(key, f"o-{key}", HELD_MS) is not None
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    try:
        results = store.renew_many([(key, f"o-{key}", HELD_MS) for key in keys])
    finally:
        _revive(redis_three_masters)
    assert_only_these_failed(keys, results, on_victim)
    store.close()
    client.close()


def _revive(cluster: ClusterNodes) -> None:
    """Start again the nodes a test killed and wait until every node reports the cluster ok."""
    for node in cluster.nodes:
        node.ensure_running()
    deadline = time.monotonic() + WAIT
    for node in cluster.nodes:
        client = node.client(socket_timeout=0.5)
        try:
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, f"node {node.port} never saw the cluster ok"
                time.sleep(0.05)
        finally:
            client.close()
