"""The beat lease as one beat process sees it: take it, keep it, notice its loss, take it again.

A public :func:`celery_lease.lease` entered on the scheduler's thread; :meth:`Election.verify`
asks the store before each send, and a watchdog releases a hung loop's lease.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery_lease import Lease, LeaseContext, lease
from celery_lease._core.lease import clock_of
from celery_lease.errors import LeaseError, LockNotAcquiredError, StoreUnavailableError

logger = logging.getLogger("celery_lease.beat")

# The label of the beat lease's owner id (``celery lease list`` shows it with host and pid).
HOLDER = "celery beat"


class Election:
    """One process's part in the election of the beat that sends (``key`` before the app's
    prefix, ``ttl`` in seconds). Not thread-safe: only the scheduler thread calls it."""

    def __init__(self, app: Any, key: str, ttl: float) -> None:
        self.app = app
        self.key = key
        self.ttl = ttl
        self.held: Lease | None = None
        self._context: LeaseContext | None = None
        self._standing_by = False
        self._due_back = 0.0  # clock time by which the beat loop must call back_within again
        self._watchdog: threading.Thread | None = None
        self._stop_watch = threading.Event()

    def current(self) -> Lease | None:
        """The lease while this beat holds it, else ``None`` (a lost lease is exited here)."""
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
        self._watch(context, held)
        logger.info(
            "celery-lease beat: took %s (fencing token %d): sending due tasks", held.key, held.token
        )
        return held

    def verify(self) -> bool:
        """Whether the store, asked now (an owner-checked renewal), still has this beat holding
        the lease; ``False`` also when it did not answer or took over half the ttl (the renewal
        counts from the ask, so a late answer leaves too little lease for a send)."""
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
                " %g s ttl: not sending on that answer (a store this slow needs a longer"
                " lease_beat_ttl)",
                took,
                held.key,
                self.ttl,
            )
            return False
        return True

    def back_within(self, seconds: float) -> None:
        """Promise the loop calls this again within ``seconds``; if it does not (hung), the
        watchdog releases the lease then, so a standby takes over."""
        held = self.held
        if held is not None:
            self._due_back = clock_of(held.store).monotonic() + seconds

    def _watch(self, context: LeaseContext, held: Lease) -> None:
        """Start the thread that releases ``held`` once the loop is not back in time."""
        clock = clock_of(held.store)
        self._due_back = clock.monotonic() + self.ttl  # the tick that took it is running
        stop = self._stop_watch = threading.Event()

        def watch() -> None:
            while True:
                late = clock.monotonic() - self._due_back
                if late >= 0:
                    break
                if clock.wait(stop, -late):
                    return
            logger.error(
                "celery-lease beat: the beat loop is %.1f s late (hung in a send, a store or a"
                " database call?): releasing %s so that a standby takes over",
                late,
                held.key,
            )
            context.release_early("beat loop hung")

        self._watchdog = threading.Thread(target=watch, name="celery-lease-beat-watch", daemon=True)
        self._watchdog.start()

    def resign(self) -> None:
        """Release the lease if held (a clean shutdown: a standby takes over at once)."""
        if self.held is not None:
            logger.info("celery-lease beat: releasing %s", self.held.key)
        self._exit()

    def _exit(self) -> None:
        context, self._context, self.held = self._context, None, None
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            self._stop_watch.set()
            watchdog.join()
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
