"""Sentinel failover: a held lease is renewed on the current master or reported lost.

Each test builds its own group (one master, one replica, one Sentinel with quorum 1 on free
ports of 127.0.0.1, see :class:`tests.fixtures_redis.SentinelGroup`) and runs ``SENTINEL
FAILOVER``. Measured with Redis 7.0: the replica is promoted ~0.2 s after the command, Sentinel
names it ~0.5 s later, and the old master stays a *writable master* for ~10 s more, until
Sentinel demotes it. A client whose pooled connections still reach the old master renews there
in that window; those renewals never reach the new master.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lease import StoreUnavailableError, lease
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.fixtures_redis import RedisServer, SentinelGroup

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TTL = 2.0  # seconds: renewals every ~0.67 s
DEADLINE = 20.0  # real seconds any wait here may take before the test fails


def _plain_store(server: RedisServer) -> RedisLockStore:
    """A store talking straight to ``server`` (no Sentinel, no acks): the second client."""
    return RedisLockStore(server.client(retry=Retry(NoBackoff(), 0)))


def _script_calls(server: RedisServer) -> int:
    """How many EVALSHA clients ran on ``server`` since its last CONFIG RESETSTAT.

    Replication applies a script's effects, never the EVALSHA itself, so on a master this
    counts our clients' calls only.
    """
    client = server.client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _reset_stats(server: RedisServer) -> None:
    client = server.client()
    try:
        client.config_resetstat()
    finally:
        client.close()


def test_a_held_lease_reads_lost_before_another_client_holds_it_on_the_new_master(
    redis_sentinel: SentinelGroup,
) -> None:
    """From the failover until a second client holds the key on the new master, the first
    lease must read lost by the time the second one gets it (never two holders)."""
    store = RedisLockStore(redis_sentinel.url)
    timeline: list[tuple[float, str]] = []
    try:
        with lease("job", store=store, ttl=TTL) as held:
            started = time.monotonic()
            _, new = redis_sentinel.failover()
            timeline.append((time.monotonic() - started, f"Sentinel names {new.port}"))
            intruder = _plain_store(new)
            try:
                deadline = time.monotonic() + DEADLINE
                token = None
                while token is None:
                    assert time.monotonic() < deadline, f"nobody got the key: {timeline}"
                    if held.lost and not any(what == "lost" for _, what in timeline):
                        timeline.append((time.monotonic() - started, "lost"))
                    token = intruder.acquire("job", "intruder", 10_000)
                    lost_when_taken = held.lost
                    time.sleep(0.01)
                timeline.append((time.monotonic() - started, f"intruder holds ({token})"))
                assert lost_when_taken, (
                    "a second client holds the key on the new master while the first lease "
                    f"reads lost=False: {timeline}"
                )
                assert held.lost_reason in ("expired", "taken"), held.lost_reason
                assert token > held.token
            finally:
                intruder.client.close()
    finally:
        store.close()


def test_renewals_move_to_the_master_sentinel_names_after_the_switch(
    redis_sentinel: SentinelGroup,
) -> None:
    """Without replica acks (min_replicas=0) the lease survives a failover: after Sentinel names
    the new master, the next renewal sweep runs there (not on the still-writable old master)."""
    store = RedisLockStore(redis_sentinel.url + "?min_replicas=0")
    ttl = 6.0  # renewals every 2 s: the key is still live on the new master when they arrive
    try:
        with lease("job", store=store, ttl=ttl) as held:
            old, new = redis_sentinel.failover()
            switched = time.monotonic()
            _reset_stats(new)
            deadline = switched + ttl * 0.9
            while _script_calls(new) == 0:
                assert time.monotonic() < deadline, (
                    f"no renewal reached the new master {new.port} within {ttl * 0.9:.1f} s of "
                    f"the switch; the old master {old.port} ran {_script_calls(old)} scripts"
                )
                time.sleep(0.02)
            check = new.client()
            try:
                assert check.hget(store.lease_key("job"), "owner") == held.owner.encode()
                assert check.pttl(store.lease_key("job")) > (ttl - 2.5) * 1000
            finally:
                check.close()
            assert not held.lost
    finally:
        store.close()


def test_an_acquire_after_the_switch_lands_on_the_new_master(
    redis_sentinel: SentinelGroup,
) -> None:
    """A store whose pooled connection reaches the old master acquires on the new one once
    Sentinel names it."""
    store = RedisLockStore(redis_sentinel.url + "?min_replicas=0")
    try:
        assert store.acquire("warm", "w", 10_000) is not None  # pools a connection
        store.release("warm", "w")
        old, new = redis_sentinel.failover()
        assert store.acquire("after", "a", 10_000) is not None
        on_new, on_old = new.client(), old.client()
        try:
            assert on_new.exists(store.lease_key("after")) == 1, "acquired on the old master"
            assert on_old.exists(store.lease_key("after")) == 0
        finally:
            on_new.close()
            on_old.close()
    finally:
        store.close()


def test_the_store_reports_which_master_it_reached(redis_sentinel: SentinelGroup) -> None:
    """A failing call names the Sentinel hosts, the service and the master it talked to."""
    store = RedisLockStore(redis_sentinel.url + "?min_replicas=0")
    master = redis_sentinel.server(redis_sentinel.master_port())
    check = master.client()
    try:
        assert store.acquire("k", "a", 10_000) is not None
        check.set(store.lease_key("bad"), "not a hash")
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("bad", "a", 10_000)  # a renewal answers such a key as not renewed
        text = str(caught.value)
        assert f"127.0.0.1:{redis_sentinel.sentinel_port}" in text
        assert SentinelGroup.SERVICE in text
        assert f"master 127.0.0.1:{master.port}" in text
        assert "acquire 'bad'" in text and "WRONGTYPE" in text
        assert isinstance(caught.value.__cause__, redis.ResponseError)
    finally:
        check.close()
        store.close()


def test_without_any_sentinel_acked_renewals_go_on_and_unacked_ones_fail(
    redis_sentinel: SentinelGroup,
) -> None:
    """No Sentinel answering: with min_replicas=1 the known master keeps serving (each renewal
    confirmed by the replica); with min_replicas=0 the store cannot tell a stale master from the
    current one and raises, naming the unreachable Sentinel."""
    acked = RedisLockStore(redis_sentinel.url)
    unacked = RedisLockStore(redis_sentinel.url + "?min_replicas=0&socket_connect_timeout=0.5")
    try:
        assert acked.acquire("a", "o", 10_000) is not None
        assert unacked.acquire("u", "o", 10_000) is not None
        redis_sentinel.stop_sentinel()
        assert acked.renew("a", "o", 10_000) is True
        assert acked.renew_many([("a", "o", 10_000), ("a", "o", 10_000)]) == [True, True]
        with pytest.raises(StoreUnavailableError) as caught:
            unacked.renew("u", "o", 10_000)
        text = str(caught.value)
        assert "renew 'u' failed: MasterNotFoundError" in text
        assert f"127.0.0.1:{redis_sentinel.sentinel_port}" in text
    finally:
        acked.close()
        unacked.close()


def _wait_calls(server: RedisServer) -> int:
    """How many WAIT commands ``server`` has run (blocked ones included)."""
    client = server.client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


def test_an_acquire_a_lagging_replica_did_not_confirm_is_retried_within_the_wait(
    redis_sentinel: SentinelGroup,
) -> None:
    """With the replica stopped (SIGSTOP) the first WAIT times out; the acquire is asked again
    instead of failing, and succeeds once the replica is resumed, within the caller's wait."""
    store = RedisLockStore(redis_sentinel.url)
    master = redis_sentinel.server(redis_sentinel.master_port())
    replica = next(s for s in redis_sentinel.servers if s is not master)
    assert store.acquire("warm", "w", 10_000) is not None  # the replica acknowledges writes
    store.release("warm", "w")
    _reset_stats(master)
    outcome: list[object] = []

    def take() -> None:
        try:
            with lease("b1", store=store, ttl=TTL, wait=DEADLINE) as held:
                outcome.append(held.token)
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    _take_while_the_replica_is_stopped(master, replica, take)
    try:
        assert len(outcome) == 1 and isinstance(outcome[0], int), outcome
    finally:
        store.close()


def test_the_async_store_asks_again_too(redis_sentinel: SentinelGroup) -> None:
    """The asyncio twin asks an unconfirmed acquire again as the sync store does."""
    master = redis_sentinel.server(redis_sentinel.master_port())
    replica = next(s for s in redis_sentinel.servers if s is not master)
    outcome: list[object] = []

    async def main() -> None:
        store = AsyncRedisLockStore(redis_sentinel.url)
        try:
            async with lease("warm", store=store, ttl=TTL):
                pass
            _reset_stats(master)
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, resumed.wait, DEADLINE)
        finally:
            await store.aclose()

    ready, resumed = threading.Event(), threading.Event()

    def take() -> None:
        async def run() -> None:
            store = AsyncRedisLockStore(redis_sentinel.url)
            try:
                async with lease("b1", store=store, ttl=TTL, wait=DEADLINE) as held:
                    outcome.append(held.token)
            finally:
                await store.aclose()

        try:
            asyncio.run(run())
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    # A first store warms the replica's link (its first WAIT answered), then the test stops it.
    warm = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    warm.start()
    assert ready.wait(DEADLINE)
    try:
        _take_while_the_replica_is_stopped(master, replica, take)
    finally:
        resumed.set()
        warm.join(DEADLINE)
    assert len(outcome) == 1 and isinstance(outcome[0], int), outcome


def _take_while_the_replica_is_stopped(
    master: RedisServer, replica: RedisServer, take: Callable[[], None]
) -> None:
    """Run ``take`` on a thread with ``replica`` stopped (SIGSTOP) until the master ran a second
    WAIT (the first one timed out and the acquire was asked again), then resume the replica and
    wait for ``take`` to end."""
    assert replica.pid is not None
    os.kill(replica.pid, signal.SIGSTOP)
    thread = threading.Thread(target=take, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + DEADLINE
        # A second WAIT means the first one timed out unconfirmed and the acquire went on.
        while _wait_calls(master) < 2 and thread.is_alive():
            assert time.monotonic() < deadline, "the acquire neither retried nor ended"
            time.sleep(0.01)
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    thread.join(DEADLINE)
    assert not thread.is_alive(), "the acquire did not end after the replica resumed"
