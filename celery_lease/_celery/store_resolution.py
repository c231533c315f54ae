"""Which store a locked task uses: its ``lock_store`` option, else its app's ``lease_store``.

A ``lock_store`` URL is opened once per process and kept (forgotten in a forked child and in a
new pool process, which open their own); a store object is used as it is; no option means the
app's store (:func:`celery_lease._celery.settings.get_store`). The run engine
(:func:`execution_store`: an async store held through its ``.sync`` twin), the unique copies'
queued keys, the dead-holder reaper, ``lease(app=...)`` and ``celery lease`` all ask here, so a
task's leases and its queued key always live in the same store.

The fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_lease import _forking as forking
from celery_lease._celery.settings import cached, get_store
from celery_lease._core.lease import lease
from celery_lease.stores import store_from_url
from celery_lease.stores.base import LockStore, conforms

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp

__all__ = ["close_url_stores", "execution_store", "store_for"]

_url_stores: dict[str, LockStore] = {}


def store_for(option: str | LockStore | None, app: CeleryApp) -> LockStore:
    """The store of an execution: the task's option (URL resolved once per process) or the app's."""
    if option is None:
        return get_store(app)
    if isinstance(option, str):
        return cached(_url_stores, option, lambda: store_from_url(option))
    return option


def execution_store(option: str | LockStore | None, app: CeleryApp, key: str) -> LockStore:
    """The store an execution holds ``key`` in: :func:`store_for`, an async store's ``.sync``
    twin; a store that is no ``LockStore`` raises the error ``lease()`` gives for it."""
    store = store_for(option, app)
    if hasattr(type(store), "aclose"):  # an AsyncLockStore: a task holds it through .sync
        from celery_lease._core import aio

        store = aio.split_async_store(store)[1]
    if not conforms(store, LockStore):
        lease(key, store=store)  # raises the error lease() gives for it
    return store


def close_url_stores() -> None:
    """Close the stores built from tasks' ``lock_store`` URLs in this process and forget them
    (the next execution builds them anew); as
    :func:`celery_lease._celery.settings.close_stores`."""
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
