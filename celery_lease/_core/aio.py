"""asyncio support: ``async with lease(...)`` and ``@lease(...)`` on ``async def`` functions.

::

    async with lease("cache:prices", store=store, ttl="30s", wait="5s") as held:
        await rebuild(fence=held.token)

The options and guarantees are those of the synchronous :func:`~celery_lease._core.lease`; what
differs is where things run:

- **Acquiring and waiting** are awaited on the event loop and never block it: an
  :class:`~celery_lease.stores.base.AsyncLockStore` is awaited directly, a synchronous
  :class:`~celery_lease.LockStore` is wrapped in a :class:`ThreadedAsyncStore` (its short calls
  run on the loop's default executor). Between tries the waiter awaits the store's
  ``wait_for_release`` with the same backoff as the sync path (50 ms doubling to 1 s).
  Cancelling the waiting task stops the wait; an attempt whose reply the cancel cut off is
  released owner-checked, so nothing is left held.
- **Renewal** stays on the renewer thread of the store's synchronous twin
  (``store.sync``): an event loop blocked by other tasks does not lose the lease.
- **Release** is awaited on the loop. When the exit is cancelled (or the release fails) the
  release is done again on the dispatcher thread through ``store.sync``: a lease is never
  leaked, and the cancellation propagates as ``CancelledError``.
- **Loss** is reported as for the sync lease (``held.lost``, ``held.check()``, ``on_lost`` on the
  dispatcher). With ``on_lost="cancel"`` the task that entered the block is cancelled (from the
  thread that recorded the loss, with ``loop.call_soon_threadsafe``) and the block ends with
  :class:`~celery_lease.LockLostError` instead of ``CancelledError``. A cancellation from
  outside (a timeout, a TaskGroup, a closed connection) still propagates as ``CancelledError``.

The lease of the block is the current lease (:func:`~celery_lease.current_lease`,
:func:`~celery_lease.get_lock_token`) in the block's task and in the tasks it creates (they
copy its context). Only the task that entered the block re-enters its lease (a nested
``async with`` on the same key and store); a task created in the block that enters ``lease()``
on that key is another holder and waits for it, since it runs concurrently with the body (awaiting
such a task inside the block waits until its ``wait`` runs out).

This module decides nothing of its own: it takes the steps of
:class:`~celery_lease._core.lease.LeaseContext` (re-entry, building and renewing the lease, how
the exit ends it and what it raises) and awaits the store calls between them. ``celery_lease._core``
installs :data:`ASYNC_PATH` as the context's ``async with``.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.lease import (
    CANCEL,
    POLL_FIRST,
    POLL_MAX,
    AsyncPath,
    Lease,
    LeaseContext,
    split_async_store,
    to_ms,
)
from celery_lease.errors import (
    LockLostError,
    LockNotAcquiredError,
    ReplicaLagError,
    RestartGraceError,
)
from celery_lease.stores.base import AsyncLockStore
from celery_lease.stores.threaded import ThreadedAsyncStore

# split_async_store: the Celery layer's task path splits a store as lease() does
__all__ = ["ASYNC_PATH", "CANCEL", "ThreadedAsyncStore", "split_async_store"]

logger = logging.getLogger("celery_lease.aio")

_CANCEL_MSG = "celery-lease: the lease was lost (on_lost='cancel')"
"""The message of our own cancel: how Python 3.10 (no ``Task.uncancel``) tells it apart."""


def async_store_of(ctx: LeaseContext) -> AsyncLockStore:
    """The store a context awaits: the one given to ``lease()``, or an adapter of its sync one."""
    astore = ctx.async_store
    if astore is None:
        astore = ctx.async_store = ThreadedAsyncStore(ctx.store)
    return astore


# Entering and exiting ---------------------------------------------------------------------------


class _Canceller:
    """Cancels the task that entered an ``on_lost="cancel"`` block when its lease is lost.

    ``active`` is read and written on the loop only: True from the end of ``__aenter__`` to
    the start of ``__aexit__``, so a loss recorded after the body ended cancels nothing.
    ``fired`` says our cancel was delivered to the task (``__aexit__`` then takes it back).
    """

    __slots__ = ("active", "fired", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        self.loop = loop
        self.task = task
        self.active = False
        self.fired = False

    def on_lost(self, lease: Lease) -> None:
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
        # Python 3.10: the message of the cancel delivered travels with the error, and an
        # outside cancel delivered before ours is the context of ours (ours landed in the
        # body's clean-up of it). Only a chain of cancellations is followed: a cancel behind
        # another error is the body's own business (``wait_for``'s TimeoutError carries the
        # cancel of its inner task). An outside cancel requested before ours was delivered is
        # merged into it, and not seen here.
        seen: set[int] = set()
        while isinstance(exc, asyncio.CancelledError) and id(exc) not in seen:
            seen.add(id(exc))
            if exc.args[:1] != (_CANCEL_MSG,):
                return True
            exc = exc.__context__
        return False


async def aenter(ctx: LeaseContext) -> tuple[Lease, _Canceller | None]:
    """``LeaseContext.__aenter__``: re-enter or acquire (awaiting), then push the lease.

    Returns the lease and the canceller of an ``on_lost="cancel"`` block (else ``None``), which
    :func:`aexit` is given back.
    """
    ctx.mark_entered()
    task = asyncio.current_task()
    outer = ctx.reenter(task)  # never for a task that only copied the context
    if outer is not None:
        return outer, None
    canceller: _Canceller | None = None
    if ctx.on_lost is CANCEL:
        if task is None:
            raise RuntimeError("on_lost='cancel' needs to run in an asyncio task")
        canceller = _Canceller(asyncio.get_running_loop(), task)
    held = await _acquire(ctx, async_store_of(ctx), canceller)
    ctx.push(held, task)
    if canceller is not None:
        canceller.active = True
    return held, canceller


async def _acquire(
    ctx: LeaseContext, astore: AsyncLockStore, canceller: _Canceller | None
) -> Lease:
    """The async twin of ``LeaseContext._acquire``: same tries, backoff and clean-up."""
    clock = ctx.clock
    owner = ctx.new_owner()
    ttl_ms = to_ms(ctx.ttl)
    started = clock.monotonic()
    deadline = started + ctx.wait
    interval = POLL_FIRST
    tries = 0
    lagging: ReplicaLagError | RestartGraceError | None = None
    while True:
        if ctx.cancel is not None and ctx.cancel.is_set():
            raise LockNotAcquiredError(ctx.key, "cancelled")
        sent_at = clock.monotonic()
        try:
            token = await astore.acquire(ctx.key, owner, ttl_ms)
            lagging = None
        except (ReplicaLagError, RestartGraceError) as exc:
            # Refused for now (released by the store, or a restart grace): asked again within
            # the wait like a held key, raised when the wait runs out.
            token, lagging = None, exc
        except BaseException:
            # Cancelled or failed: the attempt may have taken effect with its reply lost.
            # Release it owner-checked (this attempt's own owner id) on the dispatcher.
            get_dispatcher().submit(ctx.abandon_attempt, owner, f"clean-up of acquire {ctx.key!r}")
            raise
        if token is not None:
            break
        tries += 1
        remaining = deadline - clock.monotonic()
        if remaining <= 0:
            if lagging is not None:
                get_dispatcher().submit(
                    ctx.abandon_attempt, owner, f"clean-up of acquire {ctx.key!r}"
                )
                raise lagging
            raise LockNotAcquiredError(ctx.key)
        await astore.wait_for_release(ctx.key, min(interval, remaining))
        interval = min(interval * 2, POLL_MAX)
    try:
        return ctx.hold(
            owner,
            token,
            tries=tries,
            started=started,
            sent_at=sent_at,
            immediate_listener=None if canceller is None else canceller.on_lost,
        )
    except BaseException:
        get_dispatcher().submit(ctx.abandon_attempt, owner, f"clean-up of acquire {ctx.key!r}")
        raise


async def aexit(ctx: LeaseContext, state: object, exc: BaseException | None) -> bool:
    """``LeaseContext.__aexit__``: stop renewing, release (awaiting), report the loss.

    ``state`` is what :func:`aenter` returned for the block besides the lease (its canceller).
    """
    canceller = state if isinstance(state, _Canceller) else None
    if canceller is not None:
        canceller.active = False  # from here on a loss cancels nothing
    held = ctx.pop()
    if held is None:
        return False  # the outer context (or, after a fork, the parent) owns the lease
    succeeded = exc is None
    ours = canceller is not None and canceller.fired
    outside = False
    if canceller is not None and ours:
        # Taken back before the first await below: a cancel landing in the release is the
        # caller's (a timeout, a TaskGroup) and must find the task's count as the caller left it.
        canceller.fired = False
        outside = canceller.take_back(exc)
    if ctx.exit_waits(succeeded=succeeded):
        # The rare paths: waiting for a renewal in flight, or a fenced cooldown. The sync exit's
        # own steps do them on a thread, which finishes them even if this task is cancelled.
        end = functools.partial(ctx.end, succeeded=succeeded)
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, end))
    else:
        _settled, final, lapsed = ctx.stop_renewing()  # one lock round, no wait
        try:
            if final:
                await _release(ctx, async_store_of(ctx), held)
        finally:  # told after the release, also when a cancel cut the release short
            if lapsed is not None:  # validity ran out before the renewer noticed
                ctx.report_loss(lapsed)
    reason = ctx.end_reason
    if ours:
        if outside:
            if isinstance(exc, asyncio.CancelledError):
                return False  # a cancel from outside as well: it goes on
            raise asyncio.CancelledError()
        if exc is None or isinstance(exc, (Exception, asyncio.CancelledError)):
            raise LockLostError(held.key, reason or "lost") from exc
        return False
    error = ctx.loss_error(exc, reason)
    if error is not None:
        raise error from exc
    return False


async def _release(ctx: LeaseContext, astore: AsyncLockStore, held: Lease) -> None:
    """Release owner-checked, awaiting; if cancelled or failed, again on the dispatcher."""
    try:
        await astore.release(held.key, held.owner)
    except asyncio.CancelledError:
        get_dispatcher().submit(ctx.send_release, held, f"release of cancelled {held.key!r}")
        raise
    except Exception as exc:
        logger.warning(
            "celery-lease: releasing %r failed (%s); trying again on the dispatcher thread",
            held.key,
            exc,
        )
        get_dispatcher().submit(ctx.send_release, held, f"second release of {held.key!r}")


ASYNC_PATH = AsyncPath(aenter=aenter, aexit=aexit)
"""What ``async with`` on a LeaseContext awaits (installed by ``celery_lease._core``)."""
