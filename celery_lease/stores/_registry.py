"""The one table of stores: URL scheme -> the classes that serve it, as ``"module:Class"`` strings.

Every reader of a store URL goes through this table:
:func:`~celery_lease.stores.base.store_from_url`,
:func:`~celery_lease.stores.base.async_store_from_url`, the settings check that refuses a
misspelled ``lease_store`` scheme at worker start (:mod:`celery_lease._celery.settings`), the
``celery
lease`` CLI (through ``store_from_url``) and the store classes :mod:`celery_lease` loads on first
use (naming the extra to install when a driver is missing). A scheme added here is known to all
of them.

The classes are named, not imported (as kombu's ``TRANSPORT_ALIASES``): a class is imported on
first use with :mod:`importlib`, so a missing optional driver fails only when its scheme is used,
and the store protocol module imports no store (each store imports it). This module imports
nothing of celery-lease.

A synchronous store is built from a URL by ``Class.from_url(url)`` when the class has one, else
``Class(url)``; a native async store by ``Class.from_url(url)``. A scheme without a native async
store is served asynchronously by :data:`THREADED_ADAPTER` over its synchronous store.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = [
    "SCHEMES",
    "THREADED_ADAPTER",
    "Entry",
    "async_class",
    "examples",
    "extra_for",
    "known_schemes",
    "lazy_names",
    "resolve",
    "sync_class",
    "threaded_adapter",
]


class Entry(NamedTuple):
    """What serves one URL scheme."""

    sync: str
    """``"module:Class"`` of the :class:`~celery_lease.stores.base.LockStore`."""
    native_async: str | None
    """``"module:Class"`` of the native :class:`~celery_lease.stores.base.AsyncLockStore`, or
    ``None``: :data:`THREADED_ADAPTER` runs the synchronous store's calls on a thread."""
    extra: str | None
    """The ``celery-lease[extra]`` that installs the driver, or ``None`` (standard library)."""
    example: str | None
    """How the scheme is listed in an error's ``supported:`` URLs, or ``None``: not listed on its
    own (another spelling of a listed scheme, or the socket form of ``redis://``)."""


_MEMORY = "celery_lease.stores.memory:MemoryLockStore"
_SQLITE = "celery_lease.stores.sqlite:SQLiteLockStore"
_REDIS = "celery_lease.stores.redis:RedisLockStore"
_REDIS_ASYNC = "celery_lease.stores.redis_async:AsyncRedisLockStore"
_POSTGRES = "celery_lease.stores.postgres:PostgresLockStore"
_POSTGRES_ASYNC = "celery_lease.stores.postgres_async:AsyncPostgresLockStore"
_DJANGO = "celery_lease.django:DjangoStore"
_DJANGO_ASYNC = "celery_lease.django:AsyncDjangoStore"

SCHEMES: Mapping[str, Entry] = MappingProxyType(
    {
        "memory": Entry(_MEMORY, None, None, "memory://"),
        "sqlite": Entry(_SQLITE, None, None, "sqlite:///path/to.db"),
        "redis": Entry(_REDIS, _REDIS_ASYNC, "redis", "redis://"),
        "rediss": Entry(_REDIS, _REDIS_ASYNC, "redis", "rediss://"),
        "redis+sentinel": Entry(_REDIS, _REDIS_ASYNC, "redis", "redis+sentinel://"),
        "unix": Entry(_REDIS, _REDIS_ASYNC, "redis", None),
        "postgresql": Entry(_POSTGRES, _POSTGRES_ASYNC, "postgres", "postgresql://"),
        "postgres": Entry(_POSTGRES, _POSTGRES_ASYNC, "postgres", None),
        # Not a store of its own: the PostgreSQL or SQLite store of a database of Django's
        # settings.DATABASES (celery_lease.django, above the stores: named, never imported).
        "django": Entry(_DJANGO, _DJANGO_ASYNC, "django", "django://<alias>"),
    }
)
"""Lower-case URL scheme -> :class:`Entry`, in the order the schemes are listed to users."""

THREADED_ADAPTER = "celery_lease._core.threaded_store:ThreadedAsyncStore"
"""``"module:Class"`` of the async adapter over any synchronous store (built with the store and
``close_store=True``)."""


def resolve(path: str) -> Any:
    """The object a ``"module:name"`` string names, importing the module (on every call: a
    module already imported is looked up in :data:`sys.modules`).

    Raises:
        ImportError: the module, or a driver it imports, is not installed.
    """
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


def known_schemes() -> tuple[str, ...]:
    """Every scheme a store is built for, in the table's order."""
    return tuple(SCHEMES)


def examples() -> tuple[str, ...]:
    """The URL forms an error lists as ``supported:``."""
    return tuple(entry.example for entry in SCHEMES.values() if entry.example is not None)


def sync_class(scheme: str) -> type[Any]:
    """The synchronous store class of ``scheme`` (lower case), imported.

    Raises:
        KeyError: ``scheme`` is not in :data:`SCHEMES`.
        ImportError: its driver is not installed.
    """
    cls: type[Any] = resolve(SCHEMES[scheme].sync)
    return cls


def async_class(scheme: str) -> type[Any] | None:
    """The native async store class of ``scheme`` (lower case), imported, or ``None`` when the
    scheme has none (:func:`threaded_adapter` serves it).

    Raises:
        KeyError: ``scheme`` is not in :data:`SCHEMES`.
        ImportError: its driver is not installed.
    """
    path = SCHEMES[scheme].native_async
    if path is None:
        return None
    cls: type[Any] = resolve(path)
    return cls


def threaded_adapter() -> type[Any]:
    """The :data:`THREADED_ADAPTER` class, imported."""
    cls: type[Any] = resolve(THREADED_ADAPTER)
    return cls


def extra_for(scheme: str) -> str | None:
    """The extra that installs the driver of ``scheme``'s stores, or ``None`` (none needed).

    Raises:
        KeyError: ``scheme`` is not in :data:`SCHEMES`.
    """
    return SCHEMES[scheme].extra


def lazy_names() -> dict[str, tuple[str, str | None]]:
    """Class name -> ``(module, extra or None)`` of every class the table names, and of the
    adapter: for the names :mod:`celery_lease` loads on first use."""
    names: dict[str, tuple[str, str | None]] = {}
    for entry in SCHEMES.values():
        for path in (entry.sync, entry.native_async):
            if path is not None:
                module_name, _, name = path.partition(":")
                names[name] = (module_name, entry.extra)
    module_name, _, name = THREADED_ADAPTER.partition(":")
    names[name] = (module_name, None)
    return names
