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
- **Renewal** stays on the process's renewer thread, through the store's synchronous twin
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

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.lease import (
    POLL_FIRST,
    POLL_MAX,
    Frame,
    current_frame,
    new_owner_id,
    pop_frame,
    to_ms,
)
from celery_lease._core.renewer import Entry, Renewer, get_renewer
from celery_lease._core.threaded_store import ThreadedAsyncStore
from celery_lease.errors import LeaseConfigError, LockLostError, LockNotAcquiredError
from celery_lease.stores.base import AsyncLockStore, LockStore

if TYPE_CHECKING:
    from celery_lease._core.lease import Lease, LeaseContext

__all__ = ["CANCEL", "ThreadedAsyncStore"]

logger = logging.getLogger("celery_lease.aio")

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])


class _CancelBody:
    """The value ``lease()`` keeps for ``on_lost="cancel"``: a marker, and a no-op listener.

    The cancel itself is an immediate loss listener installed by ``__aenter__`` for the task
    that entered; this object only stands in the context's ``on_lost`` slot (where a plain
    callable is expected), so calling it does nothing.
    """

    __slots__ = ()
    _async_only = True  # a sync ``with`` refuses it on entering (``LeaseContext.__enter__``)

    def __call__(self, lease: Lease) -> None:
        return None

    def __repr__(self) -> str:
        return "'cancel'"


CANCEL = _CancelBody()
"""What ``lease(on_lost="cancel")`` stores as its ``on_lost``."""

_CANCEL_MSG = "celery-lease: the lease was lost (on_lost='cancel')"
"""The message of our own cancel: how Python 3.10 (no ``Task.uncancel``) tells it apart."""


def _generation() -> int:
    """The fork generation of this process, read live from ``celery_lease._core.lease``."""
    return int(sys.modules["celery_lease._core.lease"]._generation)


# Resolving the store of a lease() ---------------------------------------------------------------


def is_async_store(store: object) -> bool:
    """True for an :class:`~celery_lease.stores.base.AsyncLockStore` (cached per class)."""
    cls = type(store)
    known = _ASYNC_CLASSES.get(cls)
    if known is None:
        known = _ASYNC_CLASSES[cls] = isinstance(store, AsyncLockStore)
    return known


_ASYNC_CLASSES: dict[type, bool] = {}


def split_async_store(store: Any) -> tuple[AsyncLockStore | None, Any]:
    """``(store, store.sync)`` for an AsyncLockStore given to ``lease()``, else ``(None, store)``.

    Raises:
        LeaseConfigError: when the async store's ``sync`` is not a synchronous LockStore.
    """
    if not is_async_store(store):
        return None, store
    twin = store.sync
    if not isinstance(twin, LockStore) or is_async_store(twin):
        raise LeaseConfigError(
            f"store={store!r} is an AsyncLockStore whose .sync ({twin!r}) is not a synchronous"
            " LockStore: the renewer thread renews through it"
        )
    return store, twin


def decorates_async(ctx: LeaseContext, func: object) -> bool:
    """True when ``@lease`` must wrap ``func`` with ``async with`` (an ``async def``).

    Raises:
        LeaseConfigError: for an async generator function (a lease held only while the
            generator object is made would hold nothing), or ``on_lost="cancel"`` on a
            function that is not ``async def`` (there is no task to cancel).
    """
    if inspect.isasyncgenfunction(func):
        raise LeaseConfigError(
            f"@lease cannot decorate the async generator function {func!r}: use"
            " 'async with lease(...)' inside it"
        )
    if inspect.iscoroutinefunction(func):
        return True
    if ctx.on_lost is CANCEL:
        raise LeaseConfigError(
            f"on_lost='cancel' needs an async def function (it cancels an asyncio task);"
            f" {func!r} is not one"
        )
    return False


def async_store_of(ctx: LeaseContext) -> AsyncLockStore:
    """The store a context awaits: the one given to ``lease()``, or an adapter of its sync one."""
    astore = ctx._astore
    if astore is None:
        astore = ctx._astore = ThreadedAsyncStore(ctx.store)
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
        # Python 3.10: the message of the cancel delivered travels with the error. An outside
        # cancel requested before ours was delivered is merged into it, and not seen here.
        return isinstance(exc, asyncio.CancelledError) and exc.args[:1] != (_CANCEL_MSG,)


async def aenter(ctx: LeaseContext) -> Lease:
    """``LeaseContext.__aenter__``: re-enter or acquire (awaiting), then push the lease."""
    if ctx._entered:
        raise RuntimeError("a lease() context cannot be entered twice; call lease() again")
    ctx._entered = True
    generation = _generation()
    task = asyncio.current_task()
    top = current_frame.get()
    frame = top
    while frame is not None and frame.gen == generation:  # as in __enter__: see there
        outer = frame.lease
        if (
            outer.key == ctx.key
            and outer.store is ctx.store
            and outer._reenterable_by(task)  # never a task that only copied the context
            and not outer.lost
            and not (outer._entry is not None and outer._entry.closed)
        ):
            ctx._reentered = True
            ctx._lease = outer
            ctx._frame = Frame(outer, top)
            current_frame.set(ctx._frame)
            return outer
        frame = frame.parent
    canceller: _Canceller | None = None
    if ctx.on_lost is CANCEL:
        if task is None:
            raise RuntimeError("on_lost='cancel' needs to run in an asyncio task")
        canceller = _Canceller(asyncio.get_running_loop(), task)
    held = await _acquire(ctx, async_store_of(ctx), canceller)
    if task is not None:
        held._task = weakref.ref(task)
    ctx._lease = held
    ctx._frame = Frame(held, top)
    current_frame.set(ctx._frame)
    ctx._canceller = canceller
    if canceller is not None:
        canceller.active = True
    return held


async def _acquire(
    ctx: LeaseContext, astore: AsyncLockStore, canceller: _Canceller | None
) -> Lease:
    """The async twin of ``LeaseContext._acquire``: same tries, backoff and clean-up."""
    clock = ctx.clock
    owner = new_owner_id(node=ctx.node, task=ctx.task, task_id=ctx.task_id, label=ctx.label)
    ttl_ms = to_ms(ctx.ttl)
    started = clock.monotonic()
    deadline = started + ctx.wait
    interval = POLL_FIRST
    tries = 0
    while True:
        if ctx.cancel is not None and ctx.cancel.is_set():
            raise LockNotAcquiredError(ctx.key, "cancelled")
        sent_at = clock.monotonic()
        try:
            token = await astore.acquire(ctx.key, owner, ttl_ms)
        except BaseException:
            # Cancelled or failed: the attempt may have taken effect with its reply lost.
            # Release it owner-checked (this attempt's own owner id) on the dispatcher.
            get_dispatcher().submit(ctx._abandon, owner, f"clean-up of acquire {ctx.key!r}")
            raise
        if token is not None:
            break
        tries += 1
        remaining = deadline - clock.monotonic()
        if remaining <= 0:
            raise LockNotAcquiredError(ctx.key)
        await astore.wait_for_release(ctx.key, min(interval, remaining))
        interval = min(interval * 2, POLL_MAX)
    held: Lease | None = None
    try:
        held = ctx._hold(owner, token, tries, started, sent_at)
        if canceller is not None:
            held._listeners = [(canceller.on_lost, True)]  # before the renewer knows it
        assert held._entry is not None
        get_renewer(clock).add(held._entry)
    except BaseException:
        entry = None if held is None else held._entry
        if entry is not None and entry.renewer is not None:
            entry.renewer.abandon(entry)
        get_dispatcher().submit(ctx._abandon, owner, f"clean-up of acquire {ctx.key!r}")
        raise
    return held


async def aexit(
    ctx: LeaseContext,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> bool:
    """``LeaseContext.__aexit__``: stop renewing, release (awaiting), report the loss."""
    canceller = ctx._canceller if isinstance(ctx._canceller, _Canceller) else None
    if canceller is not None:
        canceller.active = False  # from here on a loss cancels nothing
    held = ctx._lease
    assert held is not None
    pop_frame(ctx._frame)
    if ctx._reentered or held._gen != _generation():
        return False  # the outer context (or, after a fork, the parent) owns the lease
    entry = held._entry
    assert entry is not None and entry.renewer is not None
    succeeded = exc is None
    ours = canceller is not None and canceller.fired
    outside = False
    if canceller is not None and ours:
        # Taken back before the first await below: a cancel landing in the release is the
        # caller's (a timeout, a TaskGroup) and must find the task's count as the caller left it.
        canceller.fired = False
        outside = canceller.take_back(exc)
    if entry.inflight or (succeeded and ctx.cooldown > 0 and entry.lost_reason is None):
        # The rare paths: waiting for a renewal in flight, or a fenced cooldown. The sync exit's
        # own steps do them on a thread, which finishes them even if this task is cancelled.
        end = functools.partial(_end_on_thread, ctx, held, entry, succeeded)
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, end))
    else:
        _settled, final, lapsed = entry.renewer.remove(entry)  # one lock round, no wait
        try:
            if final:
                await _release(ctx, async_store_of(ctx), held)
        finally:  # told after the release, also when a cancel cut the release short
            if lapsed is not None:  # validity ran out before the renewer noticed
                Renewer._notify(entry, lapsed)
    reason = entry.lost_reason
    if ours:
        if outside:
            if isinstance(exc, asyncio.CancelledError):
                return False  # a cancel from outside as well: it goes on
            raise asyncio.CancelledError()
        if exc is None or isinstance(exc, (Exception, asyncio.CancelledError)):
            raise LockLostError(held.key, reason or "lost") from exc
        return False
    if (
        isinstance(exc, Exception)
        and reason is not None
        and not ctx._released_early
        and not isinstance(exc, LockLostError)
    ):
        raise LockLostError(held.key, reason) from exc
    return False


def _end_on_thread(ctx: LeaseContext, held: Lease, entry: Entry, succeeded: bool) -> None:
    """The sync exit's steps after the pop: remove, release or cool down, tell a lapse."""
    assert entry.renewer is not None
    settled, final, lapsed = entry.renewer.remove(entry)
    if final:
        ctx._finish(held, entry, succeeded=succeeded, settled=settled)
    if lapsed is not None:
        Renewer._notify(entry, lapsed)


async def _release(ctx: LeaseContext, astore: AsyncLockStore, held: Lease) -> None:
    """Release owner-checked, awaiting; if cancelled or failed, again on the dispatcher."""
    try:
        await astore.release(held.key, held.owner)
    except asyncio.CancelledError:
        get_dispatcher().submit(ctx._release, held, f"release of cancelled {held.key!r}")
        raise
    except Exception as exc:
        logger.warning(
            "celery-lease: releasing %r failed (%s); trying again on the dispatcher thread",
            held.key,
            exc,
        )
        get_dispatcher().submit(ctx._release, held, f"second release of {held.key!r}")


# The decorator ----------------------------------------------------------------------------------


def decorate(ctx: LeaseContext, func: _F) -> _F:
    """``@lease(...)`` on an ``async def``: each call awaits its body under a fresh lease."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        fresh = ctx._fresh()
        fresh._astore = ctx._astore
        async with fresh:
            return await func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
