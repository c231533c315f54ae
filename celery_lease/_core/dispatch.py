"""The dispatcher: where the core runs user callbacks (``on_lost`` and other loss listeners),
never on the renewer or watchdog thread. Each goes to an idle thread or a new one (the pool
grows without bound on purpose: a bound would queue callbacks behind blocked ones); what it
raises (``SystemExit`` too) is logged on ``celery_lease.dispatch``. Threads, their end and fork
resets: ``docs/internals.md`` (sections 1 and 5, "The dispatcher").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from celery_lease import _forking as forking

logger = logging.getLogger("celery_lease.dispatch")

IDLE_EXIT = 10.0
"""Real seconds an idle dispatcher thread waits for another callback before it exits."""

_Callback = Callable[[Any], object]
_T = TypeVar("_T")


class Dispatcher:
    """Runs ``fn(arg)`` on a thread of its own pool, never on the caller's thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[_Callback, object, str]] = deque()
        self._waiting = 0  # threads blocked waiting for a callback
        self._busy: dict[threading.Thread, str] = {}  # thread -> what it runs now
        self._threads: set[threading.Thread] = set()
        self._stopping = False
        self._names = itertools.count(1)

    def submit(self, fn: Callable[[_T], object], arg: _T, what: str) -> None:
        """Run ``fn(arg)`` soon on a dispatcher thread; ``what`` names it in logs and errors."""
        start: threading.Thread | None = None
        with self._cond:
            self._stopping = False
            self._queue.append((fn, arg, what))
            if len(self._queue) > self._waiting:
                start = threading.Thread(
                    target=self._work,
                    name=f"celery-lease-dispatch-{next(self._names)}",
                    daemon=True,
                )
                self._threads.add(start)
            else:
                self._cond.notify()
        if start is not None:
            try:
                start.start()
            except RuntimeError:  # pragma: no cover - out of threads: another one will run it
                logger.exception("celery-lease: could not start a dispatcher thread for %s", what)
                with self._cond:
                    self._threads.discard(start)

    def _work(self) -> None:
        me = threading.current_thread()
        with self._cond:
            try:
                while True:
                    while self._queue:
                        fn, arg, what = self._queue.popleft()
                        self._busy[me] = what
                        self._cond.release()
                        try:
                            fn(arg)
                        except BaseException:  # SystemExit too: logged, the thread goes on
                            logger.exception("celery-lease: %s raised", what)
                        finally:
                            self._cond.acquire()
                            del self._busy[me]
                            self._cond.notify_all()
                    if self._stopping:
                        return
                    self._waiting += 1
                    try:
                        woken = self._cond.wait(IDLE_EXIT)
                    finally:
                        self._waiting -= 1
                    if not woken and not self._queue:
                        return
            finally:
                self._threads.discard(me)
                self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every submitted callback has run; whether that happened within
        ``timeout`` (real seconds; ``None``: no limit). Meant for tests."""
        limit = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def stop(self, deadline: float) -> list[str]:
        """Run what is queued, then stop and join the threads by ``deadline``
        (``time.monotonic``); what was still running then (empty when every thread ended)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            while self._threads:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            threads = list(self._threads)
            running = sorted(self._busy.values()) or [t.name for t in threads]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return running if any(t.is_alive() for t in threads) else []


_dispatcher = Dispatcher()


def get_dispatcher() -> Dispatcher:
    """The dispatcher of this process (a forked child's own, even after a fork that skipped
    Python's at-fork hooks: :func:`celery_lease._forking.generation` runs the resets)."""
    forking.generation()
    return _dispatcher


def drain(timeout: float | None = 10.0) -> bool:
    """Wait until every loss callback submitted so far has run (default: at most 10 real s);
    whether they all ran in time. For tests that assert on what a callback did."""

    return _dispatcher.drain(timeout)


def _after_fork_in_child() -> None:
    global _dispatcher
    _dispatcher = Dispatcher()


forking.on_fork_child(_after_fork_in_child, name="dispatch: a new, empty dispatcher")
