"""One renewer thread per store (and clock) in a process, for the leases held in that store.

Each held lease is an :class:`Entry` in a heap ordered by its next action: renew it (every
ttl/3; due ones in one ``renew_many`` where the store has it), retry a failed renewal, or record
it lost. How a lease ended is one record, written once under the renewer's lock
(``lost_reason``, then ``closed``): finished (``None``), ``"taken"``, ``"replaced"`` (a newer
``on_held="replace"`` execution asked it to stop), ``"expired"``, ``"max_hold"`` or
``"released"``. Whoever records first wins, but a refusal answered while the exit waits for
that renewal turns "finished" into ``"taken"`` or ``"replaced"`` (:meth:`Renewer.remove`). A key
lost by running out of time (:data:`FREED_ON_LOSS`) is released owner-checked on the dispatcher
once the loss is notified (a late renewal may have kept it; one after the release is refused).
The holder's exit waits for a renewal in flight (:meth:`Renewer.settle`) or fences its final
action (:meth:`Renewer.fence`). ``on_lost`` and observers run outside every lock. The renewer
and watchdog threads, idle exit and fork resets: ``docs/internals.md`` (sections 1 and 5).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from celery_lease import _forking as forking
from celery_lease._core.dispatch import get_dispatcher
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.stores.base import SupportsReplace, conforms
from celery_lease.stores.slots import marked, split_slot

logger = logging.getLogger("celery_lease.renewer")

DRIFT_FACTOR = 0.01
"""Fraction of the ttl subtracted from a lease's local validity for clock drift (Redlock's)."""

DRIFT_MARGIN = 0.002
"""Seconds subtracted from a lease's local validity on top of the drift fraction."""

IDLE_EXIT = 30.0
"""Seconds (of the renewer's clock) the thread waits with no lease before it exits."""

IDLE_POLL = 1.0
"""Seconds between two looks at the heap while idle (a lease due sooner wakes the thread)."""

COMPACT_AFTER = 256
"""Closed entries after which (and once as many as are held) the heaps drop their items."""

FREED_ON_LOSS = frozenset({"expired", "max_hold"})
"""Loss reasons after which the key is released owner-checked (a late renewal may hold it)."""

FLIGHT_WAIT = 1.0
"""Seconds (never past the validity) :meth:`Renewer.remove` waits for a renewal in flight."""


def validity(sent_at: float, ttl: float) -> float:
    """The last moment (clock seconds) a lease whose request left at ``sent_at`` is surely held."""
    return sent_at + ttl - (ttl * DRIFT_FACTOR + DRIFT_MARGIN)


class Entry:
    """What the renewer knows of one held lease. ``valid_until`` (clock seconds): surely held
    until then. ``lost_reason`` is written before ``closed``: a reader that sees ``closed`` then
    reads the final reason. ``on_lost(reason)``: called once, outside every lock."""

    __slots__ = (
        "acquired_at", "closed", "due", "finalized", "free_on_loss", "inflight", "key", "landed",
        "last_error", "lost_reason", "max_hold_at", "on_lost", "owner", "redo", "refused",
        "renewals", "renewer", "store", "token", "ttl", "ttl_ms", "valid_until",
    )  # fmt: skip

    # Positional too: a class called with keywords costs several times a positional call, and
    # the lease's enter makes one per lease.
    def __init__(
        self,
        store: Any,
        key: str,
        owner: str,
        ttl: float,
        sent_at: float,
        max_hold_at: float | None,
        on_lost: Callable[[str], None],
        token: int | None = None,
        free_on_loss: bool = True,
    ) -> None:
        self.store = store
        self.key = key
        self.owner = owner
        self.token = token  # for snapshot() only
        self.acquired_at = sent_at
        self.renewals = 0  # successful renewals (snapshot())
        self.last_error: str | None = None  # of the last renewal attempt, if it failed
        self.ttl = ttl
        ms = round(ttl * 1000)
        self.ttl_ms = ms if ms > 1 else 1  # at least 1
        self.valid_until = sent_at + ttl - (ttl * DRIFT_FACTOR + DRIFT_MARGIN)  # validity()
        self.max_hold_at = max_hold_at
        self.on_lost = on_lost
        self.lost_reason: str | None = None
        self.closed = False
        due = sent_at + ttl / 3
        self.due = due if max_hold_at is None or not max_hold_at < due else max_hold_at  # _cap()
        self.renewer: Renewer | None = None  # set by Renewer.add
        self.inflight = False  # a renewal of it is between being taken and being answered
        self.landed: threading.Event | None = None  # made only when someone waits for it
        self.redo: Callable[[], None] | None = None  # run by the renewer after the flight
        self.finalized = False  # the holder's release (or cooldown) was sent
        # The loss reason of a renewal refused while the exit waited for it (``"taken"`` or
        # ``"replaced"``), else None.
        self.refused: str | None = None
        self.free_on_loss = free_on_loss  # False: an owner id shared by design

    def overdue(self, now: float) -> str | None:
        """``"max_hold"`` or ``"expired"`` when the lease is past that deadline at ``now``."""
        if self.max_hold_at is not None and now >= self.max_hold_at:
            return "max_hold"
        if now >= self.valid_until:
            return "expired"
        return None

    def _cap(self, due: float) -> float:
        return due if self.max_hold_at is None else min(due, self.max_hold_at)


class Renewer:
    """Renews the leases of one ``store`` on one daemon thread, waiting on ``clock``; one per
    (clock, store) (:func:`get_renewer`), both held strongly so neither's ``id`` is reused."""

    def __init__(self, clock: Clock, store: Any) -> None:
        self.clock = clock
        self.store = store
        self._registry_key = (id(clock), id(store))  # its key in the registry
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, Entry]] = []
        self._deadlines: list[tuple[float, int, Entry]] = []
        # Entries added while no store call was watched, not yet in _deadlines: moved there when
        # the next watched call begins (the watchdog reads _deadlines only during one).
        self._unwatched: list[Entry] = []
        self._seq = itertools.count()
        self._wake = threading.Event()
        self._next_wake = float("inf")
        self._idle_since: float | None = None  # when the last lease left
        self._thread: threading.Thread | None = None
        self._entries: set[Entry] = set()
        self._closed = 0  # entries closed since the heaps were last compacted
        self._watchdog: threading.Thread | None = None
        self._in_io = False
        # Set on each change of _in_io, an add during a store call, and the end; cleared only by
        # the watchdog, before it reads the state: no wake-up is lost.
        self._watch_wake = threading.Event()
        self._stopping = False
        self._observers: tuple[_Observer, ...] = ()
        self.sweeps = 0  # sweeps that sent at least one renewal (for benchmarks and tests)

    def observe_renewals(self, callback: RenewalObserver) -> Callable[[], None]:
        """Call ``callback(key, token, seconds, ok)`` for every renewal result of this renewer;
        returns a function that unregisters it. ``seconds``: the store call's round trip (one per
        ``renew_many`` batch); ``ok``: True (renewed), False (refused) or None (the call failed).
        Called on the renewer thread, outside its lock: keep it quick. What it raises is logged
        once per observer. It keeps the renewer registered across idle exits."""
        observer = _Observer(callback)
        with self._lock:
            successor = _register(self)
            if successor is None:
                self._observers = (*self._observers, observer)
        if successor is not None:  # this one left the registry meanwhile
            return successor.observe_renewals(callback)

        def forget() -> None:
            with self._lock:
                self._observers = tuple(o for o in self._observers if o is not observer)
                if not self._observers and self._thread is None and not self._entries:
                    _forget_idle(self)

        return forget

    def add(self, entry: Entry) -> None:
        """Start renewing ``entry``, starting the thread if needed; a renewer no longer the
        registered one hands it to its successor (one store, one renewer).

        Raises:
            ValueError: when ``entry`` is held in another store than this renewer's.
        """
        if entry.store is not self.store:
            raise ValueError(
                f"Renewer.add(entry={entry.key!r}): the entry's store {entry.store!r} is not this"
                f" renewer's {self.store!r}; use get_renewer(clock, entry.store)"
            )
        entry.renewer = self
        with self._lock:  # only the idle exit, under this lock too, unregisters this renewer
            # _register(self), its usual answer read first
            successor = None if _registry.get(self._registry_key) is self else _register(self)
            if successor is None:
                heapq.heappush(self._heap, (entry.due, next(self._seq), entry))
                watch = self._in_io  # the watchdog must count this lease's deadline too
                if watch:
                    heapq.heappush(self._deadlines, (_deadline(entry), next(self._seq), entry))
                else:
                    self._unwatched.append(entry)
                self._entries.add(entry)
                self._stopping = False
                if self._thread is None:
                    self._next_wake = float("inf")
                    self._thread = threading.Thread(
                        target=self._run, name="celery-lease-renewer", daemon=True
                    )
                    _note_running(self, True)
                    self._thread.start()
                    return
                wake = entry.due < self._next_wake
        if successor is not None:
            successor.add(entry)
            return
        if watch:
            self._watch_wake.set()
        if wake:  # only when the new lease is due before the thread means to wake anyway
            self._wake.set()

    def remove(self, entry: Entry) -> tuple[bool, bool, str | None]:
        """Stop renewing ``entry``; ``(settled, final, lapsed)``. Records "finished", or
        ``"expired"``/``"max_hold"`` when past that deadline; a renewal in flight is waited for
        (:meth:`settle`), and refused in time makes it ``"taken"`` (``"replaced"`` when the store
        marked it so). ``settled``: no renewal can still land (else :meth:`fence`); ``final``:
        the caller sends the release or cooldown; ``lapsed``: the loss recorded here, to notify
        after the release. Calls come before the first change, so an interrupt leaves it
        untouched or recorded (:meth:`abandon` ends it).
        """
        with self._lock:
            final = not entry.finalized
            entry.finalized = True
            if entry.closed:
                self._forget(entry)  # idempotent: in case an interrupt cut the recorder short
                return True, final, None  # already lost: nothing of its holder's is cooled down
            now = self.clock.monotonic()
            reason = entry.overdue(now)
            inflight = entry.inflight
            entry.lost_reason = reason  # _record(), without a call between the two stores
            entry.closed = True
            self._forget(entry, now)
            if reason is not None or not inflight:
                if reason is None:  # finished, nothing in flight: no loss can be told any more
                    entry.on_lost = _finished  # lets go of the holder (often a cycle with it)
                return True, final, reason
        settled = self.settle(entry)
        with self._lock:
            refused = entry.refused
            if refused is None or entry.lost_reason is not None:
                return settled, final, None
            entry.lost_reason = refused  # refused while the exit waited: the exit reports it
            return settled, final, refused

    def record(self, entry: Entry, reason: str) -> bool:
        """Record the loss of ``entry`` for ``reason`` unless its end is recorded; True if this
        call recorded it. The caller notifies (an early release frees the key first)."""
        with self._lock:
            if entry.closed:
                return False
            self._record(entry, reason)
            return True

    def expire_if_due(self, entry: Entry) -> str | None:
        """The loss reason of ``entry``, recording (and notifying) ``"expired"``/``"max_hold"``
        when due now, so a lease read lost stays lost; ``None`` while held or finished."""
        with self._lock:
            if entry.closed:
                return entry.lost_reason
            reason = entry.overdue(self.clock.monotonic())
            if reason is None:
                return None
            self._record(entry, reason)
        self.notify(entry, reason)
        return reason

    def settle(self, entry: Entry) -> bool:
        """Wait (at most :data:`FLIGHT_WAIT`, never past its validity) for a renewal of ``entry``
        in flight to be answered; True when none is left. Never waits on the renewer or watchdog
        thread (the renewal may be its own; the watchdog must stay free to report losses)."""
        with self._lock:
            if not entry.inflight:
                return True
            if threading.current_thread() in (self._thread, self._watchdog):
                return False
            if entry.landed is None:
                entry.landed = threading.Event()
            landed = entry.landed
            bound = min(FLIGHT_WAIT, entry.valid_until - self.clock.monotonic())
        if bound > 0:
            self.clock.wait(landed, bound)
        with self._lock:
            return not entry.inflight

    def fence(self, entry: Entry, action: Callable[[], None]) -> bool:
        """Have the renewer run ``action`` (a core store call) right after the renewal of
        ``entry`` in flight returns; False when none is in flight (the caller runs it now)."""
        with self._lock:
            if not entry.inflight:
                return False
            entry.redo = action
            return True

    def abandon(self, entry: Entry) -> str | None:
        """End ``entry`` whatever state an interrupted :meth:`remove` (or add) left (the caller
        releases); the loss it recorded, for the caller to notify. Idempotent."""
        with self._lock:
            entry.finalized = True
            reason = None
            if not entry.closed:
                reason = entry.overdue(self.clock.monotonic())
                entry.lost_reason = reason
                entry.closed = True
            self._forget(entry)  # also when an interrupted remove() closed it but stopped here
            return reason

    def run_unless_lost(self, entry: Entry, action: Callable[[], None]) -> bool:
        """Run ``action`` (quick core bookkeeping) under the lock unless a loss of ``entry`` is
        recorded; True if it ran. Losses are recorded under the same lock: none is missed."""
        with self._lock:
            if entry.lost_reason is not None:
                return False
            action()
            return True

    def claim_final(self, entry: Entry) -> bool:
        """True exactly once per entry: for whoever sends the holder's release (or cooldown)."""
        with self._lock:
            if entry.finalized:
                return False
            entry.finalized = True
            return True

    def _record(self, entry: Entry, reason: str | None, now: float | None = None) -> None:
        """Under the lock, no call between the two stores: no interrupt lands between them.
        ``now``: the clock read under this lock hold, if it was."""
        entry.lost_reason = reason
        entry.closed = True
        self._forget(entry, now)

    def _forget(self, entry: Entry, now: float | None = None) -> None:
        """Drop a closed ``entry`` from the held ones; under the lock (``now``: the clock read
        under this hold, if it was). Its heap items stay until they surface, or until as many
        entries were closed as are held (at least :data:`COMPACT_AFTER`): then both heaps keep
        only live items."""
        entries = self._entries
        if entry in entries:
            entries.discard(entry)
            self._closed += 1
            if self._closed >= COMPACT_AFTER and self._closed >= len(entries):
                self._compact()
        if not entries:
            self._idle_since = self.clock.monotonic() if now is None else now

    def _compact(self) -> None:
        """Rebuild both heaps with only their live items (of held entries); under the lock."""
        self._heap = [i for i in self._heap if not i[2].closed and i[0] == i[2].due]
        heapq.heapify(self._heap)
        self._deadlines = [
            i for i in self._deadlines if not i[2].closed and i[0] == _deadline(i[2])
        ]
        heapq.heapify(self._deadlines)
        self._unwatched = [entry for entry in self._unwatched if not entry.closed]
        self._closed = 0

    @staticmethod
    def _notify_all(losses: list[tuple[Entry, str]]) -> None:
        """Notify losses on the renewer or watchdog thread: a listener's ``sys.exit`` must not
        end the renewals of every other lease."""
        for entry, reason in losses:
            Renewer.notify(entry, reason, BaseException)

    @staticmethod
    def notify(entry: Entry, reason: str, catch: type[BaseException] = Exception) -> None:
        """``entry.on_lost(reason)``, outside every lock, after handing over the release of a
        key that ran out of time; what it raises of ``catch`` is logged."""
        _free_lost_key(entry, reason)
        try:
            entry.on_lost(reason)
        except catch:
            logger.exception("celery-lease: reporting the loss of %r failed", entry.key)

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

    def held_keys(self) -> list[str]:
        """The keys of the leases being renewed, sorted."""
        with self._lock:
            return sorted(entry.key for entry in self._entries)

    def snapshot(self) -> list[dict[str, Any]]:
        """The leases this renewer holds now, as :func:`snapshot` describes them."""
        with self._lock:
            now = self.clock.monotonic()
            rows = [
                {
                    "key": entry.key,
                    "token": entry.token,
                    "owner": entry.owner,
                    "held_seconds": now - entry.acquired_at,
                    "valid_for_seconds": max(0.0, _deadline(entry) - now),
                    "renewals": entry.renewals,
                    "last_renewal_error": entry.last_error,
                }
                for entry in self._entries
                if not entry.closed
            ]
        return sorted(rows, key=lambda row: (row["key"], row["owner"]))

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
                    # add() wakes the thread only for a lease due before _next_wake
                    self._next_wake = min(exit_at, now + IDLE_POLL)
                    if now >= exit_at or self._stopping:
                        self._thread = None
                        self._watch_wake.set()  # lets the watchdog see that the renewer is gone
                        _note_running(self, False)
                        _forget_idle(self)
                        return
                timeout = self._next_wake - now
            if timeout > 0:
                self.clock.wait(self._wake, timeout)
            self._wake.clear()
            try:
                self._sweep()
            except BaseException:  # pragma: no cover - a bug here must not kill renewal for good
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
        to_renew: list[Entry] = []
        for entry in self._take_due(now):
            reason = entry.overdue(now)
            if reason is not None:
                lost.append((entry, reason))
            else:
                to_renew.append(entry)
        self._notify_watched([(e, reason) for e, reason in lost if self.record(e, reason)])
        if to_renew:
            self.sweeps += 1
            self._notify_watched(self._renew_group(to_renew))

    def _notify_watched(self, losses: list[tuple[Entry, str]]) -> None:
        """Notify ``losses`` watched like a store call (an immediate listener may block)."""
        if losses:
            with self._watched():
                self._notify_all(losses)

    def _renew_group(self, group: list[Entry]) -> list[tuple[Entry, str]]:
        """Renew the due entries (all of this renewer's store); returns the losses it recorded."""
        with self._lock:  # in flight from here on: remove() waits for them
            group = [entry for entry in group if not entry.closed]
            for entry in group:
                entry.inflight = True
        if not group:
            return []
        store = self.store
        with self._watched():
            sent_at = self.clock.monotonic()
            results = self._call_store(store, group)
            answered_at = self.clock.monotonic()
        recorded: list[tuple[Entry, str]] = []
        redo: list[Callable[[], None]] = []
        refused: list[Entry] = []
        failed: list[tuple[str, BaseException]] = []  # logged after the lock is let go
        # A refusal of a lease its holder's exit ended is read too where the store can mark a
        # holder replaced (the exit waits for it); asked outside the lock, refusals only.
        marks = any(result is False for result in results) and _replaceable(store)
        with self._lock:
            for entry, result in zip(group, results, strict=True):
                if (
                    result is False
                    and answered_at < entry.valid_until
                    and (not entry.closed or (marks and entry.lost_reason is None))
                ):
                    # why: asked after the rest of the batch, outside the lock; in flight until
                    # then, so the holder's exit waits for the verdict
                    refused.append(entry)
                    continue
                _landed(entry, redo)
                reason = self._apply(entry, result, sent_at, answered_at, failed)
                if reason is not None:
                    recorded.append((entry, reason))
        if failed:  # a blocking logging handler must not block this renewer's readers
            with self._watched():
                for key, error in failed:
                    logger.warning(
                        "celery-lease: renewing %r failed (%s); retrying while the lease is valid",
                        key,
                        error,
                    )
        if refused:
            recorded.extend(self._settle_refusals(store, refused, redo))
        if self._observers or _observers:
            with self._watched():
                _tell((*self._observers, *_observers), group, results, answered_at - sent_at)
        for action in redo:  # the holders' fenced actions; one that raises is logged
            with self._watched():
                try:
                    action()
                except BaseException:  # SystemExit, gevent.Timeout
                    logger.exception("celery-lease: a fenced action after a renewal failed")
        return recorded

    def _apply(
        self,
        entry: Entry,
        result: bool | BaseException,
        sent_at: float,
        answered_at: float,
        failed: list[tuple[str, BaseException]],
    ) -> str | None:
        """Apply a renewal answer (under the lock); the loss it recorded. Failures go to
        ``failed``."""
        if entry.closed:  # a late answer changes nothing, but an in-time refusal (remove())
            if result is False and answered_at < entry.valid_until:
                entry.refused = "taken"
            return None
        if answered_at >= entry.valid_until:  # too late: it may have read lost, and stays so
            self._record(entry, "expired")
            return "expired"
        if result is True:
            entry.renewals += 1
            entry.last_error = None
            entry.valid_until = validity(sent_at, entry.ttl)
            entry.due = entry._cap(sent_at + entry.ttl / 3)
            heapq.heappush(self._deadlines, (_deadline(entry), next(self._seq), entry))
        elif result is False:  # pragma: no cover - refusals in time go to `refused`
            self._record(entry, "taken")
            return "taken"
        else:
            entry.last_error = f"{type(result).__name__}: {result}"
            failed.append((entry.key, result))
            retry_at = self.clock.monotonic() + min(max(entry.ttl / 15, 0.05), 1.0)
            entry.due = entry._cap(min(retry_at, entry.valid_until))
        heapq.heappush(self._heap, (entry.due, next(self._seq), entry))
        return None

    def _settle_refusals(
        self, store: Any, refused: list[Entry], redo: list[Callable[[], None]]
    ) -> list[tuple[Entry, str]]:
        """Record the losses of renewals ``refused`` in time, with the store's reason; an entry
        whose end was recorded meanwhile only notes the refusal for a waiting exit."""
        with self._watched():
            reasons = [self._why_gone(store, entry) for entry in refused]
        recorded: list[tuple[Entry, str]] = []
        with self._lock:
            for entry, reason in zip(refused, reasons, strict=True):
                _landed(entry, redo)
                if entry.closed:
                    entry.refused = "replaced" if reason == "replaced" else "taken"
                    continue
                self._record(entry, reason)
                recorded.append((entry, reason))
        return recorded

    @staticmethod
    def _why_gone(store: Any, entry: Entry) -> str:
        """Why a renewal found ``entry`` gone, by (at most) two inspection calls. The counter is
        read before the holder (an acquisition between them reads ``"taken"``). Held under our
        owner id with the replace mark (a store conforming to ``SupportsReplace``):
        ``"replaced"``; held by another, or free with a higher counter: ``"taken"``; free with
        our token: ``"released"`` (a force-release, or the store's clock ran fast); counter
        missing or lower (data lost): ``"expired"``; the store cannot tell: ``"taken"``, the
        cautious answer. A slot's key found free reads ``"expired"``: its last token is the
        key-wide counter on some stores, which cannot tell a release from another slot's
        acquire."""
        get = getattr(store, "get", None)
        if not callable(get):
            return "taken"
        slot = split_slot(entry.key)[1] is not None
        last_token = getattr(store, "last_token", None)
        counts = entry.token is not None and callable(last_token) and not slot
        replaceable = _replaceable(store)
        if not counts and not replaceable and not slot:
            return "taken"
        try:
            counter = last_token(entry.key) if counts else None  # type: ignore[misc]
            info = get(entry.key)
        except BaseException:  # the renewer outlives it; without an answer, the old reason
            return "taken"
        if info is not None:
            replaced = replaceable and getattr(info, "owner", None) == marked(entry.owner)
            return "replaced" if replaced else "taken"
        if slot:
            return "expired"
        if not counts:
            return "taken"
        if not isinstance(counter, int) or entry.token is None or counter < entry.token:
            return "expired"
        return "released" if counter == entry.token else "taken"

    @staticmethod
    def _call_store(store: Any, group: list[Entry]) -> list[bool | BaseException]:
        """Renew ``group``, one result or exception per entry; never raises. A ``renew_many``
        that raises or answers a wrong count fails the whole batch (not retried key by key:
        docs/internals.md, "A renew_many batch")."""
        results: list[bool | BaseException]
        renew_many = getattr(store, "renew_many", None)
        if renew_many is not None and len(group) > 1:
            try:
                answer = list(renew_many([(e.key, e.owner, e.ttl_ms) for e in group]))
            except BaseException as exc:
                return [exc] * len(group)
            if len(answer) != len(group):
                error = RuntimeError(
                    f"{store!r}.renew_many() answered {len(answer)} results for {len(group)} leases"
                )
                return [error] * len(group)
            results = [r if isinstance(r, BaseException) else bool(r) for r in answer]
        else:
            results = []
            for entry in group:
                try:
                    results.append(bool(store.renew(entry.key, entry.owner, entry.ttl_ms)))
                except BaseException as exc:
                    results.append(exc)
        return results

    def _earliest_deadline(self) -> float | None:
        """The earliest deadline of a held lease (stale heap items dropped); under the lock."""
        heap = self._deadlines
        while heap and (heap[0][2].closed or heap[0][0] != _deadline(heap[0][2])):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """Arm the watchdog around a call that may block (store, user code, logging)."""
        self._begin_io()
        try:
            yield
        finally:
            self._end_io()

    def _begin_io(self) -> None:
        with self._lock:
            self._in_io = True
            if self._unwatched:  # the watchdog counts every held lease's deadline from here
                for entry in self._unwatched:
                    if not entry.closed:
                        heapq.heappush(self._deadlines, (_deadline(entry), next(self._seq), entry))
                self._unwatched = []
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="celery-lease-watchdog", daemon=True
                )
                self._watchdog.start()
        self._watch_wake.set()

    def _end_io(self) -> None:
        with self._lock:
            self._in_io = False
        self._watch_wake.set()

    def _watch(self) -> None:
        """Record leases whose deadline passes while the renewer is stuck in a store call."""
        while True:
            self._watch_wake.clear()  # before reading the state: a change after it sets it again
            with self._lock:
                if self._thread is None:
                    self._watchdog = None
                    return
                in_io = self._in_io
                deadline = self._earliest_deadline()
            if not in_io:
                self.clock.wait(self._watch_wake, None)
                continue
            now = self.clock.monotonic()
            if deadline is None or deadline > now:
                self.clock.wait(self._watch_wake, None if deadline is None else deadline - now)
                continue
            overdue: list[tuple[Entry, str]] = []
            with self._lock:
                now = self.clock.monotonic()
                while (deadline := self._earliest_deadline()) is not None and deadline <= now:
                    entry = heapq.heappop(self._deadlines)[2]
                    reason = entry.overdue(now) or "expired"
                    self._record(entry, reason)
                    overdue.append((entry, reason))
            self._notify_all(overdue)

    def _stop(self) -> list[threading.Thread]:
        """Tell the idle threads to exit now; returns them (to join)."""
        with self._lock:
            self._stopping = True
            threads = [t for t in (self._thread, self._watchdog) if t is not None]
        self._wake.set()
        self._watch_wake.set()
        return threads


def _finished(reason: str) -> None:
    """The ``on_lost`` of an entry recorded finished with no renewal in flight: every path that
    tells a loss first finds its end recorded, so none calls it."""


def _landed(entry: Entry, redo: list[Callable[[], None]]) -> None:
    """The renewal of ``entry`` was answered: wake a waiting exit, queue its fenced action."""
    entry.inflight = False
    if entry.landed is not None:
        entry.landed.set()
        entry.landed = None
    if entry.redo is not None:
        redo.append(entry.redo)
        entry.redo = None


def _replaceable(store: Any) -> bool:
    """Whether ``store`` can mark a holder replaced (``SupportsReplace``): its refusals are
    then read for the mark."""
    return conforms(store, SupportsReplace)


def _free_lost_key(entry: Entry, reason: str) -> None:
    """Hand the release of a key lost for a reason in :data:`FREED_ON_LOSS` to the dispatcher."""
    if reason not in FREED_ON_LOSS or not entry.free_on_loss:
        return
    try:
        get_dispatcher().submit(_release_lost, entry, f"release of the lost lease {entry.key!r}")
    except Exception:  # pragma: no cover - the key then expires by itself, as before
        logger.exception("celery-lease: could not hand over the release of %r", entry.key)


def _release_lost(entry: Entry) -> None:
    try:
        entry.store.release(entry.key, entry.owner)
    except Exception as exc:
        logger.warning(
            "celery-lease: freeing the key of the lost lease %r failed (%s);"
            " it expires within its ttl",
            entry.key,
            exc,
        )


RenewalObserver = Callable[[str, int | None, float, bool | None], object]
"""``(key, token, seconds, ok)``: see :meth:`Renewer.observe_renewals`."""


class _Observer:
    """One registered renewal observer; ``failed`` once it raised (logged that once)."""

    __slots__ = ("callback", "failed")

    def __init__(self, callback: RenewalObserver) -> None:
        if not callable(callback):
            raise TypeError(
                f"observe_renewals(callback={callback!r}): must be a callable taking"
                " (key, token, seconds, ok)"
            )
        self.callback = callback
        self.failed = False


_observers_lock = threading.Lock()
_observers: tuple[_Observer, ...] = ()
"""Observers of every renewer of the process (:func:`observe_renewals`); kept across fork."""


def observe_renewals(callback: RenewalObserver) -> Callable[[], None]:
    """:meth:`Renewer.observe_renewals` for every renewer of the process, later ones too."""
    global _observers
    observer = _Observer(callback)
    with _observers_lock:
        _observers = (*_observers, observer)

    def forget() -> None:
        global _observers
        with _observers_lock:
            _observers = tuple(o for o in _observers if o is not observer)

    return forget


def _tell(
    observers: tuple[_Observer, ...],
    group: list[Entry],
    results: list[bool | BaseException],
    seconds: float,
) -> None:
    """Report each renewal result of ``group`` to ``observers``; never raises."""
    for entry, result in zip(group, results, strict=True):
        ok = result if isinstance(result, bool) else None
        for observer in observers:
            try:
                observer.callback(entry.key, entry.token, seconds, ok)
            except BaseException:  # SystemExit too: the sweep's losses and actions still go on
                if not observer.failed:
                    observer.failed = True
                    logger.exception(
                        "celery-lease: renewal observer %r raised (logged once; it is still"
                        " called)",
                        observer.callback,
                    )


def _deadline(entry: Entry) -> float:
    """When ``entry`` must be reported lost if nothing renews it: validity or max_hold."""
    return entry._cap(entry.valid_until)


_registry_lock = threading.Lock()
_registry: dict[tuple[int, int], Renewer] = {}
"""The renewer of each (clock, store), by their ids; read without the lock, written under it."""
_running: set[Renewer] = set()  # renewers whose thread runs, registered or not


def get_renewer(clock: Clock | None, store: Any) -> Renewer:
    """The renewer of this process for ``store`` on ``clock`` (``None``: the system clock),
    made (not started) when missing. The system clock's skip the fork check: each acquisition
    made its owner id just before, which noticed a fork (:func:`_forking.generation`)."""
    if clock is None:
        clock = SYSTEM_CLOCK
    elif clock is not SYSTEM_CLOCK:
        forking.generation()
    key = (id(clock), id(store))
    renewer = _registry.get(key)
    if renewer is not None and renewer.clock is clock and renewer.store is store:
        return renewer
    with _registry_lock:
        renewer = _registry.get(key)
        if renewer is None or renewer.clock is not clock or renewer.store is not store:
            renewer = _registry[key] = Renewer(clock, store)
        return renewer


def renewers(clock: Clock | None = None) -> list[Renewer]:
    """The renewers of this process (registered, or running), of ``clock`` if given."""
    with _registry_lock:
        found = set(_registry.values()) | _running
    return [renewer for renewer in found if clock is None or renewer.clock is clock]


def _register(renewer: Renewer) -> Renewer | None:
    """``None`` when ``renewer`` is (or now becomes) the registered one of its (clock, store),
    else the one registered in its place. Under the renewer's lock."""

    key = renewer._registry_key
    if _registry.get(key) is renewer:
        return None
    with _registry_lock:
        current = _registry.setdefault(key, renewer)
    return None if current is renewer else current


def _note_running(renewer: Renewer, running: bool) -> None:
    """Track renewers with a live thread, for :func:`shutdown`; under the renewer's lock."""
    with _registry_lock:
        if running:
            _running.add(renewer)
        else:
            _running.discard(renewer)


def _forget_idle(renewer: Renewer) -> None:
    """Drop an idle renewer from the registry (under its lock), unless observers are on it."""
    if renewer._observers:
        return
    key = renewer._registry_key
    with _registry_lock:
        if _registry.get(key) is renewer:
            del _registry[key]


def snapshot() -> list[dict[str, Any]]:
    """The leases this process holds now, for ``celery inspect leases``; read-only.

    One dict per lease, sorted by key: ``key``, ``token`` (``None`` for an entry made without
    one), ``owner``, ``held_seconds`` (since the acquire was sent), ``valid_for_seconds`` (local
    validity or ``max_hold`` left, 0 when past), ``renewals`` and ``last_renewal_error``
    (``"Type: message"`` of the last attempt when it failed). Seconds of each renewer's clock.
    Never waits for a store call. A forked child sees only its own leases.
    """
    forking.generation()  # a child forked without the hooks: the parent's are forgotten
    rows = [row for renewer in renewers() for row in renewer.snapshot()]
    return sorted(rows, key=lambda row: (row["key"], row["owner"]))


def shutdown(timeout: float = 5.0) -> None:
    """Stop and join celery-lease's threads in this process: renewers, watchdogs, dispatcher
    (for leak-checking test suites and a clean exit; the next ``lease()`` starts them again).
    Loss callbacks already handed to the dispatcher run to their end first.

    Args:
        timeout: real seconds to wait for all the threads (default 5.0).

    Raises:
        ValueError: for a negative or non-numeric ``timeout``.
        RuntimeError: while leases are held in this process (named); nothing is stopped.
        TimeoutError: when a thread did not end within ``timeout`` (named).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds >= 0")
    deadline = time.monotonic() + timeout
    forking.generation()  # a child forked without the hooks: the parent's are forgotten
    stopping = renewers()
    held = sorted({key for renewer in stopping for key in renewer.held_keys()})
    if held:
        raise RuntimeError(
            "celery_lease.shutdown(): leases are still held on "
            + ", ".join(repr(key) for key in held)
            + "; leave their lease() blocks first"
        )
    threads: list[threading.Thread] = []
    for renewer in stopping:
        threads.extend(renewer._stop())
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    stuck.extend(get_dispatcher().stop(deadline))
    if stuck:
        raise TimeoutError(
            f"celery_lease.shutdown(): still running after {timeout:g} s: {', '.join(stuck)}"
        )


def _after_fork_in_child() -> None:
    global _observers_lock, _registry_lock
    _observers_lock = threading.Lock()  # observers registered before the fork stay
    _registry_lock = threading.Lock()
    _registry.clear()
    _running.clear()


forking.on_fork_child(_after_fork_in_child, name="renewer: registry, locks")
