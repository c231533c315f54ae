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

from celery_lease._core.acquire_plan import POLL_MAX
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.options import check_replace_store
from celery_lease._core.owners import Holder, parse_owner
from celery_lease.errors import LockNotAcquiredError
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
    holds the key and its lease. ``wait``: seconds from the first refusal; ``option``: the
    on_held option's name, for a store that cannot replace.

    Raises:
        LeaseConfigError: the store cannot ask a holder to stop.
        Superseded: a newer call took or asked for the key since this one asked.
        LockNotAcquiredError: the key was not free within ``wait``.
        StoreUnavailableError: from the store.
    """
    store = context.store
    check_replace_store(store, option)
    key = context.key
    try:
        return context, context.__enter__()
    except LockNotAcquiredError as exc:
        if exc.reason != "held":
            raise
    clock = context.clock
    started = clock.monotonic()
    deadline = started + wait
    replace = cast(SupportsReplace, store)
    ticket, holder, asked = replace.mark_replaced(key)
    logger.info(
        "celery-lease: asked the holder %s of %r to stop (ticket %d, marked: %s)",
        holder,
        key,
        ticket,
        asked,
    )
    while True:
        attempt = context.fresh()
        attempt.replace_ticket = ticket
        try:
            held = attempt.__enter__()
        except LockNotAcquiredError as exc:
            if exc.reason != "held":
                raise
        else:  # taken after a refusal: it waited, from the first refusal on
            held.waited = True
            held.wait_seconds = held.acquired_at - started
            return attempt, held
        remaining = deadline - clock.monotonic()
        if remaining <= 0:
            raise LockNotAcquiredError(key)
        info = cast(SupportsInspection, store).get(key)
        if info is None:
            continue  # freed since the refusal: try again now
        owner = unmarked(info.owner)[0]
        found = parse_owner(owner)
        stamp = found.replace_ticket if found.replace_ticket is not None else info.token
        if stamp > ticket:
            raise Superseded(key, found)
        if not replace.mark_replaced(key, ticket, holder=owner)[2]:
            continue  # another holder than the one read (or none): look again now
        _pause(context, min(remaining, POLL_MAX))


def _pause(context: LeaseContext, seconds: float) -> None:
    """Wait up to ``seconds`` for a release of ``context.key``: the store's notification when
    it sleeps on the context's clock, else that clock."""
    store, clock = context.store, context.clock
    if conforms(store, SupportsReleaseNotify) and getattr(store, "clock", clock) is clock:
        cast(SupportsReleaseNotify, store).wait_for_release(context.key, seconds)
    else:
        clock.wait(threading.Event(), seconds)
