"""The election of the beat that sends: loss, rejoining, expiry of a dead holder, the owner id."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

import pytest

from celery_lease import MemoryLockStore
from celery_lease._core.owners import parse_owner
from celery_lease.testing import FakeClock
from tests.unit.beat.conftest import KEY, Beat, sent
from tests.unit.conftest import REAL_TIMEOUT, Published, SpyStore


class TestLossAndRejoin:
    def test_a_beat_that_lost_its_lease_sends_nothing_and_rejoins(
        self,
        beats: Callable[[], Beat],
        clock: FakeClock,
        store: MemoryLockStore,
        published: Published,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Taken from a beat (its lease expired, another took it): the beat sends nothing, even
        before its renewer noticed, and takes the lease again once it is free."""
        first, second = beats(), beats()
        clock.advance(1)
        first.ticks(5)
        old = first.token
        assert store.force_release(KEY) is not None  # as if it expired while first was paused
        second.ticks(5)  # takes it; the tick was sent 0 s ago by first: not again
        clock.advance(1)
        with caplog.at_level(logging.WARNING, logger="celery_lease.beat"):
            first.ticks(5)  # due, but the store says the lease is second's
        assert "no longer records this beat" in caplog.text
        assert first.token is None
        second.ticks(5)
        assert sent(published) == [old, second.token]
        second.close()
        clock.advance(1)
        first.ticks(5)
        assert first.token is not None and first.token > (second.token or 0)
        assert sent(published)[-1] == first.token
        assert len(published.ids) == 3

    def test_a_standby_takes_over_when_the_holder_stops_renewing(
        self, beats: Callable[[], Beat], clock: FakeClock, store: MemoryLockStore
    ) -> None:
        """The key of a holder that stopped renewing expires within one ttl; the standby takes
        it then."""
        first, second = beats(), beats()
        first.ticks(1)
        holder = store.get(KEY)
        assert holder is not None
        store.release(KEY, holder.owner)  # the holder's renewer is gone with it
        store.acquire(KEY, holder.owner, 30_000)  # its last renewal, then nothing
        clock.advance(29.9)
        second.ticks(1)
        assert second.token is None
        clock.advance(0.2)
        second.ticks(1)
        assert second.token is not None
        first.scheduler.election._exit()  # its lease was taken: drop it without a release


def test_the_beat_lease_in_the_store_names_the_beat(
    beats: Callable[[], Beat], store: MemoryLockStore
) -> None:
    """The owner id of the beat lease carries host, pid and the label ``celery beat``."""

    beats().tick()
    info = store.get(KEY)
    assert info is not None
    holder = parse_owner(info.owner)
    assert (holder.host, holder.pid, holder.label) == (
        socket.gethostname(),
        os.getpid(),
        "celery beat",
    )


def test_nothing_is_sent_while_the_store_cannot_confirm_the_lease(
    beats: Callable[[], Beat],
    clock: FakeClock,
    store: SpyStore,
    published: Published,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that stops answering: the due tick waits (it is neither sent nor skipped) and
    goes out once the store confirms the lease again."""
    beat = beats()
    beat.tick()
    store.fail_forever = True
    clock.advance(1)
    with caplog.at_level(logging.WARNING, logger="celery_lease.beat"):
        beat.ticks(5)
    assert "cannot check" in caplog.text
    assert published.ids == []
    store.fail_forever = False
    beat.ticks(5)
    assert sent(published) == [beat.token]


def test_a_holder_whose_loop_does_not_come_back_lets_the_lease_go(
    beats: Callable[[], Beat], clock: FakeClock, store: MemoryLockStore
) -> None:
    """The holder's loop hangs after a tick (the lease's renewer still runs): a ttl after the
    loop was due back the lease is released, and the standby takes it."""
    first, second = beats(), beats()
    clock.advance(1)
    first.ticks(5)  # sent; the loop is due back within the interval it returned
    held = first.scheduler.election.held
    assert held is not None
    clock.advance(1 + 30 + 0.5)  # first never ticks again
    assert held.wait_lost(REAL_TIMEOUT)
    assert held.lost_reason == "beat loop hung"
    second.ticks(5)
    assert second.token is not None


def test_closing_stops_the_watchdog(beats: Callable[[], Beat]) -> None:
    """The thread that watches the beat loop ends with the lease: a closed beat leaves none."""
    beat = beats()
    beat.tick()
    watchdog = beat.scheduler.election._watchdog
    assert watchdog is not None and watchdog.is_alive()
    beat.close()
    assert not watchdog.is_alive()
