"""The per-pool interrupt of ``on_lost="revoke"`` (:mod:`celery_lease._celery.interrupt`), order by
order.

The task's thread calls ``start()`` before the body and ``end()`` after it; ``fire()`` comes from
the renewer or watchdog thread at any moment. These tests force the dangerous orders on purpose:
``fire()`` deciding just as the body returns, a signal arriving at every line of ``start()`` and
``end()``, our signal and billiard's soft time limit (``SIGUSR1``) pending at the same time, and
the green pools (gevent, eventlet) in subprocesses with monkey patching.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from billiard.pool import soft_timeout_sighandler

from celery_lease._celery import interrupt
from celery_lease._celery.interrupt import AsyncLockLost, Interrupter
from tests.support import service_missing

TIMEOUT = 10.0  # real seconds a test waits for another thread at most
ROOT = Path(__file__).resolve().parents[3]
OUR_SIGNAL = interrupt.INTERRUPT_SIGNAL
"""The signal our interrupt uses in the main thread."""


def spin(rounds: int = 2000) -> None:
    """Run Python bytecode (backward jumps): a pending signal or async exception lands here."""
    for _ in range(rounds):
        pass


@pytest.fixture
def signals_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Restore SIGUSR1, our signal and the module's list of main-thread runs after the test."""
    numbers = [signal.SIGUSR1] + ([OUR_SIGNAL] if OUR_SIGNAL is not None else [])
    saved = {number: signal.getsignal(number) for number in numbers}
    monkeypatch.setattr(interrupt, "_main_thread_runs", [])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)
        for number, handler in saved.items():
            signal.signal(number, handler)


class SelfDeadlock(AssertionError):
    """A lock was acquired again by a thread that held it: with a real Lock, a hang for ever."""


class ReentryCheckingLock:
    """A Lock that raises :class:`SelfDeadlock` instead of hanging when its holder re-acquires it
    (a signal handler taking a lock that the thread it interrupted holds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._owner == threading.get_ident():
            raise SelfDeadlock("a lock was re-acquired by the thread holding it")
        got = self._lock.acquire(blocking, timeout if timeout != -1 else 2.0)
        if not got and blocking and timeout == -1:
            raise SelfDeadlock("a lock could not be acquired within 2 s (held by its waiter?)")
        if got:
            self._owner = threading.get_ident()
        return got

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def checked_interrupter(key: str = "k") -> Interrupter:
    """An Interrupter whose lock detects self-deadlock (a handler taking it)."""
    it = Interrupter(key, f"test[{key}]")
    it._lock = ReentryCheckingLock()  # type: ignore[assignment]
    return it


def handler_at_line(count: int, signum: int, call: Callable[[], None]) -> tuple[bool, Any]:
    """Run ``call()``; at the ``count``-th line run in :mod:`celery_lease._celery.interrupt`, run
    the
    handler installed for ``signum``, as if the signal arrived while the frame sits on that line
    (holding whatever locks it holds there).

    The handler runs inside the trace function and what it raises is recorded, not propagated
    (an exception raised by a trace function at a line boundary can skip a ``with`` block's
    ``__exit__``, which a real signal, handled at a call or a backward jump, never does).
    Returns whether the line was reached and what the handler raised (``None``: nothing).
    """
    seen = [0]
    result: list[Any] = [False, None]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            if seen[0] == count:
                result[0] = True
                handler = signal.getsignal(signum)
                try:
                    if callable(handler):
                        handler(signum, frame)
                except BaseException as exc:  # what the signal would raise
                    result[1] = exc
            seen[0] += 1
        return local

    def global_trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == interrupt.__file__ else None

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        call()
    finally:
        sys.settrace(previous)
    return result[0], result[1]


def deferred_kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record ``signal.pthread_kill`` calls instead of sending them."""
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(signal, "pthread_kill", lambda tid, sig: kills.append((tid, sig)))
    return kills


def fire_from_thread(it: Interrupter, reason: str = "taken") -> None:
    thread = threading.Thread(target=it.fire, args=(reason,))
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "fire() blocked"


class TestThreadsPool:
    """A body in a non-main thread: ``PyThreadState_SetAsyncExc``."""

    def test_fire_racing_the_body_exit_never_lands_after_end(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """fire() decides while the body runs, end() runs before fire() raises: after end()
        returned, nothing lands (not in the release code, the tracer or the next task)."""
        it = Interrupter("k", "test")
        about_to_raise, end_returned, raised = (threading.Event() for _ in range(3))
        real = interrupt._set_async_exc

        def late_raise(thread_id: int, exc: type[BaseException] | None) -> None:
            if exc is None:
                real(thread_id, exc)
                return
            about_to_raise.set()
            end_returned.wait(0.25)  # let end() overtake us if nothing stops it
            real(thread_id, exc)
            raised.set()

        monkeypatch.setattr(interrupt, "_set_async_exc", late_raise)
        outcome: dict[str, str] = {}

        def task_thread() -> None:
            it.start()
            firer = threading.Thread(target=it.fire, args=("taken",))
            firer.start()  # the body has just returned
            assert about_to_raise.wait(TIMEOUT)
            try:
                it.end()
                outcome["end"] = "returned"
            except AsyncLockLost:
                outcome["end"] = "raised"  # allowed: the engine handles it as the interrupt
            try:
                end_returned.set()
                raised.wait(TIMEOUT)
                spin()  # our release code, Celery's tracer, the next task on this thread
                outcome["after"] = "quiet"
            except AsyncLockLost:
                outcome["after"] = "interrupted"
            firer.join(TIMEOUT)

        thread = threading.Thread(target=task_thread)
        thread.start()
        thread.join(TIMEOUT)
        assert outcome.get("after") == "quiet", outcome
        assert outcome["end"] in {"returned", "raised"}

    def test_fire_on_the_bodys_own_thread_raises_nothing(self) -> None:
        """A loss decided on the body's own thread (an early release by ``retry()`` or
        ``apply_async`` with its own id) is not raised into the caller of fire()."""
        results: list[str] = []

        def task_thread() -> None:
            it = Interrupter("k", "test")
            it.start()
            try:
                it.fire("released")
                spin()
                it.end()
                spin()
                results.append("quiet")
            except AsyncLockLost:
                results.append("raised")

        thread = threading.Thread(target=task_thread)
        thread.start()
        thread.join(TIMEOUT)
        assert results == ["quiet"]

    def test_loss_before_start_stops_the_body_before_it_runs(self) -> None:
        """fire() before start() (the loss was recorded between acquire and the body): start()
        raises AsyncLockLost, so the body never runs on a lost lease."""
        results: list[str] = []
        it = Interrupter("k", "test")
        it.fire("expired")

        def task_thread() -> None:
            try:
                it.start()
                spin()
                results.append("body ran")
                it.end()
            except AsyncLockLost:
                results.append("stopped")

        thread = threading.Thread(target=task_thread)
        thread.start()
        thread.join(TIMEOUT)
        assert results == ["stopped"] and it.fired


class TestMainThread:
    """A body in the main thread (prefork child, solo): a signal sent with ``pthread_kill``."""

    @pytest.mark.parametrize("source", ["ours", "soft_time_limit"])
    def test_a_signal_at_any_line_of_end_never_deadlocks(
        self, source: str, monkeypatch: pytest.MonkeyPatch, signals_restored: None
    ) -> None:
        """Our signal (fire() just before end()) or billiard's soft time limit arriving at each
        line of end(): no lock taken by the handler is held by the thread it interrupted; what
        lands is the interrupt (or the soft limit) and nothing lands after end() returned."""
        signal.signal(signal.SIGUSR1, soft_timeout_sighandler)  # as billiard's child has it
        kills = deferred_kills(monkeypatch)
        expected = AsyncLockLost if source == "ours" else SoftTimeLimitExceeded
        main = threading.main_thread().ident
        assert main is not None and threading.current_thread() is threading.main_thread()
        line = 0
        while True:
            it = checked_interrupter()
            it.start()
            if source == "ours":
                fire_from_thread(it)
                assert kills, "fire() sent no signal"
                signum = kills[-1][1]
            else:
                signum = signal.SIGUSR1
            reached, raised = handler_at_line(line, signum, it.end)
            assert not isinstance(raised, SelfDeadlock), f"deadlock at line {line}: {raised}"
            assert raised is None or isinstance(raised, expected), (line, raised)
            if not reached:
                break
            late = signal.getsignal(signum)
            try:  # a late copy of the signal after end() returned: nothing may land
                if source == "ours" and callable(late):
                    late(signum, None)
            except BaseException as exc:
                pytest.fail(f"{exc!r} raised by a signal after end() (first at line {line})")
            line += 1
        assert line > 1, "the trace never reached end()"

    def test_a_signal_at_any_line_of_start_never_deadlocks(
        self, monkeypatch: pytest.MonkeyPatch, signals_restored: None
    ) -> None:
        """A soft time limit arriving at each line of start() is raised, never a deadlock."""
        signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
        main = threading.main_thread().ident
        assert main is not None
        line = 0
        while True:
            it = checked_interrupter()
            reached, raised = handler_at_line(line, signal.SIGUSR1, it.start)
            assert not isinstance(raised, SelfDeadlock), f"deadlock at line {line}: {raised}"
            assert raised is None or isinstance(raised, SoftTimeLimitExceeded), (line, raised)
            it.end()
            if not reached:
                break
            line += 1
        assert line > 1

    def test_soft_time_limit_and_pending_interrupt_both_arrive(
        self, signals_restored: None
    ) -> None:
        """A lease loss and billiard's soft time limit pending at the same time (on SIGUSR1 the
        two coalesce into one): the body gets SoftTimeLimitExceeded, and a body that goes on
        after it (cleanup) then gets the interrupt too."""
        signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
        main = threading.main_thread().ident
        assert main is not None
        blocked = {signal.SIGUSR1} | ({OUR_SIGNAL} if OUR_SIGNAL is not None else set())
        it = Interrupter("k", "test")
        it.start()
        last: BaseException | None = None
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            fire_from_thread(it)  # our signal is pending (blocked) ...
            signal.pthread_kill(main, signal.SIGUSR1)  # ... and so is the soft time limit
            try:
                try:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
                    spin()
                except SoftTimeLimitExceeded:
                    deadline = time.monotonic() + TIMEOUT
                    while time.monotonic() < deadline:  # the body's cleanup goes on
                        time.sleep(0.005)
                    raise
                finally:
                    it.end()
            except BaseException as exc:
                last = exc
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        chain = []
        while last is not None:  # the last exception, then the one it was raised while handling
            chain.append(type(last).__name__)
            last = last.__context__
        assert chain == ["AsyncLockLost", "SoftTimeLimitExceeded"], chain

    def test_coalesced_interrupts_do_not_swallow_a_later_soft_time_limit(
        self, signals_restored: None
    ) -> None:
        """Two interrupts (nested runs, both lost) whose signals coalesce: a soft time limit in a
        later task of the same process still raises SoftTimeLimitExceeded."""
        signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
        main = threading.main_thread().ident
        assert main is not None
        blocked = {signal.SIGUSR1} | ({OUR_SIGNAL} if OUR_SIGNAL is not None else set())
        outer, inner = Interrupter("outer", "test"), Interrupter("inner", "test")
        outer.start()
        inner.start()
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            fire_from_thread(inner)
            fire_from_thread(outer)
            try:
                try:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
                    spin()
                finally:
                    inner.end()
                    outer.end()
            except AsyncLockLost:
                pass
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        spin()
        with pytest.raises(SoftTimeLimitExceeded):  # the next task's soft time limit
            signal.pthread_kill(main, signal.SIGUSR1)
            spin()

    def test_fire_on_the_main_thread_itself_raises_nothing(self, signals_restored: None) -> None:
        """fire() called by the body itself (an early release on its own thread) never raises."""
        it = Interrupter("k", "test")
        it.start()
        try:
            it.fire("released")
            spin()
        finally:
            it.end()
        spin()

    def test_sigusr1_is_left_to_billiard_and_celery(self, signals_restored: None) -> None:
        """start() in the main thread does not replace SIGUSR1 (billiard's soft time limit in a
        prefork child, Celery's stack dump in a solo worker)."""
        signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
        it = Interrupter("k", "test")
        it.start()
        it.end()
        assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler

    def test_interrupt_still_arrives_when_our_handler_was_replaced(
        self, signals_restored: None
    ) -> None:
        """Someone replaced our handler while the body runs: fire() does not send a signal that
        would now be ignored or kill the process; the body is still interrupted."""
        it = Interrupter("k", "test")
        it.start()
        number = OUR_SIGNAL if OUR_SIGNAL is not None else signal.SIGUSR1
        signal.signal(number, signal.SIG_IGN)
        landed: list[str] = []
        try:
            try:
                fire_from_thread(it)
                spin(200_000)
            finally:
                it.end()
        except AsyncLockLost:
            landed.append("interrupted")
        assert landed == ["interrupted"]


GREEN_SCRIPT = """
import json, sys, time, threading
POOL = sys.argv[1]
if POOL == "gevent":
    from gevent import monkey; monkey.patch_all()
    import gevent
    spawn, sleep = gevent.spawn, gevent.sleep
else:
    import eventlet; eventlet.monkey_patch()
    spawn, sleep = eventlet.spawn, eventlet.sleep
from celery_lease._celery.interrupt import AsyncLockLost, Interrupter

def body(it, out, switches):
    try:
        it.start()
        for _ in range(switches):
            sleep(0.01)
        out.append("finished")
    except AsyncLockLost:
        out.append("interrupted")
    finally:
        try:
            it.end()
            sleep(0.05)
            out.append("quiet after end")
        except AsyncLockLost:
            out.append("landed after end")

results = {}
# 1. fired while the body runs (from another green thread, as the renewer is one)
it, out = Interrupter("k", "t"), []
g = spawn(body, it, out, 300)
sleep(0.05)
it.fire("taken")
g.join() if POOL == "gevent" else g.wait()
results["running"] = out
# 2. fired after the body's last switch, before end(): must not land after end()
it, out = Interrupter("k2", "t"), []
def fire_then_return():
    it.start()
    it.fire("taken")  # the callback is queued now; end() runs before it
    try:
        it.end()
        out.append("end returned")
    except AsyncLockLost:
        out.append("end raised")
    try:
        sleep(0.05)
        out.append("quiet after end")
    except AsyncLockLost:
        out.append("landed after end")
g = spawn(fire_then_return)
g.join() if POOL == "gevent" else g.wait()
results["at_end"] = out
print(json.dumps(results))
"""


def run_green(pool: str) -> dict[str, list[str]]:
    if importlib.util.find_spec(pool) is None:  # not imported here: eventlet warns on import
        service_missing(f"the {pool} package", f"pip install -e '.[test]' (or pip install {pool})")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(GREEN_SCRIPT), pool],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


class TestGreenPools:
    """gevent and eventlet: the body's greenlet is thrown AsyncLockLost at its next switch."""

    @pytest.mark.parametrize("pool", ["gevent", "eventlet"])
    def test_interrupt_reaches_the_greenlet_and_never_after_end(self, pool: str) -> None:
        """A loss while the body runs interrupts it at its next switch; one queued just before
        end() never lands after end() returned."""
        results = run_green(pool)
        assert results["running"] == ["interrupted", "quiet after end"], results
        assert results["at_end"][-1] == "quiet after end", results
