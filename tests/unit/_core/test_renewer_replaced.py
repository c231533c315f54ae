"""A holder asked to stop (``on_held="replace"``) reads its loss as ``"replaced"``: the renewer
reads the store's record after a refusal (single renewal, a ``renew_many`` batch, a refusal
answered while the exit waits for it), and the marked lease is released at the holder's exit."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_lease import LockLostError, MemoryLockStore, lease
from celery_lease.stores.slots import marked
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore


class _PausedRenewals(MemoryLockStore):
    """Holds each renewal (before it reaches the store) until ``go`` is set; ``sent`` says one
    is waiting there."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.sent = threading.Event()
        self.go = threading.Event()
        self.gets = 0

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        self.sent.set()
        assert self.go.wait(REAL_TIMEOUT)
        return super().renew(key, owner, ttl_ms)

    def get(self, key: str) -> Any:
        self.gets += 1
        return super().get(key)


class _WithoutReplace:
    """A store with inspection but without ``mark_replaced`` (delegates to ``inner``)."""

    def __init__(self, inner: MemoryLockStore) -> None:
        self.inner = inner

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.inner.acquire(key, owner, ttl_ms)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self.inner.renew(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.inner.release(key, owner)

    def get(self, key: str) -> Any:
        return self.inner.get(key)

    def last_token(self, key: str) -> int | None:
        return self.inner.last_token(key)

    def list(self, prefix: str = "") -> Any:
        return self.inner.list(prefix)

    def force_release(self, key: str) -> Any:
        return self.inner.force_release(key)


class TestSingleRenewal:
    def test_a_marked_holder_reads_replaced(self, store: SpyStore, clock: FakeClock) -> None:
        """Marked by ``mark_replaced``: the next renewal is refused and the loss reads
        ``"replaced"`` (``lost_reason``, ``check()``'s LockLostError)."""
        with lease("job", store=store, ttl=3, clock=clock) as held:
            _ticket, holder, asked = store.mark_replaced("job")
            assert (holder, asked) == (held.owner, True)
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "replaced"
            with pytest.raises(LockLostError) as caught:
                held.check()
            assert caught.value.reason == "replaced"
            assert caught.value.key == "job"

    def test_the_marked_lease_is_kept_until_the_exit_releases_it(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Lost as ``"replaced"``, the lease stays in the store (marked) until the holder's
        exit, which deletes it owner-checked."""
        with lease("job", store=store, ttl=3, clock=clock) as held:
            store.mark_replaced("job")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            info = store.get("job")
            assert info is not None and info.owner == marked(held.owner)
            assert store.acquire("job", "newcomer", 3000) is None
        assert store.get("job") is None
        assert store.acquire("job", "newcomer", 3000) is not None
        store.release("job", "newcomer")

    def test_a_holder_running_on_frees_the_key_when_its_lease_expires(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A replaced holder that runs on (``on_lost="mark"``) is no longer renewed: its marked
        lease expires one ttl after its last renewal and the key is free before it exits."""
        with lease("job", store=store, ttl=3, clock=clock) as held:
            store.mark_replaced("job")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert store.get("job") is not None
            clock.advance(3.0)
            assert store.get("job") is None
            assert store.acquire("job", "newcomer", 3000) is not None
        info = store.get("job")
        assert info is not None and info.owner == "newcomer"  # the late exit freed nothing else
        store.release("job", "newcomer")

    def test_a_body_that_raises_after_the_mark_gets_lock_lost_replaced(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The exit turns the body's error into ``LockLostError(key, "replaced")``."""
        with (
            pytest.raises(LockLostError) as caught,
            lease("job", store=store, ttl=3, clock=clock) as held,
        ):
            store.mark_replaced("job")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            raise ValueError("the body failed")
        assert caught.value.reason == "replaced"

    def test_another_owners_lease_still_reads_taken(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The key freed and taken by another owner (even one marked since): ``"taken"``."""
        with lease("job", store=store, ttl=3, clock=clock) as held:
            assert store.force_release("job") is not None
            assert store.acquire("job", "other", 60_000) is not None
            store.mark_replaced("job")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "taken"
        store.release("job", "other")

    def test_a_store_without_mark_replaced_reads_taken(self, clock: FakeClock) -> None:
        """Only a store conforming to SupportsReplace is asked: another store's refusal reads
        as before (here a marked record written behind its back)."""
        inner = MemoryLockStore(clock=clock)
        store = _WithoutReplace(inner)
        with lease("job", store=store, ttl=3, clock=clock) as held:  # type: ignore[arg-type]
            inner.mark_replaced("job")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "taken"


class TestBatch:
    def test_a_batch_marks_only_the_replaced_lease(self, store: SpyStore, clock: FakeClock) -> None:
        """Two leases renewed in one ``renew_many``: the marked one reads ``"replaced"``, the
        other is renewed and held."""
        with (
            lease("a", store=store, ttl=3, clock=clock) as first,
            lease("b", store=store, ttl=3, clock=clock) as second,
        ):
            store.mark_replaced("a")
            clock.advance(1.0)
            assert first.wait_lost(REAL_TIMEOUT)
            store.wait_renewals(2)
            assert 2 in store.batches
            assert first.lost_reason == "replaced"
            assert not second.lost


class TestInFlight:
    def test_a_renewal_in_flight_when_marked_reads_replaced(self, clock: FakeClock) -> None:
        """Marked while its renewal is on the way: the store refuses it, ``"replaced"``."""
        store = _PausedRenewals(clock)
        with lease("job", store=store, ttl=3, clock=clock) as held:
            clock.advance(1.0)
            assert store.sent.wait(REAL_TIMEOUT)
            store.mark_replaced("job")
            store.go.set()
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "replaced"
        assert store.get("job") is None

    def test_a_refusal_answered_while_the_exit_waits_reads_replaced(self, clock: FakeClock) -> None:
        """The body ends while the renewal is in flight; marked meanwhile, that renewal is
        refused while the exit waits for it: the exit reports ``"replaced"`` (not ``"taken"``)
        and frees the key."""
        store = _PausedRenewals(clock)
        told: list[str | None] = []
        with lease(
            "job", store=store, ttl=3, clock=clock, on_lost=lambda h: told.append(h.lost_reason)
        ) as held:
            clock.advance(1.0)
            assert store.sent.wait(REAL_TIMEOUT)
            store.mark_replaced("job")
            clock.wait_for_sleepers(1, REAL_TIMEOUT)  # the watchdog, armed around the renewal
            begun = clock.waits

            def answer_once_the_exit_waits() -> None:
                clock.wait_for_waits(begun + 1, REAL_TIMEOUT)  # the exit's wait for the flight
                store.go.set()

            answer = threading.Thread(target=answer_once_the_exit_waits)
            answer.start()
        answer.join(REAL_TIMEOUT)
        assert held.lost_reason == "replaced"
        assert store.get("job") is None


class _FreedBeforeTheRead(MemoryLockStore):
    """The marked lease goes (here force-released; expiry leaves the store the same) between
    the refused renewal and the renewer's read of the holder."""

    def get(self, key: str) -> Any:
        self.force_release(key)
        return super().get(key)


class TestFreedBeforeTheRead:
    def test_a_marked_lease_gone_before_the_read_reads_taken_not_released(
        self, clock: FakeClock
    ) -> None:
        """The key is free when read, but its counter is above the holder's token (the ticket
        the replacer drew): ``"taken"``, never ``"released"`` (that says our own token is the
        last one: a force-release, or a store clock running fast)."""
        store = _FreedBeforeTheRead(clock=clock)
        with lease("job", store=store, ttl=3, clock=clock) as held:
            store.mark_replaced("job")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            assert held.lost_reason == "taken"
