"""Findings of the hostile review of the lease core (issue 8), each forced on purpose.

Found (each test failed on the committed core, 4504d28 + 4285cb0):

- a malformed ``renew_many`` answer (one result short) left leases "in flight" for ever and
  dropped the loss notifications of the same batch (``TestBatchAnswer``);
- a ``BaseException`` from user code (an immediate listener calling ``sys.exit``) or from a store
  (``asyncio.CancelledError``, ``gevent.Timeout``) killed the renewer or the watchdog for good:
  no lease of the process was renewed, or reported lost on time, any more
  (``TestBaseExceptionsOnOurThreads``);
- an asynchronous exception (the ``on_lost="revoke"`` interrupt of an enclosing lease, a soft
  time limit) landing in the core's own bookkeeping of ``__enter__`` / ``__exit__`` left a lease
  renewed for ever, or a finished lease on the context's stack that a later ``lease()`` on the
  same key re-entered without holding the key; one landing inside the store's ``release`` call
  was logged as a failed release and swallowed (the interrupt is a ``LockLostError``, an
  ``Exception``), so the body ran on after its lease was lost (``TestInterruptInsideTheCore``);
- a renewal refused by the store while the body's exit waited for it was ignored: the loss was
  hidden (``lost`` False, no ``on_lost``) (``TestRefusalWhileTheExitWaits``);
- while the renewer hung in one store call, a lease added meanwhile was not watched: its loss
  was reported only at the earlier lease's deadline (``TestWatchdogDuringAHang``);
- ``KeyboardInterrupt``/``SystemExit``/``GeneratorExit`` raised in a body whose lease was lost
  left the block as ``LockLostError``, an ``Exception`` (``TestBaseExceptionThroughTheExit``);
- ``release_early(reason)`` with a reason other than ``"released"`` made a failing body's exit
  raise ``LockLostError``, against its docstring (``TestReleaseEarlyReason``);
- a ``ttl`` too short to leave any local validity was accepted (the lease was lost at birth);
  ``FakeClock.advance(nan)`` put the clock at NaN; a dispatched callback raising ``SystemExit``
  ended its thread without a log line (``TestInputAndTools``).

Tried and held (these pass on the committed core too): a fork while another thread holds the
renewer's and the dispatcher's locks; a lease taken while ``shutdown()`` stops the threads; an
immediate listener run on the body's thread by its own read of ``lost`` that uses the lease
again; ``release_early`` waiting for a renewal while the body exits.

Left open (``xfail``): an interrupt landing between a reader's record of a loss and its
notification; closing it needs the interrupter to defer delivery while the core records.

The interrupt is simulated by a ``BaseException`` raised at one chosen point of the core, on the
body's thread: that is where CPython delivers an asynchronous exception (at a call or a jump).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import celery_lease
from celery_lease import (
    Lease,
    LeaseConfigError,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    lease,
)
from celery_lease.dispatch import drain, get_dispatcher
from celery_lease.renewer import Entry, Renewer, get_renewer
from celery_lease.testing import FakeClock
from tests.adversary import AdversaryStore
from tests.unit.test_interleavings import Body

REAL = 5.0
"""Real seconds a test waits for a background thread before it fails."""

_lease_module = sys.modules["celery_lease.lease"]  # the package exports a function of that name


def wait_until(predicate: Callable[[], object], timeout: float = REAL, what: str = "") -> None:
    """Poll ``predicate`` (real time) until it is true; AssertionError after ``timeout``."""
    limit = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > limit:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.001)


class Interrupt(BaseException):
    """Stands for an asynchronous exception delivered inside the core (not an ``Exception``)."""


class FaultyBatchStore(MemoryLockStore):
    """A MemoryLockStore whose ``renew_many`` answers one result short, ``bad_batches`` times."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.bad_batches = 1
        self.batches = 0

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.batches += 1
        results = super().renew_many(items)
        if self.bad_batches > 0:
            self.bad_batches -= 1
            return results[:-1]
        return results


def valid_until(held: Lease) -> float:
    """The local validity deadline of a held lease (clock seconds)."""
    assert held._entry is not None
    return held._entry.valid_until


def closed(held: Lease) -> bool:
    """Whether the end of ``held`` is recorded (finished or lost)."""
    assert held._entry is not None
    return held._entry.closed


class TestBatchAnswer:
    def test_a_short_renew_many_answer_is_an_error_of_the_whole_batch(
        self, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """One result short: no lease stays "in flight", none is decided on it, renewal goes on."""
        store = FaultyBatchStore(clock)
        lost: list[str] = []
        with (
            caplog.at_level(logging.WARNING, logger="celery_lease"),
            lease("a", store=store, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.key)) as a,
            lease("b", store=store, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.key)) as b,
        ):
            store.force_release("a")  # the batch's answer for a would be False
            store.acquire("a", "another-owner", 60_000)  # taken, not just freed
            clock.advance(1.0)
            wait_until(lambda: store.batches >= 1, what="the first batch")
            entries = [held._entry for held in (a, b)]
            wait_until(lambda: not any(e.inflight for e in entries if e), what="answered")
            assert any("2 leases" in r.getMessage() for r in caplog.records), caplog.text
            clock.advance(0.2)  # the retry: a well-formed answer this time
            wait_until(lambda: a.lost, what="a reported taken")
            assert a.lost_reason == "taken"
            assert drain() and lost == ["a"], "the loss of a must reach its listeners"
            assert not b.lost
            renewed_at = valid_until(b)
            clock.advance(1.0)
            wait_until(lambda: valid_until(b) > renewed_at, what="b renewed again")
            assert not b.lost


class ExitingStore(MemoryLockStore):
    """A MemoryLockStore whose next ``renew`` raises ``error`` (a ``BaseException``)."""

    def __init__(self, clock: FakeClock, error: BaseException) -> None:
        super().__init__(clock=clock)
        self.error: BaseException | None = error
        self.renewals = 0

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        self.renewals += 1
        error, self.error = self.error, None
        if error is not None:
            raise error
        return super().renew(key, owner, ttl_ms)


class TestBaseExceptionsOnOurThreads:
    def test_an_immediate_listener_calling_sys_exit_does_not_stop_renewal(
        self, clock: FakeClock
    ) -> None:
        """SystemExit from a listener on the renewer: the other lease is still renewed."""
        store = MemoryLockStore(clock=clock)
        with lease("b", store=store, ttl=3, clock=clock) as b:
            with lease("a", store=store, ttl=3, clock=clock) as a:
                a.add_loss_listener(lambda _: sys.exit("listener gives up"), immediate=True)
                store.force_release("a")
                clock.advance(1.0)
                wait_until(lambda: closed(a), what="a recorded lost")
            renewer = get_renewer(clock)
            wait_until(lambda: clock.sleepers >= 1, what="the renewer waits again")
            assert renewer.thread is not None and renewer.thread.is_alive(), "renewer died"
            for _ in range(3):
                before = valid_until(b)
                clock.advance(1.0)
                wait_until(lambda: valid_until(b) > before, what="b renewed")  # noqa: B023
            assert not b.lost and store.get("b") is not None

    def test_a_store_raising_a_base_exception_is_a_failed_renewal(self, clock: FakeClock) -> None:
        """A renew raising a BaseException (CancelledError, gevent.Timeout) is retried."""
        store = ExitingStore(clock, Interrupt("cancelled inside the driver"))
        with lease("k", store=store, ttl=3, clock=clock) as held:
            clock.advance(1.0)
            wait_until(lambda: store.renewals >= 1, what="the first renewal")
            renewer = get_renewer(clock)
            wait_until(lambda: clock.sleepers >= 1, what="the renewer waits again")
            assert renewer.thread is not None and renewer.thread.is_alive(), "renewer died"
            assert held._entry is not None and not held._entry.inflight
            clock.advance(0.2)  # the retry delay of a 3 s lease
            wait_until(lambda: store.renewals >= 2, what="the retry")
            assert not held.lost

    def test_an_immediate_listener_calling_sys_exit_on_the_watchdog(self, clock: FakeClock) -> None:
        """SystemExit from a listener run by the watchdog: the next hang is still watched."""
        inner = MemoryLockStore(clock=clock)
        store = AdversaryStore(inner)
        first = store.trap("renew", delay="before")
        with lease("a", store=store, ttl=3, clock=clock) as a:
            a.add_loss_listener(lambda _: sys.exit("listener gives up"), immediate=True)
            clock.advance(1.0)
            first.wait_entered()
            clock.wait_for_sleepers(1)  # the watchdog waits for a's validity
            clock.advance(2.0)
            wait_until(lambda: closed(a), what="the watchdog recorded a")
            first.open()
            first.wait_done()
        second = store.trap("renew", delay="before")
        with lease("b", store=store, ttl=3, clock=clock) as b:
            clock.advance(1.0)
            second.wait_entered()
            try:
                # A watchdog waits for b's validity deadline (not merely for the next store call).
                wait_until(lambda: clock._deadlines, what="a watchdog waiting for b's deadline")
                clock.advance(2.0)
                wait_until(lambda: closed(b), timeout=2.0, what="b recorded lost")
                assert b.lost_reason == "expired"
            finally:
                second.open()


class AsyncLockLostStandIn(LockLostError):
    """Stands for the Celery layer's ``AsyncLockLost``: a ``LockLostError``, so an ``Exception``."""

    def __init__(self) -> None:
        super().__init__("outer", "revoked")


class OnceRaisingRelease(MemoryLockStore):
    """A MemoryLockStore whose next ``release`` raises ``error`` before its effect."""

    def __init__(self, clock: FakeClock, error: type[BaseException]) -> None:
        super().__init__(clock=clock)
        self.error = error
        self.armed = False
        self.releases = 0

    def release(self, key: str, owner: str) -> None:
        self.releases += 1
        if self.armed:
            self.armed = False
            raise self.error()
        super().release(key, owner)


def renewed_keys(clock: FakeClock) -> list[str]:
    """The keys the renewer of ``clock`` still renews."""
    return get_renewer(clock).held_keys()


class TestInterruptInsideTheCore:
    """An asynchronous exception lands in ``lease()``'s own bookkeeping on the body's thread."""

    def test_after_the_acquire_nothing_stays_held_or_renewed(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised between the acquire and the frame push: the lease is ended, not leaked."""
        store = MemoryLockStore(clock=clock)
        frame = _lease_module._Frame

        def interrupted(held: Lease, parent: Any) -> Any:
            monkeypatch.setattr(_lease_module, "_Frame", frame)
            raise Interrupt("delivered in __enter__")

        monkeypatch.setattr(_lease_module, "_Frame", interrupted)
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock):
            pytest.fail("the body must not run")  # pragma: no cover
        assert renewed_keys(clock) == [], "the lease is renewed for ever"
        assert store.get("k") is None, "the key stays taken"
        assert _lease_module.current_lease() is None

    def test_inside_the_end_record_the_lease_still_ends(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised inside Renewer.remove (under its lock): not renewed, released, not re-entered."""
        store = MemoryLockStore(clock=clock)
        overdue = Entry.overdue
        armed = threading.Event()

        def interrupted(entry: Entry, now: float) -> str | None:
            if armed.is_set() and threading.current_thread() is threading.main_thread():
                armed.clear()
                raise Interrupt("delivered in Renewer.remove")
            return overdue(entry, now)

        monkeypatch.setattr(Entry, "overdue", interrupted)
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock):
            armed.set()
        assert renewed_keys(clock) == [], "the lease is renewed for ever"
        assert store.get("k") is None, "the key stays taken"
        assert _lease_module.current_lease() is None

    @pytest.mark.parametrize("error", [Interrupt, AsyncLockLostStandIn])
    def test_inside_the_release_call_it_propagates_and_the_key_is_freed(
        self, clock: FakeClock, error: type[BaseException]
    ) -> None:
        """Raised inside the store's release: it is not logged away as a store error (the body
        must stop), and the exit sends the release again (owner-checked)."""
        store = OnceRaisingRelease(clock, error)
        with pytest.raises(error), lease("k", store=store, ttl=3, clock=clock):
            store.armed = True
        assert renewed_keys(clock) == []
        assert store.get("k") is None, "the key stays taken for a ttl"
        assert store.releases == 2

    def test_inside_an_early_release_it_propagates_and_the_key_is_freed(
        self, clock: FakeClock
    ) -> None:
        """The same inside release_early: raised, and the key freed anyway."""
        store = OnceRaisingRelease(clock, AsyncLockLostStandIn)
        context = lease("k", store=store, ttl=3, clock=clock)
        with context:
            store.armed = True
            with pytest.raises(AsyncLockLostStandIn):
                context.release_early()
            assert store.get("k") is None, "the key stays taken for a ttl"
        assert renewed_keys(clock) == []

    def test_a_finished_lease_left_on_the_stack_is_never_re_entered(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised before the frame is popped: a later lease() on the key acquires afresh."""
        store = MemoryLockStore(clock=clock)
        pop = _lease_module._pop

        def interrupted(held: Lease) -> None:
            monkeypatch.setattr(_lease_module, "_pop", pop)
            raise Interrupt("delivered before the pop")

        monkeypatch.setattr(_lease_module, "_pop", interrupted)
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock) as first:
            pass
        assert store.acquire("k", "intruder", 60_000) is not None, "the first lease was ended"
        with (
            pytest.raises(LockNotAcquiredError),
            lease("k", store=store, ttl=3, clock=clock, wait=0) as second,
        ):
            pytest.fail(f"re-entered {second!r} (same: {second is first}) while O holds k")
        assert _lease_module.current_lease() is None

    def test_a_finished_frame_is_not_re_entered_even_if_still_on_the_stack(
        self, clock: FakeClock
    ) -> None:
        """Defence in depth: a closed lease found on the stack is skipped by re-entry."""
        store = MemoryLockStore(clock=clock)
        context = lease("k", store=store, ttl=3, clock=clock)
        token = _lease_module._current.set(None)
        try:
            stale = context.__enter__()
            context.__exit__(None, None, None)
            _lease_module._current.set(_lease_module._Frame(stale, None))  # left behind
            assert store.acquire("k", "intruder", 60_000) is not None
            with pytest.raises(LockNotAcquiredError), lease("k", store=store, clock=clock):
                pytest.fail("re-entered a finished lease")  # pragma: no cover
        finally:
            _lease_module._current.reset(token)


class TestRefusalWhileTheExitWaits:
    def test_a_refusal_answered_during_the_exit_wait_is_a_loss(self, clock: FakeClock) -> None:
        """The renewal in flight answers False while the exit waits for it: lost, "taken"."""
        inner = MemoryLockStore(clock=clock)
        store = AdversaryStore(inner)
        lost: list[str | None] = []
        trap = store.trap("renew", delay="after")
        body = Body(
            lambda: lease(
                "k", store=store, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.lost_reason)
            )
        )
        inner.force_release("k")
        intruder = inner.acquire("k", "intruder", 60_000)
        clock.advance(1.0)
        trap.wait_entered()  # the store answered False; the reply is on its way
        clock.wait_for_sleepers(1)  # the watchdog waits for the validity deadline
        body.exit()
        wait_until(lambda: not body.thread.is_alive() or clock.sleepers > 1, what="exit waits")
        trap.open()
        body.join()
        assert body.error is None
        held = body.held
        assert held is not None and held.lost_reason == "taken", "the refusal was hidden"
        assert drain() and lost == ["taken"]
        info = inner.get("k")
        assert info is not None and info.owner == "intruder" and info.token == intruder

    def test_a_body_error_after_a_refusal_during_the_wait_is_lock_lost(
        self, clock: FakeClock
    ) -> None:
        """The same, with a body that failed: the exit raises LockLostError chained to it."""
        inner = MemoryLockStore(clock=clock)
        store = AdversaryStore(inner)
        trap = store.trap("renew", delay="after")
        body = Body(
            lambda: lease("k", store=store, ttl=3, clock=clock),
            raise_in_body=ValueError("the write failed"),
        )
        inner.force_release("k")
        clock.advance(1.0)
        trap.wait_entered()
        clock.wait_for_sleepers(1)
        body.exit()
        wait_until(lambda: not body.thread.is_alive() or clock.sleepers > 1, what="exit waits")
        trap.open()
        body.join()
        assert isinstance(body.error, LockLostError) and body.error.reason == "taken"
        assert isinstance(body.error.__cause__, ValueError)


class TestInputAndTools:
    @pytest.mark.parametrize("ttl", [0.001, "2ms", 0.002])
    def test_a_ttl_that_leaves_no_validity_is_refused(self, ttl: object) -> None:
        """A ttl within the drift margin would be lost the moment it is acquired: refused."""
        with pytest.raises(LeaseConfigError, match=r"ttl=.* must be more than 2\.\d+ ms"):
            lease("k", store=MemoryLockStore(), ttl=ttl)

    def test_the_shortest_ttl_accepted_is_held_when_acquired(self, clock: FakeClock) -> None:
        """Just above the margin, a lease is held (not lost) right after the acquire."""
        store = MemoryLockStore(clock=clock)
        with lease("k", store=store, ttl="3ms", clock=clock) as held:
            assert not held.lost

    @pytest.mark.parametrize("step", [math.nan, math.inf, -1.0])
    def test_fake_clock_refuses_a_step_that_is_not_a_finite_forward_one(self, step: float) -> None:
        """NaN would make every deadline comparison false; inf breaks tokens; back is refused."""
        clock = FakeClock(5.0)
        with pytest.raises(ValueError, match="seconds="):
            clock.advance(step)
        assert clock.monotonic() == 5.0

    def test_a_dispatched_callback_raising_system_exit_is_logged(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """SystemExit in a callback is logged like any error, and the next callback runs."""
        ran = threading.Event()
        with caplog.at_level(logging.ERROR, logger="celery_lease"):
            get_dispatcher().submit(lambda _: sys.exit(3), None, "callback that exits")
            get_dispatcher().submit(lambda _: ran.set(), None, "next callback")
            assert drain() and ran.wait(REAL)
        assert any("callback that exits" in r.getMessage() for r in caplog.records), caplog.text


class TestReleaseEarlyReason:
    def test_a_custom_reason_does_not_turn_the_body_error_into_lock_lost(
        self, clock: FakeClock
    ) -> None:
        """After release_early("handed-over") the exit raises nothing of its own, as documented."""
        store = MemoryLockStore(clock=clock)
        context = lease("k", store=store, ttl=3, clock=clock)
        with pytest.raises(KeyError), context as held:
            assert context.release_early("handed-over") is True
            assert held.lost_reason == "handed-over"
            raise KeyError("the body fails on its own")

    def test_a_loss_before_the_early_release_still_chains_the_body_error(
        self, clock: FakeClock
    ) -> None:
        """Lost ("taken") first: release_early records nothing; a body error is LockLostError."""
        store = MemoryLockStore(clock=clock)
        context = lease("k", store=store, ttl=3, clock=clock)
        with pytest.raises(LockLostError, match="taken"), context as held:
            store.force_release("k")
            store.acquire("k", "another-owner", 60_000)  # taken, not just freed
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert context.release_early("handed-over") is False
            raise KeyError("the body fails on its own")


class TestWatchdogDuringAHang:
    def test_a_lease_added_while_the_renewer_hangs_is_watched(self, clock: FakeClock) -> None:
        """R hangs renewing a (ttl 30 s, one blackholed connection); b (ttl 3 s, another
        store) is acquired meanwhile: W reports b lost when b's validity passes, not at a's."""
        slow = AdversaryStore(MemoryLockStore(clock=clock))
        fast = MemoryLockStore(clock=clock)
        trap = slow.trap("renew", delay="before")
        lost: list[str] = []
        with lease("a", store=slow, ttl=30, clock=clock):
            clock.advance(10.0)
            trap.wait_entered()
            wait_until(lambda: clock._deadlines, what="W waiting for a's deadline")
            try:
                with lease(
                    "b", store=fast, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.key)
                ):
                    wait_until(lambda: any(d < 1020 for d in clock._deadlines), what="W counts b")
                    clock.advance(3.0)  # past b's validity, long before a's
                    wait_until(lambda: lost, timeout=2.0, what="b reported lost by W")
            finally:
                trap.open()
        assert lost == ["b"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
class TestForkWhileLocked:
    def test_a_child_forked_while_the_renewer_lock_is_held_never_blocks(self) -> None:
        """Fork while another thread holds the renewer's lock and the dispatcher's: the child
        uses the parent's Lease objects and leases of its own without touching either lock."""
        store = MemoryLockStore()
        context = lease("k", store=store, ttl=30)
        parent = context.__enter__()
        assert parent._entry is not None and parent._entry.renewer is not None
        locks = (parent._entry.renewer._lock, get_dispatcher()._cond)
        holding, release = threading.Event(), threading.Event()

        def hold_locks() -> None:
            with locks[0], locks[1]:
                holding.set()
                release.wait(REAL)

        holder = threading.Thread(target=hold_locks)
        holder.start()
        assert holding.wait(REAL)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            status = 1
            try:
                seen: list[object] = [parent.lost, parent.lost_reason]
                called: list[str] = []
                parent.add_loss_listener(lambda h: called.append("now"), immediate=True)
                seen += [called, parent.wait_lost(0), context.release_early()]
                context.__exit__(None, None, None)
                with lease("k", store=MemoryLockStore(), ttl=30) as mine:
                    seen.append(mine is not parent and not mine.lost)
                celery_lease.shutdown(timeout=2.0)
                os.write(write, json.dumps(seen).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        try:
            limit = time.monotonic() + REAL
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > limit:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pytest.fail("the child blocked on a lock held at the fork")
                time.sleep(0.005)
            assert os.waitstatus_to_exitcode(done[1]) == 0
            report = json.loads(os.read(read, 65536))
        finally:
            os.close(read)
            release.set()
            holder.join(REAL)
            context.__exit__(None, None, None)
        assert report == [True, "forked", ["now"], True, False, True]
        assert store.get("k") is None


class TestShutdownRace:
    def test_a_lease_taken_while_shutdown_stops_the_threads_is_still_renewed(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A lease acquired between shutdown()'s check and its stop: renewed all the same."""
        store = MemoryLockStore(clock=clock)
        with lease("warm-up", store=store, ttl=3, clock=clock):
            pass  # the renewer of this clock runs (idle)
        entered, leave = threading.Event(), threading.Event()
        holder: list[Lease] = []

        def body() -> None:
            with lease("k", store=store, ttl=3, clock=clock) as held:
                holder.append(held)
                entered.set()
                leave.wait(REAL)

        original = Renewer._stop
        thread = threading.Thread(target=body)

        def stop_after_a_new_lease(self: Renewer) -> list[threading.Thread]:
            if not thread.is_alive():
                thread.start()
                assert entered.wait(REAL)
            return original(self)

        monkeypatch.setattr(Renewer, "_stop", stop_after_a_new_lease)
        try:
            with pytest.raises(TimeoutError, match="celery-lease-renewer"):
                celery_lease.shutdown(timeout=0.2)
            (held,) = holder
            for _ in range(3):
                before = valid_until(held)
                clock.advance(1.0)
                wait_until(lambda: valid_until(held) > before, what="k renewed")  # noqa: B023
            assert not held.lost
        finally:
            leave.set()
            thread.join(REAL)


class TestImmediateListenerOnTheBodyThread:
    def test_a_listener_run_by_a_lost_read_may_use_the_lease_again(self, clock: FakeClock) -> None:
        """The body's own read records the loss; its immediate listener (same thread) reads
        lost, check()s, adds a listener and releases early: no deadlock, one notification."""
        store = MemoryLockStore(clock=clock)
        seen: list[object] = []
        context = lease("k", store=store, ttl=3, clock=clock)

        def listener(held: Lease) -> None:
            seen.append(threading.current_thread() is threading.main_thread())
            seen.append((held.lost, held.lost_reason))
            with pytest.raises(LockLostError):
                held.check()
            held.add_loss_listener(lambda h: seen.append("nested"), immediate=True)
            seen.append(context.release_early())

        with context as held:
            held.add_loss_listener(listener, immediate=True)
            assert held._entry is not None
            # Validity runs out with R asleep until its due time and W idle (no store call):
            # this read is the first to see it, and records the loss on the body's thread.
            held._entry.valid_until = clock.monotonic()
            assert held.lost
            assert len(seen) == 4, "the listener ran inside the read"
        assert seen == [True, (True, "expired"), "nested", False]
        assert store.get("k") is None


class TestReleaseEarlyVsExit:
    def test_exit_during_an_early_release_waiting_for_a_renewal(self, clock: FakeClock) -> None:
        """X's release_early waits for R's renewal in flight while B exits (cooldown 1 h): one
        release, no cooldown, "released" told once, and the late renewal revives nothing."""
        inner = MemoryLockStore(clock=clock)
        store = AdversaryStore(inner)
        trap = store.trap("renew", delay="before")
        lost: list[str | None] = []
        context = lease(
            "k",
            store=store,
            ttl=3,
            cooldown="1h",
            clock=clock,
            on_lost=lambda h: lost.append(h.lost_reason),
        )
        held = context.__enter__()
        clock.advance(1.0)
        trap.wait_entered()
        clock.wait_for_sleepers(1)
        result: list[bool] = []
        early = threading.Thread(target=lambda: result.append(context.release_early()))
        early.start()
        wait_until(lambda: clock.sleepers > 1, what="release_early waiting for the renewal")
        context.__exit__(None, None, None)  # B leaves while X still waits
        assert inner.get("k") is None, "B's exit releases (the lease is lost: no cooldown)"
        trap.open()
        early.join(REAL)
        assert result == [True] and held.lost_reason == "released"
        assert inner.get("k") is None, "the late renewal finds no lease of this owner"
        assert all(args[2] != 3_600_000 for args in store.calls("renew")), "no cooldown"
        assert len(store.calls("release")) == 1
        assert drain() and lost == ["released"]


@pytest.mark.xfail(
    strict=True,
    reason="Residual window, not closable in pure Python inside the core: an asynchronous"
    " exception landing between the body thread's record of a loss (its read of `lost`) and"
    " the notification skips on_lost for good. Fix: interrupt.py defers delivery while the"
    " target thread is inside the core's record-and-notify sections (a per-thread depth the"
    " core keeps; the signal handler and fire() check it, the resend thread retries).",
)
def test_an_interrupt_between_a_readers_record_and_its_notification(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body's read records "expired"; an interrupt lands before it notifies: on_lost?"""
    store = MemoryLockStore(clock=clock)
    lost: list[str | None] = []
    notify = Renewer._notify
    armed = threading.Event()

    def interrupted(entry: Entry, reason: str) -> None:
        if armed.is_set() and threading.current_thread() is threading.main_thread():
            armed.clear()
            raise Interrupt("delivered before the notification")
        notify(entry, reason)

    monkeypatch.setattr(Renewer, "_notify", staticmethod(interrupted))
    with (
        pytest.raises(Interrupt),
        lease(
            "k", store=store, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.lost_reason)
        ) as held,
    ):
        assert held._entry is not None
        held._entry.valid_until = clock.monotonic()  # only this read sees the lapse
        armed.set()
        held.check()
    assert drain() and lost == ["expired"]


class TestBaseExceptionThroughTheExit:
    @pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit, Interrupt])
    def test_a_base_exception_after_a_loss_is_not_turned_into_lock_lost(
        self, clock: FakeClock, error: type[BaseException]
    ) -> None:
        """Ctrl-C (or SystemExit, GeneratorExit) in a body whose lease was lost stays what it
        is: a LockLostError (an Exception) would let ``except Exception`` swallow it."""
        store = MemoryLockStore(clock=clock)
        with pytest.raises(error), lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            raise error()
