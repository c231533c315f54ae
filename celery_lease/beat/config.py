"""The leased beat's settings, read from the app and checked when the beat starts.

``lease_beat_scheduler``, ``lease_beat_key`` and ``lease_beat_ttl`` are registered (type-checked
and guarded against typos) with every other ``lease_*`` setting in
:mod:`celery_lease._celery.settings`; here they get their defaults, the ttl its lower bound and
the scheduler name its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery.beat import Scheduler
from celery.utils.imports import load_extension_class_names, symbol_by_name

from celery_lease._celery.settings import get_settings
from celery_lease.errors import LeaseConfigError

__all__ = ["DEFAULT_SCHEDULER", "DEFAULT_TTL", "MIN_TTL", "BeatConfig", "read_config"]

DEFAULT_SCHEDULER = "celery.beat:PersistentScheduler"
"""The scheduler wrapped when ``lease_beat_scheduler`` is unset: Celery's own default."""

DEFAULT_TTL = 30.0
"""Seconds: the beat lease's ttl when ``lease_beat_ttl`` is unset."""

MIN_TTL = 0.1
"""Seconds: the shortest ``lease_beat_ttl``; the lease is renewed every ttl/3 and checked with
the store before every send, so a shorter one would be lost between two checks."""

EXTENSION_NAMESPACE = "celery.beat_schedulers"
"""The entry point group whose names ``celery beat -S`` accepts (``django`` for
django-celery-beat's ``DatabaseScheduler``); ``lease_beat_scheduler`` accepts them too."""


@dataclass(frozen=True)
class BeatConfig:
    """The leased beat's validated settings.

    Attributes:
        scheduler: the wrapped scheduler class (``lease_beat_scheduler``).
        key: the lease's key before the app's ``lease_key_prefix`` (``lease_beat_key``).
        ttl: the lease's ttl in seconds (``lease_beat_ttl``).
    """

    scheduler: type[Scheduler]
    key: str
    ttl: float


def read_config(app: Any) -> BeatConfig:
    """``app``'s leased-beat settings, with their defaults.

    Raises:
        LeaseConfigError: naming the setting, its value and what is allowed: an unknown or
            unimportable scheduler, one that is not a ``celery.beat.Scheduler`` subclass, a
            ttl under :data:`MIN_TTL`, or any other bad ``lease_*`` setting of the app.
    """
    settings = get_settings(app)
    ttl = DEFAULT_TTL if settings.beat_ttl is None else settings.beat_ttl
    if ttl < MIN_TTL:
        raise LeaseConfigError(
            f"lease_beat_ttl={app.conf.get('lease_beat_ttl')!r} is too short: use at least"
            f" {MIN_TTL:g} s (default {DEFAULT_TTL:g} s)"
        )
    key = settings.beat_key or f"celery-beat:{app.main or 'default'}"
    return BeatConfig(scheduler_class(settings.beat_scheduler), key, ttl)


def scheduler_class(value: str | type | None) -> type[Scheduler]:
    """The class ``lease_beat_scheduler`` names (``None``: :data:`DEFAULT_SCHEDULER`).

    Raises:
        LeaseConfigError: as :func:`read_config`.
    """
    allowed = (
        "use a celery.beat.Scheduler subclass or its 'module:Class' name"
        f" (default {DEFAULT_SCHEDULER!r})"
    )
    name = DEFAULT_SCHEDULER if value is None else value
    if isinstance(name, str):
        aliases = dict(load_extension_class_names(EXTENSION_NAMESPACE) or ())
        try:
            found = symbol_by_name(name, aliases=aliases)
        except Exception as exc:  # any failing import: Django's ImproperlyConfigured too
            raise LeaseConfigError(
                f"lease_beat_scheduler={value!r} cannot be imported ({type(exc).__name__}:"
                f" {exc}): {allowed}"
            ) from exc
    else:
        found = name
    if not isinstance(found, type) or not issubclass(found, Scheduler):
        raise LeaseConfigError(
            f"lease_beat_scheduler={value!r} is {found!r}, not a celery.beat.Scheduler: {allowed}"
        )
    return found
