"""The renewer: every ttl/3, retries while valid, reports loss once, one thread, fork-safe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import celery_lease
from celery_lease import Lease, lease
from celery_lease.dispatch import drain
from celery_lease.renewer import IDLE_EXIT, get_renewer, validity
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore


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
            while not lost.is_set():
                clock.wait_for_sleepers(1)
                clock.advance_to_next_deadline()
                lost.wait(0.01)
            assert held.lost_reason == "expired"
            assert clock.monotonic() - held.acquired_at < 3.0

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
            assert len(get_renewer(clock)) == 0, "the renewer no longer holds it"
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
            renewer = get_renewer(clock)
            started = set(threading.enumerate()) - before
            assert started == {renewer.thread, renewer.watchdog}
            assert len(get_renewer(clock)) == 200
            assert store.batches == [200]
            assert not any(h.lost for h in held)
        finally:
            for c in contexts:
                c.__exit__(None, None, None)
        assert len(get_renewer(clock)) == 0

    def test_thread_is_reused_then_exits_when_idle(self, store: SpyStore, clock: FakeClock) -> None:
        """Leases taken one after another share one thread; it ends after IDLE_EXIT idle."""
        with lease("k", store=store, ttl=3, clock=clock):
            thread = get_renewer(clock).thread
            assert thread is not None and thread.is_alive()
        for _ in range(3):
            with lease("k", store=store, ttl=3, clock=clock):
                assert get_renewer(clock).thread is thread
        clock.advance(IDLE_EXIT - 1)
        assert thread.is_alive()
        clock.advance(1.0)
        thread.join(REAL_TIMEOUT)
        assert not thread.is_alive()
        assert get_renewer(clock).thread is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
class TestFork:
    def test_child_never_renews_the_parents_leases(self, store: SpyStore, clock: FakeClock) -> None:
        """After fork, the child's renewer starts empty and renews only its own leases."""
        read, write = os.pipe()
        with lease("parent-key", store=store, ttl=3, clock=clock):
            assert len(get_renewer(clock)) == 1
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                status = 1
                try:
                    inherited = len(get_renewer(clock))
                    with lease("child-key", store=store, ttl=3, clock=clock) as mine:
                        renewer = get_renewer(clock)
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
    """User callbacks never run on the renewer or the watchdog (issue 8, item 1)."""

    def test_a_slow_on_lost_does_not_stall_other_leases(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A's on_lost blocks; B (ttl 0.9 s) is still renewed every 0.3 s; no intruder gets it."""
        unblock = threading.Event()
        a_lost = threading.Event()

        def slow(_: Lease) -> None:
            a_lost.set()
            unblock.wait(REAL_TIMEOUT)  # as if it blocked for seconds

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
                        timeout=2.0,
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
    """``celery_lease.shutdown()`` stops this process's threads (issue 8, item 17)."""

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
