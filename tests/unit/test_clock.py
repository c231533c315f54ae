"""``celery_lease.clock``: the real clock keeps the :class:`Clock` protocol the core waits on."""

from __future__ import annotations

import threading
import time

from celery_lease.clock import SYSTEM_CLOCK, Clock, SystemClock
from celery_lease.testing import FakeClock


class TestSystemClock:
    def test_is_a_clock(self) -> None:
        """The system clock and the test clock both satisfy the protocol."""
        assert isinstance(SYSTEM_CLOCK, Clock) and isinstance(SYSTEM_CLOCK, SystemClock)
        assert isinstance(FakeClock(), Clock)

    def test_reads_the_process_clocks(self) -> None:
        """monotonic() and time() are the ones of the ``time`` module."""
        before = time.monotonic()
        reading = SYSTEM_CLOCK.monotonic()
        assert before <= reading <= time.monotonic()
        assert abs(SYSTEM_CLOCK.time() - time.time()) < 5.0

    def test_a_set_event_returns_at_once(self) -> None:
        """wait() on a set event is True without waiting, whatever the timeout."""
        event = threading.Event()
        event.set()
        for timeout in (None, 0, -1, 10.0):
            assert SYSTEM_CLOCK.wait(event, timeout) is True

    def test_a_timeout_of_zero_or_less_does_not_block(self) -> None:
        """wait() with timeout <= 0 on an unset event answers False at once."""
        event = threading.Event()
        started = time.monotonic()
        assert SYSTEM_CLOCK.wait(event, 0) is False
        assert SYSTEM_CLOCK.wait(event, -5) is False
        assert time.monotonic() - started < 1.0

    def test_waits_until_the_event_or_the_timeout(self) -> None:
        """An event set by another thread ends the wait with True; otherwise it times out."""
        event = threading.Event()
        assert SYSTEM_CLOCK.wait(event, 0.01) is False
        threading.Timer(0.01, event.set).start()
        assert SYSTEM_CLOCK.wait(event, 30.0) is True

    def test_repr(self) -> None:
        """The repr is what builds it."""
        assert repr(SYSTEM_CLOCK) == "SystemClock()"
