"""Stopping a body whose lease is lost (``on_lost="revoke"``), per pool.

One :class:`Interrupter` per locked execution. The task's thread calls :meth:`~Interrupter.start`
before the body and :meth:`~Interrupter.end` right after it; the thread that learns of the loss
(the renewer or the watchdog) calls :meth:`~Interrupter.fire`, which is quick and never blocks or
raises. What each pool does:

- prefork (a child's main thread) and solo (the main thread): :data:`INTERRUPT_SIGNAL`, a
  real-time signal that neither billiard nor Celery uses, is sent to the main thread with
  ``signal.pthread_kill``; our handler raises :class:`AsyncLockLost` in the body at once (a
  blocking ``sleep`` or socket read is interrupted). ``SIGUSR1`` stays billiard's (soft time
  limits) and Celery's (stack dumps): the two never share, count or swallow each other's signal.
  In a prefork child, a body still running :data:`REVOKE_GRACE` seconds later (stuck in C code)
  gets its child terminated with ``SIGTERM``, as ``revoke(terminate=True)`` does.
- threads: ``PyThreadState_SetAsyncExc`` raises it in the task's thread when it next runs Python
  bytecode (not inside a blocking C call).
- gevent, eventlet: the task's greenlet is thrown it at its next switch, from a hub callback.

The discipline that makes "nothing lands after ``end()``" hold:

- ``fire()`` decides and delivers under the interrupter's lock, only while the body runs;
  ``end()`` first marks the body ended (one assignment), then takes the same lock and cancels an
  asynchronous exception not yet delivered. So a ``fire()`` either finished before ``end()``
  took the lock (its exception is cancelled, or it already landed: in the body, or in ``end()``
  itself) or sees the body ended and does nothing.
- The signal handler and the green callbacks take no lock: they run between two bytecodes of
  the very thread that may hold the lock (inside ``start()`` or ``end()``), so they only read
  flags and write single attributes.

Contract for the caller (the engine):

- ``start()`` raises :class:`AsyncLockLost` when ``fire()`` came first (the lease was lost
  before the body started): do not run the body.
- ``end()`` may raise :class:`AsyncLockLost` (the interrupt landed between the body's last
  bytecode and the cancel); that is the interrupt, handle it as one. Once ``end()`` has returned
  or raised, no interrupt of this interrupter is pending or will ever land. ``end()`` is
  idempotent: when anything else landed in the ``finally`` that calls it (a soft time limit),
  call it again.
- ``fire()`` called on the body's own thread or greenlet (a loss decided by the body itself,
  e.g. an early release when it re-sends its own task id) interrupts nothing: the body is inside
  our code at that moment, and an exception there could tear a publish in half.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from celery_lease import _forking as forking
from celery_lease._celery import pool
from celery_lease.errors import LockLostError

if TYPE_CHECKING:
    from celery_lease._celery.protocols import GeventHub, Greenlet

__all__ = ["INTERRUPT_SIGNAL", "REVOKE_GRACE", "AsyncLockLost", "Interrupter"]

logger = logging.getLogger("celery_lease.interrupt")

REVOKE_GRACE = 2.0
"""Seconds a prefork child's body has to stop after ``LockLostError`` before it is terminated."""

_RESEND_INTERVAL = 0.05
"""Seconds between copies of the interrupt signal while it is not delivered."""

INTERRUPT_SIGNAL: int | None = (
    int(signal.SIGRTMIN) + 6
    if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill")
    else None
)
"""The signal that interrupts a body in the main thread (``SIGRTMIN + 6``, 40 on Linux).

A real-time signal: billiard (``SIGUSR1`` for soft time limits) and Celery (``SIGUSR1`` stack
dumps, ``SIGUSR2`` rdb) use none, billiard's and Celery's child set-up does not reset it, and
real-time signals queue instead of coalescing. ``None`` where the platform has no real-time
signals (macOS): there the main thread is interrupted like a pool thread, when it next runs
Python bytecode, and the prefork grace period still terminates a stuck child.
"""


class AsyncLockLost(LockLostError):
    """Raised inside a body by the interrupt; turned into ``LockLostError(key, reason)``."""

    def __init__(self, key: str = "?", reason: str = "lost") -> None:
        super().__init__(key, reason)


class _SpentInterrupt(AsyncLockLost):
    """Replaces an undelivered AsyncLockLost in ``end()`` and is caught there at once."""


# The C call that raises in another thread. Arguments are built once, ahead of time: ``end()``
# calls it with no Python bytecode before it, so nothing can land there first.
_SET_ASYNC_EXC: (
    Callable[[ctypes.c_ulong, ctypes.py_object[type[BaseException]] | None], int] | None
) = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
_ASYNC_LOCK_LOST: ctypes.py_object[type[BaseException]] = ctypes.py_object(AsyncLockLost)
_SPENT: ctypes.py_object[type[BaseException]] = ctypes.py_object(_SpentInterrupt)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    """Make ``exc`` pending in thread ``thread_id`` (``None``: cancel); threads hit (0 or 1)."""
    if _SET_ASYNC_EXC is None:
        return 0
    arg = _ASYNC_LOCK_LOST if exc is AsyncLockLost else ctypes.py_object(exc) if exc else None
    return int(_SET_ASYNC_EXC(ctypes.c_ulong(thread_id), arg))


# Main thread: the runs the signal handler may interrupt. Changed by the main thread only
# (start, end, the handler itself), one C-level list operation at a time.
_main_thread_runs: list[Interrupter] = []


def _forget_main_thread_runs() -> None:
    """A forked child does not run its parent's bodies' interrupts."""
    _main_thread_runs.clear()


forking.on_fork_child(_forget_main_thread_runs, name="interrupt: main-thread runs")


def _on_interrupt_signal(signum: int, frame: types.FrameType | None) -> None:
    """:data:`INTERRUPT_SIGNAL` in the main thread: raise in the innermost lost running body.

    Runs between two bytecodes of whatever the main thread was doing, which may be ``start()``
    or ``end()`` holding an interrupter's lock: it takes no lock, reads the flags ``fire()`` set
    (under its lock, before sending the signal) and ``start()``/``end()`` set (on this thread),
    and writes single attributes. A signal with nothing due (a late one) does nothing.
    """
    for run in reversed(tuple(_main_thread_runs)):
        if run._running and run._fired and not run._delivered:
            run._delivered = True
            with contextlib.suppress(ValueError):
                _main_thread_runs.remove(run)
            raise AsyncLockLost(run.key, "revoked")


def _install_handler() -> bool:
    """Install our handler for :data:`INTERRUPT_SIGNAL` (main thread only); False if impossible."""
    if INTERRUPT_SIGNAL is None:
        return False
    current = signal.getsignal(INTERRUPT_SIGNAL)
    if current is not _on_interrupt_signal:
        if current not in (signal.SIG_DFL, signal.SIG_IGN, None):
            logger.warning(
                "celery-lease: replacing the handler %r of signal %d, which on_lost='revoke' "
                "uses to interrupt a body in the main thread",
                current,
                INTERRUPT_SIGNAL,
            )
        signal.signal(INTERRUPT_SIGNAL, _on_interrupt_signal)
    return True


def _handler_installed() -> bool:
    return INTERRUPT_SIGNAL is not None and (
        signal.getsignal(INTERRUPT_SIGNAL) is _on_interrupt_signal
    )


def _greenlet() -> types.ModuleType:
    """The ``greenlet`` module (gevent and eventlet both run on it; it ships no type stubs)."""
    return importlib.import_module("greenlet")


def _green_pool() -> str:
    """``"gevent"`` or ``"eventlet"`` when that library monkey-patched threading, else ``""``."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet"
    return ""


class Interrupter:
    """Interrupts one body (its thread, the main thread or its greenlet) once, while it runs.

    Args:
        key: the lock key (for the exception raised in the body).
        describe: a short text naming the execution, for log lines (``"name[id]"``).
    """

    def __init__(self, key: str, describe: str = "?") -> None:
        self.key = key
        self.describe = describe
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._state = "new"  # "new" -> "running" -> "ended", under _lock
        self._running = False  # the same for lock-free readers; written by the task's thread
        self._fired = False  # written under _lock
        self._delivered = False  # the handler or green callback raised it
        self._armed = False  # an async exception was set and may be pending (under _lock)
        self._mode = ""
        self._thread_id = 0
        self._c_thread_id = ctypes.c_ulong(0)
        self._greenlet: Greenlet | None = None  # set by start() under gevent and eventlet
        self._hub: GeventHub | None = None  # set by start() under gevent

    # Called in the task's thread ---------------------------------------------------------------

    def start(self) -> None:
        """Prepare the interrupt of this thread or greenlet; mark the body running.

        Raises:
            AsyncLockLost: :meth:`fire` came first (the lease is already lost): the body must
                not run.
        """
        green = _green_pool()
        self._thread_id = threading.get_ident()
        self._c_thread_id = ctypes.c_ulong(self._thread_id)
        if green:
            self._mode, self._greenlet = green, _greenlet().getcurrent()
            if green == "gevent":
                import gevent

                self._hub = gevent.get_hub()
        elif threading.current_thread() is threading.main_thread() and _install_handler():
            self._mode = "signal"
            _main_thread_runs.append(self)  # before _running: a fire() from now on is seen
        else:
            self._mode = "thread"
        with self._lock:
            if self._fired:
                self._state, self._delivered = "ended", True
                if self._mode == "signal":
                    _main_thread_runs.remove(self)
                raise AsyncLockLost(self.key, "revoked")
            self._state = "running"
            self._running = True

    def end(self) -> None:
        """The body returned or raised: cancel an interrupt not yet delivered; idempotent.

        Raises:
            AsyncLockLost: the interrupt landed here, after the body's last bytecode. After
                ``end()`` returned or raised, nothing of this interrupter lands any more.
        """
        self._running = False  # first: from here the handler and green callbacks do nothing
        if self._mode == "signal":
            with contextlib.suppress(ValueError):
                _main_thread_runs.remove(self)
        with self._lock:  # a fire() in progress finishes first; later ones see the end
            self._state = "ended"
            if self._armed:
                self._armed = False
                try:
                    # Replace a pending AsyncLockLost by a marker that lands right here. (A
                    # cancel with NULL would leave CPython's eval-breaker flag set for good, up
                    # to 3.11: every traced call then spins for ever - debuggers, coverage.)
                    # Never None here: _armed is set only where it is not (and no check may
                    # run before this call).
                    _SET_ASYNC_EXC(self._c_thread_id, _SPENT)  # type: ignore[misc]
                    for _ in range(1000):
                        pass
                    _SET_ASYNC_EXC(self._c_thread_id, None)  # type: ignore[misc]  # not reached on CPython
                except _SpentInterrupt:
                    pass
        self._ended.set()

    @property
    def fired(self) -> bool:
        """Whether an interrupt was decided for this body (raised, or cancelled by ``end()``)."""
        return self._fired

    # Called in the thread that learnt of the loss ----------------------------------------------

    def fire(self, reason: str) -> None:
        """Interrupt the body if it still runs (once); quick, never blocks or raises.

        Before :meth:`start` it makes ``start()`` raise; after :meth:`end`, and on the body's
        own thread or greenlet, it does nothing.
        """
        try:
            if self._fire(reason):
                logger.warning(
                    "celery-lease: stopping %s: its lease on %r was lost (%s)",
                    self.describe,
                    self.key,
                    reason,
                )
        except Exception:  # never into the renewer or watchdog thread
            logger.exception("celery-lease: could not interrupt %s", self.describe)

    def _fire(self, reason: str) -> bool:
        with self._lock:
            if self._fired or self._state == "ended":
                return False
            if self._state == "new":
                self._fired = True  # before start(): start() raises
                return True
            if not self._running:
                return False  # end() has begun
            if self._own_thread():
                return False
            if self._mode == "thread" or (self._mode == "signal" and not _handler_installed()):
                if _SET_ASYNC_EXC is None:
                    logger.error("celery-lease: cannot interrupt %s here", self.describe)
                    return False
                self._fired = self._armed = True
                _set_async_exc(self._thread_id, AsyncLockLost)
            elif self._mode == "signal":
                assert INTERRUPT_SIGNAL is not None
                self._fired = True
                signal.pthread_kill(self._thread_id, INTERRUPT_SIGNAL)
            elif self._mode == "gevent":
                self._fired = True
                hub = cast("GeventHub", self._hub)  # start() set it in this mode
                hub.loop.run_callback_threadsafe(self._throw_into_greenlet)
            elif self._mode == "eventlet":
                self._fired = True
                importlib.import_module("eventlet.hubs").get_hub().schedule_call_global(
                    0, self._throw_into_greenlet
                )
        if self._mode == "signal" or (self._main_thread() and pool.in_pool_child()):
            threading.Thread(target=self._watch, name="celery-lease-revoke", daemon=True).start()
        return True

    def _own_thread(self) -> bool:
        if self._mode in ("gevent", "eventlet"):
            return bool(_greenlet().getcurrent() is self._greenlet)
        return threading.get_ident() == self._thread_id

    def _main_thread(self) -> bool:
        return self._thread_id == threading.main_thread().ident

    def _throw_into_greenlet(self) -> None:
        """Hub callback (the body's greenlet is switched out): throw, unless it ended meanwhile.

        No lock: the hub runs this between the body's switches, never inside start()/end().
        """
        if not self._running or self._delivered:
            return
        self._delivered = True
        cast("Greenlet", self._greenlet).throw(AsyncLockLost(self.key, "revoked"))

    def _watch(self) -> None:
        """After fire(), until the body ends: re-send the signal while it is undelivered; in a
        prefork child, terminate the process once the body outlived :data:`REVOKE_GRACE`.

        Re-sending matters: when our signal and another one (billiard's soft time limit,
        ``SIGINT``) are handled in one go and the other handler raises, CPython (3.11) can leave
        ours pending until the next signal arrives. A late copy is harmless (nothing is due).
        """
        import time

        deadline = time.monotonic() + REVOKE_GRACE
        pool_child = self._main_thread() and pool.in_pool_child()
        while not self._ended.wait(_RESEND_INTERVAL):
            if pool_child and time.monotonic() >= deadline:
                logger.error(
                    "celery-lease: %s ignored LockLostError for %.1fs; terminating its process",
                    self.describe,
                    REVOKE_GRACE,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if self._delivered:
                if not pool_child:
                    return
            elif self._mode == "signal" and _handler_installed():
                assert INTERRUPT_SIGNAL is not None
                signal.pthread_kill(self._thread_id, INTERRUPT_SIGNAL)
