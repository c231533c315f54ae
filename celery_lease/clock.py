"""Time, injected: every wait and every expiry in the core goes through a :class:`Clock`.

Production code uses :data:`SYSTEM_CLOCK`; tests use :class:`celery_lease.testing.FakeClock`.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """What the core needs from time.

    A clock is a class that defines these three methods: an object that answers every
    attribute (a ``Mock``) given as a store's ``clock`` is ignored for the system clock.
    """

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes back. Deadlines and validity use it;
        for :class:`~celery_lease.SQLiteLockStore` it must be shared by the host's processes."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch (floors fencing tokens; SQLite's fallback expiry)."""
        ...

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """Wait for ``event`` at most ``timeout`` seconds of this clock (``None``: no limit);
        returns whether it is set."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic``, ``time.time`` and ``Event.wait``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if timeout is not None and timeout <= 0:
            return event.is_set()
        return event.wait(timeout)

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK = SystemClock()
"""The process-wide real clock."""
