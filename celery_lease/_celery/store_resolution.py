"""Which store a locked task uses: its ``lock_store`` option, else its app's ``lease_store``.

A ``lock_store`` URL is opened once per process and kept (forgotten in a forked child and in a
new pool process, which open their own); a store object is used as it is; no option means the
app's store (:func:`celery_lease._celery.settings.get_store`). The run engine, the unique
copies' queued keys and the dead-holder reaper all ask here, so a task's leases and its queued
key always live in the same store.

The fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_lease import _forking as forking
from celery_lease._celery import settings as config
from celery_lease.stores import store_from_url
from celery_lease.stores.base import LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp

__all__ = ["close_url_stores", "store_for"]

_url_stores: dict[str, LockStore] = {}


def store_for(option: str | LockStore | None, app: CeleryApp) -> LockStore:
    """The store of an execution: the task's option (URL resolved once per process) or the app's."""
    if option is None:
        return config.get_store(app)
    if isinstance(option, str):
        return config.cached(_url_stores, option, lambda: store_from_url(option))
    return option


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
