"""Fault 3: Redis is killed while leases are held and comes back empty (no persistence) or
with an older snapshot; the restart grace keeps every store, in every process, off the keys
that were held until their old holders heard they lost them."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from celery_lease.errors import RestartGraceError
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.faults.harness import now
from tests.fixtures_redis import RedisServer

pytestmark = pytest.mark.slow

TTL = 1.0
SLACK = 0.3  # scheduling noise of a loaded 2-core machine
KEYS = ("invoice", "report", "sync")


def test_restart_without_persistence_reports_loss_and_keeps_tokens_increasing(
    own_redis: RedisServer, spawn
) -> None:
    """Without a restart grace, holders learn of the loss within one ttl; every later token
    exceeds every earlier one."""
    url = f"{own_redis.url}?restart_grace=0"
    holder, cycler = spawn(url), spawn(url)
    before: dict[str, list[int]] = {key: [] for key in KEYS}
    for key in KEYS:  # released leases first: their counters are lost with the server too
        for _ in range(3):
            before[key].append(cycler.request("acquire", key, TTL, 0)["token"])
            cycler.request("release", key)
    for key in KEYS:
        got = holder.request("acquire", key, TTL, 0)
        assert got["ev"] == "acquired", got
        before[key].append(got["token"])

    os.kill(own_redis.pid, signal.SIGKILL)  # type: ignore[arg-type]
    killed_at = now()
    own_redis.stop()  # reaps it; nothing was saved
    own_redis.start()

    for key in KEYS:
        lost = holder.wait_for(lambda e, k=key: e["ev"] == "lost" and e["key"] == k, timeout=10)
        assert lost["reason"] in ("taken", "expired"), lost
        assert lost["at"] - killed_at <= TTL + SLACK, (
            f"{key}: loss reported {lost['at'] - killed_at:.3f} s after the kill"
        )
        assert holder.request("check", key)["lost"] is True

    for key in KEYS:
        after = [cycler.request("acquire", key, TTL, 0)["token"]]
        cycler.request("release", key)
        after.append(holder.request("acquire", key, TTL, 0)["token"])
        assert min(after) > max(before[key]), (key, before[key], after)


GRACE = 2.0  # seconds of restart_grace: longer than TTL, so every holder heard its loss
DEADLINE = 30.0  # real seconds any wait here may take before the test fails


def _marker_started_us(server: RedisServer) -> int:
    """When the server's current run started, as the restart grace's marker records it."""
    client = server.client()
    try:
        return int(client.hget("celery-lease:marker", "started") or 0)
    finally:
        client.close()


def _crash_and_restart(server: RedisServer) -> None:
    os.kill(server.pid, signal.SIGKILL)  # type: ignore[arg-type]
    server.stop()  # reaps it; it saved nothing (an RDB file saved before is loaded again)
    server.start()


def _as_if_up_for_long(server: RedisServer) -> None:
    """The marker of the server's current run with a start long ago: its grace is over, as on
    a server that has been up for longer than any grace (this one started moments ago)."""
    client = server.client()
    try:
        run = client.info("server")["run_id"]
        client.hset("celery-lease:marker", mapping={"boot": run, "started": 0, "cause": "new"})
    finally:
        client.close()


def test_a_restarted_store_holds_new_leases_until_the_old_holders_heard_they_lost_them(
    own_redis: RedisServer, spawn
) -> None:
    """A Redis restarted without persistence refuses a key that was held before (the key reads
    free on the server) until the grace ends; the holder hears of its loss first; the token
    issued after the grace exceeds every token issued before the restart."""
    _as_if_up_for_long(own_redis)
    url = f"{own_redis.url}?restart_grace={GRACE:g}"
    holder, rival = spawn(url), spawn(url)
    held = holder.request("acquire", "job", TTL, 0)
    assert held["ev"] == "acquired", held

    _crash_and_restart(own_redis)

    refused = rival.request("acquire", "job", TTL, 0)
    assert refused["ev"] == "error" and refused["type"] == "RestartGraceError", (
        f"a second holder got the key at once after the restart: {refused}"
    )
    check = own_redis.client()
    try:
        assert check.exists("celery-lease:{job}:lease") == 0, "the key is held, not free"
    finally:
        check.close()

    lost = holder.wait_for(lambda e: e["ev"] == "lost" and e["key"] == "job", timeout=DEADLINE)
    assert lost["reason"] in ("taken", "expired"), lost
    taken = rival.request("acquire", "job", TTL, DEADLINE, timeout=DEADLINE + 5)
    assert taken["ev"] == "acquired", taken
    assert lost["at"] < taken["at"], "the old holder heard of its loss after the key was taken"
    # Tokens are the server's clock in microseconds after a restart (the counters are gone):
    # the new one was issued no sooner than the grace after the server's start, and exceeds
    # the old.
    started_us = _marker_started_us(own_redis)
    assert started_us > held["token"] - 1_000_000, (started_us, held)  # this run's start
    assert taken["token"] >= started_us + GRACE * 1_000_000, (taken, started_us)
    assert taken["token"] > held["token"]


HOUR = 3600  # a grace no test here outlives: every refusal below is the grace's


def test_a_store_that_never_acquired_is_refused_after_a_restart(own_redis: RedisServer) -> None:
    """A store idle until after the restart (another pool child, worker or process) is refused
    the lost key as the old holder's own store is: the server decides, not the store."""
    holder = RedisLockStore(own_redis.url, restart_grace=HOUR)
    fresh = RedisLockStore(own_redis.url, restart_grace=HOUR)
    off = RedisLockStore(own_redis.url, restart_grace=0)
    try:
        assert off.acquire("job", "holder", 30_000) is not None  # taken before any grace
        _crash_and_restart(own_redis)
        with pytest.raises(RestartGraceError, match="without this store's marker"):
            fresh.acquire("job", "rival", 30_000)
        with pytest.raises(RestartGraceError):
            holder.acquire("other", "holder", 30_000)
        assert off.get("job") is None, "the key reads free: only the grace refused it"
    finally:
        for store in (holder, fresh, off):
            store.close()


def test_the_async_store_is_refused_as_its_sync_twin_after_a_restart(
    own_redis: RedisServer,
) -> None:
    """The asyncio store, whose twin took a key before the restart, is refused the lost key."""
    sync = RedisLockStore(own_redis.url, restart_grace=0)
    assert sync.acquire("job", "holder", 30_000) is not None
    _crash_and_restart(own_redis)

    async def take() -> None:
        store = AsyncRedisLockStore(own_redis.url, restart_grace=HOUR)
        try:
            await store.acquire("job", "rival", 30_000)
        finally:
            await store.aclose()

    try:
        with pytest.raises(RestartGraceError):
            asyncio.run(take())
    finally:
        sync.close()


def test_a_crash_of_a_server_with_snapshots_starts_a_grace(own_redis: RedisServer) -> None:
    """A server restarted from an RDB snapshot keeps the marker but not the leases taken after
    it: the marker names the old run, so the grace starts all the same."""
    store = RedisLockStore(own_redis.url, restart_grace=HOUR)
    _as_if_up_for_long(own_redis)
    client = own_redis.client()
    try:
        assert store.acquire("warm", "holder", 30_000) is not None  # this run's grace is over
        client.save()  # a periodic snapshot (save points), the marker in it
        assert store.acquire("job", "holder", 30_000) is not None  # after the snapshot
    finally:
        client.close()
    _crash_and_restart(own_redis)  # loads the snapshot: 'job' is lost, the marker is not
    try:
        with pytest.raises(RestartGraceError, match="a marker of another server run"):
            store.acquire("job", "rival", 30_000)
        assert store.get("job") is None and store.get("warm") is not None
    finally:
        store.close()
