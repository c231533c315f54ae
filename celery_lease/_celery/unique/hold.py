"""The queued lease an ``"until_done"`` copy keeps while its body runs: renewed, then freed or
kept for the retry's wait or the cooldown."""

from __future__ import annotations

import functools
from collections.abc import Callable

from celery_lease._celery.protocols import can_release_deferred
from celery_lease._celery.unique.common import logger, ms, release_quietly
from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.held_key import HeldKey
from celery_lease.stores.base import LockStore


class QueuedHold:
    __slots__ = ("cooldown", "held", "owner", "qkey", "retry_ttl_ms", "store", "task_id")

    def __init__(
        self, store: LockStore, qkey: str, owner: str, task_id: str, held: HeldKey, cooldown: float
    ) -> None:
        self.store, self.qkey, self.owner, self.task_id = store, qkey, owner, task_id
        self.held, self.cooldown = held, cooldown
        self.retry_ttl_ms: int | None = None  # set when the body published its retry

    def end(self, succeeded: bool, defer: bool = False) -> None:
        """Stop renewing, then free the key or keep it (retry, ``cooldown``); never raises a store
        error. With ``defer`` unanswered, behind the run lease's release on its connection."""
        holding.pop(self.task_id, None)
        held = self.held
        try:
            settled, _final, _lapsed = held.stop()
        except BaseException:
            held.abandon()
            raise
        keep = self.retry_ttl_ms
        if keep is None and succeeded and self.cooldown > 0:
            keep = ms(self.cooldown)
        # Released before the execution returns: a caller that sees the result and calls again
        # must find the key free. A keep is fenced: set after any renewal in flight.
        if keep is None:
            store = self.store
            if defer and can_release_deferred(store):
                if store.release_deferred(self.qkey, self.owner):
                    return
                store.flush_deferred()  # the run lease's release answered first
            release_quietly(self.store, self.qkey, self.owner, "the copy ended")
            return
        action = functools.partial(_set_quietly, self.store, self.qkey, self.owner, keep)
        if settled or not held.fence(action):  # fenced: the renewer sets it after
            get_dispatcher().submit(_run, action, f"keep of {self.qkey!r}")


def _run(action: Callable[[], None]) -> None:
    action()


def _set_quietly(store: LockStore, key: str, owner: str, ttl_ms: int) -> None:
    try:
        if not store.renew(key, owner, ttl_ms):
            logger.warning("celery-lease: %r is no longer held by %s; not kept", key, owner)
    except Exception as exc:
        logger.warning("celery-lease: keeping %r failed (%s); it frees itself", key, exc)


def queued_lost(key: str, reason: str) -> None:
    """Renewer callback: the running copy's queued lease was lost."""
    logger.warning(
        "celery-lease: the queued key %r of a running copy was lost (%s): another copy may be"
        " enqueued meanwhile (the run lease still excludes its body)",
        key,
        reason,
    )


# Task id -> the queued lease its running ``"until_done"`` body keeps (this process).
holding: dict[str, QueuedHold] = {}
