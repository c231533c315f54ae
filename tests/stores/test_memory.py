"""The memory store runs the store contract, slots and replace included (one process only, fake
clock)."""

from __future__ import annotations

from celery_lease.stores.base import LockStore
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.testing import FakeClock
from tests.stores.contract import StoreContract
from tests.stores.slot_contract import ReplaceContract, SlotContract


class TestMemoryStore(SlotContract, ReplaceContract, StoreContract):
    """MemoryLockStore on a FakeClock."""

    supports_processes = False
    stateful_examples = 50

    def make_store(self) -> LockStore:
        return MemoryLockStore(clock=self.clock)


def test_last_token_counts_a_replace_ticket() -> None:
    """A ticket drawn by ``mark_replaced`` is above every token so far: ``last_token`` reads it,
    held, expired, or drawn on a free key."""
    clock = FakeClock(1000.0)
    store = MemoryLockStore(clock=clock)
    token = store.acquire("k", "a", 3_000)
    assert token is not None
    ticket = store.mark_replaced("k")[0]
    assert ticket > token
    assert store.last_token("k") == ticket
    clock.advance(5.0)  # the marked lease expired
    assert store.get("k") is None
    assert store.last_token("k") == ticket
    free_ticket = store.mark_replaced("free")[0]
    assert store.last_token("free") == free_ticket
