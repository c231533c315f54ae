"""The leased beat's settings (checked in :mod:`celery_lease._celery.settings`), with defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery.beat import Scheduler
from celery.utils.imports import load_extension_class_names, symbol_by_name

from celery_lease._celery.settings import get_settings
from celery_lease.errors import LeaseConfigError

DEFAULT_SCHEDULER = "celery.beat:PersistentScheduler"
DEFAULT_TTL = 30.0
MIN_TTL = 0.1  # Seconds: a shorter lease would be lost between two renewals.
# The entry points ``celery beat -S`` accepts by name (``django``), accepted here too.
EXTENSION_NAMESPACE = "celery.beat_schedulers"


@dataclass(frozen=True)
class BeatConfig:
    """The leased beat's settings: wrapped ``scheduler``, unprefixed ``key``, ``ttl`` in seconds."""

    scheduler: type[Scheduler]
    key: str
    ttl: float


def read_config(app: Any) -> BeatConfig:
    """``app``'s leased-beat settings with their defaults."""
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
    """The class ``lease_beat_scheduler`` names (``None``: :data:`DEFAULT_SCHEDULER`)."""
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
