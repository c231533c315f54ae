"""Two leased beats on a memory store over a FakeClock, for the tests of the leased beat.

Two schedulers on one app stand for two beat processes. Each runs on a thread of its own (a
one-thread executor): a lease is re-entered by code on the thread that entered it, as an
``RLock``, so two schedulers on one thread would share one lease. The schedule's wall clock is
the FakeClock's ``time()`` plus an offset a test can step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import TypeVar

import pytest
from celery import Celery
from celery.schedules import schedule

from celery_lease.beat import TOKEN_HEADER, LeasedScheduler
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, Published

T = TypeVar("T")

KEY = "celery-beat:unique-unit"
"""The beat lease's default key for the ``app`` fixture (main name ``unique-unit``)."""


class WallClock:
    """The schedule's wall clock: the FakeClock's time plus a step a test can make."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.offset = 0.0

    def __call__(self) -> datetime:
        return datetime.fromtimestamp(self.clock.time() + self.offset, tz=timezone.utc)


class Beat:
    """One scheduler and the thread that makes every call of it, as its beat process would."""

    def __init__(self, app: Celery) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1)
        self.scheduler: LeasedScheduler = self.run(lambda: LeasedScheduler(app=app))
        self.scheduler.standby_wait = 0

    def run(self, fn: Callable[[], T]) -> T:
        return self.thread.submit(fn).result(REAL_TIMEOUT)

    def tick(self) -> float:
        return self.run(self.scheduler.tick)

    def ticks(self, count: int) -> None:
        """Tick until nothing more is due now (at most ``count`` passes)."""
        for _ in range(count):
            if self.tick() > 0:
                return

    def close(self) -> None:
        self.run(self.scheduler.close)

    @property
    def token(self) -> int | None:
        held = self.scheduler.election.held
        return None if held is None else held.token


@pytest.fixture
def wall(clock: FakeClock) -> WallClock:
    return WallClock(clock)


@pytest.fixture
def beat_app(app: Celery, wall: WallClock) -> Celery:
    """``app`` with one entry every second (on ``wall``) on the plain in-memory scheduler."""

    @app.task(name="tick", shared=False)
    def tick() -> None: ...

    app.conf.update(
        lease_beat_scheduler="celery.beat:Scheduler",
        lease_beat_ttl=30,
        beat_schedule={"every-second": {"task": "tick", "schedule": schedule(1, nowfun=wall)}},
    )
    return app


@pytest.fixture
def beats(beat_app: Celery) -> Iterator[Callable[[], Beat]]:
    made: list[Beat] = []

    def make() -> Beat:
        made.append(Beat(beat_app))
        return made[-1]

    yield make
    for beat in made:
        beat.close()
        beat.thread.shutdown()


def sent(published: Published) -> list[int]:
    """The ``lease_beat_token`` of every message published so far."""
    return [headers[TOKEN_HEADER] for headers in published.headers]
