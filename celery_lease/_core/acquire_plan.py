"""The acquire plan: when to try a key, how long to pause and on which clock, when to give up,
and which failed attempt to clean up. It does no I/O.

``with`` and ``async with`` drive the one plan, :func:`acquire_steps` (as httpx's clients drive
one ``Auth.auth_flow`` generator, and tenacity's ``Retrying`` and ``AsyncRetrying`` drive one
``iter()``). The plan yields a step; the driver performs it with its own I/O and sends back
the answer, or :class:`Failed` with what the call raised:

- :class:`Try`: ``store.acquire(key, owner, ttl_ms)``; send the token, or ``None`` (held).
- :class:`Pause`: wait up to ``seconds`` for the key to be freed, on the store's release
  notification (``clock`` ``None``) or on ``clock`` with ``event``; send ``None``. The async
  driver awaits its async store's ``wait_for_release`` in both cases: the wait is counted on
  the plan's clock, slept on the event loop.
- :class:`Hold`: the key is the attempt's: build and renew the lease. On success the driver
  is done (it never resumes the plan); send :class:`Failed` if that failed.

A failed attempt (its reply lost, cancelled, or its lease never built) is released
owner-checked on the dispatcher (the owner id is the attempt's own, so this never frees
another holder's lease), and the error is raised from the plan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import NamedTuple

from celery_lease._core.dispatch import get_dispatcher
from celery_lease.clock import Clock
from celery_lease.errors import LockNotAcquiredError, ReplicaLagError, RestartGraceError
from celery_lease.stores.base import SupportsReleaseNotify, conforms

__all__ = [
    "POLL_FIRST",
    "POLL_MAX",
    "Failed",
    "Hold",
    "Pause",
    "Step",
    "Try",
    "acquire_steps",
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


def acquire_steps(
    *,
    key: str,
    owner: str,
    ttl: float,
    wait: float,
    store: object,
    clock: Clock,
    wait_clock: Callable[[], Clock],
    cancel: threading.Event | None,
    abandon: Callable[[str], object],
) -> Generator[Step, Reply, None]:
    """The steps of one acquisition of ``key`` in ``store`` (the synchronous store, whose clock
    and release notification the wait uses).

    Tries at once, then after pauses from :data:`POLL_FIRST` doubling to :data:`POLL_MAX`, until
    ``wait`` seconds have passed on the clock ``wait_clock()`` gives (asked at the first
    refusal; what the tries took until then, on ``clock``, counts against ``wait``).
    ``abandon(owner)`` releases a failed attempt (run on the dispatcher).

    Raises (from the driver's ``send``): ``LockNotAcquiredError`` when the key stays held past
    ``wait`` (``"cancelled"`` once ``cancel`` is set, looked at before each try); the last
    ``ReplicaLagError`` / ``RestartGraceError`` when the wait runs out on one (they are asked
    again like a held key); whatever else a step raised.
    """
    attempt = Try(key, owner, to_ms(ttl))
    started = clock.monotonic()
    deadline = started + wait
    interval = POLL_FIRST
    waits_on: Clock | None = None  # looked up at the first refusal: a free key needs none
    notify = False
    idle = cancel
    tries = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise LockNotAcquiredError(key, "cancelled")
        sent_at = clock.monotonic()
        reply = yield attempt
        lagging = None
        if isinstance(reply, Failed):
            if not isinstance(reply.error, (ReplicaLagError, RestartGraceError)):
                _abandon_later(abandon, owner, key)  # it may have taken effect, its reply lost
                raise reply.error
            # The replicas did not confirm it (the store released it), or a restart grace
            # refused the key: asked again like a held key, raised when the wait runs out.
            lagging = reply.error
        elif reply is not None:
            break
        tries += 1
        if waits_on is None:
            waits_on = wait_clock()
            if waits_on is not clock:
                deadline = waits_on.monotonic() + wait - (clock.monotonic() - started)
            # The store's notification sleeps on the store's clock.
            notify = conforms(store, SupportsReleaseNotify) and (
                getattr(store, "clock", waits_on) is waits_on
            )
            if idle is None and not notify:
                idle = threading.Event()
        remaining = deadline - waits_on.monotonic()
        if remaining <= 0:
            if lagging is not None:
                _abandon_later(abandon, owner, key)
                raise lagging
            raise LockNotAcquiredError(key)
        seconds = min(interval, remaining)
        yield Pause(seconds, None, None) if notify else Pause(seconds, waits_on, idle)
        interval = min(interval * 2, POLL_MAX)
    outcome = yield Hold(owner, reply, tries, started, sent_at)
    if isinstance(outcome, Failed):
        _abandon_later(abandon, owner, key)
        raise outcome.error


def _abandon_later(abandon: Callable[[str], object], owner: str, key: str) -> None:
    """On the dispatcher, so a store that just timed out does not make the caller wait for a
    second timeout before it sees the error."""
    get_dispatcher().submit(abandon, owner, f"clean-up of acquire {key!r}")
