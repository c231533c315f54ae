"""A Redis Cluster master dies and its replica takes over: batched renewals and the listing follow.

The store routes a batch by the cluster client's slot table. After the failover that table
names a dead node until it is refreshed, so the store must refresh it as redis-py's own command
path does, and send the dead master's calls to the promoted replica: leases renewed in batches
(two leases due together, and an ``until_done`` copy's run and queued leases) stay held on the
new master, the lease on another master is never disturbed, and ``list()`` sees the new master
soon after the promotion.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from celery_lease import lease
from celery_lease.errors import StoreUnavailableError
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import ClusterNodes, RedisServer

pytestmark = pytest.mark.redis

TTL = 9.0
"""Seconds: the ttl of the leases the renewer holds through the failover."""

NODE_TIMEOUT_MS = 500
"""The nodes' ``cluster-node-timeout``: a replica takes over about a second after its master
died."""

SOCKET_TIMEOUT = 1.0
"""The cluster client's socket timeouts, in seconds."""

WAIT = 30.0
"""Real seconds the test waits for the cluster to fail over before it fails."""


class _RecordingStore(RedisLockStore):
    """A store that records what each of its renewals answered, and when: one entry per call,
    ``(when, batch or not, {key: result})``."""

    def __init__(self, client: RedisCluster) -> None:
        super().__init__(client, prefix=f"failover-{uuid.uuid4().hex[:8]}:")
        self.calls: list[tuple[float, bool, dict[str, bool | Exception]]] = []
        self.answered = threading.Condition()

    def _record(self, batch: bool, answers: dict[str, bool | Exception]) -> None:
        with self.answered:
            self.calls.append((time.monotonic(), batch, answers))
            self.answered.notify_all()

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool | Exception]:
        results = super().renew_many(items)
        self._record(True, {key: r for (key, _, _), r in zip(items, results, strict=True)})
        return results

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        try:
            result = super().renew(key, owner, ttl_ms)
        except Exception as exc:
            self._record(False, {key: exc})
            raise
        self._record(False, {key: result})
        return result

    def lost(self, lease: object) -> None:
        """``on_lost`` of the test's leases: wakes the test's wait."""
        with self.answered:
            self.answered.notify_all()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterNodes]:
    """Three masters with one replica each, failing over within about a second (each test
    fails over a master that still has its replica)."""
    nodes = ClusterNodes(
        tmp_path_factory.mktemp("cluster"), replicas=1, node_timeout_ms=NODE_TIMEOUT_MS
    )
    try:
        nodes.start()
        yield nodes
    finally:
        for node in nodes.nodes:  # a stopped node would not hear SIGTERM
            if node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGCONT)
        nodes.stop()


@pytest.fixture
def store(cluster: ClusterNodes) -> Iterator[_RecordingStore]:
    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in cluster.seeds],
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
    )
    store = _RecordingStore(client)
    yield store
    store.close()
    client.close()


def _keys(
    store: RedisLockStore, cluster: ClusterNodes
) -> tuple[RedisServer, RedisServer, list[str], str]:
    """A master that has a replica, and that replica; the keys on that master (two leases,
    then the run and queued keys of one ``until_done`` copy); a key on another master."""
    client = store.client
    assert isinstance(client, RedisCluster)

    def master(key: str) -> RedisServer:
        port = client.get_node_from_key(store.lease_key(key)).port
        return next(node for node in cluster.nodes if node.port == port)

    masters = {node.port for node in client.get_primaries()}  # type: ignore[no-untyped-call]
    victim, replica = next(
        (node, replicas[0])
        for node in cluster.nodes
        if node.port in masters and (replicas := cluster.replicas_of(node))
    )
    on_victim = [key for key in (f"job:{i}" for i in range(1000)) if master(key) is victim][:2]
    pair = next(
        [f"report:{i}", f"queued:report:{i}"]
        for i in range(1000)
        if master(f"report:{i}") is victim and master(f"queued:report:{i}") is victim
    )
    elsewhere = next(f"job:{i}" for i in range(1000) if master(f"job:{i}") is not victim)
    return victim, replica, [*on_victim, *pair], elsewhere


def _replicated(store: RedisLockStore, master: RedisServer, key: str) -> None:
    """Wait until the replica of ``master`` has every write made on it so far (the leases).

    Replication is asynchronous: a master killed right after the acquires may take them with it
    (docs/stores.md). A write in the slot of ``key`` then ``WAIT`` for one replica: the stream
    is in order, so the acquires before it are on the replica too.
    """
    client = master.client()
    try:
        client.set(f"{store.prefix}{{{key}}}:replicated", 1, px=60_000)
        acked = client.execute_command("WAIT", 1, int(WAIT * 1000))
    finally:
        client.close()
    assert acked == 1, f"the replica of {master.port} did not acknowledge within {WAIT} s"


def _promoted(cluster: ClusterNodes, replica: RedisServer, dead: RedisServer) -> float:
    """Wait until ``replica`` serves the slots of the ``dead`` master; when that was seen."""
    deadline = time.monotonic() + WAIT
    client = replica.client(socket_timeout=0.5)
    try:
        while True:
            with contextlib.suppress(Exception):
                if client.execute_command("ROLE")[0] in (b"master", "master"):
                    return time.monotonic()
            if time.monotonic() > deadline:
                nodes = client.execute_command("CLUSTER", "NODES")
                raise AssertionError(
                    f"the replica {replica.port} of the dead master {dead.port} never took "
                    f"over; it sees:\n{nodes}\nits log ends:\n{replica.log()[-3000:]}"
                )
            time.sleep(0.01)
    finally:
        client.close()


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_batched_renewals_and_the_listing_follow_a_failover(
    store: _RecordingStore, cluster: ClusterNodes, fault: signal.Signals
) -> None:
    """The master of the leases' slots dies (refuses every connection) or hangs (keeps its
    sockets, answers nothing: a partition); its replica takes over."""
    victim, replica, on_victim, elsewhere = _keys(store, cluster)
    keys = [*on_victim, elsewhere]
    contexts = [lease(key, store=store, ttl=TTL, on_lost=store.lost) for key in keys]
    held = {key: context.__enter__() for key, context in zip(keys, contexts, strict=True)}
    try:
        _replicated(store, victim, on_victim[0])
        assert victim.pid is not None
        os.kill(victim.pid, fault)
        promoted_at = _promoted(cluster, replica, victim)

        def renewed_since_promotion(batch_only: bool) -> set[str]:
            return {
                key
                for at, batch, answers in store.calls
                if at > promoted_at and (batch or not batch_only)
                for key, result in answers.items()
                if result is True and key in on_victim
            }

        # Every lease on the dead master is renewed on the new one, or one is lost.
        with store.answered:
            store.answered.wait_for(
                lambda: (
                    renewed_since_promotion(False) == set(on_victim)
                    or any(held[key].lost for key in keys)
                ),
                timeout=WAIT,
            )
            renewed = renewed_since_promotion(True)
            calls = [
                (round(at - promoted_at, 2), "batch" if batch else "single", answers)
                for at, batch, answers in store.calls
                if at > promoted_at - TTL
            ]
        assert {key: held[key].lost_reason for key in keys} == {key: None for key in keys}, (
            f"leases lost after the failover; renewals (s after the promotion): {calls}"
        )
        assert renewed == set(on_victim), f"not renewed on the new master by a batch: {calls}"
        renewed_at = min(
            at
            for at, batch, answers in store.calls
            if at > promoted_at and batch and answers.get(on_victim[0]) is True
        )
        for key in keys:
            info = store.get(key)
            assert info is not None and info.token == held[key].token, (key, info)

        # The listing sees the new master within one ttl of the promotion.
        deadline = promoted_at + TTL
        while True:
            try:
                listed = [info.key for info in store.list()]
                break
            except StoreUnavailableError as exc:
                assert time.monotonic() < deadline, f"list() still fails: {exc}"
                time.sleep(0.05)
        listed_at = time.monotonic()
        assert listed == sorted(keys)
        print(
            f"{fault.name}: batched renewal on the new master {renewed_at - promoted_at:.2f} s "
            f"after the promotion, list() {listed_at - promoted_at:.2f} s after"
        )
    finally:
        for context in contexts:
            with contextlib.suppress(Exception):
                context.__exit__(None, None, None)
        if fault == signal.SIGSTOP:  # it rejoins as a replica of the node that took over
            os.kill(victim.pid, signal.SIGCONT)
        else:  # reaped: later tests do not ask it anything
            victim.stop()
