"""The cluster fan-out's threads (``celery_lease.stores._redis_cluster``): node shares run at once
and hand back their results in order, a slot-table refresh runs once at a time, and a second try
is waited for only until its deadline. Batches against real clusters: ``test_redis.py`` and
``tests/faults/test_redis_cluster*.py``."""

from __future__ import annotations

import threading
import time

import pytest

from celery_lease.stores._redis_cluster import NodeWorkers, SlotRefresh, before


class TestNodeWorkers:
    def test_results_come_in_job_order_and_the_shares_run_at_once(self) -> None:
        """Every job runs on a thread of its own but the first, all at the same time."""
        barrier = threading.Barrier(3, timeout=10)

        def job(value: int) -> int:
            barrier.wait()  # three jobs meet here only when they run at once
            return value

        assert NodeWorkers().run([lambda: job(1), lambda: job(2), lambda: job(3)]) == [1, 2, 3]

    def test_the_first_error_is_raised_after_every_job_ended(self) -> None:
        """A job that raises does not cut the others short; the first error in job order is
        raised once all have returned."""
        ended = threading.Event()

        def slow() -> int:
            ended.set()
            return 0

        def fails(message: str) -> int:
            raise ValueError(message)

        with pytest.raises(ValueError, match="first"):
            NodeWorkers().run([lambda: fails("first"), slow, lambda: fails("second")])
        assert ended.is_set()

    def test_no_jobs_no_results(self) -> None:
        """An empty batch runs nothing."""
        assert NodeWorkers().run([]) == []


class TestSlotRefresh:
    def test_a_refresh_asked_for_while_one_runs_joins_it(self) -> None:
        """Two starts while the first refresh runs: one refresh, one event for both."""
        release = threading.Event()
        runs: list[int] = []

        def refresh() -> None:
            runs.append(1)
            release.wait(10)

        slots = SlotRefresh(refresh)
        first = slots.start()
        assert slots.start() is first
        release.set()
        assert first.wait(10)
        second = slots.start()
        assert second is not first and second.wait(10)
        assert len(runs) == 2


class TestBefore:
    def test_a_job_ended_in_time_gives_its_result(self) -> None:
        """``(True, result)``; an error it raised is raised here."""
        assert before(time.monotonic() + 10, lambda: 7) == (True, 7)
        with pytest.raises(KeyError):
            before(time.monotonic() + 10, lambda: {}["missing"])

    def test_a_job_past_the_deadline_goes_on_alone(self) -> None:
        """A deadline already passed: ``(False, None)`` at once, the job still running."""
        release = threading.Event()
        assert before(time.monotonic() - 1, lambda: release.wait(10)) == (False, None)
        release.set()
