"""``lease()``, the public one: the core's lease, or a Celery app's, in its store and key space.

``lease(key, app=app)`` takes ``key`` as the app's locked tasks take their ``lock_key``: in the
store they use in this process (:func:`celery_lease._celery.settings.get_store`: ``lease_store``,
else the broker's Redis, else the host-local SQLite file), with the app's ``lease_key_prefix``
in front, and with ``lease_default_ttl`` / ``lease_default_wait`` for a ttl or wait left out. So
an endpoint, a script or a management command and a task with the same ``lock_key`` exclude
each other. ``store=`` picks another store; the prefix still applies.

The seam between the layers: the core's :func:`celery_lease._core.lease.lease` takes a store and
a key and knows nothing of apps; resolving an app into a store, a prefix and defaults is the
Celery layer's (the settings, their validation, the broker fallback, the per-process store
rebuilt after ``fork``), so it happens here, above the core, and the core is called with what it
resolved. Nothing is registered into the core. Sync and async alike: both ``with`` and
``async with`` (and the decorator forms) work on the :class:`~celery_lease.LeaseContext`
returned.

The threads, locks and fork resets this module takes part in: none of its own (those of the
settings module and of the core's lease: ``docs/internals.md``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from celery_lease._celery import settings as config
from celery_lease._core import lease as core
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease.clock import Clock
from celery_lease.durations import Duration
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import AsyncLockStore, LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp

__all__ = ["lease"]

CORE_TTL = 30.0
"""Seconds: the ttl of a ``lease()`` without an app that sets none."""

CORE_WAIT = 0.0
"""Seconds: the wait of a ``lease()`` without an app that sets none."""


def lease(
    key: str,
    *,
    store: LockStore | AsyncLockStore | None = None,
    app: CeleryApp | None = None,
    ttl: Duration | None = None,
    wait: Duration | None = None,
    max_hold: Duration | None = None,
    on_lost: Callable[[Lease], object] | Literal["cancel"] | None = None,
    cancel: threading.Event | None = None,
    clock: Clock | None = None,
    cooldown: Duration = 0,
    holder: str | None = None,
) -> LeaseContext:
    """Hold ``key`` in a store while a block (or decorated function) runs.

    ::

        with lease("account:42", store=store, ttl="30s", wait="5s") as held: ...
        async with lease("cache:prices", app=app) as held: ...   # as a task's lock_key

    Args:
        key: the key to hold (a non-empty string). With ``app``, the app's
            ``lease_key_prefix`` is put in front of it, as in front of a task's ``lock_key``.
        store: the :class:`~celery_lease.LockStore` to hold it in, or an
            :class:`~celery_lease.stores.base.AsyncLockStore` (for ``async with``; a sync
            ``with`` then uses its ``sync`` twin, which renews it in either case). A sync store
            works with ``async with`` too: its calls then run on a thread. Default: ``app``'s
            store; one of ``store`` and ``app`` is required.
        app: a Celery app: its lease store (the one its locked tasks use in this process:
            ``lease_store``, else the broker's Redis, else the host-local SQLite file) unless
            ``store`` is given, its ``lease_key_prefix``, and its ``lease_default_ttl`` and
            ``lease_default_wait`` for a ``ttl`` or ``wait`` left out. Its settings are
            validated as its tasks' are. Default: none.
        ttl: lease duration (default: the app's ``lease_default_ttl``, else 30 s); renewed every
            ttl/3 while the body runs, so a crashed holder frees the key within one ttl.
        wait: how long to wait for another holder (default: the app's ``lease_default_wait``,
            else 0: fail at once). Waiting wakes on the store's release notification where it
            has one, else polls from 50 ms doubling to 1 s. It is counted on ``clock`` when
            given, else on the store's own clock when it has one, else on the system clock.
        max_hold: stop renewing after this long (default: never); the lease is then lost.
        on_lost: ``on_lost(lease)``, called exactly once when the lease is lost, on the
            dispatcher (a thread of its own). ``"cancel"`` (``async with`` and ``async def``
            only): cancel the task running the body; the block then ends with
            :class:`~celery_lease.LockLostError`.
        cancel: a ``threading.Event``; setting it aborts the wait (within one poll interval)
            with ``LockNotAcquiredError(key, "cancelled")``.
        clock: time source (default: the system clock); a ``FakeClock`` in tests.
        cooldown: after a body that succeeded, keep the key taken this long (counted from the
            end) instead of releasing it (default 0).
        holder: a label naming who holds the key, recorded in the owner id and shown by
            ``celery lease list``; default none.

    Durations are seconds, ``timedelta`` or strings like ``"250ms"``, ``"30s"``, ``"5m"``.
    Everything is validated here, before anything is acquired. The full behaviour (re-entrancy,
    loss, fork) is the core's: :func:`celery_lease._core.lease.lease`.

    Raises:
        LeaseConfigError: (a ``ValueError``) for a bad argument, naming it: neither ``store``
            nor ``app``, an ``app`` that is not a Celery app, or a bad setting of the app.
        LockNotAcquiredError: on entry, when the key stays held past ``wait``.
        LockLostError: on exit, when the body raised an ``Exception`` after the lease was lost.
        StoreUnavailableError: when the store cannot be reached to acquire.
    """
    ttl_default, wait_default = CORE_TTL, CORE_WAIT
    if app is not None:
        if not hasattr(app, "conf"):
            raise LeaseConfigError(
                f"app={app!r} is not a Celery app (it has no .conf): pass the app whose"
                " lease store and lease_key_prefix to use, or store=..."
            )
        settings = config.get_settings(app)
        if store is None:
            store = config.get_store(app)
        if isinstance(key, str) and key:
            key = settings.key_prefix + key
        ttl_default, wait_default = settings.default_ttl, settings.default_wait
    elif store is None:
        raise LeaseConfigError(
            f"lease({key!r}) needs store=<a LockStore> or app=<a Celery app> (whose lease store"
            " and lease_key_prefix are used)"
        )
    return core.lease(
        key,
        store=store,
        ttl=ttl_default if ttl is None else ttl,
        wait=wait_default if wait is None else wait,
        max_hold=max_hold,
        on_lost=on_lost,
        cancel=cancel,
        clock=clock,
        cooldown=cooldown,
        holder=holder,
    )
