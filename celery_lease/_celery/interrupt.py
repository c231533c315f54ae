"""Stopping a body whose lease is lost (``on_lost="revoke"``), per pool: a real-time signal in
prefork and solo, ``PyThreadState_SetAsyncExc`` under threads, a greenlet throw under gevent and
eventlet. Nothing lands after :meth:`~Interrupter.end`. Locks and delivery: docs/internals.md.
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

logger = logging.getLogger("celery_lease.interrupt")

# Seconds a prefork child's body has to stop after ``LockLostError`` before it is terminated.
REVOKE_GRACE = 2.0
_RESEND_INTERVAL = 0.05  # seconds between copies of the interrupt signal while undelivered

# ``SIGRTMIN + 6`` (40 on Linux): a real-time signal, which queues instead of coalescing, that
# neither billiard (``SIGUSR1``: soft time limits) nor Celery (``SIGUSR1``, ``SIGUSR2``) uses or
# resets in a child. ``None`` without real-time signals (macOS): the main thread is then interrupted
# like a pool thread, and the prefork grace still applies.
INTERRUPT_SIGNAL: int | None = (
    int(signal.SIGRTMIN) + 6
    if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill")
    else None
)


class AsyncLockLost(LockLostError):
    """Raised inside a body by the interrupt; turned into ``LockLostError(key, reason)``."""

    def __init__(self, key: str = "?", reason: str = "lost") -> None:
        super().__init__(key, reason)


class _SpentInterrupt(AsyncLockLost):
    """Replaces an undelivered ``AsyncLockLost`` in ``end()``, caught there at once."""


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
    """Raise in the innermost lost running body of the main thread; lock-free (see the module)."""
    for run in reversed(tuple(_main_thread_runs)):
        if run._running and run._fired and not run._delivered:
            run._delivered = True
            with contextlib.suppress(ValueError):
                _main_thread_runs.remove(run)
            raise AsyncLockLost(run.key, "revoked")


def _install_handler() -> bool:
    """Install our handler (main thread only); False if the platform has no signal for it."""
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
    """The ``greenlet`` module (under gevent and eventlet; it ships no type stubs)."""
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
    """Interrupts one body once while it runs; ``describe`` names it in logs (``"name[id]"``)."""

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
        """Arm the interrupt; raise ``AsyncLockLost`` if :meth:`fire` came first."""
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
        """Cancel an undelivered interrupt (idempotent); may raise one that landed here."""
        self._running = False  # first: from here the handler and green callbacks do nothing
        if self._mode == "signal":
            with contextlib.suppress(ValueError):
                _main_thread_runs.remove(self)
        with self._lock:  # a fire() in progress finishes first; later ones see the end
            self._state = "ended"
            if self._armed:
                self._armed = False
                try:
                    # Replace a pending AsyncLockLost by a marker that lands here: a cancel with
                    # NULL leaves CPython's eval-breaker flag set for good (to 3.11), and every
                    # traced call spins. Not None: _armed implies it (no check may run first).
                    _SET_ASYNC_EXC(self._c_thread_id, _SPENT)  # type: ignore[misc]
                    for _ in range(1000):
                        pass
                    _SET_ASYNC_EXC(self._c_thread_id, None)  # type: ignore[misc]  # not reached on CPython
                except _SpentInterrupt:
                    pass
        self._ended.set()

    @property
    def fired(self) -> bool:
        """Whether an interrupt was decided (raised, or cancelled by ``end()``)."""
        return self._fired

    # Called in the thread that learnt of the loss ----------------------------------------------

    def fire(self, reason: str) -> None:
        """Interrupt the body once if it still runs; before :meth:`start`, make it raise."""
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
        """Hub callback, lock-free (between the body's switches): throw unless the body ended."""
        if not self._running or self._delivered:
            return
        self._delivered = True
        cast("Greenlet", self._greenlet).throw(AsyncLockLost(self.key, "revoked"))

    def _watch(self) -> None:
        """Re-send an undelivered signal (3.11 can drop ours); a prefork child: SIGTERM later."""
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
