"""A send goes out only while the store's confirmation of the lease is still fresh: a store
answer or a broker connection that takes about a ttl sends nothing under the old lease."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_lease.testing import FakeClock
from tests.unit.beat.conftest import Beat, sent
from tests.unit.conftest import Published, SpyStore


def test_a_confirmation_that_comes_back_a_ttl_late_sends_nothing(
    beats: Callable[[], Beat],
    clock: FakeClock,
    store: SpyStore,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store renewed the lease, but its answer took longer than the ttl: the lease may be
    another beat's by now, so the due tick is not sent under the old token."""
    beat = beats()
    beat.tick()
    old = beat.token
    clock.advance(1)
    beat_thread = beat.run(threading.get_ident)
    renew = store.renew
    late = [True]

    def renew_answering_late(key: str, owner: str, ttl_ms: int) -> bool:
        kept = renew(key, owner, ttl_ms)
        if late and threading.get_ident() == beat_thread:
            late.clear()
            clock.advance(31)  # the answer arrives a ttl (30 s) after the store renewed
        return kept

    monkeypatch.setattr(store, "renew", renew_answering_late)
    beat.ticks(5)
    assert old not in sent(published), "sent under a lease whose confirmation came back late"


def test_a_broker_connection_made_after_the_check_sends_nothing_under_a_lost_lease(
    beats: Callable[[], Beat],
    clock: FakeClock,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first send connects to the broker; a connection that takes a ttl is made before the
    store is asked, so the send goes out only under a lease the store confirmed after it."""
    beat = beats()
    beat.tick()
    old = beat.token
    clock.advance(1)
    scheduler = beat.scheduler
    connect = scheduler._ensure_connected

    def slow_connect() -> Any:
        clock.advance(31)  # the broker took a ttl to answer
        return connect()

    monkeypatch.setattr(scheduler, "_ensure_connected", slow_connect)
    beat.ticks(5)
    assert old not in sent(published), "sent under a lease that expired while connecting"
