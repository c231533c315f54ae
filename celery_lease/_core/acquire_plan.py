"""The acquire plan: when to try a key, how long to pause and on which clock, when to give up,
and which failed attempt to clean up. It does no I/O: ``with`` and ``async with`` drive it
(as httpx's clients drive ``Auth.auth_flow``), performing each step (:class:`Try`,
:class:`Pause`, :class:`Hold`) and sending back the reply: a token, ``None`` (held), or
:class:`Failed`. The first try needs no plan (most keys are free): the driver calls
:func:`check_cancel`, tries, and holds when the reply's type is :data:`GRANTED`. A failed
attempt is released owner-checked by :func:`abandon_later` (its own owner id: never another
holder's lease).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from celery_lease._core.dispatch import get_dispatcher
from celery_lease.clock import Clock
from celery_lease.errors import LockNotAcquiredError, ReplicaLagError, RestartGraceError
from celery_lease.stores.base import SupportsReleaseNotify, conforms

POLL_FIRST = 0.05
"""Seconds before the first re-try of a held key; doubles after each try."""

POLL_MAX = 1.0
"""The longest interval, in seconds, between two tries of a held key."""

GRANTED = int
"""A try's reply whose type is this is a token: the key is the attempt's."""


def to_ms(seconds: float) -> int:
    """Whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))


def check_cancel(cancel: threading.Event | None, key: str) -> None:
    """Raise ``LockNotAcquiredError(key, "cancelled")`` once ``cancel`` is set (before each try)."""
    if cancel is not None and cancel.is_set():
        raise LockNotAcquiredError(key, "cancelled")


def abandon_later(abandon: Callable[[str], object], key: str, owner: str) -> None:
    """``abandon(owner)`` on the dispatcher, so a store that just timed out does not make the
    caller wait for a second timeout before it sees the error."""
    get_dispatcher().submit(abandon, owner, f"clean-up of acquire {key!r}")


class Try(NamedTuple):
    """Ask the store for ``key`` under ``owner`` for ``ttl_ms`` milliseconds."""

    key: str
    owner: str
    ttl_ms: int


class Pause(NamedTuple):
    """Wait up to ``seconds`` for the key to be freed: on the store's release notification when
    ``clock`` is ``None``, else ``clock.wait(event, seconds)``; the async driver awaits
    ``wait_for_release`` in both cases (counted on the plan's clock, slept on the loop)."""

    seconds: float
    clock: Clock | None
    event: threading.Event | None


class Hold(NamedTuple):
    """The attempt got ``token`` after ``tries`` refusals; acquiring started at ``started`` and
    the try that got it was sent at ``sent_at`` (seconds of the lease's clock)."""

    owner: str
    token: int
    tries: int
    started: float
    sent_at: float


class Failed(NamedTuple):
    """What a step raised, sent back to the plan (which re-raises it or asks again)."""

    error: BaseException


Step = Try | Pause | Hold
Reply = int | None | Failed


class SentTry:
    """A first try sent before its context is entered: ``owner``, ``ttl_ms``, ``sent_at`` (the
    lease's clock, read before the send: the lease's validity counts from there) and ``gen``
    (the sending process's fork generation); its reply is read once, by :meth:`reply`."""

    __slots__ = ("gen", "owner", "read", "sent_at", "ttl_ms")

    def __init__(
        self, owner: str, ttl_ms: int, sent_at: float, read: Callable[[], int | None], gen: int
    ) -> None:
        self.owner, self.ttl_ms, self.sent_at, self.gen = owner, ttl_ms, sent_at, gen
        self.read: Callable[[], int | None] | None = read  # None once read

    def reply(self) -> Reply:
        """The try's reply, as a try's: a token, ``None`` (held) or :class:`Failed`."""
        read, self.read = self.read, None
        if read is None:
            raise RuntimeError("the reply of a sent try is read once")
        try:
            return read()
        except BaseException as exc:
            return Failed(exc)


class AcquirePlan:
    """The rest of an acquisition whose first try, ``attempt`` (sent at ``started`` on
    ``clock``), was not granted; ``send(reply)`` gives the next step (the first gets that try's
    reply). Pauses from :data:`POLL_FIRST` doubling to :data:`POLL_MAX` until ``wait`` seconds
    passed on ``wait_clock()`` (asked at the first refusal; earlier tries count). Raises
    ``LockNotAcquiredError`` past ``wait`` (``"cancelled"`` once ``cancel`` is set); the last
    ``ReplicaLagError``/``RestartGraceError`` when the wait runs out on one (asked again like a
    held key); whatever else a try raised, after ``abandon(owner)`` is handed over."""

    __slots__ = (
        "_abandon", "_cancel", "_clock", "_deadline", "_idle", "_interval", "_last", "_notify",
        "_sent_at", "_started", "_store", "_tries", "_try", "_wait", "_wait_clock", "_waits_on",
    )  # fmt: skip

    def __init__(
        self,
        attempt: Try,
        started: float,
        wait: float,
        store: object,
        clock: Clock,
        wait_clock: Callable[[], Clock],
        cancel: threading.Event | None,
        abandon: Callable[[str], object],
    ) -> None:
        self._try, self._started, self._sent_at = attempt, started, started
        self._last: Step = attempt
        self._wait, self._store, self._clock, self._wait_clock = wait, store, clock, wait_clock
        self._cancel, self._abandon = cancel, abandon
        self._tries = 0
        self._waits_on: Clock | None = None  # looked up at the first refusal
        self._deadline = self._interval = 0.0
        self._notify = False
        self._idle: threading.Event | None = None

    def send(self, reply: Reply) -> Step:
        """The step after the last one, which gave ``reply`` (``None`` after a pause)."""
        if type(self._last) is Pause:
            check_cancel(self._cancel, self._try.key)
            self._sent_at = self._clock.monotonic()
            self._last = self._try
            return self._try
        step = self._last = self._after_try(reply)
        return step

    def _after_try(self, reply: Reply) -> Hold | Pause:
        lagging = None
        if type(reply) is GRANTED:
            return Hold(self._try.owner, reply, self._tries, self._started, self._sent_at)
        if isinstance(reply, Failed):
            if not isinstance(reply.error, (ReplicaLagError, RestartGraceError)):
                self._abandon_later()  # it may have taken effect, its reply lost
                raise reply.error
            lagging = reply.error  # asked again like a held key, raised when the wait runs out
        elif reply is not None:  # a token of another int type (an int subclass): granted too
            return Hold(self._try.owner, reply, self._tries, self._started, self._sent_at)
        self._tries += 1
        waits_on = self._waits_on or self._first_refusal()
        remaining = self._deadline - waits_on.monotonic()
        if remaining <= 0:
            if lagging is not None:
                self._abandon_later()
                raise lagging
            raise LockNotAcquiredError(self._try.key)
        seconds = min(self._interval, remaining)
        self._interval = min(self._interval * 2, POLL_MAX)
        if self._notify:
            return Pause(seconds, None, None)
        return Pause(seconds, waits_on, self._idle)

    def _first_refusal(self) -> Clock:
        """The clock the wait is counted on; whether the store's notification sleeps on it."""

        clock, store = self._clock, self._store
        self._interval = POLL_FIRST
        waits_on = self._waits_on = self._wait_clock()
        # What the tries took until now, on the lease's clock, counts against the wait.
        self._deadline = waits_on.monotonic() + self._wait - (clock.monotonic() - self._started)
        self._notify = conforms(store, SupportsReleaseNotify) and (
            getattr(store, "clock", waits_on) is waits_on
        )
        if not self._notify:
            self._idle = self._cancel or threading.Event()
        return waits_on

    def _abandon_later(self) -> None:
        abandon_later(self._abandon, self._try.key, self._try.owner)
