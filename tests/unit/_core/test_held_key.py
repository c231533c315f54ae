"""A held key: renewed from start to stop, one final action, a loss told once."""

from __future__ import annotations

from celery_lease._core.held_key import HeldKey
from celery_lease.testing import FakeClock
from tests.unit.conftest import SpyStore


def held(store: SpyStore, clock: FakeClock, lost: list[str]) -> HeldKey:
    assert store.acquire("k", "me", 3000) is not None
    return HeldKey(
        store=store,
        key="k",
        owner="me",
        ttl=3,
        sent_at=clock.monotonic(),
        max_hold_at=None,
        on_lost=lost.append,
    )


class TestHeldKey:
    def test_renewed_every_third_of_its_ttl_until_stopped(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Started, it is renewed at ttl/3; stopped, its holder sends the final action."""
        lost: list[str] = []
        key = held(store, clock, lost)
        key.start(clock)
        clock.advance(1.0)
        store.wait_renewals(1)
        settled, final, lapsed = key.stop()
        assert (settled, final, lapsed) == (True, True, None)
        assert not key.claim_final()  # the stop claimed it
        assert not key.fence(lambda: None)  # nothing in flight: the caller acts itself
        assert key.abandon() is None and lost == []
        store.release("k", "me")

    def test_renew_at_renews_it_at_once(self, store: SpyStore, clock: FakeClock) -> None:
        """``renew_at`` now: the first renewal does not wait for ttl/3."""
        key = held(store, clock, [])
        key.start(clock, renew_at=clock.monotonic())
        store.wait_renewals(1)
        key.stop()
        store.release("k", "me")

    def test_a_recorded_loss_is_told_once(self, store: SpyStore, clock: FakeClock) -> None:
        """``record`` then ``notify`` tells ``on_lost``; a second record is refused."""
        lost: list[str] = []
        key = held(store, clock, lost)
        key.start(clock)
        assert key.record("released") and not key.record("again")
        assert key.settle() and key.claim_final()
        store.release("k", "me")
        key.notify("released")
        assert lost == ["released"]
        assert key.stop()[1] is False  # the end was claimed already
