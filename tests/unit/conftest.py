"""Helpers for unit tests of our own logic: a spy store over MemoryLockStore, on a FakeClock."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from celery_lease import MemoryLockStore, StoreUnavailableError
from celery_lease.renewer import get_renewer
from celery_lease.testing import FakeClock

REAL_TIMEOUT = 10.0
"""Real seconds a test waits for a background thread before it fails."""


class SpyStore(MemoryLockStore):
    """A MemoryLockStore that records renewals and can be told to fail them."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.clock = clock
        self.renewals: list[tuple[str, float]] = []
        self.batches: list[int] = []
        self.fail_renewals = 0  # how many renewals to fail with StoreUnavailableError
        self.fail_forever = False
        self.renewed = threading.Condition()

    def _note(self, key: str) -> None:
        with self.renewed:
            self.renewals.append((key, self.clock.monotonic()))
            self.renewed.notify_all()

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if self.fail_forever or self.fail_renewals > 0:
            self.fail_renewals -= 1
            self._note(key)
            raise StoreUnavailableError("injected renewal failure")
        result = super().renew(key, owner, ttl_ms)
        self._note(key)
        return result

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.batches.append(len(items))
        return [self.renew(*item) for item in items]

    def wait_renewals(self, count: int) -> None:
        """Block (real time) until at least ``count`` renewals were attempted."""
        with self.renewed:
            if not self.renewed.wait_for(lambda: len(self.renewals) >= count, REAL_TIMEOUT):
                raise AssertionError(f"{len(self.renewals)} renewals seen, expected {count}")
        # Only the renewer and its watchdog wait on the clock in these tests: once both wait
        # again, the renewer has handled the results (and scheduled what comes next).
        renewer = get_renewer(self.clock)
        threads = 1 + (renewer.watchdog is not None)
        self.clock.wait_for_sleepers(threads, timeout=REAL_TIMEOUT)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def store(clock: FakeClock) -> SpyStore:
    return SpyStore(clock)
