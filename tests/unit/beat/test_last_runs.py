"""Each entry's last run, shared through the lease store as a lease whose owner id carries it."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from celery_lease import MemoryLockStore
from celery_lease._core.owners import parse_owner
from celery_lease.beat.last_runs import LastRuns
from celery_lease.testing import FakeClock
from tests.unit.beat.conftest import KEY, Beat


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
