"""The memory store runs the store contract, slots and replace included (one process only, fake
clock)."""

from __future__ import annotations

from celery_lease.stores.base import LockStore
from celery_lease.stores.memory import MemoryLockStore
from tests.stores.contract import StoreContract
from tests.stores.slot_contract import ReplaceContract, SlotContract


class TestMemoryStore(SlotContract, ReplaceContract, StoreContract):
    """MemoryLockStore on a FakeClock."""

    supports_processes = False
    stateful_examples = 50

    def make_store(self) -> LockStore:
        return MemoryLockStore(clock=self.clock)
