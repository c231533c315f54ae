"""Options of unique-at-enqueue tasks: names, allowed values, validation (no Celery).

Lock options like the others, validated through :func:`validate_unique`; the behaviour lives in
:mod:`celery_lease._celery.unique`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

from celery_lease.durations import to_seconds
from celery_lease.errors import LeaseConfigError
from celery_lease.types import OnDuplicate, Unique

# Allowed ``unique`` values (besides ``None``: no enqueue-time uniqueness).
UNIQUE: tuple[Unique, ...] = get_args(Unique)
# Allowed ``on_duplicate`` policies; default ``"existing"``.
ON_DUPLICATE: tuple[OnDuplicate, ...] = get_args(OnDuplicate)
# The option names this module validates.
UNIQUE_OPTIONS = ("unique", "on_duplicate", "queue_ttl", "debounce", "debounce_max")
# Seconds an unstarted copy holds its key without ``queue_ttl`` or its app default.
BUILTIN_QUEUE_TTL = 3600.0
DEBOUNCE_MAX_FACTOR = 10.0  # ``debounce_max`` defaults to this many times ``debounce``.


@dataclass(frozen=True)
class UniqueOptions:
    """Validated enqueue-time options of one task.

    Attributes:
        unique: ``"while_queued"`` or ``"until_done"``.
        on_duplicate: ``"existing"`` (return the holder's ``AsyncResult``) or ``"raise"``.
        queue_ttl: seconds, or ``None`` for ``lease_default_queue_ttl`` (else 1 h).
        debounce: seconds, or ``None`` (no debounce).
        debounce_max: seconds (set whenever ``debounce`` is), else ``None``.
    """

    unique: Unique
    on_duplicate: OnDuplicate = "existing"
    queue_ttl: float | None = None
    debounce: float | None = None
    debounce_max: float | None = None


def validate_unique(
    raw: Mapping[str, Any], *, name: Callable[[str], str], has_key: bool
) -> UniqueOptions | None:
    """Check the enqueue-time options; ``None`` when ``unique`` is unset (today's behaviour).

    Args:
        raw: option name -> value as given (missing or ``None``: unset).
        name: option name -> how the error message names it (``lock_unique of task 'x'``).
        has_key: whether the task has a lock key configured (a template or a callable).

    Raises:
        LeaseConfigError: naming the option, its value and what is allowed.
    """
    unique = raw.get("unique")
    on_duplicate = raw.get("on_duplicate")
    debounce_raw = raw.get("debounce")
    if unique is None:
        for option in ("on_duplicate", "queue_ttl", "debounce", "debounce_max"):
            if raw.get(option) is not None:
                raise LeaseConfigError(
                    f"{name(option)}={raw[option]!r} needs {name('unique')} set: use one of"
                    f" {', '.join(repr(u) for u in UNIQUE)}"
                )
        return None
    if unique not in UNIQUE:
        raise LeaseConfigError(
            f"{name('unique')}={unique!r} is not allowed: use one of"
            f" {', '.join(repr(u) for u in UNIQUE)}, or None (no enqueue-time uniqueness)"
        )
    if on_duplicate is None:
        on_duplicate = "existing"
    if on_duplicate not in ON_DUPLICATE:
        raise LeaseConfigError(
            f"{name('on_duplicate')}={on_duplicate!r} is not allowed: use one of"
            f" {', '.join(repr(o) for o in ON_DUPLICATE)}"
        )
    queue_ttl_s = _seconds(raw, "queue_ttl", name)
    debounce = _seconds(raw, "debounce", name)
    debounce_max_raw = raw.get("debounce_max")
    if debounce is None:
        if debounce_max_raw is not None:
            raise LeaseConfigError(
                f"{name('debounce_max')}={debounce_max_raw!r} needs {name('debounce')} set"
            )
        return UniqueOptions(unique, on_duplicate, queue_ttl_s)
    if not has_key:
        raise LeaseConfigError(
            f"{name('debounce')}={debounce_raw!r} needs a unique key: set {name('key')} to a"
            " template or a callable naming what calls are duplicates (the newest arguments"
            " supersede the waiting copy, so the key cannot be a digest of all of them)"
        )
    debounce_max = (
        debounce * DEBOUNCE_MAX_FACTOR
        if debounce_max_raw is None
        else to_seconds(debounce_max_raw, name=name("debounce_max"), inclusive=False)
    )
    if debounce_max < debounce:
        raise LeaseConfigError(
            f"{name('debounce_max')}={debounce_max_raw!r} is shorter than"
            f" {name('debounce')}={debounce_raw!r}: use at least the debounce"
        )
    return UniqueOptions(unique, on_duplicate, queue_ttl_s, debounce, debounce_max)


def _seconds(raw: Mapping[str, Any], option: str, name: Callable[[str], str]) -> float | None:
    value = raw.get(option)
    return None if value is None else to_seconds(value, name=name(option), inclusive=False)


# The namespace of debounce tombstones (after ``lease_key_prefix``, before the task id).
SUPERSEDED_NAMESPACE = "superseded:"
