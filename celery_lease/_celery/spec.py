"""A locked task's definition as its executions read it: the validated options, the key function,
and the ``ttl`` / ``wait`` they resolve to under the app's settings. Built once per task class
or decorated body."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from celery_lease._celery.settings import BUILTIN_TTL, BUILTIN_WAIT, LeaseSettings, pick
from celery_lease._core.keys import KeyFunction
from celery_lease._core.lease import check_ttl
from celery_lease._core.options import LockOptions

# Where a ``LockedTask`` class or a ``@locked`` body carries its validated :class:`LockOptions`.
OPTIONS_ATTRIBUTE = "_lock_options"


def options_of(carrier: object) -> LockOptions | None:
    """The lock options a task class or ``@locked`` body carries, or None."""
    options = getattr(carrier, OPTIONS_ATTRIBUTE, None)
    return options if isinstance(options, LockOptions) else None


@dataclass(frozen=True)
class Spec:
    """``limit``: the task's limit option as its executions call it (an int, a callable taking
    the body's arguments, or ``None``: the key itself, no slots); ``plain_key``: the key is
    built from the arguments alone (a template or the default digest, no validation)."""

    options: LockOptions
    key_function: KeyFunction
    limit: int | Callable[..., int] | None = None
    # Whether the key is a template's or the default digest of the arguments as received (no
    # key callable, no validation): building it runs no user code.
    plain_key: bool = False
    _durations: list[tuple[object, float, float]] = field(
        default_factory=lambda: [(None, 0.0, 0.0)], compare=False, repr=False
    )

    def durations(self, settings: LeaseSettings) -> tuple[float, float]:
        """``(ttl, wait)`` in seconds, worked out and checked once per settings object."""
        read, ttl, wait = self._durations[0]
        if read is settings:
            return ttl, wait
        options = self.options
        ttl = pick(options.ttl, settings.default_ttl, BUILTIN_TTL)
        wait = pick(options.wait, settings.default_wait, BUILTIN_WAIT)
        check_ttl(ttl, ttl, name="ttl")  # as lease() checks it: lease_default_ttl may be too short
        self._durations[0] = (settings, ttl, wait)
        return ttl, wait
