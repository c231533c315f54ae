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
    """Holders learn of the loss within one ttl; every later token exceeds every earlier one."""
    holder, cycler = spawn(own_redis.url), spawn(own_redis.url)
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
