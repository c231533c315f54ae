"""One Redis Cluster master that stops answering (stopped, its socket still open) delays a
batch across the nodes by at most one socket timeout, and costs only the leases on it.

The nodes' pipelines of one batch run at once and a node that timed out is not asked again in
the same batch, so the answering nodes' results come back within one socket timeout; a later
batch that has their keys too does not wait on it again, so they are renewed at most one
socket timeout late.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.cluster import ClusterNode, RedisCluster

from celery_lease import lease
from celery_lease.errors import StoreUnavailableError
from celery_lease.stores._redis_cluster import ClusterFanOut
from celery_lease.stores.redis import RedisLockStore
from tests.faults.cluster_batches import assert_only_these_failed, keys_on, leases_held
from tests.fixtures_redis import ClusterNodes, RedisServer

pytestmark = pytest.mark.redis

SOCKET_TIMEOUT = 1.0
"""The client's socket timeout, in seconds: how long one read from the stopped node blocks."""

WAIT = 30.0
"""Real seconds the test waits for the stopped node's leases to read lost before it fails."""

KEYS = [f"job:{i}" for i in range(12)]

NODE_THREAD = "celery-lease-redis-node"
"""The name prefix of the threads a cluster store runs the nodes' pipelines in."""


@pytest.fixture
def store(redis_three_masters: ClusterNodes) -> Iterator[RedisLockStore]:
    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in redis_three_masters.seeds],
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_TIMEOUT,
    )
    store = RedisLockStore(client)
    yield store
    store.close()
    client.close()


@contextlib.contextmanager
def stopped(node: RedisServer) -> Iterator[None]:
    """The node's process stopped (SIGSTOP: it keeps its sockets, it answers nothing) inside."""
    assert node.pid is not None
    os.kill(node.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.pid, signal.SIGCONT)


@pytest.mark.parametrize("hung", [1, 2], ids=["one-master-hangs", "two-masters-hang"])
def test_renew_many_answers_within_one_socket_timeout_when_masters_hang(
    store: RedisLockStore, redis_three_masters: ClusterNodes, hung: int
) -> None:
    """The answering nodes' keys are renewed and the stopped nodes' keys get a
    StoreUnavailableError in their places, all within one socket timeout: a stopped node is
    not asked twice, and two stopped nodes are waited for at once."""
    victims = redis_three_masters.nodes[:hung]
    on_victims = keys_on(store, KEYS, *victims)
    with leases_held(store, KEYS) as batch:
        with contextlib.ExitStack() as stack:
            for victim in victims:
                stack.enter_context(stopped(victim))
            started = time.monotonic()
            results = store.renew_many(batch)
            took = time.monotonic() - started
        assert took < 2 * SOCKET_TIMEOUT, f"renew_many took {took:.2f} s"
        assert_only_these_failed(KEYS, results, on_victims)


def test_list_fails_within_one_socket_timeout_when_a_master_hangs(
    store: RedisLockStore, redis_three_masters: ClusterNodes
) -> None:
    """The key scan and the lease reads go to every master at once; a stopped one fails the
    listing (all or nothing) with StoreUnavailableError naming it, after one socket timeout."""
    victim = redis_three_masters.nodes[1]
    keys_on(store, KEYS, victim)
    with leases_held(store, KEYS):
        with stopped(victim):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as raised:
                store.list()
            took = time.monotonic() - started
        assert took < 2 * SOCKET_TIMEOUT, f"list took {took:.2f} s"
        assert f"127.0.0.1:{victim.port}" in str(raised.value)
        assert [info.key for info in store.list()] == sorted(KEYS)


def test_a_hung_master_costs_only_the_leases_on_it(
    store: RedisLockStore, redis_three_masters: ClusterNodes
) -> None:
    """Leases whose ttl is 2.5 socket timeouts stay held on the answering nodes while one
    master hangs for longer than their ttl; those on the hung master are lost."""
    victim = redis_three_masters.nodes[2]
    on_victim = keys_on(store, KEYS, victim)
    ttl = 2.5 * SOCKET_TIMEOUT
    contexts = [lease(key, store=store, ttl=ttl) for key in KEYS]
    held = {key: context.__enter__() for key, context in zip(KEYS, contexts, strict=True)}
    try:
        with stopped(victim):
            for key in sorted(on_victim):
                assert held[key].wait_lost(WAIT), f"{key} lives on the hung node: it must read lost"
            # Their ttl passed since the node stopped: the others were renewed through batches
            # that waited on the hung node, and go on being renewed for two more ttls.
            healthy = min(set(KEYS) - on_victim)
            assert not held[healthy].wait_lost(2 * ttl), held[healthy].lost_reason
            survivors = {key: held[key].lost_reason for key in KEYS if key not in on_victim}
            assert survivors == {key: None for key in survivors}
    finally:
        for context in contexts:
            with contextlib.suppress(Exception):  # the hung node's leases fail to release
                context.__exit__(None, None, None)


def test_a_master_that_timed_out_holds_up_no_later_batch_of_the_others(
    store: RedisLockStore, redis_three_masters: ClusterNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a master timed out, a later batch across the nodes hands the answering nodes'
    results back as soon as they are in, its share on that master still waiting on it, its
    keys failed in place. Waiting on it again would renew the others a socket timeout late
    once more: after a batch that already waited on it (their renewal due meanwhile), that is
    past their validity (the leases on every master expired at once)."""
    victim = redis_three_masters.nodes[2]
    on_victim = keys_on(store, KEYS, victim)
    name = f"127.0.0.1:{victim.port}"
    entered, let_go = threading.Event(), threading.Event()
    real = ClusterFanOut._node_pipeline

    def held_on_victim(self: ClusterFanOut, node: str, *args: Any) -> Any:
        if node == name:  # its read blocks, however long: the batch must not wait for it
            entered.set()
            let_go.wait(2 * WAIT)
        return real(self, node, *args)

    answered: list[list[bool | Exception]] = []
    done = threading.Event()

    def renew(batch: list[tuple[str, str, int]]) -> None:
        answered.append(store.renew_many(batch))
        done.set()

    with leases_held(store, KEYS) as batch:
        try:
            with stopped(victim):
                assert_only_these_failed(KEYS, store.renew_many(batch), on_victim)  # timed out
                monkeypatch.setattr(ClusterFanOut, "_node_pipeline", held_on_victim)
                threading.Thread(target=renew, args=(batch,), daemon=True).start()
                assert entered.wait(WAIT), "the batch sent no share to the node that timed out"
                assert done.wait(WAIT), "the batch waited on the node that had timed out"
                assert_only_these_failed(KEYS, answered[0], on_victim)
        finally:
            let_go.set()
        for thread in node_threads():  # the share left behind ends on its own
            thread.join(WAIT)
        assert node_threads() == []


def node_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(NODE_THREAD)]


def test_node_threads_are_daemons_that_end_with_their_batch(
    store: RedisLockStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch across nodes runs the other nodes' shares on threads of its own: daemons (a
    share stuck on a hung node never holds up the interpreter's exit), none left once the batch
    returned."""
    ran_on: list[threading.Thread] = []
    real = ClusterFanOut._node_share

    def recording(self: ClusterFanOut, *args: Any, **kwargs: Any) -> Any:
        ran_on.append(threading.current_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ClusterFanOut, "_node_share", recording)
    with leases_held(store, KEYS) as batch:
        assert store.renew_many(batch) == [True] * len(KEYS)
        helpers = [t for t in ran_on if t is not threading.current_thread()]
        assert len(helpers) == 2, "three nodes: the caller runs one share, two threads the rest"
        assert all(t.daemon and t.name.startswith(NODE_THREAD) for t in helpers)
        assert not any(t.is_alive() for t in helpers), "a node thread outlived its batch"
        assert node_threads() == []


def _child_renews(store: RedisLockStore, results: Any) -> None:
    """In a forked child: renew every key in one batch across the nodes, report the results."""
    try:
        results.put(store.renew_many([(k, f"o-{k}", 60_000) for k in KEYS]))
    except BaseException as exc:  # pragma: no cover - reported to the parent
        results.put(repr(exc))


def test_a_forked_child_runs_batches_on_node_threads_of_its_own(store: RedisLockStore) -> None:
    """A forked child's batches across nodes run on threads of its own, as the parent's do."""
    for key in KEYS:
        assert store.acquire(key, f"o-{key}", 60_000) is not None
    try:
        assert store.renew_many([(k, f"o-{k}", 60_000) for k in KEYS]) == [True] * len(KEYS)
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(target=_child_renews, args=(store, results))
        child.start()
        try:
            assert results.get(timeout=WAIT) == [True] * len(KEYS)
        finally:
            child.join(WAIT)
            if child.is_alive():  # pragma: no cover - the failure above: do not leave it behind
                child.kill()
                child.join(WAIT)
        assert child.exitcode == 0
    finally:
        for key in KEYS:
            store.release(key, f"o-{key}")
