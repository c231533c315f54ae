"""One faulty store never costs the leases of another store their renewals.

Each store has a renewer of its own (one per clock and store). A store whose renewal hangs,
raises or answers garbage must not delay, fail or lose the leases held in another store; and a
``renew_many`` answered per key fails only the keys whose slot holds an error.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from celery_lease import lease
from celery_lease._core.renewer import renewers, shutdown, snapshot
from celery_lease.errors import StoreUnavailableError
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore


class HangingStore(SpyStore):
    """Its renewals hang until the test lets them go (a blackholed connection)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.hang = False
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if self.hang:
            self.entered.set()
            self.let_go.wait(REAL_TIMEOUT)
        return super().renew(key, owner, ttl_ms)

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.batches.append(len(items))
        return [self.renew(*item) for item in items]


class RaisingStore(SpyStore):
    """Its renewals raise something that is not a store error."""

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        raise RuntimeError("a bug in a third-party store")

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        raise RuntimeError("a bug in a third-party store")


class GarbageStore(SpyStore):
    """Its batched renewal answers a list of the wrong length."""

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return [True]


class TestOneStoreHangs:
    def test_a_hung_store_does_not_cost_another_store_its_lease(self, clock: FakeClock) -> None:
        """While the slow store's renewal hangs, the fast store's lease is renewed on time."""
        slow, fast = HangingStore(clock), SpyStore(clock)
        try:
            with (
                lease("a", store=slow, ttl=15, clock=clock) as a,
                lease("b", store=fast, ttl=3, clock=clock) as b,
            ):
                slow.hang = True
                for n in range(1, 5):  # b is renewed every second; a is first due at +5
                    clock.advance(1.0)
                    fast.wait_renewals(n)
                clock.advance(1.0)  # a and b are both due: a's renewal hangs from here
                assert slow.entered.wait(REAL_TIMEOUT)
                for n in range(5, 11):
                    with fast.renewed:
                        renewed = fast.renewed.wait_for(
                            lambda n=n: len(fast.renewals) >= n, REAL_TIMEOUT / 5
                        )
                    assert renewed, f"b was renewed {len(fast.renewals)} times, expected {n}"
                    # On the clock: b's renewer and watchdog, and a's watchdog (a's renewer
                    # hangs in the store); once all three wait, b's renewal is handled.
                    clock.wait_for_sleepers(3, timeout=REAL_TIMEOUT)
                    clock.advance(1.0)
                assert not b.lost, f"b lost ({b.lost_reason}) while its own store answered"
                assert not a.lost, "a is valid for 15 s from +0 and its renewal began at +5"
                assert slow.renewals == [], "a's renewal is still hanging"
                slow.let_go.set()  # a's exit waits for its renewal in flight
        finally:
            slow.let_go.set()


class TestOneStoreMisbehaves:
    @pytest.mark.parametrize("faulty", [RaisingStore, GarbageStore])
    def test_a_store_that_raises_or_answers_garbage_costs_only_its_own_leases(
        self, clock: FakeClock, faulty: type[SpyStore]
    ) -> None:
        """A renewal that raises an unexpected error, or answers a batch of the wrong length,
        is that store's failure: the other store's lease goes on being renewed."""
        bad, good = faulty(clock), SpyStore(clock)
        with (
            lease("x", store=bad, ttl=3, clock=clock),
            lease("y", store=good, ttl=3, clock=clock) as y,
        ):
            for n in range(1, 4):
                clock.advance(1.0)
                good.wait_renewals(n)
            assert not y.lost, f"y lost ({y.lost_reason}) for another store's fault"
            assert good.get("y") is not None


class PerKeyStore(SpyStore):
    """Its renewals of ``poisoned`` fail with a store error; ``renew_many`` answers per key, the
    error in that key's slot (a Redis key holding another type: ``WRONGTYPE`` for it alone)."""

    poisoned = "poisoned"

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if key == self.poisoned:
            self._note(key)
            raise StoreUnavailableError(f"WRONGTYPE for {key!r} only")
        return super().renew(key, owner, ttl_ms)

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool | BaseException]:
        self.batches.append(len(items))
        answer: list[bool | BaseException] = []
        for item in items:
            try:
                answer.append(self.renew(*item))
            except StoreUnavailableError as exc:
                answer.append(exc)
        return answer


class TestOneKeyFails:
    def test_an_error_in_one_keys_slot_fails_that_key_alone(self, clock: FakeClock) -> None:
        """``renew_many`` answers per key: an exception in one key's slot fails that key alone.
        The key renewed beside it stays held; the failing one is retried while it is valid, then
        lost ("expired")."""
        store = PerKeyStore(clock)

        def step(seconds: float) -> None:
            before = len(store.renewals)
            clock.advance(seconds)
            store.wait_renewals(before + 1)

        def attempts(key: str) -> int:
            return sum(1 for k, _ in store.renewals if k == key)

        with (
            lease("poisoned", store=store, ttl=3, clock=clock) as poisoned,
            lease("healthy", store=store, ttl=3, clock=clock) as healthy,
        ):
            step(1.0)
            assert store.batches == [2], "both leases went in one renew_many"
            for _ in range(15):  # retried every 0.2 s (ttl/15) until its validity (2.968 s)
                if poisoned.lost:
                    break
                step(0.2)
            assert poisoned.lost_reason == "expired"
            retries = attempts("poisoned")
            assert retries >= 9, f"the failing key was tried {retries} times while valid"
            for _ in range(3):
                step(1.0)
            assert attempts("poisoned") == retries, "a lost lease is not renewed again"
            assert attempts("healthy") == 6, "renewed at +1, +2, +3, +4, +5 and +6"
            assert not healthy.lost, f"healthy lost ({healthy.lost_reason}) for another key"
            assert store.get("healthy") is not None


class TestProcessWide:
    def test_snapshot_and_shutdown_see_the_leases_of_every_store(self, clock: FakeClock) -> None:
        """snapshot() lists the leases of both stores' renewers; shutdown() refuses naming the
        keys held in either, and stops every renewer once none is held."""
        one, two = SpyStore(clock), SpyStore(clock)
        with (
            lease("in-one", store=one, ttl=3, clock=clock),
            lease("in-two", store=two, ttl=3, clock=clock),
        ):
            assert [row["key"] for row in snapshot()] == ["in-one", "in-two"]
            with pytest.raises(RuntimeError, match="'in-one', 'in-two'"):
                shutdown()
        threads = [r.thread for r in renewers(clock) if r.thread is not None]
        assert len(threads) == 2, "one renewer thread per store"
        shutdown()
        assert not any(thread.is_alive() for thread in threads)
