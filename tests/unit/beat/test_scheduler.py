"""The leased scheduler: one sender, the token header, take-over at the due time, clock steps."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import celery
import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler

from celery_lease.beat import TOKEN_HEADER
from celery_lease.testing import FakeClock
from tests.unit.beat.conftest import Beat, WallClock, sent
from tests.unit.conftest import Published

CELERY_MARKS_BEAT_TASKS = celery.VERSION >= (5, 7)
"""Celery 5.7 on sets the header ``celery_beat_task`` on what beat sends."""


class TestOneSender:
    def test_only_the_holder_sends_each_tick_once(
        self, beats: Callable[[], Beat], clock: FakeClock, published: Published
    ) -> None:
        """Two beats on one schedule: each second's tick is sent once, by the holder."""
        first, second = beats(), beats()
        for _ in range(10):
            clock.advance(1)
            first.ticks(5)
            second.ticks(5)
        assert first.token is not None
        assert second.token is None
        assert sent(published) == [first.token] * 10

    def test_every_message_carries_the_fencing_token(
        self, beats: Callable[[], Beat], clock: FakeClock, published: Published
    ) -> None:
        """The header ``lease_beat_token`` is the holder's fencing token."""
        beat = beats()
        clock.advance(1)
        beat.ticks(5)
        assert beat.token is not None
        assert published.headers[0][TOKEN_HEADER] == beat.token
        if CELERY_MARKS_BEAT_TASKS:  # the wrapped scheduler's own header is kept beside ours
            assert published.headers[0]["celery_beat_task"] is True
        else:
            assert "celery_beat_task" not in published.headers[0]


class TestTakeOver:
    def test_after_a_clean_shutdown_the_standby_sends_the_next_tick_at_its_due_time(
        self, beats: Callable[[], Beat], clock: FakeClock, published: Published
    ) -> None:
        """The standby takes over at once and neither repeats the last tick nor skips one."""
        first, second = beats(), beats()
        clock.advance(1)  # the entry was made 1 s ago: due
        first.ticks(5)
        second.ticks(5)
        assert len(published.ids) == 1
        old = first.token
        clock.advance(0.5)
        first.close()  # releases
        second.ticks(5)
        assert second.token is not None
        assert len(published.ids) == 1, "the tick the first beat sent 0.5 s ago was sent again"
        clock.advance(0.5)
        second.ticks(5)
        assert sent(published) == [old, second.token]


class TestSharedLastRuns:
    @pytest.mark.parametrize(
        ("step", "seconds", "sends"),
        [(-3600.0, 5, 1), (3600.0, 0, 2)],
        ids=["back an hour: none again", "forward an hour: one, not 3600"],
    )
    def test_a_wall_clock_step_sends_no_tick_twice(
        self,
        beats: Callable[[], Beat],
        clock: FakeClock,
        wall: WallClock,
        published: Published,
        step: float,
        seconds: int,
        sends: int,
    ) -> None:
        """After a wall-clock step neither beat sends a tick twice and the lease is kept (it is
        counted on the monotonic clock); a step forward sends the due tick once (Celery's
        catch-up)."""
        first, second = beats(), beats()
        clock.advance(1)
        first.ticks(5)
        wall.offset = step
        first.ticks(5)
        second.ticks(5)
        for _ in range(seconds):
            clock.advance(1)
            first.ticks(5)
            second.ticks(5)
        assert len(published.ids) == sends
        assert first.token is not None and second.token is None

    def test_a_take_over_reads_runs_newer_than_its_own(
        self,
        beats: Callable[[], Beat],
        clock: FakeClock,
        published: Published,
    ) -> None:
        """A beat that sent long ago and takes the lease back reads the other beat's runs."""
        first, second = beats(), beats()
        clock.advance(1)
        first.ticks(5)
        first.close()
        for _ in range(3):
            clock.advance(1)
            second.ticks(5)
        clock.advance(0.5)
        second.close()
        first.ticks(5)  # its own last run is 3.5 s old; the shared one 0.5 s
        assert first.token is not None
        assert len(published.ids) == 4
        clock.advance(0.5)
        first.ticks(5)
        assert len(published.ids) == 5


def test_a_reload_of_older_state_after_a_take_over_sends_no_tick_again(
    beats: Callable[[], Beat], clock: FakeClock, wall: WallClock, published: Published
) -> None:
    """The wrapped scheduler reloads its entries with a last run older than the shared one
    (django-celery-beat reads its database every 5 minutes; the dead holder had not saved its
    last run): the tick its predecessor sent is still not sent again."""
    first, second = beats(), beats()
    clock.advance(1)
    first.ticks(5)
    clock.advance(0.5)
    first.close()
    second.ticks(5)
    assert second.token is not None

    def reload_stale_state() -> None:
        for entry in second.scheduler.schedule.values():
            entry.last_run_at = wall() - timedelta(hours=1)
        second.scheduler._heap = None  # as django-celery-beat does after a reload

    second.run(reload_stale_state)
    clock.advance(0.1)
    second.ticks(5)
    assert len(published.ids) == 1, "the tick sent 0.6 s ago was sent again after a reload"
    clock.advance(0.4)
    second.ticks(5)
    assert len(published.ids) == 2


class UncopyableEntry(ScheduleEntry):
    """An entry that cannot be copied, as django-celery-beat's ``ModelEntry``."""

    def __reduce__(self) -> Any:
        raise TypeError("ModelEntry.__init__() takes from 2 to 3 positional arguments")


class UncopyableScheduler(Scheduler):
    Entry = UncopyableEntry


def test_a_scheduler_whose_entries_do_not_copy_sends_with_the_token(
    beat_app: Celery, beats: Callable[[], Beat], clock: FakeClock, published: Published
) -> None:
    """The token goes on the send, not into the schedule, whatever the entry class."""
    beat_app.conf.lease_beat_scheduler = UncopyableScheduler
    beat = beats()
    clock.advance(1)
    beat.ticks(5)
    assert sent(published) == [beat.token]
    entry = beat.scheduler.schedule["every-second"]
    assert TOKEN_HEADER not in (entry.options.get("headers") or {})
