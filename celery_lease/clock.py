"""Time, injected: every wait and every expiry in the core goes through a :class:`Clock`.

Production code uses :data:`SYSTEM_CLOCK`; tests use :class:`celery_lease.testing.FakeClock`, whose
``advance()`` wakes every thread waiting on it, so expiry and renewal are tested without sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """What the core needs from time.

    A clock of your own is a class that defines these three methods (or inherits them). A
    store's ``clock`` attribute (``MemoryLockStore(clock=)``, ``SQLiteLockStore(clock=)``) is
    the clock its leases run on only when its class does: an object that answers every
    attribute (a ``Mock``, a ``__getattr__`` proxy) is no clock, and the system clock is used.
    """

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes back. Used for deadlines.

        The lease's validity estimate is counted on it, and :class:`~celery_lease.SQLiteLockStore`
        decides expiry with it, so for that store it must be a clock every process of the host
        shares and that never steps (``SystemClock``: ``CLOCK_MONOTONIC`` on Linux).
        """
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch.

        Used to floor fencing tokens, and by the SQLite store for its wall-clock expiry column,
        which decides expiry only for processes that cannot read the host's boot id.
        """
        ...

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """Block until ``event`` is set or ``timeout`` seconds of this clock have passed.

        Returns whether the event is set. ``None`` waits for the event alone.
        """
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
