"""Fault 3: Redis is killed while leases are held and comes back empty (no persistence)."""

from __future__ import annotations

import os
import signal

import pytest

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


def _server_time_us(server: RedisServer) -> int:
    client = server.client()
    try:
        seconds, micros = client.time()
    finally:
        client.close()
    return int(seconds) * 1_000_000 + int(micros)


def test_a_restarted_store_holds_new_leases_until_the_old_holders_heard_they_lost_them(
    own_redis: RedisServer, spawn
) -> None:
    """A Redis restarted without persistence refuses a key that was held before (the key reads
    free on the server) until the grace ends; the holder hears of its loss first; the token
    issued after the grace exceeds every token issued before the restart."""
    url = f"{own_redis.url}?restart_grace={GRACE:g}"
    holder, rival = spawn(url), spawn(url)
    warm = rival.request("acquire", "warm-up", TTL, 0)  # the rival used this server before,
    assert warm["ev"] == "acquired", warm  # as every running worker has
    rival.request("release", "warm-up")
    held = holder.request("acquire", "job", TTL, 0)
    assert held["ev"] == "acquired", held

    os.kill(own_redis.pid, signal.SIGKILL)  # type: ignore[arg-type]
    own_redis.stop()  # reaps it; nothing was saved
    own_redis.start()
    restarted_us = _server_time_us(own_redis)

    refused = rival.request("acquire", "job", TTL, 0)
    assert refused["ev"] == "error" and refused["type"] == "LockNotAcquiredError", (
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
    # the new one was issued no sooner than the grace after the restart, and exceeds the old.
    assert taken["token"] >= restarted_us + GRACE * 1_000_000, (taken, restarted_us)
    assert taken["token"] > held["token"]
