"""The thread adapter: :class:`ThreadedAsyncStore`, an AsyncLockStore over a synchronous store.

Among the stores (it needs only the protocol) so that ``async_store_from_url`` can build one.
Threads, locks and fork resets: docs/internals.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import TypeVar, cast

from celery_lease import _forking as forking
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import AsyncLockStore, LockStore, SupportsSlots, conforms
from celery_lease.stores.slots import release_channel, release_owner_slots

__all__ = ["ThreadedAsyncStore"]

logger = logging.getLogger("celery_lease.aio")

_T = TypeVar("_T")

_waiters_lock = threading.Lock()
# ``(id(store), key)`` -> the futures of this process's coroutines waiting for that key; a
# release through any ThreadedAsyncStore over the store of the key (or of any of its slots) wakes
# them.
_waiters: dict[tuple[int, str], set[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]]] = {}


def _after_fork_in_child() -> None:
    """A forked child: a fresh lock, no waiters (they belong to the parent's loops)."""
    global _waiters_lock
    _waiters_lock = threading.Lock()
    _waiters.clear()


forking.on_fork_child(_after_fork_in_child, name="aio store: waiters lock, waiters")


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _wake(store: LockStore, key: str) -> None:
    """Wake the coroutines of this process waiting for ``key`` of ``store`` (any loop)."""
    with _waiters_lock:
        waiting = _waiters.pop((id(store), key), None)
    if not waiting:
        return
    for loop, future in waiting:
        with contextlib.suppress(RuntimeError):  # a closed loop: its waiter is gone with it
            loop.call_soon_threadsafe(_resolve, future, True)


def _undo(undo: Callable[[], object]) -> None:
    try:
        undo()
    except Exception:
        logger.exception("celery-lease: undoing a cancelled store call failed")


async def _on_thread(fn: Callable[[], _T], undo: Callable[[], object] | None = None) -> _T:
    """``fn()`` on the loop's default executor, awaited. If the awaiting task is cancelled
    first, ``undo()`` runs once ``fn`` ends (on its thread, or on the executor if it had ended):
    how a cancelled acquire that took effect is released."""
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    state = {"done": False, "abandoned": False}

    def work() -> _T:
        try:
            return fn()
        finally:
            with lock:
                state["done"] = True
                late = state["abandoned"]
            if late and undo is not None:
                _undo(undo)

    try:
        return await loop.run_in_executor(None, work)
    except asyncio.CancelledError:
        with lock:
            ended = state["done"]
            if not ended:
                state["abandoned"] = True
        if ended and undo is not None:
            with contextlib.suppress(RuntimeError):  # an executor shut down: nothing to run on
                loop.run_in_executor(None, _undo, undo)
        raise


class ThreadedAsyncStore:
    """An :class:`~celery_lease.stores.base.AsyncLockStore` over a synchronous store.

    Each call runs the sync store's method on the event loop's default executor; meant for
    short local calls (SQLite, memory) or any store without a native async twin. :attr:`sync`
    is the wrapped store. ``wait_for_release`` wakes on releases through any
    ``ThreadedAsyncStore`` of this process over the same store; other releases are seen by the
    waiter's next poll (50 ms doubling to 1 s).

    Args:
        store: the synchronous :class:`~celery_lease.LockStore`.
        close_store: True when this adapter owns ``store``: :meth:`aclose` then calls its
            ``close()`` (default False: the caller closes its own store).

    Raises:
        LeaseConfigError: when ``store`` is not a ``LockStore``.
    """

    def __init__(self, store: LockStore, *, close_store: bool = False) -> None:
        if not conforms(store, LockStore) or conforms(store, AsyncLockStore):
            raise LeaseConfigError(
                f"store={store!r} is not a synchronous LockStore: it needs acquire(), renew()"
                " and release()"
            )
        self._store = store
        self._close_store = close_store

    @property
    def sync(self) -> LockStore:
        """The wrapped synchronous store."""
        return self._store

    async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        store = self._store
        return await _on_thread(
            functools.partial(store.acquire, key, owner, ttl_ms),
            undo=functools.partial(store.release, key, owner),
        )

    async def acquire_slot(
        self, key: str, owner: str, ttl_ms: int, limit: int
    ) -> tuple[int, int] | None:
        """The sync store's ``acquire_slot`` on a thread (``AttributeError`` when it has none);
        cancelled first, the slot it took is released once the call ends."""
        store = self._store
        return await _on_thread(
            functools.partial(cast(SupportsSlots, store).acquire_slot, key, owner, ttl_ms, limit),
            undo=functools.partial(release_owner_slots, store, key, owner, limit),
        )

    async def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return await _on_thread(functools.partial(self._store.renew, key, owner, ttl_ms))

    async def release(self, key: str, owner: str) -> None:
        await _on_thread(functools.partial(self._store.release, key, owner))
        _wake(self._store, release_channel(key))

    async def wait_for_release(self, key: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        slot = (id(self._store), key)
        item = (loop, future)
        with _waiters_lock:
            _waiters.setdefault(slot, set()).add(item)
        timer = loop.call_later(max(0.0, timeout), _resolve, future, False)
        try:
            return await future
        finally:
            timer.cancel()
            with _waiters_lock:
                waiting = _waiters.get(slot)
                if waiting is not None:
                    waiting.discard(item)
                    if not waiting:
                        del _waiters[slot]

    async def aclose(self) -> None:
        close = getattr(self._store, "close", None)
        if self._close_store and callable(close):
            await _on_thread(close)

    def __repr__(self) -> str:
        return f"ThreadedAsyncStore({self._store!r})"
