"""How a key's slots and a replaced holder are written in a store: the names every store uses.

A key used with ``limit`` (``lease(key, limit=n)``, ``lock_limit``) holds up to ``n`` leases,
each in its own *slot*. Slot ``i`` of ``key`` is an ordinary lease on the store key
:func:`slot_key` ``(key, i)``: renewed, released, listed, reaped and force-released as any key.
Only :meth:`~celery_lease.stores.base.SupportsSlots.acquire_slot` knows the slots belong together:
it counts the live ones, picks a free one and draws the token from the key's slot counter (kept
under :func:`counter_key`), so a slot's token is larger than every token issued earlier to any
slot of the key. A key's slots and the key itself (without ``limit``) are separate: a lease taken
without ``limit`` does not count against the slots, nor they against it.

A holder asked to stop by ``on_held="replace"`` keeps its lease until it releases it or the
lease expires, but its owner id is stored with :data:`REPLACED_MARK` appended: its renewals are
refused from then on (the owner no longer matches) and its release still deletes it.
"""

from __future__ import annotations

from typing import cast

from celery_lease.stores.base import LockStore, SupportsOwnedSlotsRelease, conforms

__all__ = [
    "MAX_LIMIT",
    "REPLACED_MARK",
    "SLOT_MARK",
    "counter_key",
    "marked",
    "release_channel",
    "release_owner_slots",
    "slot_key",
    "split_slot",
    "unmarked",
]

SLOT_MARK = "\x1f"
"""The character (U+001F, unit separator) that ends a key and begins its slot suffix. A key given
to ``lease()`` or built from a task's arguments may not contain it."""

MAX_LIMIT = 100
"""The largest ``limit`` a key may have: an acquire reads every slot of the key, so its cost
grows with the limit, on every store. Measured on Redis 7.0 (``INFO commandstats``,
``usec_per_call`` over 2000-3000 refused slot acquires, every slot held, three runs on a loaded
2-core machine): 340-470 µs of server time per call at limit 100, 40-75 µs at limit 10 and
14-15 µs at limit 1; the server runs nothing else meanwhile."""

REPLACED_MARK = "\x1freplaced"
"""Appended to the stored owner id of a lease whose holder was asked to stop."""


def slot_key(key: str, slot: int) -> str:
    """The store key of ``slot`` (0-based) of ``key``: ``key`` + U+001F + the slot's digits."""
    return f"{key}{SLOT_MARK}{slot}"


def counter_key(key: str) -> str:
    """The store key under which ``key``'s slot token counter is kept (never a lease)."""
    return key + SLOT_MARK


def split_slot(store_key: str) -> tuple[str, int | None]:
    """``(key, slot)`` of a slot's store key; ``(store_key, None)`` for any other key."""
    head, mark, tail = store_key.rpartition(SLOT_MARK)
    if mark and tail.isdigit() and tail.isascii():
        return head, int(tail)
    return store_key, None


def release_channel(store_key: str) -> str:
    """The key whose waiters a release of ``store_key`` wakes: a slot's key for any of its
    slots (a waiter for a slot waits on the key), else ``store_key`` itself."""
    return split_slot(store_key)[0]


def marked(owner: str) -> str:
    """``owner`` as stored once its holder was asked to stop."""
    return owner + REPLACED_MARK


def unmarked(stored_owner: str) -> tuple[str, bool]:
    """``(owner id, whether it was asked to stop)`` of an owner id as a store holds it."""
    if stored_owner.endswith(REPLACED_MARK):
        return stored_owner[: -len(REPLACED_MARK)], True
    return stored_owner, False


def release_owner_slots(store: LockStore, key: str, owner: str, limit: int) -> None:
    """Release every slot of ``key`` that ``owner`` holds, owner-checked: in one call when
    ``store`` offers :class:`~celery_lease.stores.base.SupportsOwnedSlotsRelease`, else
    ``store.release(slot_key(key, i), owner)`` for each ``i`` below ``limit``, going on past a
    failed one. Undoes a slot acquire whose reply never came (owner ids are unique per attempt:
    no other holder is touched).

    Raises:
        Exception: the first error a release raised, once every slot was tried.
    """
    if conforms(store, SupportsOwnedSlotsRelease):
        cast(SupportsOwnedSlotsRelease, store).release_owned_slots(key, owner)
        return
    first: Exception | None = None
    for slot in range(limit):
        try:
            store.release(slot_key(key, slot), owner)
        except Exception as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first
