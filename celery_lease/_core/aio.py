"""What only ``async with lease(...)`` needs: the store's awaited try and release (a cancelled
or failed one is done again on the dispatcher), and the :class:`Canceller` of
``on_lost="cancel"``. Renewal stays on the sync twin's renewer thread. User guide:
``docs/asyncio.md``; threads and fork resets: ``docs/internals.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, cast

from celery_lease._core.acquire_plan import Failed, Reply
from celery_lease._core.arguments import CANCEL, split_async_store
from celery_lease._core.dispatch import get_dispatcher
from celery_lease.errors import LockLostError
from celery_lease.stores.base import AsyncLockStore, AsyncSupportsSlots
from celery_lease.stores.threaded import ThreadedAsyncStore

# split_async_store: the Celery layer's task path splits a store as lease() does
__all__ = [
    "CANCEL",
    "Canceller",
    "ThreadedAsyncStore",
    "after_our_cancel",
    "release",
    "split_async_store",
    "try_acquire",
    "try_acquire_slot",
]

logger = logging.getLogger("celery_lease.aio")

_CANCEL_MSG = "celery-lease: the lease was lost (on_lost='cancel')"
"""The message of our own cancel: how Python 3.10 (no ``Task.uncancel``) tells it apart."""


class Canceller:
    """Cancels the task that entered an ``on_lost="cancel"`` block when its lease is lost.
    ``active`` (loop only): from the end of ``__aenter__`` to the start of ``__aexit__``;
    ``fired``: our cancel was delivered (``__aexit__`` takes it back)."""

    __slots__ = ("active", "fired", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        self.loop = loop
        self.task = task
        self.active = False
        self.fired = False

    def on_lost(self, lease: object) -> None:
        """Immediate loss listener (any thread): schedule the cancel on the task's loop."""
        with contextlib.suppress(RuntimeError):  # a closed loop: no body left to cancel
            self.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if self.active and not self.fired and not self.task.done():
            self.fired = True
            self.task.cancel(msg=_CANCEL_MSG)

    def take_back(self, exc: BaseException | None) -> bool:
        """Undo our cancel; True when a cancellation from outside is pending as well."""
        uncancel = getattr(self.task, "uncancel", None)
        if uncancel is not None:  # Python 3.11+: cancellation requests are counted
            return bool(uncancel())  # the requests left: from outside
        # Python 3.10: our message travels with the error, an outside cancel delivered before
        # ours is its context (only a chain of cancellations is followed); an outside cancel
        # requested before ours was delivered is merged into it, unseen.
        seen: set[int] = set()
        while isinstance(exc, asyncio.CancelledError) and id(exc) not in seen:
            seen.add(id(exc))
            if exc.args[:1] != (_CANCEL_MSG,):
                return True
            exc = exc.__context__
        return False


def after_our_cancel(
    key: str, reason: str | None, exc: BaseException | None, outside: bool
) -> bool:
    """How a block our cancel ended exits (``__aexit__``'s result, or raises): with a cancel
    from ``outside`` too, the cancellation goes on; else :class:`LockLostError` from what the
    body raised, unless that is another ``BaseException``, which goes on as is."""
    if outside:
        if isinstance(exc, asyncio.CancelledError):
            return False
        raise asyncio.CancelledError()
    if exc is None or isinstance(exc, (Exception, asyncio.CancelledError)):
        raise LockLostError(key, reason or "lost") from exc
    return False


async def try_acquire(astore: AsyncLockStore, key: str, owner: str, ttl_ms: int) -> Reply:
    try:
        return await astore.acquire(key, owner, ttl_ms)
    except BaseException as exc:
        return Failed(exc)


async def try_acquire_slot(
    astore: AsyncLockStore, key: str, owner: str, ttl_ms: int, limit: int
) -> tuple[int, int] | Failed | None:
    """``astore.acquire_slot``: ``(slot, token)``, ``None`` when refused, or what it raised."""
    try:
        return await cast(AsyncSupportsSlots, astore).acquire_slot(key, owner, ttl_ms, limit)
    except BaseException as exc:
        return Failed(exc)


async def release(
    astore: AsyncLockStore, key: str, owner: str, again: Callable[[str], object]
) -> None:
    """Release owner-checked, awaiting; if cancelled or failed, ``again(owner)`` on the
    dispatcher (through the synchronous store): a lease is never leaked."""
    try:
        await astore.release(key, owner)
    except asyncio.CancelledError:
        get_dispatcher().submit(again, owner, f"release of cancelled {key!r}")
        raise
    except Exception as exc:
        logger.warning(
            "celery-lease: releasing %r failed (%s); trying again on the dispatcher thread",
            key,
            exc,
        )
        get_dispatcher().submit(again, owner, f"second release of {key!r}")
