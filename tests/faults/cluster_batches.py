"""Leases spread over the masters of a Redis Cluster, and what one renewal batch answers for them.

Shared by the suites in which one master dies or hangs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

from redis.cluster import RedisCluster

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import RedisServer

HELD_MS = 60_000
"""The ttl of the leases the batches renew, in milliseconds: none expires during a test."""


def keys_on(store: RedisLockStore, keys: Iterable[str], *nodes: RedisServer) -> set[str]:
    """Those of ``keys`` whose lease key lives on one of ``nodes`` (some, never all of them)."""
    client = store.client
    assert isinstance(client, RedisCluster)
    every = list(keys)
    ports = {node.port for node in nodes}
    on_nodes = {k for k in every if client.get_node_from_key(store.lease_key(k)).port in ports}
    assert 0 < len(on_nodes) < len(every), "the keys must span the failing nodes and the others"
    return on_nodes


@contextlib.contextmanager
def leases_held(store: RedisLockStore, keys: Sequence[str]) -> Iterator[list[tuple[str, str, int]]]:
    """Each key held by ``o-<key>`` inside (released after); yields the batch that renews them."""
    for key in keys:
        assert store.acquire(key, f"o-{key}", HELD_MS) is not None
    try:
        yield [(key, f"o-{key}", HELD_MS) for key in keys]
    finally:
        for key in keys:
            store.release(key, f"o-{key}")


def assert_only_these_failed(
    keys: Sequence[str], results: Sequence[object], failed: Iterable[str]
) -> None:
    """A batch's answer: StoreUnavailableError naming the renewal for ``failed``, else True."""
    failing = set(failed)
    for key, result in zip(keys, results, strict=True):
        if key in failing:
            assert isinstance(result, StoreUnavailableError), (key, result)
            assert f"renew {key!r}" in str(result)
        else:
            assert result is True, (key, result)
