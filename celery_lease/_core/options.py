"""Lock options of a task: names, allowed policies, defaults and validation (no Celery here).

Shared by :class:`~celery_lease.LockedTask` (``lock_<name>``) and :func:`~celery_lease.locked`
(``<name>=``); validated when the task is defined, so a typo fails at start-up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast, get_args

from celery_lease._core.arguments import check_slot_store, checked_limit
from celery_lease._core.lease import check_ttl
from celery_lease._core.unique_options import UNIQUE_OPTIONS, UniqueOptions, validate_unique
from celery_lease.durations import to_seconds
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import LockStore, SupportsReplace, conforms
from celery_lease.stores.slots import MAX_LIMIT
from celery_lease.types import OnHeld, OnLost

# Option names: ``lock_<name>`` on a task class, ``<name>=`` for :func:`locked`.
OPTIONS = (
    "key",
    "ttl",
    "wait",
    "max_hold",
    "cooldown",
    "store",
    "on_held",
    "retry_countdown",
    "on_lost",
    "limit",
    *UNIQUE_OPTIONS,
)

# Allowed ``on_held`` policies (the key stayed held past ``wait``); default ``"raise"``.
ON_HELD: tuple[OnHeld, ...] = get_args(OnHeld)
# Allowed ``on_lost`` policies (the lease was lost while the body ran); default ``"mark"``.
ON_LOST: tuple[OnLost, ...] = get_args(OnLost)
# Seconds: the first ``on_held="retry"`` countdown when ``retry_countdown`` is unset.
RETRY_FIRST = 1.0
RETRY_CAP = 60.0  # Seconds: the longest default ``on_held="retry"`` countdown.

REPLACE_WAIT_MARGIN = 2.0
"""Seconds added to the ttl for the default ``wait`` of ``on_held="replace"``. A holder asked to
stop hears it at its next renewal (within a third of the ttl) and frees the key when its body
ends (``on_lost="revoke"`` stops it then); one whose body runs on (``on_lost="mark"``) is no
longer renewed, so its lease expires at most one ttl after the ask. The margin covers what comes
on top: the holder's exit and release, the wake-up of the waiter, and clock drift between the
worker and the store (the renewer allows 1% of the ttl). Two seconds hold on a loaded machine
whatever the ttl, and cost nothing when the key frees sooner (the waiter is woken by the
release)."""


@dataclass(frozen=True)
class LockOptions:
    """Validated lock options of one task (``None``: take the app setting or the default).

    Attributes:
        key: template, callable or ``None`` (digest of the bound arguments).
        ttl: seconds, or ``None`` for ``lease_default_ttl`` (else 30).
        wait: seconds, or ``None`` for ``lease_default_wait`` (else 0).
        max_hold: seconds, or ``None`` for no limit.
        cooldown: seconds the key stays taken after a successful run (default 0).
        store: a ``LockStore``, a store URL, or ``None`` for the app's store.
        on_held: ``"raise"``, ``"skip"``, ``"retry"`` or ``"replace"`` (ask the holder to stop,
            take the key once it is free: :func:`replace_wait`; the newest call wins, and one a
            newer call overtook ends as a skip does, with the reason ``"replaced"``).
        retry_countdown: seconds between ``on_held="retry"`` attempts, or ``None`` for
            exponential from 1 s, jittered, capped at 60 s.
        on_lost: ``"mark"`` or ``"revoke"``.
        limit: how many executions of one key may run at once: ``None`` (one: the key itself
            is held), an int from 1 to :data:`~celery_lease.stores.slots.MAX_LIMIT` (each
            execution holds a *slot* of the key: ``request.lock_slot``; 1 runs one at a time
            in the key's slots, counted with executions under another limit), or a callable
            called with the task's arguments as a key callable is (``fn(*args, **kwargs)``),
            returning an int from 1 to MAX_LIMIT per
            call. A task with a callable limit always holds slots, also when it returns 1, so
            executions count against each other whatever value each call gets; a lowered
            value refuses new executions until fewer run, never stops a running one. The key
            itself and its slots are two lock spaces that do not exclude each other: a task
            without ``limit`` and one with a limit on the same key run side by side (the
            worker warns at start-up); give every task of a key a limit, or none.
        unique: the enqueue-time options (:class:`UniqueOptions`), or ``None``.
    """

    key: str | Callable[..., str] | None = None
    ttl: float | None = None
    wait: float | None = None
    max_hold: float | None = None
    cooldown: float = 0.0
    store: str | LockStore | None = None
    on_held: OnHeld = "raise"
    retry_countdown: float | None = None
    on_lost: OnLost = "mark"
    limit: int | Callable[..., int] | None = None
    unique: UniqueOptions | None = None


def validate_options(raw: Mapping[str, Any], *, where: str, prefix: str = "") -> LockOptions:
    """Check raw option values and normalise durations to seconds.

    Args:
        raw: option name (without prefix) -> value as given; missing or ``None`` is "unset".
        where: the task or function, for error messages.
        prefix: ``"lock_"`` for task attributes, ``""`` for decorator keywords.

    Raises:
        LeaseConfigError: naming the option, its value and what is allowed.
    """

    def name(option: str) -> str:
        return f"{prefix}{option} of {where}"

    def duration(option: str, *, positive: bool = False) -> float | None:
        value = raw.get(option)
        if value is None:
            return None
        return to_seconds(value, name=name(option), inclusive=not positive)

    key = raw.get("key")
    if key is not None and not isinstance(key, str) and not callable(key):
        raise LeaseConfigError(
            f"{name('key')}={key!r} is not allowed: use a template str such as"
            ' "account:{account_id}", a callable returning a str, or None'
        )
    if isinstance(key, str) and not key:
        raise LeaseConfigError(f"{name('key')}='' must be a non-empty template")
    store = raw.get("store")
    if store is not None and not isinstance(store, str) and not conforms(store, LockStore):
        raise LeaseConfigError(
            f"{name('store')}={store!r} is not allowed: use a LockStore, a store URL, or None"
        )
    if isinstance(store, str) and "://" not in store:
        raise LeaseConfigError(
            f"{name('store')}={store!r} is not a store URL (redis://, sqlite:///..., memory://)"
        )
    on_held = raw.get("on_held") or "raise"
    if on_held not in ON_HELD:
        raise LeaseConfigError(
            f"{name('on_held')}={on_held!r} is not allowed: use one of {', '.join(ON_HELD)}"
        )
    on_lost = raw.get("on_lost") or "mark"
    if on_lost not in ON_LOST:
        raise LeaseConfigError(
            f"{name('on_lost')}={on_lost!r} is not allowed: use one of {', '.join(ON_LOST)}"
        )
    ttl = duration("ttl", positive=True)
    if ttl is not None:
        check_ttl(ttl, raw.get("ttl"), name=name("ttl"))
    limit = _limit(raw.get("limit"), store, name("limit"))
    unique = validate_unique(raw, name=name, has_key=key is not None)
    wait = duration("wait")
    cooldown = duration("cooldown") or 0.0
    if on_held == "replace":
        check_replace(raw.get("limit"), unique, store, name("on_held"))
        if cooldown > 0:
            raise LeaseConfigError(
                f"{name('on_held')}='replace' cannot be combined with cooldown={cooldown!r}: a"
                " holder in its cooldown runs nothing and cannot be asked to stop, so 'replace'"
                " would wait it out; leave cooldown unset (or 0) with 'replace', or use on_held"
                " raise, skip or retry with a cooldown"
            )
        if ttl is not None:
            check_replace_wait(wait, ttl, name("wait"))
    if limit is not None and unique is not None:
        raise LeaseConfigError(
            f"{name('limit')}={raw.get('limit')!r} cannot be combined with"
            f" {prefix}unique={unique.unique!r}: unique keeps one copy of a key, a limit lets"
            " several run; drop one of them"
        )
    return LockOptions(
        key=key,
        ttl=ttl,
        wait=wait,
        max_hold=duration("max_hold", positive=True),
        cooldown=cooldown,
        store=store,
        on_held=on_held,
        retry_countdown=duration("retry_countdown"),
        on_lost=on_lost,
        limit=limit,
        unique=unique,
    )


def check_replace(
    limit: object, unique: UniqueOptions | None, store: str | LockStore | None, name: str
) -> None:
    """``on_held="replace"`` needs the key itself held (no ``limit``: int or callable),
    no ``unique`` and, when the store is given as a store, one that can ask a holder to stop
    (``SupportsReplace``; a URL's or the app's store is checked when it is known).

    Raises:
        LeaseConfigError: naming ``name`` (the on_held option), the value and what is allowed.
    """
    head = f"{name}='replace'"
    if limit is not None:
        raise LeaseConfigError(
            f"{head} cannot be combined with limit={limit!r}: it replaces the one holder of the"
            " key itself, and any limit holds the key's slots; leave limit unset with"
            " 'replace', or use another on_held policy (raise, skip, retry) with a limit"
        )
    if unique is not None:
        raise LeaseConfigError(
            f"{head} cannot be combined with unique={unique.unique!r}: a unique copy refuses the"
            " calls that 'replace' would let in; drop unique, or use on_held raise, skip or retry"
        )
    if store is not None and not isinstance(store, str):
        check_replace_store(store, name)


def check_replace_store(store: object, name: str) -> None:
    """``LeaseConfigError`` unless ``store`` can ask a holder to stop and name it
    (``SupportsReplace`` and ``get``); ``name``: the on_held option, for the message."""
    if not (conforms(store, SupportsReplace) and callable(getattr(store, "get", None))):
        raise LeaseConfigError(
            f"{name}='replace' needs a store that can ask the holder of a key to stop"
            f" (mark_replaced, SupportsReplace), and {store!r} cannot; use such a store"
            " (memory://, or a store of this version that implements it) or on_held raise, skip"
            " or retry"
        )


def check_replace_wait(wait: float | None, ttl: float, name: str) -> None:
    """``LeaseConfigError`` naming ``name`` (the wait option) when an explicit ``wait`` of an
    ``on_held="replace"`` task is shorter than its ``ttl`` (seconds both): a holder asked to
    stop may keep its lease up to one ttl, so a shorter wait would stop it and then give up."""
    if wait is not None and wait < ttl:
        raise LeaseConfigError(
            f"{name}={wait!r} is shorter than the ttl ({ttl!r} s) of an on_held='replace'"
            " task: a holder asked to stop may keep the key up to one ttl; use a wait >= the"
            f" ttl, or leave it unset (the ttl + {REPLACE_WAIT_MARGIN:g} s)"
        )


def replace_wait(options: LockOptions, ttl: float, name: str = "wait") -> float:
    """Seconds an ``on_held="replace"`` execution waits for the key after asking its holder to
    stop, at least: the task's ``wait`` when set, else ``ttl`` + :data:`REPLACE_WAIT_MARGIN` (a
    holder no longer renewed frees the key within one ttl; the app's ``lease_default_wait``,
    meant for the other policies, does not apply). Each holder asked extends it to its own ttl
    plus the margin (:func:`~celery_lease._celery.replace.take_over`).

    Raises:
        LeaseConfigError: an explicit ``wait`` shorter than ``ttl`` (named ``name``), where the
            ttl was not known when the task was defined (the app's ``lease_default_ttl``).
    """
    check_replace_wait(options.wait, ttl, name)
    return options.wait if options.wait is not None else ttl + REPLACE_WAIT_MARGIN


def _limit(value: object, store: object, name: str) -> int | Callable[..., int] | None:
    """The ``limit`` option checked: ``None`` for unset, an int, or a callable;
    either of the last two with a store object given needs its ``acquire_slot`` now."""
    limit: int | Callable[..., int] | None
    if callable(value) and not isinstance(value, type):
        limit = cast("Callable[..., int]", value)  # always slots, whatever it returns
    else:
        limit = checked_limit(value, name=name)
    if limit is not None and store is not None and not isinstance(store, str):
        check_slot_store(value, store, None, name=name)
    return limit


def call_limit(
    limit: Callable[..., int],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    where: str,
    key: str,
) -> int:
    """The limit a callable ``limit`` gives one call: ``limit(*args, **kwargs)``, checked.

    Raises:
        LeaseConfigError: when it returns anything but an int from 1 to MAX_LIMIT, naming
            ``where`` (``"task 'name'"``), the key and the value.
    """
    value = limit(*args, **kwargs)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise LeaseConfigError(
            f"limit={limit!r} of {where} returned {value!r} ({type(value).__name__}) for"
            f" key {key!r}; a limit function must return an int from 1 to {MAX_LIMIT}"
        )
    return value


def retry_countdown(options: LockOptions, retries: int) -> float:
    """Seconds before an ``on_held="retry"`` attempt: the option, else exponential from
    :data:`RETRY_FIRST`, jittered to [half, whole], capped at :data:`RETRY_CAP`."""
    if options.retry_countdown is not None:
        return options.retry_countdown
    base = min(RETRY_CAP, RETRY_FIRST * (2 ** min(retries, 16)))
    return random.uniform(base / 2, base)
