"""One renewer thread per process (per clock) for all held leases.

Every held lease is an :class:`Entry` in a heap ordered by the time of its next action: renew it
(every ttl/3), retry a failed renewal, or declare it lost (its local validity ran out, or
``max_hold`` was reached). Renewals due together are sent together; a store with ``renew_many``
gets one round trip per sweep. The thread starts when the first lease is added and exits when
none is left. After ``fork`` a child starts from an empty registry: it never renews its parent's
leases.

The renewer never raises into its callers: a store error is retried while the lease is still
valid by the local estimate, then the lease is reported lost through its ``on_lost`` callback,
which is called exactly once, outside every lock.

A store call can hang (a blackholed connection without a socket timeout). So that loss is still
reported on time, a second thread, the watchdog, does no I/O at all: while the renewer is inside
a store call, it waits for the earliest validity deadline (or ``max_hold``) of the held leases
and reports the ones that pass it. Renewal itself stays on the one renewer thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from celery_lease.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "DRIFT_FACTOR",
    "DRIFT_MARGIN",
    "IDLE_EXIT",
    "IDLE_POLL",
    "Entry",
    "Renewer",
    "get_renewer",
    "validity",
]

logger = logging.getLogger(__name__)

DRIFT_FACTOR = 0.01
"""Fraction of the ttl subtracted from a lease's local validity for clock drift (Redlock's)."""

DRIFT_MARGIN = 0.002
"""Seconds subtracted from a lease's local validity on top of the drift fraction."""

IDLE_EXIT = 30.0
"""Seconds (of the renewer's clock) the thread waits with no lease before it exits.

Short leases taken one after another reuse the running thread instead of starting one each.
"""

IDLE_POLL = 1.0
"""Seconds between two looks at the heap while idle (a lease due sooner wakes the thread)."""


def validity(sent_at: float, ttl: float) -> float:
    """The last moment (clock seconds) a lease whose request left at ``sent_at`` is surely held."""
    return sent_at + ttl - (ttl * DRIFT_FACTOR + DRIFT_MARGIN)


class Entry:
    """What the renewer knows of one held lease.

    ``valid_until`` (clock seconds) is the local estimate of validity: the lease is surely held
    until then, counted from the moment the last successful acquire/renew request was sent.
    """

    __slots__ = (
        "closed",
        "due",
        "key",
        "lost_reason",
        "max_hold_at",
        "on_lost",
        "owner",
        "store",
        "ttl",
        "ttl_ms",
        "valid_until",
    )

    def __init__(
        self,
        *,
        store: Any,
        key: str,
        owner: str,
        ttl: float,
        sent_at: float,
        max_hold_at: float | None,
        on_lost: Callable[[str], None],
    ) -> None:
        self.store = store
        self.key = key
        self.owner = owner
        self.ttl = ttl
        self.ttl_ms = max(1, round(ttl * 1000))
        self.valid_until = validity(sent_at, ttl)
        self.max_hold_at = max_hold_at
        self.on_lost = on_lost
        self.lost_reason: str | None = None
        self.closed = False
        self.due = self._cap(sent_at + ttl / 3)

    def _cap(self, due: float) -> float:
        return due if self.max_hold_at is None else min(due, self.max_hold_at)

    def retry_delay(self) -> float:
        """Seconds to wait before retrying a renewal that failed with a store error."""
        return min(max(self.ttl / 15, 0.05), 1.0)


class Renewer:
    """Renews every lease added to it, on one daemon thread, waiting on ``clock``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, Entry]] = []
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()
        self._wake = threading.Event()
        self._next_wake = float("inf")
        self._idle_since: float | None = None  # when the last lease left
        self._thread: threading.Thread | None = None
        self._entries: set[Entry] = set()
        self._watchdog: threading.Thread | None = None
        self._in_io = False
        self._io_begun = threading.Event()
        self._io_ended = threading.Event()
        self.sweeps = 0
        """Number of sweeps that sent at least one renewal (for benchmarks and tests)."""

    def add(self, entry: Entry) -> None:
        """Start renewing ``entry``; starts the thread if it is not running."""
        with self._lock:
            heapq.heappush(self._heap, (entry.due, next(self._seq), entry))
            heapq.heappush(self._deadlines, (_deadline(entry), next(self._seq), entry))
            self._entries.add(entry)
            if self._thread is None:
                self._next_wake = float("inf")
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-renewer", daemon=True
                )
                self._thread.start()
                return
            wake = entry.due < self._next_wake
        if wake:  # only when the new lease is due before the thread means to wake anyway
            self._wake.set()

    def remove(self, entry: Entry) -> None:
        """Stop renewing ``entry`` (its heap item is dropped lazily)."""
        with self._lock:
            if not entry.closed:
                self._close(entry)

    def _close(self, entry: Entry) -> None:
        """Mark ``entry`` closed and note when the renewer became idle; under the lock."""
        entry.closed = True
        self._entries.discard(entry)
        if not self._entries:
            self._idle_since = self.clock.monotonic()

    @property
    def thread(self) -> threading.Thread | None:
        """The running renewer thread, if any."""
        return self._thread

    @property
    def watchdog(self) -> threading.Thread | None:
        """The running watchdog thread, if any."""
        return self._watchdog

    def __len__(self) -> int:
        """Number of leases being renewed."""
        return len(self._entries)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._heap and self._heap[0][2].closed:
                    heapq.heappop(self._heap)
                now = self.clock.monotonic()
                if self._heap:
                    self._next_wake = self._heap[0][0]
                else:
                    idle_since = now if self._idle_since is None else self._idle_since
                    exit_at = idle_since + IDLE_EXIT
                    # Look again every IDLE_POLL seconds, so that a new lease due later than
                    # that needs no wake-up call (add() wakes the thread only for earlier ones).
                    self._next_wake = min(exit_at, now + IDLE_POLL)
                    if now >= exit_at:
                        self._thread = None
                        self._io_begun.set()  # lets the watchdog see that the renewer is gone
                        _forget_idle(self)
                        return
                timeout = self._next_wake - now
            if timeout > 0:
                self.clock.wait(self._wake, timeout)
            self._wake.clear()
            try:
                self._sweep()
            except Exception:  # pragma: no cover - a bug here must not kill renewal for good
                logger.exception("celery-lease renewer sweep failed")

    def _take_due(self, now: float) -> list[Entry]:
        due: list[Entry] = []
        with self._lock:
            while self._heap:
                at, _, entry = self._heap[0]
                if entry.closed or at != entry.due:
                    heapq.heappop(self._heap)
                    continue
                if at > now + min(entry.ttl / 30, 0.5):
                    break
                heapq.heappop(self._heap)
                due.append(entry)
        return due

    def _sweep(self) -> None:
        now = self.clock.monotonic()
        lost: list[tuple[Entry, str]] = []
        to_renew: dict[int, list[Entry]] = {}
        for entry in self._take_due(now):
            if entry.max_hold_at is not None and now >= entry.max_hold_at:
                lost.append((entry, "max_hold"))
            elif now >= entry.valid_until:
                lost.append((entry, "expired"))
            else:
                to_renew.setdefault(id(entry.store), []).append(entry)
        if to_renew:
            self.sweeps += 1
        for group in to_renew.values():
            lost.extend(self._renew_group(group))
        for entry, reason in lost:
            self._report_lost(entry, reason)

    def _renew_group(self, group: list[Entry]) -> list[tuple[Entry, str]]:
        store = group[0].store
        self._begin_io()
        try:
            sent_at = self.clock.monotonic()
            results = self._call_store(store, group)
        finally:
            self._end_io()
        lost: list[tuple[Entry, str]] = []
        answered_at = self.clock.monotonic()
        with self._lock:
            for entry, result in zip(group, results, strict=True):
                if entry.closed:
                    continue
                if answered_at >= entry.valid_until:
                    # The answer came too late: the lease already read as lost meanwhile, and a
                    # lost lease never comes back.
                    lost.append((entry, "expired"))
                    continue
                if result is True:
                    entry.valid_until = validity(sent_at, entry.ttl)
                    entry.due = entry._cap(sent_at + entry.ttl / 3)
                    heapq.heappush(self._deadlines, (_deadline(entry), next(self._seq), entry))
                elif result is False:
                    lost.append((entry, "taken"))
                    continue
                else:
                    logger.warning(
                        "celery-lease: renewing %r failed (%s); retrying while the lease is valid",
                        entry.key,
                        result,
                    )
                    now = self.clock.monotonic()
                    entry.due = entry._cap(min(now + entry.retry_delay(), entry.valid_until))
                heapq.heappush(self._heap, (entry.due, next(self._seq), entry))
        return lost

    @staticmethod
    def _call_store(store: Any, group: list[Entry]) -> list[bool | BaseException]:
        """Renew ``group`` (one store), one result or exception per entry; never raises."""
        results: list[bool | BaseException]
        renew_many = getattr(store, "renew_many", None)
        if renew_many is not None and len(group) > 1:
            try:
                results = list(renew_many([(e.key, e.owner, e.ttl_ms) for e in group]))
            except Exception as exc:
                results = [exc] * len(group)
        else:
            results = []
            for entry in group:
                try:
                    results.append(bool(store.renew(entry.key, entry.owner, entry.ttl_ms)))
                except Exception as exc:
                    results.append(exc)
        return results

    # Watchdog ---------------------------------------------------------------------------------

    def _earliest_deadline(self) -> float | None:
        """The earliest deadline of a held lease (stale heap items dropped); under the lock."""
        heap = self._deadlines
        while heap and (heap[0][2].closed or heap[0][0] != _deadline(heap[0][2])):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _begin_io(self) -> None:
        with self._lock:
            self._in_io = True
            self._io_ended.clear()
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="celery-lease-watchdog", daemon=True
                )
                self._watchdog.start()
        self._io_begun.set()

    def _end_io(self) -> None:
        with self._lock:
            self._in_io = False
        self._io_ended.set()

    def _watch(self) -> None:
        """Report leases whose deadline passes while the renewer is stuck in a store call."""
        while True:
            with self._lock:
                if self._thread is None:
                    self._watchdog = None
                    return
                in_io = self._in_io
                deadline = self._earliest_deadline()
            if not in_io:
                self.clock.wait(self._io_begun, None)
                self._io_begun.clear()
                continue
            now = self.clock.monotonic()
            if deadline is None or deadline > now:
                self.clock.wait(self._io_ended, None if deadline is None else deadline - now)
                continue
            overdue: list[Entry] = []
            with self._lock:
                while (deadline := self._earliest_deadline()) is not None and deadline <= now:
                    overdue.append(heapq.heappop(self._deadlines)[2])
            for entry in overdue:
                hold = entry.max_hold_at is not None and entry.max_hold_at <= now
                self._report_lost(entry, "max_hold" if hold else "expired")

    def _report_lost(self, entry: Entry, reason: str) -> None:
        with self._lock:
            if entry.closed:
                return
            self._close(entry)
        try:
            entry.on_lost(reason)
        except Exception:
            logger.exception("celery-lease: on_lost callback for %r raised", entry.key)


def _deadline(entry: Entry) -> float:
    """When ``entry`` must be reported lost if nothing renews it: validity or max_hold."""
    if entry.max_hold_at is None:
        return entry.valid_until
    return min(entry.valid_until, entry.max_hold_at)


_registry_lock = threading.Lock()
_registry: dict[int, Renewer] = {}


def get_renewer(clock: Clock | None = None) -> Renewer:
    """The renewer of this process for ``clock`` (default: the system clock)."""
    clock = clock if clock is not None else SYSTEM_CLOCK
    with _registry_lock:
        renewer = _registry.get(id(clock))
        if renewer is None or renewer.clock is not clock:
            renewer = _registry[id(clock)] = Renewer(clock)
        return renewer


def _forget_idle(renewer: Renewer) -> None:
    """Drop an idle renewer of a test clock, so fake clocks do not pile up in the registry."""
    if renewer.clock is SYSTEM_CLOCK:
        return
    with _registry_lock:
        if _registry.get(id(renewer.clock)) is renewer:
            del _registry[id(renewer.clock)]


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    _registry.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
