"""``on_held="replace"``: a new execution asks the holder of its key to stop and takes the key
once it is free (``docs/celery.md#replace``).

1. Try the key; granted, run.
2. Refused: ``mark_replaced(key)`` draws a *ticket* (every later token of the key is greater)
   and marks the holder (its renewals are refused from now on: it reads lost, ``"replaced"``).
3. Until the deadline: try again with an owner id carrying the ticket (``rt``); refused by a
   holder ``H``, ``H``'s *stamp* is its ``rt`` if any, else its token. A stamp above the ticket
   means a newer call took or asked for the key since: this one gives up (:class:`Superseded`).
   Else ``H`` is marked too (``holder=H``: never another holder than the one read) and the
   execution waits for a release (or a poll of at most ``POLL_MAX`` s).
4. Past the deadline: ``LockNotAcquiredError``, as ``on_held="raise"`` gives.

Newest wins: tickets only grow, and a lease taken after a ticket was drawn has a token above it,
so the execution whose ticket (or, taken at once, token) is highest is never given up on.
"""

from __future__ import annotations

import logging
import threading
from typing import cast

from celery_lease._core.acquire_plan import POLL_FIRST, POLL_MAX
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.options import REPLACE_WAIT_MARGIN, check_replace_store
from celery_lease._core.owners import Holder, parse_owner
from celery_lease.errors import LockNotAcquiredError, StoreUnavailableError
from celery_lease.stores.base import (
    SupportsInspection,
    SupportsReleaseNotify,
    SupportsReplace,
    conforms,
)
from celery_lease.stores.slots import unmarked

logger = logging.getLogger("celery_lease.engine")


class Superseded(LockNotAcquiredError):
    """A newer ``on_held="replace"`` call took (or asked for) the key since this one asked:
    this one gives up. ``reason`` is ``"replaced"``; ``holder``: the newer holder."""

    def __init__(self, key: str, holder: Holder) -> None:
        super().__init__(key, "replaced")
        self.holder = holder

    def __reduce__(self) -> tuple[object, ...]:
        return (Superseded, (self.key, self.holder))

    def __str__(self) -> str:
        return f"a newer call replaced this one on {self.key!r}"


def take_over(context: LeaseContext, wait: float, *, option: str) -> tuple[LeaseContext, Lease]:
    """Enter ``context`` (built with ``wait=0``) as ``on_held="replace"`` does; the context that
    holds the key and its lease. ``wait``: seconds from the first try, at least: each holder
    asked extends it to that holder's ttl (its owner id's, else ``context.ttl``) plus
    :data:`~celery_lease._core.options.REPLACE_WAIT_MARGIN` from its ask. ``option``: the
    on_held option's name, for a store that cannot replace.

    Raises:
        LeaseConfigError: the store cannot ask a holder to stop.
        Superseded: a newer call took or asked for the key since this one asked.
        LockNotAcquiredError: the key was not free within the wait, or its holder runs under
            this execution's own task id (a redelivery or retry of it is never asked to stop).
        StoreUnavailableError: the last store error, when the wait ran out on one (store
            errors are asked again until then, as a plain wait asks a lagging replica again).
    """
    check_replace_store(context.store, option)
    return _TakeOver(context, wait).run()


class _TakeOver:
    """The state of one take-over: the ticket, the deadline, the holders asked so far."""

    def __init__(self, context: LeaseContext, wait: float) -> None:
        self.context = context
        self.store = context.store
        self.key = context.key
        self.clock = context.clock
        self.started = self.clock.monotonic()
        self.deadline = self.started + wait
        self.ticket: int | None = None
        self.asked: set[str] = set()  # owner ids this execution asked to stop
        self.waited = False
        self.backoff = POLL_FIRST

    def run(self) -> tuple[LeaseContext, Lease]:
        attempt = True
        while True:
            try:
                if attempt:
                    held = self._try()
                    if held is not None:
                        return held
                attempt = self._after_refusal()
                self.backoff = POLL_FIRST
            except StoreUnavailableError as exc:  # ReplicaLagError, RestartGraceError too
                self.waited = attempt = True
                remaining = self.deadline - self.clock.monotonic()
                if remaining <= 0:
                    raise
                logger.info(
                    "celery-lease: replacing the holder of %r: %s; asked again within %.2fs",
                    self.key,
                    exc,
                    min(self.backoff, remaining),
                )
                self.clock.wait(threading.Event(), min(self.backoff, remaining))
                self.backoff = min(self.backoff * 2, POLL_MAX)

    def _try(self) -> tuple[LeaseContext, Lease] | None:
        """One try (with the ticket once drawn); the context and lease when granted."""
        attempt = self.context.fresh()
        attempt.replace_ticket = self.ticket
        try:
            held = attempt.__enter__()
        except LockNotAcquiredError as exc:
            if exc.reason != "held":
                raise
            self.waited = True
            return None
        if self.waited:  # taken after a refusal: it waited, from the first try on
            held.waited = True
            held.wait_seconds = held.acquired_at - self.started
        return attempt, held

    def _after_refusal(self) -> bool:
        """Read the holder and ask it to stop; whether to try again (else read again)."""
        info = cast(SupportsInspection, self.store).get(self.key)
        if info is None:
            return True  # freed since the refusal: try again now
        owner = unmarked(info.owner)[0]
        found = parse_owner(owner)
        own = self.context.task_id
        if own is not None and found.task_id == own:
            # This execution's own id (a redelivery, or a retry of it): never asked to stop.
            raise LockNotAcquiredError(self.key)
        if self.ticket is not None:
            stamp = found.replace_ticket if found.replace_ticket is not None else info.token
            if stamp > self.ticket:
                raise Superseded(self.key, found)
        first = self.ticket is None
        replace = cast(SupportsReplace, self.store)
        self.ticket, holder, asked = replace.mark_replaced(self.key, self.ticket, holder=owner)
        if first:
            logger.info(
                "celery-lease: asked the holder %s of %r to stop (ticket %d, marked: %s)",
                owner,
                self.key,
                self.ticket,
                asked,
            )
        if not asked:
            return holder is None  # free: try now; another holder than the one read: read it
        now = self.clock.monotonic()
        if owner not in self.asked:
            # Not renewed from now on, its lease ends within its ttl: wait that long at least.
            fresh = not self.asked
            self.asked.add(owner)
            ttl = found.ttl if found.ttl is not None else self.context.ttl
            self.deadline = max(self.deadline, now + ttl + REPLACE_WAIT_MARGIN)
            if fresh:
                return True  # the first ask: try again at once
        remaining = self.deadline - now
        if remaining <= 0:
            raise LockNotAcquiredError(self.key)
        _pause(self.context, min(remaining, POLL_MAX))
        return True


def _pause(context: LeaseContext, seconds: float) -> None:
    """Wait up to ``seconds`` for a release of ``context.key``: the store's notification when
    it sleeps on the context's clock, else that clock."""
    store, clock = context.store, context.clock
    if conforms(store, SupportsReleaseNotify) and getattr(store, "clock", clock) is clock:
        cast(SupportsReleaseNotify, store).wait_for_release(context.key, seconds)
    else:
        clock.wait(threading.Event(), seconds)
