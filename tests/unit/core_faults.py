"""Helpers for tests that force an order or a fault inside the lease core.

A stand-in for an asynchronous exception delivered on the body's thread, a store whose renewal of
one chosen key waits for the test, short leases churned through the renewer, and a real-time poll
for the background threads that react.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from celery_lease import MemoryLockStore, lease
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT

REAL = 5.0
"""Real seconds a test waits for a background thread before it fails."""


def poll_until(predicate: Callable[[], object], timeout: float = REAL, what: str = "") -> None:
    """Poll ``predicate`` (real time) until it is true; AssertionError after ``timeout``."""
    limit = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > limit:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.001)


class Interrupt(BaseException):
    """Stands for an asynchronous exception delivered inside the core (not an ``Exception``)."""


class GatedRenewalStore(MemoryLockStore):
    """Counts renewals per (key, owner); the first renewal of ``gate_key`` waits for ``go``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.gate_key: str | None = None
        self.entered = threading.Event()
        self.go = threading.Event()
        self.renewed: Counter[tuple[str, str]] = Counter()
        self.cond = threading.Condition()

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if key == self.gate_key:
            self.gate_key = None
            self.entered.set()
            if not self.go.wait(REAL_TIMEOUT):
                raise AssertionError("the test never let the gated renewal go on")
        ok = super().renew(key, owner, ttl_ms)
        with self.cond:
            self.renewed[(key, owner)] += 1
            self.cond.notify_all()
        return ok

    def wait_renewed(self, pairs: list[tuple[str, str]], count: int) -> None:
        """Block (real time) until each (key, owner) was renewed at least ``count`` times."""
        with self.cond:
            if not self.cond.wait_for(
                lambda: all(self.renewed[p] >= count for p in pairs), REAL_TIMEOUT
            ):
                raise AssertionError(f"renewals {dict(self.renewed)}, expected {count} each")


def churn(store: MemoryLockStore, clock: FakeClock, prefix: str, count: int) -> None:
    """Take and leave ``count`` short leases: each exit closes one renewer entry."""
    for i in range(count):
        with lease(f"{prefix}{i}", store=store, ttl=3, clock=clock):
            pass
