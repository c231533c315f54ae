"""The beat lease as one beat sees it: held with :func:`celery_lease.lease` on the scheduler's
thread, checked with the store before each send (:meth:`Election.verify`), waited for again
after a loss."""

from __future__ import annotations

import logging
from typing import Any

from celery_lease import Lease, LeaseContext, lease
from celery_lease.errors import LeaseError, LockNotAcquiredError, StoreUnavailableError

__all__ = ["HOLDER", "Election"]

logger = logging.getLogger("celery_lease.beat")

HOLDER = "celery beat"
"""The label of the beat lease's owner id."""


class Election:
    """One process's part in electing the beat that sends; one scheduler thread calls it."""

    def __init__(self, app: Any, key: str, ttl: float) -> None:
        self.app = app
        self.key = key
        self.ttl = ttl
        self.held: Lease | None = None
        self._context: LeaseContext | None = None
        self._standing_by = False

    def current(self) -> Lease | None:
        """The lease while held, else ``None`` (a lease found lost is exited here)."""
        held = self.held
        if held is None:
            return None
        if held.lost:
            self._exit()
            return None
        return held

    def take(self, wait: float) -> Lease | None:
        """Wait up to ``wait`` seconds for the lease; it once held, else ``None``."""
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
            "celery-lease beat: took %s (fencing token %d): sending due tasks", held.key, held.token
        )
        return held

    def verify(self) -> bool:
        """Whether the store still records this beat as holder (an owner-checked renewal)."""
        held = self.current()
        if held is None:
            return False
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
        return kept

    def resign(self) -> None:
        """Release the lease if held, so a standby takes over at once."""
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
    logger.warning(
        "celery-lease beat: lost %s (fencing token %d, %s): stopped sending; standing by to"
        " take it again",
        held.key,
        held.token,
        held.lost_reason,
    )
