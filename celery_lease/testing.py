"""Helpers for tests, ours and our users': a fake clock and pytest fixtures.

``FakeClock`` is accepted wherever a clock is (``MemoryLockStore``, ``lease()``, the renewer).
Time moves only when a test calls :meth:`FakeClock.advance`, which wakes every thread waiting on
the clock, so tests of expiry, waiting and renewal never sleep; with ``autojump_threshold`` it
also moves by itself to the next deadline once every thread waiting on it has slept that long.
A Celery task's lease runs on the clock of the store it is taken in, so under these fixtures
its renewer sleeps on ``lease_clock``.

:func:`override_lease_store` points an existing Celery app at another store inside a block.

Installed as a pytest plugin (entry point ``celery_lease``), it provides the fixtures
``lease_clock`` (a ``FakeClock``), ``lease_store`` (a ``MemoryLockStore`` on that clock) and
``use_lease_store`` (``use_lease_store(app)`` points an app at ``lease_store`` for one test).
They stop celery-lease's background threads at teardown (:func:`celery_lease.shutdown`).

Loss callbacks (``on_lost``) run on a dispatcher thread: a test that asserts on what one did
waits for them with :func:`celery_lease._core.dispatch.drain`.
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
        autojump_threshold: real seconds (default ``math.inf``: never). When every thread of
            the clock waits on it, none is due to wake (its event set or its deadline come),
            and no thread has read, advanced or begun or ended a wait on it for this long, the
            clock moves by itself to the earliest deadline of those waits (trio's
            ``MockClock.autojump_threshold``). A wait called from the test's own thread then
            returns instead of hanging; time still moves from deadline to deadline, so each
            renewal and expiry on the way happens in order. The threads of the clock are those
            that ever waited on it, busy from the moment a wait returns until their next wait
            begins or they end, and the renewer and watchdog threads of leases on it from their
            start: while one of them works (a renewal's store round trip, a descheduled thread)
            the clock stays still. A thread that never waited on it (the test's own before its
            first wait, the dispatcher running ``lock_lost`` receivers) is not seen: a jump may
            come while it works longer than the threshold. A thread that waited on the clock
            and then blocks on something else (a ``join``, a queue) holds the clock still until
            it waits on the clock again or ends. Settable at any time.
    """

    def __init__(self, start: float = 0.0, *, autojump_threshold: float = math.inf) -> None:
        self._now = float(start)
        self._cond = threading.Condition()
        self._sleepers = 0
        self._deadlines: list[float] = []
        self._events: list[threading.Event] = []
        # The threads in a wait() now (how many waits each: a signal handler may nest one), and
        # every thread that ever waited (weakly: a thread object that is gone counts no more).
        self._waiting: dict[threading.Thread, int] = {}
        self._participants: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._autojump = _checked_threshold(autojump_threshold)
        self._last_activity = time.monotonic()  # real seconds
        self.waits = 0
        """How many calls to :meth:`wait` have begun (lets a test see a thread go back to sleep)."""

    @property
    def autojump_threshold(self) -> float:
        """Real seconds of quiet after which the clock jumps to the next deadline (``math.inf``:
        never). Raises ``ValueError`` when set to a negative number or NaN."""
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
        """Real seconds until the clock may jump by itself (<= 0: now), or ``None`` while it may
        not: off, no deadline, a waiter due to wake (its event set or its deadline come) that
        has yet to return, or a participant busy off the clock (:meth:`_busy`)."""
        if self._autojump == math.inf or not self._deadlines:
            return None
        if any(d - _EPSILON <= self._now for d in self._deadlines):
            return None
        if any(event.is_set() for event in self._events) or self._busy():
            return None
        return self._last_activity + self._autojump - time.monotonic()

    def _busy(self) -> bool:
        """Whether a thread of the clock is alive and not in a :meth:`wait` (the lock is held).

        The threads of the clock: each that ever waited on it, and the renewer and watchdog
        threads of celery-lease's renewers on this clock, from their start (a renewer thread
        just started has not reached its first wait yet).
        """
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
        """Advance exactly to the earliest deadline of a thread waiting now; returns the step.

        Returns 0.0 (and does not move) when no waiter has a deadline.
        """
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
        limit = time.monotonic() + timeout
        with self._cond:
            while self.waits < count:
                left = limit - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.waits} wait(s) begun, expected {count}")
                self._cond.wait(min(left, 0.05))

    @property
    def sleepers(self) -> int:
        """How many threads are blocked in :meth:`wait` right now."""
        with self._cond:
            return self._sleepers

    def wait_for_sleepers(self, count: int, timeout: float = 10.0) -> None:
        """Block (real time) until at least ``count`` threads wait on this clock.

        Lets a test know that a background thread reached its wait before moving time.

        Raises:
            TimeoutError: when that does not happen within ``timeout`` real seconds.
        """
        limit = time.monotonic() + timeout
        with self._cond:
            while self._sleepers < count:
                left = limit - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self._sleepers} thread(s) wait on the clock, expected {count}"
                    )
                self._cond.wait(min(left, 0.05))

    def __repr__(self) -> str:
        if self._autojump == math.inf:
            return f"FakeClock(now={self._now!r})"
        return f"FakeClock(now={self._now!r}, autojump_threshold={self._autojump!r})"


def close_lease_stores(app: Celery | None = None) -> None:
    """Close the stores celery-lease built in this process, and forget them: ``app``'s lease
    store (or every app's) and the stores of tasks' ``lock_store`` URLs. The next task or
    ``lease(app=...)`` builds them anew, from the settings as they are then.

    For a test runner about to drop the database a store is connected to: under pytest-django
    with ``lease_store = "django://default"``, the store's own connections to the test database
    make ``DROP DATABASE`` fail ("being accessed by other users") unless they are closed first
    (``docs/django.md`` has the fixture). A ``LockStore`` given as ``lease_store`` is the
    caller's: forgotten, not closed. Call it when no lease of those stores is held.
    """
    from celery_lease._celery.settings import close_stores
    from celery_lease._celery.store_resolution import close_url_stores

    close_stores(app)
    close_url_stores()


_S = TypeVar("_S", bound="str | LockStore")


@contextlib.contextmanager
def override_lease_store(app: Celery, store: _S) -> Iterator[_S]:
    """Point ``app`` at ``store`` (a ``LockStore`` or a store URL) inside the block.

    celery-lease resolves an app's store once and keeps it, so setting ``app.conf.lease_store``
    in a test reaches only the first test that runs a task of the app. This sets the setting and
    makes celery-lease read the app's settings again, on entry and on exit; on exit the app's
    previous setting is back as it was (a value set in ``app.conf``, one from
    ``config_from_object``, or none), Django's namespaced ``CELERY_LEASE_STORE`` included.
    Tasks with a ``lock_store=`` option of their own keep that store. The pytest fixture
    ``use_lease_store`` is this for one test; in a ``unittest.TestCase``, use
    ``self.enterContext(override_lease_store(app, store))``.

    Yields:
        ``store``.
    """
    from celery_lease._celery.settings import reset

    conf = app.conf
    conf.finalize()  # load config_from_object now: its namespace decides the key
    prefix = conf.prefix or ""
    key = prefix + "lease_store"
    key = key.upper() if prefix.isupper() else key.lower()
    # Celery looks in its changes first, and there for the namespaced spelling first: this key
    # wins over every other spelling and source of the setting.
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
        """A :class:`FakeClock` starting at 1000.0 seconds, without autojump.

        Autojump is off because the clock cannot see a thread that never waited on it (the
        test's own thread before its first wait, a ``lock_lost`` receiver on the dispatcher):
        on a busy machine time could move under it, and a test that moves the clock itself
        decides exactly when time moves. A test that waits on its own thread turns it on:
        ``lease_clock.autojump_threshold = 0.01``.

        At teardown it calls :func:`celery_lease.shutdown`, so no celery-lease thread outlives
        the test (suites with a thread-leak check, such as Celery's ``threads_not_lingering``,
        stay green). A test that leaves a ``lease()`` block un-exited errors at teardown with
        the key named.
        """
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
        """A function that points a Celery app at ``lease_store`` for this test; returns the store.

        ``use_lease_store(app)`` is :func:`override_lease_store` for the rest of the test: the
        app's tasks take their leases in the test's fresh store, and at teardown the app's own
        setting is back. Call it for each app (a module-level one, ``celery_app``), in the test
        or in an autouse fixture.
        """
        with contextlib.ExitStack() as stack:

            def use(app: Celery) -> MemoryLockStore:
                return stack.enter_context(override_lease_store(app, lease_store))

            yield use
