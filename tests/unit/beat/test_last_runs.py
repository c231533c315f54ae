"""Each entry's last run, shared through the lease store as a lease whose owner id carries it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import kombu.messaging
import pytest
from celery import Celery
from celery.schedules import schedule
from celery.signals import after_task_publish, before_task_publish
from celery.utils.dispatch import Signal

from celery_lease import MemoryLockStore
from celery_lease._core.owners import parse_owner
from celery_lease.beat.last_runs import MIN_RECORD_KEEP, LastRuns
from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.testing import FakeClock
from tests.unit.beat.conftest import KEY, Beat, WallClock, sent
from tests.unit.conftest import Published


class TestLastRuns:
    def test_a_written_run_is_read_back(self, store: MemoryLockStore) -> None:
        """What one beat writes, another (a new ``LastRuns`` on the store) reads."""
        LastRuns(store, KEY).write("nightly", 1733450000.25)
        assert LastRuns(store, KEY).read() == {"nightly": 1733450000.25}

    def test_a_later_write_replaces_an_earlier_one_of_another_beat(
        self, store: MemoryLockStore
    ) -> None:
        """A record written by another beat is replaced, not kept beside the new one."""
        LastRuns(store, KEY).write("nightly", 100.0)
        mine = LastRuns(store, KEY)
        mine.write("nightly", 200.0)
        mine.write("nightly", 300.0)
        assert LastRuns(store, KEY).read() == {"nightly": 300.0}
        assert [info.key for info in store.list(KEY)] == [KEY + ":last-run:nightly"]

    def test_other_leases_under_the_prefix_are_ignored(self, store: MemoryLockStore) -> None:
        """Leases that are no records (another owner id form) are not read as runs."""
        store.acquire(KEY + ":last-run:odd", "host/1/00;l=something", 10_000)
        assert LastRuns(store, KEY).read() == {}

    def test_the_record_names_host_pid_and_the_run(self, store: MemoryLockStore) -> None:
        """``celery lease list`` shows a record's writer and its run as the owner's label."""
        LastRuns(store, KEY).write("nightly", 1.5)
        info = store.get(KEY + ":last-run:nightly")
        assert info is not None
        assert parse_owner(info.owner).label == "last-run 1500"

    def test_a_store_without_listing_shares_nothing(self, clock: FakeClock) -> None:
        """A store that cannot list its leases: nothing is written, nothing read."""
        inner = MemoryLockStore(clock=clock)
        store = SimpleNamespace(acquire=inner.acquire, renew=inner.renew, release=inner.release)
        runs = LastRuns(store, KEY)
        runs.write("nightly", 1.0)
        assert runs.read() == {}
        assert inner.list() == []


def test_a_send_records_the_entry_s_run(
    beats: Callable[[], Beat], clock: FakeClock, store: MemoryLockStore
) -> None:
    """After each send, the entry's last run is in the store, next to the beat lease."""
    beat = beats()
    clock.advance(1)
    beat.ticks(5)
    runs = LastRuns(store, KEY).read()
    assert runs == {"every-second": pytest.approx(clock.time(), abs=0.001)}


def test_a_record_the_store_refused_is_written_on_the_next_tick(
    beats: Callable[[], Beat],
    clock: FakeClock,
    store: MemoryLockStore,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store fails once while a run is recorded: the record is written once the store
    answers again, so a beat taking over later does not send that tick again."""
    first, second = beats(), beats()
    acquire = store.acquire
    failures = [StoreUnavailableError("injected record failure")]

    def acquire_failing_once(key: str, owner: str, ttl_ms: int) -> int | None:
        if ":last-run:" in key and failures:
            raise failures.pop()
        return acquire(key, owner, ttl_ms)

    monkeypatch.setattr(store, "acquire", acquire_failing_once)
    clock.advance(1)
    with caplog.at_level(logging.WARNING, logger="celery_lease.beat"):
        first.ticks(5)
    assert "could not record the run" in caplog.text
    clock.advance(0.5)
    first.ticks(5)  # nothing due; the store answers again
    first.close()
    second.ticks(5)  # takes over 0.5 s after the tick was sent
    assert len(published.ids) == 1, "the tick whose record had failed was sent again"


def test_the_record_of_an_entry_that_stopped_running_expires(
    beats: Callable[[], Beat], clock: FakeClock, store: MemoryLockStore
) -> None:
    """A record is kept about twice its entry's period (at least an hour), not 400 days: the
    record of an entry removed from the schedule leaves the store on its own."""
    beat = beats()
    clock.advance(1)
    beat.ticks(5)
    record = KEY + ":last-run:every-second"
    assert store.get(record) is not None
    beat.run(lambda: beat.scheduler.schedule.pop("every-second"))
    clock.advance(MIN_RECORD_KEEP + 3)
    beat.ticks(5)
    assert store.get(record) is None, "the record of a removed entry is still kept"


def test_a_record_the_store_never_takes_does_not_hold_back_the_others(
    beat_app: Celery,
    beats: Callable[[], Beat],
    clock: FakeClock,
    store: MemoryLockStore,
    wall: WallClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record refused for good (a key too long for the store) is given up with a warning;
    the other entries' runs are still recorded."""
    beat_app.conf.beat_schedule = {
        "a-too-long-name": {"task": "tick", "schedule": schedule(1, nowfun=wall)},
        "every-second": {"task": "tick", "schedule": schedule(1, nowfun=wall)},
    }
    acquire = store.acquire

    def acquire_refusing_long_keys(key: str, owner: str, ttl_ms: int) -> int | None:
        if key.endswith("a-too-long-name"):
            raise LeaseConfigError(f"key of {len(key)} bytes is too long")
        return acquire(key, owner, ttl_ms)

    monkeypatch.setattr(store, "acquire", acquire_refusing_long_keys)
    beat = beats()
    for _ in range(3):
        clock.advance(1)
        beat.ticks(5)
    assert LastRuns(store, KEY).read() == {"every-second": pytest.approx(clock.time(), abs=0.001)}


@contextmanager
def _receiving(signal: Signal, receiver: Callable[..., None]) -> Iterator[None]:
    """``receiver`` connected to ``signal`` inside the block."""
    signal.connect(receiver, weak=False)
    try:
        yield
    finally:
        signal.disconnect(receiver)


@pytest.mark.parametrize(
    ("lands", "sent_by"),
    [
        pytest.param(after_task_publish, "first", id="after the message went out: recorded"),
        pytest.param(before_task_publish, "second", id="before it went out: the next sends it"),
    ],
)
def test_a_stop_during_a_send_records_the_run_once_its_message_went_out(
    lands: Signal,
    sent_by: str,
    beats: Callable[[], Beat],
    clock: FakeClock,
    published: Published,
) -> None:
    """``celery beat`` raises SystemExit from its SIGTERM handler, wherever the main thread is.
    Landing just after the message went out (before the send returned), the run must still be
    recorded when the beat closes, or the beat taking over sends that tick again; landing
    before, nothing went out and the next beat sends the tick."""
    first, second = beats(), beats()
    stops = [SystemExit()]

    def stop(**_: object) -> None:
        if stops:
            raise stops.pop()

    with _receiving(lands, stop):
        clock.advance(1)
        with pytest.raises(SystemExit):
            first.ticks(5)
    tokens = {"first": first.token}
    first.close()  # what celery beat does on its way out
    second.ticks(5)  # takes over at once
    tokens["second"] = second.token
    assert sent(published) == [tokens[sent_by]], "the tick was sent twice, or never"


class TestWhichSendIsRecorded:
    """A run is recorded once its own message went out, and only then."""

    def test_another_message_going_out_first_does_not_record_a_send_that_failed(
        self,
        beats: Callable[[], Beat],
        beat_app: Celery,
        clock: FakeClock,
        published: Published,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A receiver publishes an audit message during the send, then the broker refuses the
        tick itself: nothing was sent, so the beat taking over sends the tick."""
        first, second = beats(), beats()

        def audit(sender: object = None, **_: object) -> None:
            if sender == "tick":
                beat_app.send_task("audit")

        refusals = [ValueError("the broker refused the message")]
        publish = kombu.messaging.Producer.publish

        def publish_refusing_the_tick(self: Any, body: Any, **options: Any) -> Any:
            if options.get("headers", {}).get("task") == "tick" and refusals:
                raise refusals.pop()
            return publish(self, body, **options)

        monkeypatch.setattr(kombu.messaging.Producer, "publish", publish_refusing_the_tick)
        with _receiving(before_task_publish, audit):
            clock.advance(1)
            first.ticks(1)
        first.close()
        second.ticks(5)
        ticks = [headers for headers in published.headers if headers["task"] == "tick"]
        assert len(ticks) == 1, "the refused tick was recorded as sent"

    def test_a_send_that_reserves_its_entry_itself_is_recorded(
        self, beats: Callable[[], Beat], clock: FakeClock, published: Published
    ) -> None:
        """``apply_async(entry)`` (advance=True: Celery reserves inside the send)."""
        first, second = beats(), beats()
        clock.advance(1)
        first.ticks(5)
        clock.advance(1)
        scheduler = first.scheduler
        first.run(lambda: scheduler.apply_async(scheduler.schedule["every-second"]))
        first.close()
        second.ticks(5)
        assert len(published.ids) == 2, "the tick sent by apply_async(entry) was sent again"

    def test_a_send_that_publishes_nothing_is_recorded(
        self, beats: Callable[[], Beat], beat_app: Celery, clock: FakeClock
    ) -> None:
        """Eager mode runs the task in place (no message, no after_task_publish)."""
        beat_app.conf.task_always_eager = True
        runs: list[int] = []
        beat_app.tasks["tick"].run = lambda: runs.append(1)
        first, second = beats(), beats()
        clock.advance(1)
        first.ticks(5)
        first.close()
        second.ticks(5)
        assert runs == [1], "the tick run in place was run again by the next beat"

    def test_a_send_inside_a_send_leaves_the_outer_one_recorded(
        self,
        beats: Callable[[], Beat],
        beat_app: Celery,
        clock: FakeClock,
        published: Published,
    ) -> None:
        """A receiver in the beat's thread sends another entry while the tick's send runs."""
        beat_app.conf.beat_schedule["other"] = {"task": "other", "schedule": 1000}
        first, second = beats(), beats()
        clock.advance(1)
        first.ticks(5)
        scheduler = first.scheduler

        def nested(sender: object = None, **_: object) -> None:
            if sender == "tick":
                before_task_publish.disconnect(nested)
                other = scheduler.reserve(scheduler.schedule["other"])
                scheduler.apply_async(other, advance=False)

        with _receiving(before_task_publish, nested):
            clock.advance(1)
            first.ticks(1)
        first.close()
        second.ticks(1)
        ticks = [headers for headers in published.headers if headers["task"] == "tick"]
        assert len(ticks) == 2, "a tick of the outer send was sent again"
