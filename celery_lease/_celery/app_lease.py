"""``lease()``, the public one: the core's lease, or a Celery app's, in its store and key space.
With ``app``, ``key`` is taken as the app's locked tasks take their ``lock_key`` (same store,
prefix and defaults), so a script excludes the task with the same key; the app is resolved
here and nothing is registered into the core."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from celery_lease._celery.settings import get_settings
from celery_lease._celery.store_resolution import store_for
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.lease import lease as core_lease
from celery_lease.clock import Clock
from celery_lease.durations import Duration
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import AsyncLockStore, LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp
    from celery_lease._core.acquire_plan import SentTry

CORE_TTL = 30.0  # Seconds: the ttl of a ``lease()`` without an app that sets none.
CORE_WAIT = 0.0


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
    limit: int | None = None,
) -> LeaseContext:
    """Hold ``key`` in a store while a block (or decorated function) runs.

    ::

        with lease("account:42", store=store, ttl="30s", wait="5s") as held: ...
        async with lease("cache:prices", app=app) as held: ...   # as a task's lock_key
        with lease("partner:acme", store=store, limit=3) as held: ...   # 3 holders at once

    Args:
        key: the key to hold (non-empty, without U+001F); with ``app``, after its
            ``lease_key_prefix``.
        store: a :class:`~celery_lease.LockStore`, or an
            :class:`~celery_lease.stores.base.AsyncLockStore` (a sync ``with`` uses its
            ``sync`` twin; a sync store under ``async with`` runs on a thread). Default:
            ``app``'s; one of the two is required.
        app: a Celery app: its store (the one its locked tasks use here), ``lease_key_prefix``
            and default ttl and wait, read on each entry, so a lease made at import uses the
            configuration the app has when it runs. A task with its own ``lock_store`` is
            excluded only with the same ``store=``.
        ttl: lease duration (default: the app's ``lease_default_ttl``, else 30 s), renewed
            every ttl/3: a crashed holder frees the key within one ttl.
        wait: how long to wait for the key (default: the app's ``lease_default_wait``, else
            0), woken by the store's release notification where it has one, else polling from
            50 ms up to 1 s.
        max_hold: stop renewing after this long (default: never); the lease is then lost.
        on_lost: ``on_lost(lease)``, called once on the dispatcher thread; ``"cancel"`` (async
            only) cancels the body's task, which ends with
            :class:`~celery_lease.LockLostError`.
        cancel: a ``threading.Event`` that aborts the wait with ``LockNotAcquiredError(key,
            "cancelled")``.
        clock: time source (default: the system clock; without it the wait counts on the
            store's clock where it has one); a ``FakeClock`` in tests.
        cooldown: after a successful body, keep the key this long (default 0).
        holder: a label for the owner id, shown by ``celery lease list``.
        limit: how many holders the key may have at once, an int from 1 to
            :data:`~celery_lease.stores.slots.MAX_LIMIT` (default ``None``: one holder, the key
            itself). Given (1 too), each holder takes a free *slot* of the key (``held.slot``:
            0 to limit - 1), a lease of its own on ``held.store_key``, renewed, lost and released
            alone; its token is larger than every earlier token of the key in any slot; a waiter is
            woken by any slot's release. The store needs ``acquire_slot`` (every built-in store has
            it). The key itself and its slots are two lock spaces that do not exclude each other: a
            lease without ``limit`` and one with a limit on the same key run side by side (give
            every user of a key a limit, or none); a nested lease re-enters an outer one of the same
            key only when both have a limit or neither has.

    Durations are seconds, ``timedelta`` or strings (``"250ms"``, ``"30s"``, ``"5m"``),
    validated before anything is acquired. Re-entrancy, loss and fork:
    :func:`celery_lease._core.lease.lease`.

    Raises:
        LeaseConfigError: (a ``ValueError``) a bad argument or app setting, named; also
            any ``limit`` with a store that has no ``acquire_slot``.
        LockNotAcquiredError: on entry, when the key (with ``limit``: every slot) stays held
            past ``wait``.
        LockLostError: on exit, when the body raised an ``Exception`` after the lease was
            lost.
        StoreUnavailableError: when the store cannot be reached to acquire.
    """
    if app is None:
        if store is None:
            raise LeaseConfigError(
                f"lease({key!r}) needs store=<a LockStore> or app=<a Celery app> (whose lease"
                " store and lease_key_prefix are used)"
            )
        # The hot path of a plain lease: straight to the core, no app to resolve.
        return core_lease(
            key,
            store=store,
            ttl=CORE_TTL if ttl is None else ttl,
            wait=CORE_WAIT if wait is None else wait,
            max_hold=max_hold,
            on_lost=on_lost,
            cancel=cancel,
            clock=clock,
            cooldown=cooldown,
            holder=holder,
            limit=limit,
        )
    if not hasattr(type(app), "conf"):  # on the type: reading app.conf would configure the app
        raise LeaseConfigError(
            f"app={app!r} is not a Celery app (it has no .conf): pass the app whose"
            " lease store and lease_key_prefix to use, or store=..."
        )
    arguments = _Arguments(
        key, store, ttl, wait, max_hold, on_lost, cancel, clock, cooldown, holder, limit
    )
    # Everything that does not depend on the app is checked now, against a stand-in store.
    template = arguments.resolve(None, UNRESOLVED)
    context = AppLeaseContext(app, arguments, template)
    if getattr(app, "configured", True):
        context.resolve()  # a bad setting fails here, and ttl/wait/key show the app's
    return context


class _Unresolved:
    """The stand-in store of an app lease not entered yet: never called."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        raise AssertionError("an app lease is resolved before it is entered")

    renew = release = acquire

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int]:
        raise AssertionError("an app lease is resolved before it is entered")


UNRESOLVED = cast(LockStore, _Unresolved())


@dataclass(frozen=True)
class _Arguments:
    """What ``lease(app=...)`` was called with, resolved against the app on entry."""

    key: str
    store: LockStore | AsyncLockStore | None
    ttl: Duration | None
    wait: Duration | None
    max_hold: Duration | None
    on_lost: Callable[[Lease], object] | Literal["cancel"] | None
    cancel: threading.Event | None
    clock: Clock | None
    cooldown: Duration
    holder: str | None
    limit: int | None

    def resolve(self, app: CeleryApp | None, fallback: LockStore) -> LeaseContext:
        """The core's context with ``app``'s store, prefix and defaults (``None``: the core's)."""
        key, store = self.key, self.store
        ttl_default, wait_default = CORE_TTL, CORE_WAIT
        if app is not None:
            settings = get_settings(app)
            if store is None:
                store = store_for(None, app)
            if isinstance(key, str) and key:
                key = settings.key_prefix + key
            ttl_default, wait_default = settings.default_ttl, settings.default_wait
        return core_lease(
            key,
            store=fallback if store is None else store,
            ttl=ttl_default if self.ttl is None else self.ttl,
            wait=wait_default if self.wait is None else self.wait,
            max_hold=self.max_hold,
            on_lost=self.on_lost,
            cancel=self.cancel,
            clock=self.clock,
            cooldown=self.cooldown,
            holder=self.holder,
            limit=self.limit,
        )


class AppLeaseContext(LeaseContext):
    """``lease(app=...)``'s context: the app's store, prefix and defaults read on each entry."""

    def __init__(self, app: CeleryApp, arguments: _Arguments, template: LeaseContext) -> None:
        super().__init__(
            template.key,
            template.store,
            template.ttl,
            template.wait,
            template.max_hold,
            template.cooldown,
            template.on_lost,
            template.cancel,
            template.clock,
            label=template.label,
            wait_clock=template.wait_clock,
        )
        self.async_store = template.async_store
        self.limit = template.limit
        self.app = app
        self.arguments = arguments

    def resolve(self) -> None:
        """Take the app's store, prefixed key and defaults as they are now."""
        resolved = self.arguments.resolve(self.app, UNRESOLVED)
        self.key, self.store = resolved.key, resolved.store
        self.store_key = resolved.key
        self.ttl, self.wait = resolved.ttl, resolved.wait
        self.async_store = resolved.async_store
        self.limit = resolved.limit

    def fresh(self) -> LeaseContext:
        """A new, unentered context with the same arguments, resolved on entry."""
        return AppLeaseContext(self.app, self.arguments, self)

    def enter(self, sent: SentTry | None = None) -> Lease:
        """Resolve, then enter (:meth:`LeaseContext.enter`)."""
        self.resolve()
        return super().enter(sent)

    __enter__ = enter

    async def __aenter__(self) -> Lease:
        self.resolve()
        return await super().__aenter__()
