"""Stopping a body whose lease is lost (``on_lost="revoke"``), per pool.

One :class:`Interrupter` per locked execution. The task's thread calls :meth:`~Interrupter.start`
before the body and :meth:`~Interrupter.end` right after it; the thread that learns of the loss
calls :meth:`~Interrupter.fire`. What each pool does:

- prefork (a child's main thread) and solo (the main thread): ``SIGUSR1`` is sent to the main
  thread with ``signal.pthread_kill``; our handler raises ``LockLostError`` in the body at once
  (a blocking ``sleep`` or socket read is interrupted). In a prefork child, a body still running
  :data:`REVOKE_GRACE` seconds later (stuck in C code) gets its child terminated with
  ``SIGTERM``, as ``revoke(terminate=True)`` does.
- threads: ``PyThreadState_SetAsyncExc`` raises ``LockLostError`` in the task's thread when it
  next runs Python bytecode (not inside a blocking C call).
- gevent: the task's greenlet is thrown ``LockLostError`` at its next switch.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import types
from typing import Any

from celery_lease import worker as _worker
from celery_lease.errors import LockLostError

__all__ = ["REVOKE_GRACE", "AsyncLockLost", "Interrupter"]

logger = logging.getLogger(__name__)

REVOKE_GRACE = 2.0
"""Seconds a prefork child's body has to stop after ``LockLostError`` before it is terminated."""


class AsyncLockLost(LockLostError):
    """Raised inside a body by the interrupt; turned into ``LockLostError(key, reason)``."""

    def __init__(self, key: str = "?", reason: str = "lost") -> None:
        super().__init__(key, reason)


_main_thread_runs: list[Interrupter] = []
_signal_lock = threading.Lock()
_previous_sigusr1: Any = None
_our_signals = 0


def _on_sigusr1(signum: int, frame: types.FrameType | None) -> None:
    """SIGUSR1 in the main thread: raise in a lost body, or hand over to the previous handler."""
    global _our_signals
    with _signal_lock:
        ours = _our_signals > 0
        if ours:
            _our_signals -= 1
        target = next((r for r in reversed(_main_thread_runs) if r.due_interrupt()), None)
    if target is not None:
        raise AsyncLockLost(target.key, "revoked")
    if not ours and callable(_previous_sigusr1):
        _previous_sigusr1(signum, frame)


def _install_sigusr1() -> bool:
    """Install our SIGUSR1 handler (main thread only); False where that is impossible."""
    global _previous_sigusr1
    if not hasattr(signal, "pthread_kill") or not hasattr(signal, "SIGUSR1"):
        return False
    current = signal.getsignal(signal.SIGUSR1)
    if current is not _on_sigusr1:
        _previous_sigusr1 = current
        signal.signal(signal.SIGUSR1, _on_sigusr1)
    return True


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


class Interrupter:
    """Interrupts one body (its thread, main thread or greenlet) once, while it runs.

    Args:
        key: the lock key (for the exception raised in the body).
        describe: a short text naming the execution, for log lines (``"name[id]"``).
    """

    def __init__(self, key: str, describe: str = "?") -> None:
        self.key = key
        self.describe = describe
        self._lock = threading.Lock()
        self._running = False
        self._fired = False
        self._delivered = False
        self._mode = ""
        self._target: Any = None

    # Called in the task's thread ---------------------------------------------------------------

    def start(self) -> None:
        """Prepare the interrupt of this thread or greenlet; mark the body running."""
        if _gevent_patched():
            import gevent

            self._mode, self._target = "gevent", gevent.getcurrent()
        elif threading.current_thread() is threading.main_thread() and _install_sigusr1():
            self._mode, self._target = "signal", threading.main_thread().ident
            _main_thread_runs.append(self)
        else:
            self._mode, self._target = "thread", threading.get_ident()
        with self._lock:
            self._running = True

    def end(self) -> None:
        """The body returned or raised: no interrupt may land from now on."""
        with self._lock:
            self._running = False
            if self._mode == "thread" and self._fired and not self._delivered:
                self._delivered = True
                _set_async_exc(self._target, None)  # cancel it if not delivered yet
        if self._mode == "signal":
            with _signal_lock:
                if self in _main_thread_runs:
                    _main_thread_runs.remove(self)

    def due_interrupt(self) -> bool:
        """True once, when a fired interrupt should now raise in the body (signal handler)."""
        with self._lock:
            if self._running and self._fired and not self._delivered:
                self._delivered = True
                return True
            return False

    @property
    def fired(self) -> bool:
        """Whether this interrupter fired."""
        return self._fired

    # Called in the thread that learnt of the loss ----------------------------------------------

    def fire(self, reason: str) -> None:
        """Interrupt the body if it still runs (once); quick, never blocks."""
        global _our_signals
        with self._lock:
            if not self._running or self._fired:
                return
            self._fired = True
            mode, target = self._mode, self._target
        logger.warning(
            "celery-lease: stopping %s: its lease on %r was lost (%s)",
            self.describe,
            self.key,
            reason,
        )
        if mode == "thread":
            _set_async_exc(target, AsyncLockLost)
        elif mode == "signal":
            with _signal_lock:
                _our_signals += 1
            signal.pthread_kill(target, signal.SIGUSR1)
            if _worker.in_pool_child():
                threading.Thread(
                    target=self._terminate_if_stuck, name="celery-lease-revoke", daemon=True
                ).start()
        elif mode == "gevent":
            import gevent

            gevent.get_hub().loop.run_callback(self._throw_into_greenlet)

    def _throw_into_greenlet(self) -> None:
        with self._lock:
            if not self._running or self._delivered:
                return
            self._delivered = True
        self._target.throw(AsyncLockLost(self.key, "revoked"))

    def _terminate_if_stuck(self) -> None:
        import os
        import time

        deadline = time.monotonic() + REVOKE_GRACE
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return
            time.sleep(0.05)
        logger.error(
            "celery-lease: %s ignored LockLostError for %.1fs; terminating its process",
            self.describe,
            REVOKE_GRACE,
        )
        os.kill(os.getpid(), signal.SIGTERM)
