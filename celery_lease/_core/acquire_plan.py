"""The acquire plan: when to try a key, how long to pause and on which clock, when to give up,
and which failed attempt to clean up. It does no I/O.

``with`` and ``async with`` drive one plan (as httpx's clients drive
one ``Auth.auth_flow`` generator, and tenacity's ``Retrying`` and ``AsyncRetrying`` drive one
``iter()``). The plan (:class:`AcquirePlan`) gives a step; the driver performs it with its own
I/O and sends back the answer, or :class:`Failed` with what the call raised:

- :class:`Try`: ``store.acquire(key, owner, ttl_ms)``; send the token, or ``None`` (held).
- :class:`Pause`: wait up to ``seconds`` for the key to be freed, on the store's release
  notification (``clock`` ``None``) or on ``clock`` with ``event``; send ``None``. The async
  driver awaits its async store's ``wait_for_release`` in both cases: the wait is counted on
  the plan's clock, slept on the event loop.
- :class:`Hold`: the key is the attempt's: build and renew the lease. On success the driver
  is done; send :class:`Failed` if that failed.

A failed attempt (its reply lost, cancelled, or its lease never built) is released
owner-checked (the owner id is the attempt's own, so this never frees another holder's lease),
and the error is raised from the plan. A try that failed is released on the dispatcher; a lease
never built is released before the error is raised when the driver may block (``with``: an
interrupt that ends the process leaves nothing to a daemon thread), else on the dispatcher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from celery_lease._core.dispatch import get_dispatcher
from celery_lease.clock import Clock
from celery_lease.errors import LockNotAcquiredError, ReplicaLagError, RestartGraceError
from celery_lease.stores.base import SupportsReleaseNotify, conforms

__all__ = [
    "POLL_FIRST",
    "POLL_MAX",
    "AcquirePlan",
    "Failed",
    "Hold",
    "Pause",
    "Step",
    "Try",
    "to_ms",
]

POLL_FIRST = 0.05
"""Seconds before the first re-try of a held key; doubles after each try."""

POLL_MAX = 1.0
"""The longest interval, in seconds, between two tries of a held key."""


def to_ms(seconds: float) -> int:
    """Whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))


class Try(NamedTuple):
    """Ask the store for ``key`` under ``owner`` for ``ttl_ms`` milliseconds."""

    key: str
    owner: str
    ttl_ms: int


class Pause(NamedTuple):
    """Wait up to ``seconds`` for the key to be freed: on the store's release notification when
    ``clock`` is ``None``, else ``clock.wait(event, seconds)`` (``event``: the lease's
    ``cancel``, or one never set)."""

    seconds: float
    clock: Clock | None
    event: threading.Event | None


class Hold(NamedTuple):
    """The attempt got ``token``: build and renew its lease."""

    owner: str
    token: int
    tries: int
    """How many tries found the key held first."""
    started: float
    """When acquiring started (seconds of the lease's clock)."""
    sent_at: float
    """When the attempt that got it was sent (seconds of the lease's clock)."""


class Failed(NamedTuple):
    """What a step raised, sent back to the plan (which re-raises it or asks again)."""

    error: BaseException


Step = Try | Pause | Hold
Reply = int | None | Failed


class AcquirePlan:
    """The decisions of one acquisition in ``store`` (the synchronous store, whose clock and
    release notification the wait uses): :meth:`next_try` is the first step, and
    ``send(reply)`` the step after the last one, performed with ``reply``.

    Tries at once, then after pauses from :data:`POLL_FIRST` doubling to :data:`POLL_MAX`, until
    ``wait`` seconds have passed on the clock ``wait_clock()`` gives (asked at the first
    refusal; what the tries took until then, on ``clock``, counts against ``wait``).
    ``abandon(owner)`` releases a failed attempt: on the dispatcher, or in the driver's thread
    for a lease never built when ``blocking`` (the driver may block on the store). ``attempt``
    is the :class:`Try` each try sends.

    ``next_try`` and ``send`` raise ``LockNotAcquiredError`` when the key stays held past ``wait``
    (``"cancelled"`` once ``cancel`` is set, looked at before each try); the last
    ``ReplicaLagError`` / ``RestartGraceError`` when the wait runs out on one (they are asked
    again like a held key); whatever else a step raised (sent as :class:`Failed`).
    """

    __slots__ = (
        "_abandon", "_blocking", "_cancel", "_clock", "_deadline", "_idle", "_interval", "_last",
        "_notify", "_open", "_sent_at", "_started", "_store", "_tries", "_try", "_wait",
        "_wait_clock", "_waits_on",
    )  # fmt: skip

    def __init__(
        self,
        attempt: Try,
        wait: float,
        store: object,
        clock: Clock,
        wait_clock: Callable[[], Clock],
        cancel: threading.Event | None,
        abandon: Callable[[str], object],
        *,
        blocking: bool = False,
    ) -> None:
        self._try = attempt
        self._blocking = blocking
        self._wait, self._store, self._clock, self._wait_clock = wait, store, clock, wait_clock
        self._cancel, self._abandon = cancel, abandon
        self._started = clock.monotonic()
        self._tries = 0
        self._sent_at = self._started
        self._last: Step = attempt
        self._waits_on: Clock | None = None  # looked up at the first refusal
        self._deadline = self._interval = 0.0
        self._notify = False
        self._idle: threading.Event | None = None
        # A try was sent whose grant may stand and that nobody released or built a lease of.
        self._open = False

    def send(self, reply: Reply) -> Step:
        """The step after the last one, performed with ``reply`` (``None`` after a pause)."""
        last = self._last
        if type(reply) is int and last is self._try:  # the usual answer: the key is ours
            step: Step = Hold(last.owner, reply, self._tries, self._started, self._sent_at)
            self._last = step
            return step
        if type(last) is Pause:
            return self.next_try()
        if type(last) is Hold:  # building its lease failed
            assert isinstance(reply, Failed)
            self._abandon_open(self._blocking)  # blocking: the store just answered
            raise reply.error
        step = self._last = self._after_try(reply)
        return step

    def next_try(self) -> Try:
        """A try: the first step, and the one after each pause."""
        if self._cancel is not None and self._cancel.is_set():
            raise LockNotAcquiredError(self._try.key, "cancelled")
        self._sent_at = self._clock.monotonic()
        self._last = self._try
        self._open = True
        return self._try

    def interrupted(self) -> None:
        """An exception left the driver between two steps (an interrupt after a try was sent,
        or while its lease was built): release that attempt unless it was refused, released
        already or its lease built. The driver calls it from its ``except`` around every step
        and the lease's build (not after the build succeeded)."""
        self._abandon_open(self._blocking)

    def _after_try(self, reply: Reply) -> Hold | Pause:
        lagging = None
        if isinstance(reply, Failed):
            if not isinstance(reply.error, (ReplicaLagError, RestartGraceError)):
                self._abandon_open(False)  # it may have taken effect, its reply lost
                raise reply.error
            # The replicas did not confirm it (the store released it), or a restart grace
            # refused the key: asked again like a held key, raised when the wait runs out.
            lagging = reply.error
        elif reply is not None:
            return Hold(self._try.owner, reply, self._tries, self._started, self._sent_at)
        else:
            self._open = False  # refused: the key is another holder's
        self._tries += 1
        waits_on = self._waits_on or self._first_refusal()
        remaining = self._deadline - waits_on.monotonic()
        if remaining <= 0:
            if lagging is not None:
                self._abandon_open(False)
                raise lagging
            raise LockNotAcquiredError(self._try.key)
        seconds = min(self._interval, remaining)
        self._interval = min(self._interval * 2, POLL_MAX)
        if self._notify:
            return Pause(seconds, None, None)
        return Pause(seconds, waits_on, self._idle)

    def _first_refusal(self) -> Clock:
        """Look up the clock the wait is counted on, and whether the store's notification
        sleeps on it."""
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

    def _abandon_open(self, now: bool) -> None:
        """Release the open attempt, once: ``now`` in this thread, else on the dispatcher (so a
        store that just timed out does not make the caller wait for a second timeout before it
        sees the error)."""
        if not self._open:
            return
        self._open = False
        key, owner = self._try.key, self._try.owner
        if now:
            self._abandon(owner)
        else:
            get_dispatcher().submit(self._abandon, owner, f"clean-up of acquire {key!r}")
