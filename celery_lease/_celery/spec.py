"""A locked task's definition as its executions read it: the validated options, the key
function, and the ``ttl`` / ``wait`` they resolve to under the app's settings.

Built once per task class (:class:`~celery_lease.LockedTask`) or per decorated body
(:func:`~celery_lease.locked`), and handed to the run engine
(:func:`celery_lease._celery.execution.run_locked`) and to the unique copies' publish
(:func:`celery_lease._celery.unique.apply_unique`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from celery_lease._celery.settings import BUILTIN_TTL, BUILTIN_WAIT, LeaseSettings, pick
from celery_lease._core.keys import KeyFunction
from celery_lease._core.lease import check_ttl
from celery_lease._core.options import LockOptions

__all__ = ["OPTIONS_ATTRIBUTE", "Spec", "options_of"]

OPTIONS_ATTRIBUTE = "_lock_options"
"""The attribute under which a :class:`~celery_lease.LockedTask` class, or a body decorated with
:func:`~celery_lease.locked`, carries its validated :class:`LockOptions` (set by
:mod:`celery_lease._celery.task` when the class or the decorator is made)."""


def options_of(carrier: object) -> LockOptions | None:
    """The validated lock options ``carrier`` (a task class or a ``@locked`` body) carries, or
    None for anything that is not locked. The one place other modules read them from."""
    options = getattr(carrier, OPTIONS_ATTRIBUTE, None)
    return options if isinstance(options, LockOptions) else None


@dataclass(frozen=True)
class Spec:
    """What an execution needs from its task definition: options and the key function."""

    options: LockOptions
    key_function: KeyFunction
    _durations: list[tuple[object, float, float]] = field(
        default_factory=lambda: [(None, 0.0, 0.0)], compare=False, repr=False
    )

    def durations(self, settings: LeaseSettings) -> tuple[float, float]:
        """``(ttl, wait)`` in seconds: the task's options, else the app's settings, else the
        built-in defaults; worked out and checked once per settings object (a new one is read
        after :func:`celery_lease._celery.settings.reset`)."""
        read, ttl, wait = self._durations[0]
        if read is settings:
            return ttl, wait
        options = self.options
        ttl = pick(options.ttl, settings.default_ttl, BUILTIN_TTL)
        wait = pick(options.wait, settings.default_wait, BUILTIN_WAIT)
        check_ttl(ttl, ttl, name="ttl")  # as lease() checks it: lease_default_ttl may be too short
        self._durations[0] = (settings, ttl, wait)
        return ttl, wait
