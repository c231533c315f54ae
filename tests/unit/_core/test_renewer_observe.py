"""Renewal observers: every renewal result reaches them, a failing one is logged once, no cost
without one."""

from __future__ import annotations

import logging
import threading

import pytest

from celery_lease import lease
from celery_lease._core.renewer import get_renewer, observe_renewals, renewers
from celery_lease.testing import FakeClock
from tests.unit.conftest import (
    REAL_TIMEOUT,
    SpyStore,
    let_idle_exit,
    renewer_thread_after_one_lease,
)

Seen = list[tuple[str, int | None, float, bool | None]]


class _Recorder:
    """An observer that records what it is told and wakes a waiter after each call."""

    def __init__(self) -> None:
        self.seen: Seen = []
        self.cond = threading.Condition()

    def __call__(self, key: str, token: int | None, seconds: float, ok: bool | None) -> None:
        with self.cond:
            self.seen.append((key, token, seconds, ok))
            self.cond.notify_all()

    def wait(self, count: int) -> Seen:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.seen) >= count, REAL_TIMEOUT):
                raise AssertionError(f"{len(self.seen)} renewals observed, expected {count}")
            return list(self.seen)


class TestObserveRenewals:
    def test_a_renewer_observer_gets_key_token_round_trip_and_true(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A successful renewal is observed once with the key, the token, the round trip of the
        store call (of the renewer's clock) and ok=True."""
        recorder = _Recorder()
        forget = get_renewer(clock, store).observe_renewals(recorder)
        try:
            with lease("k", store=store, ttl=3, clock=clock) as held:
                clock.advance(1.0)
                store.wait_renewals(1)
                seen = recorder.wait(1)
        finally:
            forget()
        assert seen == [("k", held.token, 0.0, True)]

    def test_a_refused_renewal_is_observed_as_false(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A renewal the store refuses (another owner took the key) is observed with ok=False."""
        recorder = _Recorder()
        forget = get_renewer(clock, store).observe_renewals(recorder)
        try:
            with lease("k", store=store, ttl=3, clock=clock):
                store.force_release("k")
                store.acquire("k", "someone-else", 60_000)
                clock.advance(1.0)
                seen = recorder.wait(1)
        finally:
            forget()
        assert [(key, ok) for key, _, _, ok in seen] == [("k", False)]

    def test_a_failed_renewal_is_observed_as_none(self, store: SpyStore, clock: FakeClock) -> None:
        """A renewal that raised (store unavailable) is observed with ok=None."""
        recorder = _Recorder()
        store.fail_renewals = 1
        forget = get_renewer(clock, store).observe_renewals(recorder)
        try:
            with lease("k", store=store, ttl=3, clock=clock):
                clock.advance(1.0)
                store.wait_renewals(1)
                seen = recorder.wait(1)
        finally:
            forget()
        assert [(key, ok) for key, _, _, ok in seen] == [("k", None)]

    def test_the_module_observer_sees_renewals_of_every_renewer(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """observe_renewals() (module level) observes a renewer made after it was registered."""
        recorder = _Recorder()
        forget = observe_renewals(recorder)
        try:
            with lease("k", store=store, ttl=3, clock=clock):
                clock.advance(1.0)
                store.wait_renewals(1)
                seen = recorder.wait(1)
        finally:
            forget()
        assert [(key, ok) for key, _, _, ok in seen] == [("k", True)]

    def test_forget_stops_the_calls(self, store: SpyStore, clock: FakeClock) -> None:
        """After the returned forget() ran, the observer is not called again (forget twice is
        harmless)."""
        recorder = _Recorder()
        forget = get_renewer(clock, store).observe_renewals(recorder)
        forget()
        forget()
        with lease("k", store=store, ttl=3, clock=clock):
            clock.advance(1.0)
            store.wait_renewals(1)
        assert recorder.seen == []

    def test_a_raising_observer_is_logged_once_and_renewal_goes_on(
        self, store: SpyStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An observer that raises on every call is logged once; the lease is renewed and not
        lost, and the observers after it are still called."""
        calls: list[str] = []

        def broken(key: str, token: int | None, seconds: float, ok: bool | None) -> None:
            calls.append(key)
            raise RuntimeError("observer bug")

        recorder = _Recorder()
        renewer = get_renewer(clock, store)
        forget_broken = renewer.observe_renewals(broken)
        forget = renewer.observe_renewals(recorder)
        try:
            with (
                caplog.at_level(logging.ERROR, logger="celery_lease.renewer"),
                lease("k", store=store, ttl=3, clock=clock) as held,
            ):
                for n in (1, 2):
                    clock.advance(1.0)
                    store.wait_renewals(n)
                    recorder.wait(n)
                assert not held.lost
        finally:
            forget_broken()
            forget()
        assert calls == ["k", "k"]
        logged = [r for r in caplog.records if "observer" in r.getMessage()]
        assert len(logged) == 1

    def test_an_observer_must_be_callable(self, store: SpyStore, clock: FakeClock) -> None:
        """A non-callable observer is refused when registered, naming what was given."""
        with pytest.raises(TypeError, match="callback=42"):
            get_renewer(clock, store).observe_renewals(42)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="callback=42"):
            observe_renewals(42)  # type: ignore[arg-type]

    def test_batched_renewals_are_each_observed(self, store: SpyStore, clock: FakeClock) -> None:
        """Two leases renewed in one renew_many are observed once each."""
        recorder = _Recorder()
        forget = get_renewer(clock, store).observe_renewals(recorder)
        try:
            with (
                lease("a", store=store, ttl=3, clock=clock),
                lease("b", store=store, ttl=3, clock=clock),
            ):
                clock.advance(1.0)
                seen = recorder.wait(2)
        finally:
            forget()
        assert sorted(key for key, *_ in seen) == ["a", "b"]
        assert all(ok is True for *_, ok in seen)


class TestObserverAcrossIdleExit:
    def test_an_observer_of_a_renewer_is_kept_after_its_idle_exit(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A renewer whose thread exits for lack of leases stays the store's renewer while an
        observer is registered on it: a lease taken later is renewed there, and observed."""
        recorder = _Recorder()
        renewer = get_renewer(clock, store)
        forget = renewer.observe_renewals(recorder)
        try:
            thread = renewer_thread_after_one_lease(renewer, store, clock, "a")
            let_idle_exit(thread, clock)
            assert not thread.is_alive()
            assert get_renewer(clock, store) is renewer, (
                "the idle exit dropped the renewer and its observers with it"
            )
            with lease("b", store=store, ttl=3, clock=clock):
                clock.advance(1.0)
                seen = recorder.wait(1)
        finally:
            forget()
        assert [(key, ok) for key, _, _, ok in seen] == [("b", True)]

    def test_a_renewer_leaves_the_registry_at_idle_once_its_observers_are_gone(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Unregistering the last observer lets the renewer go at its next idle exit, or at
        once when it is idle already."""
        renewer = get_renewer(clock, store)
        forget = renewer.observe_renewals(_Recorder())
        thread = renewer_thread_after_one_lease(renewer, store, clock, "a")
        forget()
        let_idle_exit(thread, clock)
        assert renewer not in renewers(clock)
        idle = get_renewer(clock, store)
        idle.observe_renewals(_Recorder())()  # registered and unregistered while idle
        assert idle not in renewers(clock)

    def test_observing_a_renewer_that_left_the_registry_observes_its_successor(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A renewer looked up, then dropped at its idle exit and replaced before the observer
        is registered: the observer lands on the renewer that renews the store's leases."""
        recorder = _Recorder()
        stale = get_renewer(clock, store)
        let_idle_exit(renewer_thread_after_one_lease(stale, store, clock, "a"), clock)
        assert stale not in renewers(clock)
        successor = get_renewer(clock, store)
        assert successor is not stale
        forget = stale.observe_renewals(recorder)
        try:
            with lease("b", store=store, ttl=3, clock=clock):
                clock.advance(1.0)
                seen = recorder.wait(1)
        finally:
            forget()
        assert [(key, ok) for key, _, _, ok in seen] == [("b", True)]


class TestBlockingObserver:
    def test_loss_is_reported_while_an_observer_blocks(self, clock: FakeClock) -> None:
        """An observer stuck after a renewal does not delay the loss report past validity: the
        watchdog watches the renewer while observers run, as it does during a store call."""
        unblock = threading.Event()
        entered = threading.Event()

        def stuck(key: str, token: int | None, seconds: float, ok: bool | None) -> None:
            entered.set()
            unblock.wait(REAL_TIMEOUT)

        store = SpyStore(clock)
        lost = threading.Event()
        forget = get_renewer(clock, store).observe_renewals(stuck)
        try:
            with lease("k", store=store, ttl=3, clock=clock, on_lost=lambda _: lost.set()) as held:
                clock.advance(1.0)  # renewed at +1: valid until +1 + 2.968 s
                assert entered.wait(REAL_TIMEOUT)
                clock.wait_for_sleepers(1)  # the watchdog waits for the validity deadline
                clock.advance(2.99)
                assert lost.wait(REAL_TIMEOUT), "loss must be reported while an observer blocks"
                assert held.lost_reason == "expired"
        finally:
            unblock.set()
            forget()
