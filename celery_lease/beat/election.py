"""The beat lease as one beat process sees it: take it, keep it, notice its loss, take it again.

A beat holds the lease with the public :func:`celery_lease.lease` (the app's store and
``lease_key_prefix``), entered and exited on the thread that runs the scheduler, so the
library's renewer renews it every ttl/3 and records its loss; :meth:`Election.verify` asks the
store itself, right before each send, whether the lease is still this beat's. A beat that lost
the lease does not exit: its next tick exits the lost lease and stands by again, waiting for the
key as any ``lease(wait=...)`` does (woken by a release where the store notifies one, else
polling from 50 ms up to 1 s).
"""

from __future__ import annotations

import logging
from typing import Any

from celery_lease import Lease, LeaseContext, lease
from celery_lease._core.lease import clock_of
from celery_lease.errors import LeaseError, LockNotAcquiredError, StoreUnavailableError

__all__ = ["HOLDER", "Election"]

logger = logging.getLogger("celery_lease.beat")

HOLDER = "celery beat"
"""The label of the beat lease's owner id (``celery lease list`` shows it with host and pid)."""


class Election:
    """One process's part in the election of the beat that sends.

    Args:
        app: the Celery app (its lease store and ``lease_key_prefix``).
        key: the lease's key, before the app's prefix.
        ttl: the lease's ttl in seconds.

    Not thread-safe: one scheduler thread calls it (the loss report runs on the library's
    dispatcher thread and only logs).
    """

    def __init__(self, app: Any, key: str, ttl: float) -> None:
        self.app = app
        self.key = key
        self.ttl = ttl
        self.held: Lease | None = None
        self._context: LeaseContext | None = None
        self._standing_by = False

    def current(self) -> Lease | None:
        """The lease while this beat holds it; ``None`` when it does not (a lease found lost is
        exited here, and the beat stands by from its next :meth:`take`)."""
        held = self.held
        if held is None:
            return None
        if held.lost:
            self._exit()
            return None
        return held

    def take(self, wait: float) -> Lease | None:
        """Wait up to ``wait`` seconds for the lease; the lease once held, else ``None``."""
        context = lease(
            self.key, app=self.app, ttl=self.ttl, wait=wait, holder=HOLDER, on_lost=_report_lost
        )
        try:
            held = context.__enter__()
        except LockNotAcquiredError:
            if not self._standing_by:
                self._standing_by = True
                logger.info(
                    "celery-lease beat: %s is held by another beat; standing by", context.key
                )
            return None
        except StoreUnavailableError as exc:
            logger.warning(
                "celery-lease beat: cannot reach the store to take %s (%s); trying again",
                context.key,
                exc,
            )
            return None
        self.held, self._context, self._standing_by = held, context, False
        logger.info(
            "celery-lease beat: took %s (fencing token %d): sending due tasks",
            held.key,
            held.token,
        )
        return held

    def verify(self) -> bool:
        """Whether this beat still holds the lease, asked of the store now (a renewal, owner
        checked): ``False`` once it is lost, taken, or the store does not answer, and when
        the answer took more than half the ttl (the renewal is counted from when it was asked,
        so a late answer leaves too little of the lease for a send)."""
        held = self.current()
        if held is None:
            return False
        clock = clock_of(held.store)  # the clock the store counts the lease's expiry on
        asked = clock.monotonic()
        try:
            kept = held.store.renew(held.key, held.owner, max(1, round(self.ttl * 1000)))
        except (LeaseError, OSError) as exc:
            logger.warning(
                "celery-lease beat: cannot check %s with the store (%s): not sending now",
                held.key,
                exc,
            )
            return False
        if not kept:
            logger.warning(
                "celery-lease beat: the store no longer records this beat as the holder of %s:"
                " stopped sending; standing by",
                held.key,
            )
            self._exit()
            return False
        took = clock.monotonic() - asked
        if took > self.ttl / 2:
            logger.warning(
                "celery-lease beat: the store took %.3f s to confirm %s, more than half its"
                " %g s ttl: not sending on that answer",
                took,
                held.key,
                self.ttl,
            )
            return False
        return True

    def resign(self) -> None:
        """Release the lease if held (a clean shutdown: a standby takes over at once)."""
        if self.held is not None:
            logger.info("celery-lease beat: releasing %s", self.held.key)
        self._exit()

    def _exit(self) -> None:
        context, self._context, self.held = self._context, None, None
        if context is None:
            return
        try:
            context.__exit__(None, None, None)
        except LeaseError as exc:  # a lost lease ends here; it was reported when lost
            logger.debug("celery-lease beat: leaving %s: %s", context.key, exc)


def _report_lost(held: Lease) -> None:
    """Log a lost beat lease (on the library's dispatcher thread)."""
    logger.warning(
        "celery-lease beat: lost %s (fencing token %d, %s): stopped sending; standing by to"
        " take it again",
        held.key,
        held.token,
        held.lost_reason,
    )
