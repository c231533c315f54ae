"""The whole store contract (:mod:`tests.stores.contract`), run against an async store.

:class:`SyncOverAsync` is a synchronous :class:`~celery_lease.LockStore` whose calls run the
async store's coroutines on a private event loop thread (one loop per adapter, the async store
built and closed in it). So every contract test applies unchanged: threads racing for a key
become coroutines racing on one loop; a thread blocked in ``wait_for_release`` is a coroutine
awaiting it.

What the async protocol has no coroutine for (``get``, ``list``, ``last_token``,
``force_release``: the CLI's inspection) is read through the async store's ``sync`` twin, on the
same data; the contract needs it to watch a real-clock lease expire. ``renew_many`` is not
offered (the async protocol has none), so the contract skips it.

Subclass :class:`AsyncStoreContract` and define ``make_async_store`` (called on the adapter's
loop thread) and ``async_store_factory`` (picklable, for child processes).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from celery_lease.stores.base import AsyncLockStore, LeaseInfo, LockStore, SupportsInspection
from tests.stores.contract import DEADLINE, StoreContract

_T = TypeVar("_T")

CALL_TIMEOUT = 60.0  # real seconds one adapted call may take before the test fails


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` real seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class SyncOverAsync:
    """A sync LockStore (plus release notify and inspection) over an AsyncLockStore.

    Args:
        build: a zero-argument callable returning the async store; it runs on the loop thread,
            so a store that binds to the running loop at construction binds to this one.
    """

    def __init__(self, build: Callable[[], AsyncLockStore]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sync-over-async", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def make() -> AsyncLockStore:
            return build()

        self.async_store: AsyncLockStore = self.run(make())

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The private loop every call runs on."""
        return self._loop

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the private loop and return its result (or raise its error)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT)

    @property
    def sync(self) -> LockStore:
        return self.async_store.sync

    def _inspect(self) -> SupportsInspection:
        twin = self.async_store.sync
        assert isinstance(twin, SupportsInspection)
        return twin

    # LockStore ------------------------------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.run(self.async_store.acquire(key, owner, ttl_ms))

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self.run(self.async_store.renew(key, owner, ttl_ms))

    def release(self, key: str, owner: str) -> None:
        self.run(self.async_store.release(key, owner))

    def wait_for_release(self, key: str, timeout: float) -> bool:
        return self.run(self.async_store.wait_for_release(key, timeout))

    # Inspection, through the sync twin -------------------------------------------------------

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        return self._inspect().list(prefix)

    def get(self, key: str) -> LeaseInfo | None:
        return self._inspect().get(key)

    def last_token(self, key: str) -> int | None:
        return self._inspect().last_token(key)

    def force_release(self, key: str) -> LeaseInfo | None:
        return self._inspect().force_release(key)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self.async_store.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(DEADLINE)
            self._loop.close()

    def __repr__(self) -> str:
        return f"SyncOverAsync({self.async_store!r})"


class _AdaptedFactory:
    """Picklable: builds a :class:`SyncOverAsync` over ``factory()`` (in a child process)."""

    def __init__(self, factory: Callable[[], AsyncLockStore]) -> None:
        self.factory = factory

    def __call__(self) -> LockStore:
        return SyncOverAsync(self.factory)


class AsyncStoreContract(StoreContract):
    """The store contract for an async store, through :class:`SyncOverAsync`."""

    def make_async_store(self) -> AsyncLockStore:
        """A fresh, empty async store (called on the adapter's loop thread)."""
        raise NotImplementedError

    def async_store_factory(self) -> Callable[[], AsyncLockStore]:
        """A picklable zero-arg callable building the async store on the same backend."""
        raise NotImplementedError

    def make_store(self) -> LockStore:
        return SyncOverAsync(self.make_async_store)

    def store_factory(self) -> Callable[[], LockStore]:
        return _AdaptedFactory(self.async_store_factory())
