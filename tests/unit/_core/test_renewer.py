"""The renewer: every ttl/3, retries while valid, reports loss once, one thread, fork-safe."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import celery_lease
from celery_lease import Lease, MemoryLockStore, lease
from celery_lease._core import renewer as renewer_module
from celery_lease._core.dispatch import drain, get_dispatcher
from celery_lease._core.renewer import IDLE_EXIT, Entry, Renewer, get_renewer, renewers, validity
from celery_lease.testing import FakeClock
from tests.adversary import AdversaryStore
from tests.unit.conftest import (
    REAL_TIMEOUT,
    SpyStore,
    held_entry,
    let_idle_exit,
    renewer_thread_after_one_lease,
)
from tests.unit.core_faults import REAL, GatedRenewalStore, Interrupt, churn, poll_until


class TestSchedule:
    def test_first_renewal_is_due_at_a_third_of_the_ttl(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A lease acquired at t is due for renewal at t + ttl/3."""
        with lease("k", store=store, ttl=3, clock=clock) as held:
            assert held._entry is not None
            assert held._entry.due == pytest.approx(held.acquired_at + 1.0)
            assert held._entry.valid_until == pytest.approx(validity(held.acquired_at, 3))

    def test_renews_every_third_of_the_ttl(self, store: SpyStore, clock: FakeClock) -> None:
        """Advancing the clock by ttl/3 three times yields three renewals, at those times."""
        start = clock.monotonic()
        with lease("k", store=store, ttl=3, clock=clock) as held:
            for n in range(1, 4):
                clock.advance(1.0)
                store.wait_renewals(n)
            assert [t - start for _, t in store.renewals] == pytest.approx([1.0, 2.0, 3.0])
            assert not held.lost

    def test_long_job_keeps_its_lease(self, store: SpyStore, clock: FakeClock) -> None:
        """Ten ttls of work, renewed on time, never lose the lease."""
        with lease("k", store=store, ttl=3, clock=clock) as held:
            for n in range(1, 31):
                clock.advance(1.0)
                store.wait_renewals(n)
            assert not held.lost
            assert store.get("k") is not None


class TestFailures:
    def test_store_error_is_retried_while_valid(self, store: SpyStore, clock: FakeClock) -> None:
        """A renewal that fails with a store error is retried, and the lease survives."""
        store.fail_renewals = 2
        with lease("k", store=store, ttl=3, clock=clock) as held:
            clock.advance(1.0)
            store.wait_renewals(1)
            clock.advance(0.2)
            store.wait_renewals(2)
            clock.advance(0.2)
            store.wait_renewals(3)
            assert not held.lost
            assert held._entry is not None
            assert held._entry.due == pytest.approx(clock.monotonic() + 1.0)

    def test_running_out_of_validity_loses_the_lease(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Renewals that keep failing end in loss ('expired') before the ttl is over."""
        store.fail_forever = True
        lost = threading.Event()
        with lease("k", store=store, ttl=3, clock=clock, on_lost=lambda _: lost.set()) as held:
            ttl_over = held.acquired_at + 3.0

            def next_retry() -> float | None:
                due = [d for d in clock._deadlines if clock.monotonic() < d < ttl_over]
                return min(due) if due else None

            # Time moves from one deadline to the next, never to the end of the ttl: the renewer
            # (or its watchdog, not this thread: ``closed`` only reads) must record the loss
            # before. ``held.lost`` would record an overdue loss itself.
            while not closed(held):
                poll_until(
                    lambda: closed(held) or next_retry() is not None,
                    timeout=REAL_TIMEOUT,
                    what="a renewal retry due before the ttl is over, or the loss recorded",
                )
                if not closed(held):
                    clock.advance_to_next_deadline()
            assert held.lost_reason == "expired"
            assert clock.monotonic() < ttl_over
            assert lost.wait(REAL_TIMEOUT)  # on_lost runs on the dispatcher, in real time

    def test_on_lost_runs_exactly_once(self, store: SpyStore, clock: FakeClock) -> None:
        """However long it stays lost, on_lost is called once."""
        calls: list[Lease] = []
        with lease("k", store=store, ttl=3, clock=clock, on_lost=calls.append) as held:
            store.force_release("k")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            for _ in range(5):
                clock.advance(1.0)
        assert drain(), "on_lost runs on the dispatcher: wait for it"
        assert calls == [held]

    def test_on_lost_that_raises_does_not_break_renewal(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A failing on_lost callback is logged; other leases keep being renewed."""

        def explode(_: Lease) -> None:
            raise RuntimeError("callback bug")

        with (
            lease("a", store=store, ttl=3, clock=clock, on_lost=explode) as a,
            lease("b", store=store, ttl=3, clock=clock) as b,
        ):
            store.force_release("a")
            clock.advance(1.0)
            assert a.wait_lost(REAL_TIMEOUT)
            clock.advance(1.0)
            store.wait_renewals(3)
            assert not b.lost

    def test_max_hold_stops_renewal(self, store: SpyStore, clock: FakeClock) -> None:
        """After max_hold the lease is reported lost ('max_hold') and no longer renewed."""
        with lease("k", store=store, ttl=3, max_hold=2, clock=clock) as held:
            clock.advance(1.0)
            store.wait_renewals(1)
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "max_hold"
            assert held._entry is not None and held._entry.closed
            assert len(get_renewer(clock, store)) == 0, "the renewer no longer holds it"
        assert store.get("k") is None, "a lease over max_hold is still ours to release"


class TestHangingStore:
    def test_loss_is_reported_while_a_renewal_hangs(self, clock: FakeClock) -> None:
        """A renewal stuck in the store does not delay the loss report past validity."""
        release_the_call = threading.Event()
        entered = threading.Event()

        class Hanging(SpyStore):
            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                entered.set()
                release_the_call.wait(REAL_TIMEOUT)
                return False

        store = Hanging(clock)
        lost = threading.Event()
        try:
            with lease("k", store=store, ttl=3, clock=clock, on_lost=lambda _: lost.set()) as held:
                clock.advance(1.0)
                assert entered.wait(REAL_TIMEOUT)
                clock.wait_for_sleepers(1)  # the watchdog waits for the validity deadline
                clock.advance(1.99)  # validity is 3 s less 1 % and 2 ms: 2.968 s
                assert lost.wait(REAL_TIMEOUT), "loss must be reported while renew() hangs"
                assert held.lost_reason == "expired"
                assert clock.monotonic() - held.acquired_at < 3.0
        finally:
            release_the_call.set()


class TestScale:
    def test_one_thread_renews_many_leases_in_batches(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """200 leases are renewed by one thread (plus the I/O-free watchdog), one batch a sweep."""
        before = set(threading.enumerate())
        contexts = [lease(f"k{i}", store=store, ttl=3, clock=clock) for i in range(200)]
        held = [c.__enter__() for c in contexts]
        try:
            clock.advance(1.0)
            store.wait_renewals(200)
            renewer = get_renewer(clock, store)
            started = set(threading.enumerate()) - before
            assert started == {renewer.thread, renewer.watchdog}
            assert len(get_renewer(clock, store)) == 200
            assert store.batches == [200]
            assert not any(h.lost for h in held)
        finally:
            for c in contexts:
                c.__exit__(None, None, None)
        assert len(get_renewer(clock, store)) == 0

    def test_thread_is_reused_then_exits_when_idle(self, store: SpyStore, clock: FakeClock) -> None:
        """Leases taken one after another share one thread; it ends after IDLE_EXIT idle."""
        with lease("k", store=store, ttl=3, clock=clock):
            thread = get_renewer(clock, store).thread
            assert thread is not None and thread.is_alive()
        for _ in range(3):
            with lease("k", store=store, ttl=3, clock=clock):
                assert get_renewer(clock, store).thread is thread
        clock.advance(IDLE_EXIT - 1)
        assert thread.is_alive()
        clock.advance(1.0)
        thread.join(REAL_TIMEOUT)
        assert not thread.is_alive()
        assert get_renewer(clock, store).thread is None

    def test_a_renewer_idled_out_and_added_to_again_is_registered_again(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A caller that looked the renewer up just before its idle exit adds to it after: the
        renewer starts again, is the store's renewer again, and renews the lease."""
        renewer = get_renewer(clock, store)
        let_idle_exit(renewer_thread_after_one_lease(renewer, store, clock), clock)
        assert renewer not in renewers(clock), "an idle renewer leaves the registry"
        entry = held_entry(store, clock)
        renewer.add(entry)
        try:
            assert get_renewer(clock, store) is renewer
            clock.advance(1.0)
            store.wait_renewals(1)
            assert store.renewals[-1][0] == "late"
        finally:
            renewer.remove(entry)

    def test_a_lease_added_to_a_renewer_replaced_since_goes_to_its_successor(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A caller looked the renewer up just before its idle exit; another thread then made
        the store's next renewer and added a lease; the first caller's add goes to that one:
        one store, one renewer thread."""
        stale = get_renewer(clock, store)
        let_idle_exit(renewer_thread_after_one_lease(stale, store, clock), clock)
        with lease("other", store=store, ttl=3, clock=clock):
            current = get_renewer(clock, store)
            assert current is not stale
            entry = held_entry(store, clock)
            stale.add(entry)
            try:
                assert entry.renewer is current, "the store has two renewers"
                assert stale.thread is None
                assert [r for r in renewers(clock) if r.store is store] == [current]
                clock.advance(1.0)
                store.wait_renewals(2)
                assert sorted(key for key, _ in store.renewals) == ["late", "other"]
            finally:
                current.remove(entry)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
class TestFork:
    def test_child_never_renews_the_parents_leases(self, store: SpyStore, clock: FakeClock) -> None:
        """After fork, the child's renewer starts empty and renews only its own leases."""
        read, write = os.pipe()
        with lease("parent-key", store=store, ttl=3, clock=clock):
            assert len(get_renewer(clock, store)) == 1
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
                signal.alarm(60)  # a child that hangs dies instead of outliving the test
                status = 1
                try:
                    inherited = len(get_renewer(clock, store))
                    with lease("child-key", store=store, ttl=3, clock=clock) as mine:
                        renewer = get_renewer(clock, store)
                        own = len(renewer)
                        alive = renewer.thread is not None and renewer.thread.is_alive()
                        clock.advance(1.0)
                        store.wait_renewals(1)
                        keys = {k for k, _ in store.renewals}
                        ok = not mine.lost
                    os.write(write, f"{inherited} {own} {alive} {sorted(keys)} {ok}".encode())
                    status = 0
                finally:
                    os._exit(status)
            os.close(write)
            _, status = os.waitpid(pid, 0)
            report = os.read(read, 1000).decode()
            os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0, report
        assert report == "0 1 True ['child-key'] True"


def wait_until(predicate: Callable[[], object], timeout: float = REAL_TIMEOUT) -> bool:
    """Poll ``predicate`` (real time) until it is true; returns whether it became true."""
    limit = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > limit:
            return False
        time.sleep(0.001)
    return True


def lease_threads() -> list[threading.Thread]:
    """The core's threads alive now (renewers, watchdogs, dispatcher)."""
    prefixes = ("celery-lease-renewer", "celery-lease-watchdog", "celery-lease-dispatch")
    return [t for t in threading.enumerate() if t.name.startswith(prefixes) and t.is_alive()]


class TestDispatch:
    """User callbacks never run on the renewer or the watchdog."""

    def test_a_slow_on_lost_does_not_stall_other_leases(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A's on_lost blocks; B (ttl 0.9 s) is still renewed every 0.3 s; no intruder gets it."""
        unblock = threading.Event()
        a_lost = threading.Event()

        def slow(_: Lease) -> None:
            a_lost.set()
            unblock.wait(6 * REAL_TIMEOUT)  # blocks far longer than a step may wait below

        try:
            with (
                lease("a", store=store, ttl=0.9, clock=clock, on_lost=slow),
                lease("b", store=store, ttl=0.9, clock=clock) as b,
            ):
                store.force_release("a")
                clock.advance(0.3)
                assert a_lost.wait(REAL_TIMEOUT)
                for n in range(1, 5):  # 1.2 s: past B's ttl unless it is renewed
                    renewed = sum(key == "b" for key, _ in store.renewals)
                    clock.advance(0.3)
                    assert wait_until(
                        lambda renewed=renewed: sum(k == "b" for k, _ in store.renewals) > renewed,
                        timeout=REAL_TIMEOUT,
                    ), f"B was not renewed at step {n}: the renewer is stuck in A's on_lost"
                assert store.acquire("b", "intruder", 900) is None
                assert not b.lost
        finally:
            unblock.set()

    def test_on_lost_runs_on_a_dispatcher_thread(self, store: SpyStore, clock: FakeClock) -> None:
        """on_lost runs neither on the renewer nor on the watchdog nor on the caller."""
        names: list[str] = []
        with lease(
            "k",
            store=store,
            ttl=3,
            clock=clock,
            on_lost=lambda _: names.append(threading.current_thread().name),
        ):
            store.force_release("k")
            clock.advance(1.0)
            assert wait_until(lambda: names)
        assert names[0].startswith("celery-lease-dispatch"), names

    def test_one_blocked_receiver_delays_only_itself(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Two leases lost together: the second one's on_lost runs while the first one's blocks."""
        unblock = threading.Event()
        second = threading.Event()
        try:
            with (
                lease("a", store=store, ttl=3, clock=clock, on_lost=lambda _: unblock.wait(10)),
                lease("b", store=store, ttl=3, clock=clock, on_lost=lambda _: second.set()),
            ):
                store.force_release("a")
                store.force_release("b")
                clock.advance(1.0)
                assert second.wait(REAL_TIMEOUT)
        finally:
            unblock.set()


class TestShutdown:
    """``celery_lease.shutdown()`` stops this process's threads."""

    def test_no_thread_outlives_shutdown(self, store: SpyStore, clock: FakeClock) -> None:
        """Once the last lease is released and shutdown() returned, no celery-lease thread lives."""
        lost = threading.Event()
        with lease("k", store=store, ttl=3, clock=clock, on_lost=lambda _: lost.set()):
            store.force_release("k")
            clock.advance(1.0)  # starts the watchdog and a dispatcher thread too
            assert lost.wait(REAL_TIMEOUT)
        with lease("k", store=store, ttl=3, clock=clock):
            pass
        assert lease_threads()
        celery_lease.shutdown()
        assert lease_threads() == []

    def test_refuses_while_a_lease_is_held(self, store: SpyStore, clock: FakeClock) -> None:
        """shutdown() with a lease held raises RuntimeError naming the key, and stops nothing."""
        with lease("still-held", store=store, ttl=3, clock=clock) as held:
            with pytest.raises(RuntimeError, match="'still-held'"):
                celery_lease.shutdown()
            clock.advance(1.0)
            store.wait_renewals(1)
            assert not held.lost
        celery_lease.shutdown()

    def test_a_new_lease_after_shutdown_is_renewed(self, store: SpyStore, clock: FakeClock) -> None:
        """The threads start again for the next lease."""
        with lease("k", store=store, ttl=3, clock=clock):
            pass
        celery_lease.shutdown()
        with lease("k", store=store, ttl=3, clock=clock) as held:
            clock.advance(1.0)
            store.wait_renewals(1)
            assert not held.lost
        celery_lease.shutdown()
        assert lease_threads() == []

    def test_a_blocked_listener_makes_it_time_out(self, store: SpyStore, clock: FakeClock) -> None:
        """A listener still running at the timeout is named in a TimeoutError; later it succeeds."""
        unblock = threading.Event()
        running = threading.Event()

        def stuck(_: Lease) -> None:
            running.set()
            unblock.wait(REAL_TIMEOUT)

        with lease("k", store=store, ttl=3, clock=clock, on_lost=stuck):
            store.force_release("k")
            clock.advance(1.0)
            assert running.wait(REAL_TIMEOUT)
        try:
            with pytest.raises(TimeoutError, match=r"loss listener .*stuck.* of 'k'"):
                celery_lease.shutdown(timeout=0.05)
        finally:
            unblock.set()
        celery_lease.shutdown()
        assert lease_threads() == []

    def test_bad_timeout(self) -> None:
        """The timeout must be a number of seconds >= 0."""
        with pytest.raises(ValueError, match="timeout=-1"):
            celery_lease.shutdown(timeout=-1)

    def test_plugin_fixtures_leave_no_thread(self, tmp_path: Path) -> None:
        """A suite using lease_clock/lease_store has no celery-lease thread after the test."""
        (tmp_path / "test_user.py").write_text(
            textwrap.dedent(
                """
                import threading

                from celery_lease import lease


                def test_uses_a_lease(lease_clock, lease_store):
                    with lease("k", store=lease_store, clock=lease_clock):
                        lease_clock.advance(10)


                def test_then_no_thread_lingers():
                    names = [t.name for t in threading.enumerate()]
                    assert not [n for n in names if n.startswith("celery-lease")], names
                """
            )
        )
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:celery", "-p", "no:cacheprovider"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr


# A malformed batch answer, and BaseExceptions on the renewer's and the watchdog's threads -----


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
            poll_until(lambda: store.batches >= 1, what="the first batch")
            entries = [held._entry for held in (a, b)]
            poll_until(lambda: not any(e.inflight for e in entries if e), what="answered")
            # Logged once the renewer has let its lock go, after the answer was applied.
            poll_until(
                lambda: any("2 leases" in r.getMessage() for r in caplog.records),
                what=f"the short answer logged as an error of the whole batch: {caplog.text!r}",
            )
            clock.advance(0.2)  # the retry: a well-formed answer this time
            poll_until(lambda: a.lost, what="a reported taken")
            assert a.lost_reason == "taken"
            assert drain() and lost == ["a"], "the loss of a must reach its listeners"
            assert not b.lost
            renewed_at = valid_until(b)
            clock.advance(1.0)
            poll_until(lambda: valid_until(b) > renewed_at, what="b renewed again")
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
                poll_until(lambda: closed(a), what="a recorded lost")
            renewer = get_renewer(clock, store)
            poll_until(lambda: clock.sleepers >= 1, what="the renewer waits again")
            assert renewer.thread is not None and renewer.thread.is_alive(), "renewer died"
            for _ in range(3):
                before = valid_until(b)
                clock.advance(1.0)
                poll_until(lambda: valid_until(b) > before, what="b renewed")  # noqa: B023
            assert not b.lost and store.get("b") is not None

    def test_a_store_raising_a_base_exception_is_a_failed_renewal(self, clock: FakeClock) -> None:
        """A renew raising a BaseException (CancelledError, gevent.Timeout) is retried."""
        store = ExitingStore(clock, Interrupt("cancelled inside the driver"))
        with lease("k", store=store, ttl=3, clock=clock) as held:
            clock.advance(1.0)
            poll_until(lambda: store.renewals >= 1, what="the first renewal")
            renewer = get_renewer(clock, store)
            # Both the renewer and its watchdog (started by that renewal, idle between store
            # calls): the watchdog alone waiting says nothing of whether the renewer has
            # scheduled the retry yet, and time moved before that would skip it.
            poll_until(lambda: clock.sleepers >= 2, what="the renewer waits again")
            assert renewer.thread is not None and renewer.thread.is_alive(), "renewer died"
            assert held._entry is not None and not held._entry.inflight
            clock.advance(0.2)  # the retry delay of a 3 s lease
            poll_until(lambda: store.renewals >= 2, what="the retry")
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
            poll_until(lambda: closed(a), what="the watchdog recorded a")
            first.open()
            first.wait_done()
        second = store.trap("renew", delay="before")
        with lease("b", store=store, ttl=3, clock=clock) as b:
            clock.advance(1.0)
            second.wait_entered()
            try:
                # A watchdog waits for b's validity deadline (not merely for the next store call).
                poll_until(lambda: clock._deadlines, what="a watchdog waiting for b's deadline")
                clock.advance(2.0)
                poll_until(lambda: closed(b), timeout=REAL_TIMEOUT, what="b recorded lost")
                assert not second.timed_out, "b was recorded lost only once its hung renewal ended"
                assert b.lost_reason == "expired"
            finally:
                second.open()


class TestWatchdogDuringAHang:
    def test_a_lease_added_while_the_renewer_hangs_is_watched(self, clock: FakeClock) -> None:
        """The renewer hangs renewing a (ttl 30 s, one blackholed connection); b (ttl 3 s, the
        same store, so the same renewer) is acquired meanwhile: the watchdog reports b lost when
        b's validity passes, not at a's."""
        slow = AdversaryStore(MemoryLockStore(clock=clock))
        trap = slow.trap("renew", delay="before")
        lost: list[str] = []
        with lease("a", store=slow, ttl=30, clock=clock):
            clock.advance(10.0)
            trap.wait_entered()
            poll_until(lambda: clock._deadlines, what="W waiting for a's deadline")
            try:
                with lease(
                    "b", store=slow, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.key)
                ):
                    poll_until(lambda: any(d < 1020 for d in clock._deadlines), what="W counts b")
                    clock.advance(3.0)  # past b's validity, long before a's
                    poll_until(lambda: lost, timeout=REAL_TIMEOUT, what="b reported lost by W")
                    assert not trap.timed_out, "b was reported only once a's renewal gave up"
            finally:
                trap.open()
        assert lost == ["b"]

    def test_leases_added_before_the_hang_are_watched(self, clock: FakeClock) -> None:
        """b (ttl 6 s) and a (ttl 3 s) are acquired while the renewer is idle; a's renewal hangs;
        the watchdog reports a at its validity, then b at its own, the store call still hung."""
        slow = AdversaryStore(MemoryLockStore(clock=clock))
        trap = slow.trap("renew", delay="before")
        lost: list[str] = []
        try:
            with (
                lease("b", store=slow, ttl=6, clock=clock, on_lost=lambda h: lost.append(h.key)),
                lease("a", store=slow, ttl=3, clock=clock, on_lost=lambda h: lost.append(h.key)),
            ):
                clock.advance(1.0)  # a is due; b (due at 2 s) is not
                trap.wait_entered()
                poll_until(lambda: clock._deadlines, what="W waiting for a's deadline")
                clock.advance(2.0)  # past a's validity (2.968 s), not b's (5.938 s)
                poll_until(lambda: lost, timeout=REAL_TIMEOUT, what="a reported lost by W")
                assert lost == ["a"]
                clock.advance(3.0)
                poll_until(lambda: len(lost) == 2, timeout=REAL_TIMEOUT, what="b reported by W")
                assert not trap.timed_out, "b was reported only once a's renewal gave up"
        finally:
            trap.open()
        assert lost == ["a", "b"]


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
                celery_lease.shutdown(timeout=REAL_TIMEOUT)
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
                poll_until(lambda: valid_until(held) > before, what="k renewed")  # noqa: B023
            assert not held.lost
        finally:
            leave.set()
            thread.join(REAL)


# Heap compaction -----------------------------------------------------------------------------


@pytest.fixture
def compactions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Make the renewer compact its heaps after 2 closed entries; counts the compactions."""
    monkeypatch.setattr(renewer_module, "COMPACT_AFTER", 2)
    calls: list[int] = []
    original = Renewer._compact

    def counting(self: Renewer) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(Renewer, "_compact", counting)
    yield calls


class TestCompaction:
    def test_a_lease_whose_renewal_is_in_flight_survives_a_compaction(
        self, compactions: list[int]
    ) -> None:
        """Compaction while the only item of a live entry is out of the heap (its renewal is in
        flight): the entry is pushed back after the answer and renewed every ttl/3 after."""
        clock = FakeClock(1000.0)
        store = GatedRenewalStore(clock)
        with lease("live", store=store, ttl=3, clock=clock) as live:
            store.gate_key = "live"
            clock.advance(1.0)
            assert store.entered.wait(REAL_TIMEOUT)
            churn(store, clock, "short", 6)
            assert compactions, "the churn did not compact the heaps"
            store.go.set()
            pair = ("live", live.owner)
            store.wait_renewed([pair], 1)
            for cycle in range(2, 8):
                clock.advance(1.0)
                store.wait_renewed([pair], cycle)
            assert not live.lost

    def test_an_entry_closed_during_its_flight_is_never_renewed_after_a_compaction(
        self, compactions: list[int]
    ) -> None:
        """The holder exits while its renewal is in flight (remove() waits for it), the heaps
        are compacted meanwhile: the late answer neither revives the entry nor keeps the key."""
        clock = FakeClock(1000.0)
        store = GatedRenewalStore(clock)
        store.gate_key = "gone"
        held: list[Any] = []
        inside, leave = threading.Event(), threading.Event()

        def holder() -> None:
            with lease("gone", store=store, ttl=3, clock=clock) as gone:
                held.append(gone)
                inside.set()
                assert leave.wait(REAL_TIMEOUT)

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert inside.wait(REAL_TIMEOUT)
            clock.advance(1.0)
            assert store.entered.wait(REAL_TIMEOUT)  # the renewal of "gone" is in flight
            leave.set()
            clock.wait_for_sleepers(2, timeout=REAL_TIMEOUT)  # the watchdog and the exit, waiting
            churn(store, clock, "short", 6)
            assert compactions
        finally:
            store.go.set()
            thread.join(REAL_TIMEOUT)
        assert not thread.is_alive()
        assert store.get("gone") is None
        with lease("witness", store=store, ttl=3, clock=clock) as witness:
            for cycle in range(1, 5):
                clock.advance(1.0)
                store.wait_renewed([("witness", witness.owner)], cycle)
        assert store.renewed[("gone", held[0].owner)] == 1  # only the one in flight
        assert not held[0].lost

    def test_the_watchdog_reports_a_hung_lease_after_a_compaction(
        self, compactions: list[int]
    ) -> None:
        """The renewal of a lease hangs in the store; the deadline heap is compacted meanwhile;
        the watchdog still reports that lease at its validity deadline."""
        clock = FakeClock(1000.0)
        store = GatedRenewalStore(clock)
        try:
            with lease("hung", store=store, ttl=3, clock=clock) as hung:
                store.gate_key = "hung"
                clock.advance(1.0)
                assert store.entered.wait(REAL_TIMEOUT)
                churn(store, clock, "short", 6)
                assert compactions
                clock.advance(2.5)  # past the validity of "hung" (3 s less the drift margin)
                assert hung.wait_lost(REAL_TIMEOUT)
                assert hung.lost_reason == "expired"
        finally:
            store.go.set()

    def test_held_leases_stay_renewed_while_other_threads_churn(
        self, compactions: list[int]
    ) -> None:
        """Two threads take and leave leases (compacting again and again) while the renewer
        renews three long-held ones through six ttl/3 periods: none is dropped or lost."""
        clock = FakeClock(1000.0)
        store = GatedRenewalStore(clock)
        errors: list[BaseException] = []

        def churner(prefix: str) -> None:
            try:
                churn(store, clock, prefix, 300)
            except BaseException as exc:  # reported below
                errors.append(exc)

        contexts = [lease(f"long{i}", store=store, ttl=3, clock=clock) for i in range(3)]
        helds = [context.__enter__() for context in contexts]
        pairs = [(held.key, held.owner) for held in helds]
        threads = [threading.Thread(target=churner, args=(p,)) for p in ("a", "b")]
        try:
            for thread in threads:
                thread.start()
            for cycle in range(1, 7):
                clock.advance(1.0)
                store.wait_renewed(pairs, cycle)
            for thread in threads:
                thread.join(REAL_TIMEOUT)
            assert not errors
            assert compactions
            assert [held.lost for held in helds] == [False, False, False]
        finally:
            for context in reversed(contexts):
                context.__exit__(None, None, None)

    def test_an_entry_ended_between_its_take_and_its_renewal_is_not_renewed(self) -> None:
        """One sweep takes two due leases; the first is past max_hold, and its immediate loss
        listener (on the renewer thread, between the take and the renewal) ends the second
        one early: the second is not renewed, and its key stays free."""
        clock = FakeClock(1000.0)
        store = GatedRenewalStore(clock)
        first = lease("first", store=store, ttl=3, max_hold=1.0, clock=clock)
        second = lease("second", store=store, ttl=3, clock=clock)
        with first as held_first, second as held_second:
            ended = threading.Event()

            def end_second(_: object) -> None:
                second.release_early()
                ended.set()

            held_first.add_loss_listener(end_second, immediate=True)
            clock.advance(1.0)
            assert ended.wait(REAL_TIMEOUT)
            assert held_first.lost_reason == "max_hold"
            with lease("witness", store=store, ttl=3, clock=clock) as witness:
                clock.advance(1.0)
                store.wait_renewed([("witness", witness.owner)], 1)
            assert store.renewed[("second", held_second.owner)] == 0
            assert held_second.lost_reason == "released"
            assert store.get("second") is None


def test_there_is_one_renewer_per_clock_and_store() -> None:
    """Each (clock, store) has a renewer of its own: another store, or the system clock, another."""
    clock = FakeClock(0.0)
    store, other = MemoryLockStore(clock=clock), MemoryLockStore(clock=clock)
    assert get_renewer(clock, store) is get_renewer(clock, store)
    assert get_renewer(clock, store) is not get_renewer(clock, other)
    assert get_renewer(clock, store) is not get_renewer(None, store)
    assert get_renewer(clock, store).store is store


def test_a_renewer_refuses_an_entry_of_another_store() -> None:
    """Renewer.add of an entry held in another store raises ValueError naming the key: that
    lease would be renewed behind this store's calls."""
    clock = FakeClock(0.0)
    store, other = MemoryLockStore(clock=clock), MemoryLockStore(clock=clock)
    entry = Entry(
        store=other,
        key="elsewhere",
        owner="me",
        ttl=3,
        sent_at=0.0,
        max_hold_at=None,
        on_lost=lambda reason: None,
    )
    with pytest.raises(ValueError, match=r"'elsewhere'.*get_renewer"):
        get_renewer(clock, store).add(entry)
    assert entry.renewer is None
    assert len(get_renewer(clock, store)) == 0
