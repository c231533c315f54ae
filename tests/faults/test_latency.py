"""Fault 5: 50 ms of latency plus jitter between the clients and Redis."""

from __future__ import annotations

import pytest

from tests.faults.harness import FencedResource, Plan, Report, check, now, run_processes
from tests.faults.tcp_proxy import TcpProxy
from tests.fixtures_redis import RedisServer

pytestmark = pytest.mark.slow

TTL = 1.0
LATENCY, JITTER = 0.05, 0.02


@pytest.fixture
def slow_redis_url(own_redis: RedisServer):  # type: ignore[no-untyped-def]
    """A URL reaching the throwaway Redis through a proxy adding 50-70 ms each way."""
    with TcpProxy(own_redis.port, latency=LATENCY, jitter=JITTER, seed=5) as proxy:
        yield f"redis://127.0.0.1:{proxy.port}/0"


def test_the_proxy_really_adds_latency(slow_redis_url: str) -> None:
    """A PING through the proxy takes at least two one-way latencies."""
    import redis

    client = redis.Redis.from_url(slow_redis_url)
    try:
        client.ping()
        started = now()
        assert client.ping()
        assert now() - started >= 2 * LATENCY
    finally:
        client.close()


def test_renewals_land_within_ttl_and_a_rival_never_gets_in(slow_redis_url: str, spawn) -> None:
    """Held for three ttls through the slow link, the lease stays renewed and exclusive."""
    holder, rival = spawn(slow_redis_url), spawn(slow_redis_url)
    for agent in (holder, rival):  # connect and load the scripts: the cold start is tested below
        assert agent.request("acquire", "warm", TTL, 0)["ev"] == "acquired"
        agent.request("release", "warm")
    got = holder.request("acquire", "slow", TTL, 0)
    assert got["ev"] == "acquired", got
    attempts = 0
    while now() - got["at"] < 3 * TTL:
        answer = rival.request("acquire", "slow", TTL, 0)
        assert answer.get("type") == "LockNotAcquiredError", answer
        attempts += 1
    assert attempts >= 5
    assert holder.request("check", "slow")["lost"] is False
    assert [e for e in holder.events if e["ev"] == "lost"] == []


def test_cold_holder_is_reported_lost_before_a_rival_gets_in(slow_redis_url: str, spawn) -> None:
    """A first acquire on a cold connection costs several slow round trips of the ttl; if the
    lease cannot be renewed in time it is reported lost before any rival acquires it."""
    holder, rival = spawn(slow_redis_url), spawn(slow_redis_url)
    got = holder.request("acquire", "cold", TTL, 0)
    assert got["ev"] == "acquired", got
    taken = None
    while now() - got["at"] < 3 * TTL:
        answer = rival.request("acquire", "cold", TTL, 0)
        if answer["ev"] == "acquired":
            taken = answer
            break
        assert answer.get("type") == "LockNotAcquiredError", answer
    if taken is None:  # renewals landed: the holder must still believe it holds the key
        assert holder.request("check", "cold")["lost"] is False
    else:  # never two holders: the holder was told before the rival got the key
        lost = holder.wait_for(lambda e: e["ev"] == "lost", timeout=10)
        assert lost["at"] < taken["at"], (lost, taken)


def test_checker_through_the_slow_link_finds_no_overlap(
    slow_redis_url: str, fence_sqlite: str, exclusion_reports: list[Report]
) -> None:
    """Holders with holds spanning renewals, through the slow link: no overlap, fencing in order."""
    plan = Plan(keys=["a", "b"], rounds=5, seed=7, ttl=TTL, hold_max=0.4)
    records = run_processes(slow_redis_url, fence_sqlite, holders=3, plan=plan)
    resource = FencedResource(fence_sqlite)
    report = check("redis, 50 ms + jitter", records, resource.log())
    resource.close()
    exclusion_reports.append(report)
    assert report.violations == []
    assert report.acquisitions == 15
    # Round 0 runs on a cold connection (see above); once warm, renewals must land.
    lost = [r for r in records if r.get("lost") and r["round"] > 0]
    assert lost == [], f"warm leases lost through the slow link: {lost}"
