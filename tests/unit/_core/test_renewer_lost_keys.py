"""A lease the renewer records lost by expiry (or ``max_hold``) frees its key on the store at once.

The renewal that may still have landed (its answer came back too late, or never came back) can
have extended the key on the server by a whole ttl; nobody renews it any more, yet every other
holder would be kept out until it expires. The key is released, owner-checked, on the dispatcher
as soon as the loss is notified, while the body may still run.
"""

from __future__ import annotations

import logging
import threading

import pytest

from celery_lease import MemoryLockStore, StoreUnavailableError, lease
from celery_lease._core.dispatch import drain
from celery_lease._core.renewer import Entry, get_renewer
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore
from tests.unit.core_faults import poll_until


def holder(store: MemoryLockStore, key: str = "k") -> str | None:
    """The owner the store says holds ``key`` now, or None."""
    info = store.get(key)
    return None if info is None else info.owner


def freed_while_held(store: MemoryLockStore, key: str = "k") -> str | None:
    """Wait (real time) for ``key`` to be free; None once it is, else who still holds it.

    Called inside the ``with``: the exit of a lost lease turns an assertion that fails there
    into ``LockLostError``, so the caller asserts on the answer after the block.
    """
    try:
        poll_until(lambda: holder(store, key) is None)
    except AssertionError:
        return holder(store, key) or "?"
    return None


class LateAnswerStore(SpyStore):
    """Renewals of ``late_key`` take effect, then the answer arrives past ``answer_at``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.late_key: str | None = None
        self.answer_at = 0.0

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        result = super().renew(key, owner, ttl_ms)
        if key == self.late_key:
            self.late_key = None
            self.clock.advance(self.answer_at - self.clock.monotonic())
        return result


class ReplyLostStore(SpyStore):
    """Every renewal takes effect on the store; its reply is lost (the call raises)."""

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        MemoryLockStore.renew(self, key, owner, ttl_ms)
        self._note(key)
        raise StoreUnavailableError("the reply of a renewal that took effect was lost")


class TestExpiredLeaseIsReleased:
    def test_a_renewal_answered_too_late_frees_the_key(self, clock: FakeClock) -> None:
        """The renewal extended the key by a ttl, but its answer came after the validity: the
        lease is lost ("expired") and the key is free before the body ends."""
        store = LateAnswerStore(clock)
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.late_key = "k"
            store.answer_at = held.acquired_at + 3.0  # past the local validity (2.968 s)
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            still = freed_while_held(store)
        assert held.lost_reason == "expired"
        assert still is None, f"the key stays held by the lost lease ({still}) while it runs"

    def test_a_renewal_whose_reply_is_lost_frees_the_key_once_validity_ends(
        self, clock: FakeClock
    ) -> None:
        """The renewal landed but raised (its reply lost): the lease reads lost at its validity,
        and the key that renewal extended to a ttl after it is freed then, not at that end."""
        store = ReplyLostStore(clock)
        with lease("k", store=store, ttl=3, clock=clock) as held:
            entry = held._entry
            assert entry is not None
            clock.advance(1.0)  # the renewal: it lands (the key now lasts until +4 s) and raises
            store.wait_renewals(1)
            clock.advance(held.acquired_at + 3.0 - clock.monotonic())  # past the validity
            poll_until(lambda: entry.closed, what="the loss recorded at the validity")
            still = freed_while_held(store)
        assert held.lost_reason == "expired"
        assert still is None, f"the key stays held by the lost lease ({still}) while it runs"

    def test_max_hold_frees_the_key(self, store: SpyStore, clock: FakeClock) -> None:
        """At ``max_hold`` the lease is lost and its key free, although its last renewal
        would keep it on the store for most of a ttl more."""
        lease_ = lease("k", store=store, ttl=3, clock=clock, max_hold=2.5)
        with lease_ as held:
            clock.advance(1.0)
            store.wait_renewals(1)
            clock.advance(1.0)
            store.wait_renewals(2)
            clock.advance(0.5)
            assert held.wait_lost(REAL_TIMEOUT)
            still = freed_while_held(store)
        assert held.lost_reason == "max_hold"
        assert still is None, f"the key stays held past max_hold ({still}) while the body runs"


class TestOnlyItsOwnKey:
    def test_a_lease_taken_by_another_owner_is_not_released(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A key taken over by another owner stays theirs: the loss ("taken") frees nothing."""
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            assert store.acquire("k", "other", 60_000) is not None
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "taken"
        assert holder(store) == "other"

    def test_a_key_expired_and_taken_since_is_not_released(self, clock: FakeClock) -> None:
        """The late answer lands after another owner took the expired key: the release the
        renewer sends for the lost lease is owner-checked and leaves the new holder alone."""
        taken = threading.Event()

        class TakenMeanwhile(LateAnswerStore):
            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                result = super().renew(key, owner, ttl_ms)
                if not taken.is_set():
                    taken.set()
                    self.force_release(key)
                    assert self.acquire(key, "other", 60_000) is not None
                return result

        store = TakenMeanwhile(clock)
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.late_key = "k"
            store.answer_at = held.acquired_at + 3.0
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
        assert holder(store) == "other"


class TestOneFaultyRelease:
    def test_a_release_that_fails_does_not_stop_the_other_renewals(
        self, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The release of one lost lease raises: it is logged, and the renewer goes on renewing
        the other lease of the same store."""

        class FailingRelease(LateAnswerStore):
            def release(self, key: str, owner: str) -> bool:
                if key == "lost":
                    raise StoreUnavailableError("release refused")
                return super().release(key, owner)

        store = FailingRelease(clock)
        caplog.set_level(logging.WARNING, logger="celery_lease.renewer")
        with lease("kept", store=store, ttl=30, clock=clock) as kept:
            lost_lease = lease("lost", store=store, ttl=3, clock=clock)
            with lost_lease as lost:
                store.late_key = "lost"
                store.answer_at = lost.acquired_at + 3.0
                clock.advance(1.0)
                assert lost.wait_lost(REAL_TIMEOUT)
                poll_until(
                    lambda: any("release refused" in r.getMessage() for r in caplog.records),
                    what="the failed release of the lost lease logged",
                )
            for n in range(1, 6):  # "kept" is due every 10 s; "lost" was renewed once
                clock.advance(10.0)
                store.wait_renewals(1 + n)
            assert not kept.lost


class TestAReleaseThatHangs:
    def test_the_other_leases_of_the_store_are_still_renewed(self, clock: FakeClock) -> None:
        """The release of the lost lease hangs in the store (a dead node, a locked row): it
        runs on the dispatcher, so the renewer goes on renewing the store's other lease."""
        in_release = threading.Event()
        go = threading.Event()

        class HungRelease(LateAnswerStore):
            def release(self, key: str, owner: str) -> bool:
                if key == "lost" and not go.is_set():
                    in_release.set()
                    go.wait(REAL_TIMEOUT * 6)  # longer than every wait of the test
                return super().release(key, owner)

        store = HungRelease(clock)
        try:
            with (
                lease("kept", store=store, ttl=30, clock=clock) as kept,
                lease("lost", store=store, ttl=3, clock=clock) as lost,
            ):
                store.late_key = "lost"
                store.answer_at = lost.acquired_at + 3.0
                clock.advance(1.0)
                assert lost.wait_lost(REAL_TIMEOUT)
                assert in_release.wait(REAL_TIMEOUT), "the lost lease's key was released"
                for n in range(1, 4):  # "kept" is due every 10 s; "lost" was renewed once
                    clock.advance(10.0)
                    store.wait_renewals(1 + n)
                assert not kept.lost
                go.set()
        finally:
            go.set()
        assert holder(store, "lost") is None


class TestASharedOwner:
    def test_an_entry_made_not_to_free_its_key_keeps_it_after_a_loss(
        self, clock: FakeClock
    ) -> None:
        """``free_on_loss=False`` (a unique copy's queued lease, whose owner id a retry or a
        redelivered copy takes again): the loss is reported, the key is left to its holder."""
        store = LateAnswerStore(clock)
        store.acquire("q", "shared-owner", 3000)
        lost = threading.Event()
        entry = Entry(
            store=store,
            key="q",
            owner="shared-owner",
            ttl=3,
            sent_at=clock.monotonic(),
            max_hold_at=None,
            on_lost=lambda _: lost.set(),
            free_on_loss=False,
        )
        renewer = get_renewer(clock, store)
        store.late_key = "q"
        store.answer_at = clock.monotonic() + 3.0
        renewer.add(entry)
        clock.advance(1.0)
        assert lost.wait(REAL_TIMEOUT)
        assert entry.lost_reason == "expired"
        assert drain(), "every loss notification and hand-over ran"
        renewer.remove(entry)
        assert holder(store, "q") == "shared-owner"
