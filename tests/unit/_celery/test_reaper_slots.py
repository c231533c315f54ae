"""The reaper frees the slot a dead pool child held, and only it; ``lock_released`` names the key
and the slot (the store lists each slot under its own store key)."""

from __future__ import annotations

from typing import Any

from celery_lease import MemoryLockStore
from celery_lease._celery.reaper import _Death
from celery_lease._core.dispatch import drain
from celery_lease.stores.slots import slot_key
from tests.unit._celery.test_reaper import DEAD, TTL_MS, owner, reaper_over, released

__all__ = ["released"]  # the fixture, used by name below


def test_a_dead_childs_slot_is_freed_and_named(released: list[dict[str, Any]]) -> None:
    """The dead child's slot 1 goes; slot 0 of another child stays; the signal says key "k",
    slot 1."""
    store = MemoryLockStore()
    alive = owner("t-alive", pid=DEAD + 1)
    assert store.acquire_slot("k", alive, TTL_MS, 3) is not None
    got = store.acquire_slot("k", owner("t1"), TTL_MS, 3)
    assert got is not None and got[0] == 1
    reaper_over(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
    assert drain()
    assert store.get(slot_key("k", 1)) is None
    info = store.get(slot_key("k", 0))
    assert info is not None and info.owner == alive
    (sent,) = released
    assert (sent["key"], sent["slot"], sent["token"]) == ("k", 1, got[1])


def test_a_key_without_slots_is_named_slot_0(released: list[dict[str, Any]]) -> None:
    store = MemoryLockStore()
    store.acquire("k", owner("t1"), TTL_MS)
    reaper_over(store).release(_Death(DEAD, -9, {"t1": "t.run"}))
    assert drain()
    (sent,) = released
    assert (sent["key"], sent["slot"]) == ("k", 0)
