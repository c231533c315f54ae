"""The arguments of ``lease()``, checked once, before anything is acquired: each bad one raises
:class:`~celery_lease.LeaseConfigError` naming the parameter, its value and what is allowed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS
from celery_lease._core.renewer import DRIFT_FACTOR, DRIFT_MARGIN
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.durations import Duration, to_seconds
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import (
    AsyncLockStore,
    AsyncSupportsSlots,
    LockStore,
    SupportsSlots,
    conforms,
)
from celery_lease.stores.slots import MAX_LIMIT, SLOT_MARK

MIN_TTL = DRIFT_MARGIN / (1 - DRIFT_FACTOR)
"""Seconds (about 2.02 ms) a ttl must exceed to leave the lease any local validity."""


class _CancelBody:
    """``on_lost="cancel"``: a marker and a no-op listener (``async with`` installs the cancel)."""

    __slots__ = ()

    def __call__(self, lease: object) -> None:
        return None

    def __repr__(self) -> str:
        return "'cancel'"


CANCEL = _CancelBody()
"""What ``lease(on_lost="cancel")`` stores as its ``on_lost`` (a sync ``with`` refuses it)."""


def check_ttl(seconds: float, given: object, *, name: str) -> None:
    """Raise :class:`LeaseConfigError` unless a ttl of ``seconds`` is over :data:`MIN_TTL`
    (``given``, ``name``: for the message)."""
    if seconds <= MIN_TTL:
        raise LeaseConfigError(
            f"{name}={given!r} must be more than {MIN_TTL * 1000:.2f} ms: a lease counts"
            f" {DRIFT_MARGIN * 1000:g} ms and {DRIFT_FACTOR:.0%} of its ttl off its validity for"
            " clock drift, so a shorter one would be lost the moment it is acquired"
        )


_ASYNC_CLASSES: dict[type, bool] = {}


def is_async_store(store: object) -> bool:
    """True for an :class:`~celery_lease.stores.base.AsyncLockStore` (cached per class, but for
    a class delegating through ``__getattr__``)."""
    cls = type(store)
    known = _ASYNC_CLASSES.get(cls)
    if known is None:
        known = conforms(store, AsyncLockStore)
        if not hasattr(cls, "__getattr__"):  # a delegating wrapper answers per wrapped store
            _ASYNC_CLASSES[cls] = known
    return known


def split_async_store(store: Any) -> tuple[AsyncLockStore | None, Any]:
    """``(store, store.sync)`` for an AsyncLockStore given to ``lease()``, else ``(None, store)``.

    Raises:
        LeaseConfigError: when the async store's ``sync`` is not a synchronous LockStore.
    """
    if not is_async_store(store):
        return None, store
    twin = store.sync
    if not conforms(twin, LockStore) or is_async_store(twin):
        raise LeaseConfigError(
            f"store={store!r} is an AsyncLockStore whose .sync ({twin!r}) is not a synchronous"
            " LockStore: the renewer thread renews through it"
        )
    return store, twin


LeaseArguments = tuple[
    LockStore,  # the synchronous store
    "AsyncLockStore | None",  # the async store given, if one was
    float,  # ttl
    float,  # wait
    "float | None",  # max_hold
    float,  # cooldown
    "Callable[[Any], object] | None",  # on_lost, "cancel" as CANCEL
    Clock,
]
"""``lease()``'s arguments, checked: durations in seconds (a plain tuple: built per call)."""

_SECONDS: dict[tuple[str, type, object], float] = {}
"""Durations already checked, by (parameter, type, value): most calls repeat a few literals."""


def _seconds(name: str, value: object, *, positive: bool = False) -> float:
    key = (name, type(value), value)
    try:
        return _SECONDS[key]
    except (KeyError, TypeError):  # TypeError: unhashable, so no duration (to_seconds says why)
        pass
    seconds = to_seconds(value, name=name, inclusive=not positive)
    if name == "ttl":
        check_ttl(seconds, value, name=name)
    if len(_SECONDS) < 256:
        _SECONDS[key] = seconds
    return seconds


def _checked_store(store: object) -> tuple[AsyncLockStore | None, LockStore]:
    astore: AsyncLockStore | None = None
    if hasattr(type(store), "aclose"):  # an AsyncLockStore: held through it, renewed via .sync
        astore, store = split_async_store(store)
    if not conforms(store, LockStore):
        hint = (
            " (build one with store_from_url(url) or async_store_from_url(url) once)"
            if isinstance(store, str)
            else ""
        )
        raise LeaseConfigError(
            f"store={store!r} is not a LockStore: it needs acquire(), renew() and release(){hint}"
        )
    return astore, cast(LockStore, store)


def _checked_on_lost(on_lost: object) -> Callable[[Any], object] | None:
    if isinstance(on_lost, str) and on_lost == "cancel":
        return CANCEL
    if on_lost is not None and not callable(on_lost):
        raise LeaseConfigError(
            f"on_lost={on_lost!r} must be a callable taking the Lease, 'cancel' (async with"
            " only), or None"
        )
    return cast("Callable[[Any], object] | None", on_lost)


def checked_arguments(
    key: object,
    store: object,
    ttl: Duration,
    wait: Duration,
    max_hold: Duration | None,
    on_lost: object,
    cancel: object,
    clock: object,
    cooldown: Duration,
    holder: object,
) -> LeaseArguments:
    """``lease()``'s arguments checked and normalised (see :func:`~celery_lease.lease`).

    Raises:

        LeaseConfigError: for the first bad argument, naming it.
    """
    if not isinstance(key, str) or not key:
        raise LeaseConfigError(f"key={key!r} must be a non-empty string")
    if SLOT_MARK in key:
        raise LeaseConfigError(key_with_slot_mark(key))
    astore, sync_store = _checked_store(store)
    ttl_s = _seconds("ttl", ttl, positive=True)
    wait_s = _seconds("wait", wait)
    max_hold_s = None if max_hold is None else _seconds("max_hold", max_hold, positive=True)
    cooldown_s = _seconds("cooldown", cooldown)
    listener = _checked_on_lost(on_lost)
    if cancel is not None and not (hasattr(cancel, "is_set") and hasattr(cancel, "wait")):
        raise LeaseConfigError(f"cancel={cancel!r} must be a threading.Event or None")
    if clock is not None and not conforms(clock, Clock):
        raise LeaseConfigError(f"clock={clock!r} must provide monotonic(), time() and wait()")
    if holder is not None and not (
        isinstance(holder, str) and 0 < len(holder) <= MAX_OWNER_FIELD_CHARS
    ):
        raise LeaseConfigError(
            f"holder={holder!r} must be a non-empty str of at most {MAX_OWNER_FIELD_CHARS}"
            " characters, or None"
        )
    clock_ = SYSTEM_CLOCK if clock is None else cast(Clock, clock)
    return sync_store, astore, ttl_s, wait_s, max_hold_s, cooldown_s, listener, clock_


def key_with_slot_mark(key: str, where: str = "") -> str:
    """The message refusing ``key`` (of ``where``, e.g. ``" of task 'x'"``) for holding
    :data:`~celery_lease.stores.slots.SLOT_MARK`."""
    return (
        f"key={key!r}{where} contains U+001F (unit separator): stores mark a key's slots with"
        " it, so a key may hold any character but that one"
    )


def checked_limit(limit: object, *, name: str = "limit") -> int | None:
    """``limit`` checked: ``None`` for ``None`` (one holder, the key itself), else the int
    from 1 to :data:`~celery_lease.stores.slots.MAX_LIMIT` (that many slots of the key: 1 is
    one holder at a time in the key's slot space, counted with holders under other limits).

    Raises:
        LeaseConfigError: for a bool, a non-int, or an int outside 1 .. MAX_LIMIT, naming
            ``name`` (default ``"limit"``), the value and what is allowed.
    """
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise LeaseConfigError(
            f"{name}={limit!r} is not allowed: use an int from 1 to {MAX_LIMIT} (how many"
            " holders the key may have at once), or None (the key itself)"
        )
    return limit


def check_slot_store(
    limit: object, store: object, astore: object | None, *, name: str = "limit"
) -> None:
    """Raise :class:`LeaseConfigError` unless ``store`` (and ``astore``, the async store given,
    if any) can hold slots of a key (``acquire_slot``) for ``limit`` (the option ``name``)."""
    for given, protocol in ((store, SupportsSlots), (astore, AsyncSupportsSlots)):
        if given is not None and not (
            hasattr(type(given), "acquire_slot") and conforms(given, protocol)
        ):
            raise LeaseConfigError(
                f"{name}={limit!r} needs a store with acquire_slot() (memory, SQLite, Redis,"
                f" PostgreSQL, Django stores have it); store={given!r} has none: leave limit"
                " unset (None) with it, or use another store"
            )
