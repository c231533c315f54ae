"""Helpers for tests, ours and our users': :class:`FakeClock`, :func:`drain` (wait for ``on_lost``
callbacks) and the pytest plugin's fixtures ``lease_clock``, ``lease_store``, ``use_lease_store``.
Guide: docs/testing.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from celery_lease._core.dispatch import drain
from celery_lease._core.renewer import renewers

__all__ = [
    "FakeClock",
    "close_lease_stores",
    "drain",
    "lease_clock",
    "lease_store",
    "override_lease_store",
    "use_lease_store",
]

if TYPE_CHECKING:
    from celery import Celery

    from celery_lease.stores.base import LockStore
    from celery_lease.stores.memory import MemoryLockStore

# How often (real seconds) a thread waiting on a FakeClock re-checks its event.
_POLL = 0.002
# Deadlines computed as now + (due - now) can land one float ulp past `due`.
_EPSILON = 1e-9


def _checked_threshold(value: float) -> float:
    if not (isinstance(value, (int, float)) and value >= 0):  # NaN fails the comparison
        raise ValueError(
            f"autojump_threshold={value!r} must be a number of real seconds >= 0"
            " (math.inf: never jump)"
        )
    return float(value)


class FakeClock:
    """A clock that moves only when told to, or by itself once every thread on it sleeps.

    Args:
        start: the initial reading of both ``monotonic()`` and ``time()``, in seconds.
        autojump_threshold: real seconds (default ``math.inf``: never). Once every thread of
            the clock waits on it, none is due to wake, and none used it for this long, the
            clock jumps to the earliest deadline of those waits (trio's
            ``MockClock.autojump_threshold``). A thread that never waited on it (nor is a
            renewer or watchdog of a lease on it) is not seen. Settable at any time.
    """

    def __init__(self, start: float = 0.0, *, autojump_threshold: float = math.inf) -> None:
        self._now = float(start)
        self._cond = threading.Condition()
        self._sleepers = 0
        self._deadlines: list[float] = []
        self._events: list[threading.Event] = []
        # Threads in a wait() now (counted: a signal handler may nest one); all that ever waited.
        self._waiting: dict[threading.Thread, int] = {}
        self._participants: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._autojump = _checked_threshold(autojump_threshold)
        self._last_activity = time.monotonic()  # real seconds
        self.waits = 0
        """How many calls to :meth:`wait` have begun (lets a test see a thread go back to sleep)."""

    @property
    def autojump_threshold(self) -> float:
        """Real seconds of quiet before the clock jumps (``math.inf``: never); ``ValueError``
        when set to a negative number or NaN."""
        with self._cond:
            return self._autojump

    @autojump_threshold.setter
    def autojump_threshold(self, value: float) -> None:
        checked = _checked_threshold(value)
        with self._cond:
            self._autojump = checked
            self._touch()

    def _touch(self) -> None:
        """Someone used the clock (the lock is held): the quiet starts again; wake the waiters."""
        self._last_activity = time.monotonic()
        self._cond.notify_all()

    def _autojump_in(self) -> float | None:
        """Real seconds until the clock may jump (<= 0: now); ``None``: not now."""
        if self._autojump == math.inf or not self._deadlines:
            return None
        if any(d - _EPSILON <= self._now for d in self._deadlines):
            return None
        if any(event.is_set() for event in self._events) or self._busy():
            return None
        return self._last_activity + self._autojump - time.monotonic()

    def _busy(self) -> bool:
        """Whether a thread of the clock is alive and not in a :meth:`wait`; the lock is held."""
        for thread in list(self._participants):
            if not thread.is_alive():
                self._participants.discard(thread)
            elif thread not in self._waiting:
                return True
        for renewer in renewers(self):
            for own in (renewer.thread, renewer.watchdog):
                if own is not None and own.is_alive() and own not in self._waiting:
                    return True
        return False

    def monotonic(self) -> float:
        with self._cond:
            self._last_activity = time.monotonic()
            return self._now

    def time(self) -> float:
        with self._cond:
            self._last_activity = time.monotonic()
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every waiter whose deadline has come.

        Raises:
            ValueError: for a negative step (a clock does not go back), NaN or infinity.
        """
        if not 0 <= seconds < math.inf:
            raise ValueError(
                f"seconds={seconds!r} must be a finite number >= 0: a clock does not go back"
            )
        with self._cond:
            self._now += seconds
            self._touch()

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        thread = threading.current_thread()
        with self._cond:
            deadline = None if timeout is None else self._now + timeout
            self._sleepers += 1
            self.waits += 1
            if deadline is not None:
                self._deadlines.append(deadline)
            self._events.append(event)
            self._waiting[thread] = self._waiting.get(thread, 0) + 1
            self._participants.add(thread)
            self._touch()
            try:
                while not event.is_set():
                    if deadline is not None and self._now >= deadline - _EPSILON:
                        return False
                    jump_in = self._autojump_in()
                    if jump_in is not None and jump_in <= 0:
                        self._now = min(self._deadlines)
                        self._touch()
                        continue
                    self._cond.wait(_POLL if jump_in is None else min(_POLL, jump_in))
                return True
            finally:
                self._sleepers -= 1
                if deadline is not None:
                    self._deadlines.remove(deadline)
                self._events.remove(event)
                left = self._waiting[thread] - 1
                if left:
                    self._waiting[thread] = left
                else:
                    del self._waiting[thread]
                self._touch()

    def advance_to_next_deadline(self) -> float:
        """Advance exactly to the earliest deadline of a thread waiting now; returns the step
        (0.0, not moving, when no waiter has a deadline)."""
        with self._cond:
            future = [d for d in self._deadlines if d > self._now]
            step = (min(future) - self._now) if future else 0.0
            self._now += step
            self._touch()
            return step

    def wait_for_waits(self, count: int, timeout: float = 10.0) -> None:
        """Block (real time) until :attr:`waits` reaches ``count``.

        Raises:
            TimeoutError: when that does not happen within ``timeout`` real seconds.
        """
        self._block_until(
            lambda: self.waits >= count,
            timeout,
            lambda: f"{self.waits} wait(s) begun, expected {count}",
        )

    @property
    def sleepers(self) -> int:
        """How many threads are blocked in :meth:`wait` right now."""
        with self._cond:
            return self._sleepers

    def wait_for_sleepers(self, count: int, timeout: float = 10.0) -> None:
        """Block (real time) until at least ``count`` threads wait on this clock.

        Raises:
            TimeoutError: when that does not happen within ``timeout`` real seconds.
        """
        self._block_until(
            lambda: self._sleepers >= count,
            timeout,
            lambda: f"{self._sleepers} thread(s) wait on the clock, expected {count}",
        )

    def _block_until(
        self, done: Callable[[], bool], timeout: float, failure: Callable[[], str]
    ) -> None:
        limit = time.monotonic() + timeout
        with self._cond:
            while not done():
                left = limit - time.monotonic()
                if left <= 0:
                    raise TimeoutError(failure())
                self._cond.wait(min(left, 0.05))

    def __repr__(self) -> str:
        if self._autojump == math.inf:
            return f"FakeClock(now={self._now!r})"
        return f"FakeClock(now={self._now!r}, autojump_threshold={self._autojump!r})"


def close_lease_stores(app: Celery | None = None) -> None:
    """Close and forget the stores celery-lease built: ``app``'s (or every app's) and those of
    ``lock_store`` URLs; rebuilt on next use. For a test runner about to drop their database
    (docs/django.md); a ``LockStore`` object is forgotten, not closed. Call it with no lease held.
    """
    from celery_lease._celery.settings import close_stores
    from celery_lease._celery.store_resolution import close_url_stores

    close_stores(app)
    close_url_stores()


_S = TypeVar("_S", bound="str | LockStore")


@contextlib.contextmanager
def override_lease_store(app: Celery, store: _S) -> Iterator[_S]:
    """Point ``app`` at ``store`` (a ``LockStore`` or a store URL) inside the block.

    The settings are read again on entry and on exit, when the previous setting is back. Tasks
    with their own ``lock_store=`` keep it.

    Yields:
        ``store``.
    """
    from celery_lease._celery.settings import reset

    conf = app.conf
    conf.finalize()  # load config_from_object now: its namespace decides the key
    prefix = conf.prefix or ""
    key = prefix + "lease_store"
    key = key.upper() if prefix.isupper() else key.lower()
    # Celery looks in its changes first, the namespaced spelling first: this key wins.
    changes = conf.changes
    missing = object()
    previous = changes.get(key, missing)
    changes[key] = store
    reset(app)
    try:
        yield store
    finally:
        if previous is missing:
            changes.pop(key, None)
        else:
            changes[key] = previous
        reset(app)


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is only needed for the fixtures
    pass
else:

    @pytest.fixture
    def lease_clock() -> Iterator[FakeClock]:
        """A :class:`FakeClock` at 1000.0 seconds, without autojump; teardown calls
        :func:`celery_lease.shutdown` (a ``lease()`` block left un-exited errors there)."""
        from celery_lease._core.renewer import shutdown

        yield FakeClock(1000.0)
        shutdown()

    @pytest.fixture
    def lease_store(lease_clock: FakeClock) -> Iterator[MemoryLockStore]:
        """A fresh :class:`~celery_lease.MemoryLockStore` on the ``lease_clock`` fixture."""
        from celery_lease.stores.memory import MemoryLockStore

        yield MemoryLockStore(clock=lease_clock)

    @pytest.fixture
    def use_lease_store(
        lease_store: MemoryLockStore,
    ) -> Iterator[Callable[[Celery], MemoryLockStore]]:
        """``use_lease_store(app)``: :func:`override_lease_store` for the rest of the test."""
        with contextlib.ExitStack() as stack:

            def use(app: Celery) -> MemoryLockStore:
                return stack.enter_context(override_lease_store(app, lease_store))

            yield use
