"""Which store a locked task uses: its ``lock_store`` (a URL opened once per process, forgotten
after fork), else its app's; everything asks here, so a task's leases and queued key share a
store."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_lease import _forking as forking
from celery_lease._celery.settings import cached, get_store
from celery_lease._core.lease import lease
from celery_lease.stores import store_from_url
from celery_lease.stores.base import LockStore, conforms

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp

_url_stores: dict[str, LockStore] = {}


def store_for(option: str | LockStore | None, app: CeleryApp) -> LockStore:
    """The task's store option (a URL opened once per process), or the app's store."""
    if option is None:
        return get_store(app)
    if isinstance(option, str):
        return cached(_url_stores, option, lambda: store_from_url(option))
    return option


def execution_store(option: str | LockStore | None, app: CeleryApp, key: str) -> LockStore:
    """:func:`store_for`, an async store's ``.sync`` twin (a non-store raises as ``lease()``)."""
    store = store_for(option, app)
    if hasattr(type(store), "aclose"):  # an AsyncLockStore: a task holds it through .sync
        from celery_lease._core import aio

        store = aio.split_async_store(store)[1]
    if not conforms(store, LockStore):
        lease(key, store=store)  # raises the error lease() gives for it
    return store


def close_url_stores() -> None:
    """Close and forget the stores built from ``lock_store`` URLs."""
    while _url_stores:
        try:
            _, store = _url_stores.popitem()  # one at a time: atomic, whatever runs at once
        except KeyError:
            return
        close = getattr(store, "close", None)
        if callable(close):
            close()


def _forget_url_stores() -> None:
    _url_stores.clear()


forking.on_fork_child(_forget_url_stores, name="engine: stores of lock_store URLs")
forking.on_new_process(_forget_url_stores, name="engine: stores of lock_store URLs")
