"""In-process store: thread-safe, for one process and for tests."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import (
    MAX_LIMIT,
    SLOT_MARK,
    counter_key,
    marked,
    release_channel,
    slot_key,
    unmarked,
)

__all__ = ["MemoryLockStore"]


@dataclass
class _Entry:
    owner: str | None
    expires: float  # store clock, monotonic seconds
    token: int


class MemoryLockStore:
    """A :class:`~celery_lease.LockStore` in this process's memory.

    Excludes across the threads of one process only. Expiry follows the clock's
    ``monotonic()`` (a wall-clock step neither frees nor extends a lease); ``time()`` only
    floors tokens. Entries of free keys are forgotten, the largest dropped token kept as a
    floor, so memory does not grow with every key ever locked while tokens only grow.

    Args:
        clock: time source (default: the system clock); pass a ``FakeClock`` in tests.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._floor = 0  # largest token of any dropped entry
        self._released: dict[str, threading.Event] = {}
        self._widths: dict[str, int] = {}  # key -> 1 + the highest slot of it ever taken
        self._tickets: dict[str, int] = {}  # key -> the last replace ticket drawn from its counter
        self._ops = 0

    @classmethod
    def from_url(cls, url: str) -> MemoryLockStore:
        """A new, empty store for ``memory://`` (the URL carries nothing more): each call, and
        so each process, gets its own."""
        return cls()

    @property
    def clock(self) -> Clock:
        """The clock this store's expiry is measured on (a lease waiting on it waits on it too)."""
        return self._clock

    def _now(self) -> float:
        return self._clock.monotonic()

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.owner is None or entry.expires <= now:
            return None
        return entry

    def _sweep(self, now: float) -> None:
        """Forget entries of free keys, remembering the largest token dropped."""
        dead = [k for k, e in self._entries.items() if e.owner is None or e.expires <= now]
        for key in dead:
            self._floor = max(self._floor, self._entries.pop(key).token)
        for key in [k for k in self._tickets if k not in self._entries]:
            self._floor = max(self._floor, self._tickets.pop(key))
        for key, width in list(self._widths.items()):
            if not any(slot_key(key, slot) in self._entries for slot in range(width)):
                del self._widths[key]  # no slot of it is live: its counter is in the floor

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.acquire_or_holder(key, owner, ttl_ms)[0]

    def acquire_or_holder(self, key: str, owner: str, ttl_ms: int) -> tuple[int | None, str | None]:
        """:meth:`acquire`; when refused, ``(None, owner of the live lease)``."""
        with self._lock:
            now = self._now()
            live = self._live(key, now)
            if live is not None:
                if live.owner != owner:
                    return None, live.owner
                live.expires = now + ttl_ms / 1000.0  # the holder again: same token, new expiry
                return live.token, None
            token = self._draw(key)
            self._entries[key] = _Entry(owner, now + ttl_ms / 1000.0, token)
            self._count_op(now)
            return token, None

    def _draw(self, counter: str) -> int:
        """The next token of the counter kept under ``counter`` (a key, or a key's slot
        counter): above its last one and every dropped one, floored at the clock in µs."""
        previous = self._entries.get(counter)
        last = previous.token if previous is not None else self._floor
        last = max(last, self._tickets.get(counter, 0))
        return max(last + 1, int(self._clock.time() * 1_000_000))

    def _count_op(self, now: float) -> None:
        self._ops += 1
        if self._ops % 1024 == 0:
            self._sweep(now)

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        """Take the lowest free slot of ``key`` below ``limit`` when fewer than ``limit`` of its
        slots are live (see :class:`~celery_lease.stores.base.SupportsSlots`)."""
        if not 1 <= limit <= MAX_LIMIT or SLOT_MARK in key:
            raise ValueError(
                f"acquire_slot({key!r}, limit={limit!r}): needs 1 <= limit <= {MAX_LIMIT}"
                " and a key without U+001F"
            )
        expires_in = ttl_ms / 1000.0
        with self._lock:
            now = self._now()
            free: int | None = None
            held = 0
            for slot in range(max(limit, self._widths.get(key, 0))):
                live = self._live(slot_key(key, slot), now)
                if live is None:
                    if free is None and slot < limit:
                        free = slot
                    continue
                if live.owner == owner:
                    live.expires = now + expires_in
                    return slot, live.token
                held += 1
            if held >= limit or free is None:
                return None
            counter = counter_key(key)
            token = self._draw(counter)
            self._entries[counter] = _Entry(None, 0.0, token)
            self._entries[slot_key(key, free)] = _Entry(owner, now + expires_in, token)
            self._widths[key] = max(free + 1, self._widths.get(key, 0))
            self._count_op(now)
            return free, token

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        """Ask the live holder of ``key`` to stop (see
        :class:`~celery_lease.stores.base.SupportsReplace`)."""
        with self._lock:
            now = self._now()
            if ticket is None:
                ticket = self._tickets[key] = self._draw(key)
            live = self._live(key, now)
            if live is None:
                return ticket, None, False
            assert live.owner is not None
            owner, asked = unmarked(live.owner)
            if holder is not None and owner != holder:
                return ticket, owner, False
            if not asked:
                live.owner = marked(owner)
            return ticket, owner, True

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        with self._lock:
            now = self._now()
            entry = self._live(key, now)
            if entry is None or entry.owner != owner:
                return False
            entry.expires = now + ttl_ms / 1000.0
            return True

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return [self.renew(key, owner, ttl_ms) for key, owner, ttl_ms in items]

    def release(self, key: str, owner: str) -> None:
        with self._lock:
            entry = self._live(key, self._now())
            if entry is None or entry.owner is None or unmarked(entry.owner)[0] != owner:
                return
            entry.owner = None
            event = self._released.pop(release_channel(key), None)
        if event is not None:
            event.set()

    def release_owned_slots(self, key: str, owner: str) -> None:
        """Release every slot of ``key`` that ``owner`` holds (see
        :class:`~celery_lease.stores.base.SupportsOwnedSlotsRelease`)."""
        with self._lock:
            now = self._now()
            freed = False
            for slot in range(self._widths.get(key, 0)):
                entry = self._live(slot_key(key, slot), now)
                if entry is not None and entry.owner and unmarked(entry.owner)[0] == owner:
                    entry.owner = None
                    freed = True
            event = self._released.pop(key, None) if freed else None
        if event is not None:
            event.set()

    def wait_for_release(self, key: str, timeout: float) -> bool:
        with self._lock:
            event = self._released.setdefault(key, threading.Event())
        return self._clock.wait(event, timeout)

    def _info(self, key: str, entry: _Entry, now: float) -> LeaseInfo:
        assert entry.owner is not None
        return LeaseInfo(key, entry.owner, entry.token, max(0.0, entry.expires - now))

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        with self._lock:
            now = self._now()
            return [
                self._info(k, e, now)
                for k, e in sorted(self._entries.items())
                if k.startswith(prefix) and self._live(k, now) is not None
            ]

    def get(self, key: str) -> LeaseInfo | None:
        with self._lock:
            now = self._now()
            entry = self._live(key, now)
            return None if entry is None else self._info(key, entry, now)

    def last_token(self, key: str) -> int | None:
        """The last token issued for ``key`` or the last replace ticket drawn from its counter,
        whichever is greater (``None``: neither is remembered)."""
        with self._lock:
            entry = self._entries.get(key)
            ticket = self._tickets.get(key)
            if entry is None:
                return ticket
            return entry.token if ticket is None else max(entry.token, ticket)

    def force_release(self, key: str) -> LeaseInfo | None:
        with self._lock:
            now = self._now()
            entry = self._live(key, now)
            if entry is None:
                return None
            info = self._info(key, entry, now)
            entry.owner = None
            event = self._released.pop(release_channel(key), None)
        if event is not None:
            event.set()
        return info

    def __len__(self) -> int:
        """Number of key entries currently remembered (live or not yet swept)."""
        return len(self._entries)

    def __repr__(self) -> str:
        return f"MemoryLockStore(clock={self._clock!r})"
