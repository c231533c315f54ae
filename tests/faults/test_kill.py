"""Fault 1: the process holding a lease is SIGKILLed; the key frees itself within one ttl."""

from __future__ import annotations

import signal

import pytest

from celery_lease._core.lease import POLL_MAX
from tests.faults.harness import now

pytestmark = pytest.mark.slow

TTL = 1.0
SLACK = 0.5  # scheduling noise of a loaded 2-core machine


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_killed_holder_is_replaced_within_ttl_and_one_poll(
    store: str, request: pytest.FixtureRequest, spawn
) -> None:
    """After SIGKILL of the holder, a waiting process acquires within ttl + one poll, with a
    higher token."""
    if store == "redis":
        url = request.getfixturevalue("own_redis").url
    else:
        url = request.getfixturevalue("sqlite_store_url")
    holder, waiter = spawn(url), spawn(url)
    held = holder.request("acquire", "report", TTL, 0)
    assert held["ev"] == "acquired", held
    assert waiter.request("acquire", "report", TTL, 0)["type"] == "LockNotAcquiredError"

    since = waiter.send("acquire", "report", TTL, 10)
    holder.signal(signal.SIGKILL)
    killed_at = now()
    taken = waiter.answer(since, timeout=TTL + 10)

    assert taken["ev"] == "acquired", taken
    assert taken["token"] > held["token"]
    assert taken["at"] - killed_at <= TTL + POLL_MAX + SLACK, (
        f"acquired {taken['at'] - killed_at:.3f} s after the kill"
    )
