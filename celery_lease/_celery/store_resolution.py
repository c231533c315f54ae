"""Which store a locked task uses: its ``lock_store`` (a URL opened once per process, forgotten
after fork), else its app's; everything asks here, so a task's leases and queued key share a
store."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_lease import _forking as forking
from celery_lease._celery.settings import cached, changed, get_store
from celery_lease._core.lease import lease
from celery_lease.stores import store_from_url
from celery_lease.stores.base import LockStore, conforms

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp
    from celery_lease._celery.settings import LeaseSettings

_url_stores: dict[str, LockStore] = {}
# The last synchronous store :func:`execution_store` found to be a LockStore (one, held strongly).
_last_checked: object = None


def store_for(
    option: str | LockStore | None, app: CeleryApp, settings: LeaseSettings | None = None
) -> LockStore:
    """The task's store option (a URL opened once per process), or the app's store;
    ``settings``: ``app``'s, when the caller has just read them (default: read here)."""
    if option is None:
        return get_store(app, settings)
    if isinstance(option, str):
        return cached(_url_stores, option, lambda: store_from_url(option))
    return option


def execution_store(
    option: str | LockStore | None,
    app: CeleryApp,
    key: str,
    settings: LeaseSettings | None = None,
) -> LockStore:
    """:func:`store_for`, an async store's ``.sync`` twin (a non-store raises as ``lease()``)."""
    global _last_checked
    store = store_for(option, app, settings)
    if store is _last_checked:
        return store
    if hasattr(type(store), "aclose"):  # an AsyncLockStore: a task holds it through .sync
        from celery_lease._core import aio

        twin: LockStore = aio.split_async_store(store)[1]  # checked there
        return twin
    if not conforms(store, LockStore):
        lease(key, store=store)  # raises the error lease() gives for it
    _last_checked = store
    return store


def close_url_stores() -> None:
    """Close and forget the stores built from ``lock_store`` URLs."""
    while _url_stores:
        try:
            _, store = _url_stores.popitem()  # one at a time: atomic, whatever runs at once
        except KeyError:
            return
        changed()
        close = getattr(store, "close", None)
        if callable(close):
            close()


def _forget_url_stores() -> None:
    _url_stores.clear()
    changed()


forking.on_fork_child(_forget_url_stores, name="engine: stores of lock_store URLs")
forking.on_new_process(_forget_url_stores, name="engine: stores of lock_store URLs")
