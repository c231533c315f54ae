"""The table of stores (URL scheme -> ``"module:Class"``) and the factories that read it.

Every reader of a store URL (the factories, the settings check, the CLI, the lazy names of
:mod:`celery_lease`) goes through :data:`SCHEMES`. Classes are named, not imported (as kombu's
``TRANSPORT_ALIASES``): a missing optional driver fails only when its scheme is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import AsyncLockStore, LockStore, redact_url
from celery_lease.stores.threaded import ThreadedAsyncStore


class Entry(NamedTuple):
    """What serves one URL scheme."""

    sync: str  # "module:Class" of the LockStore
    native_async: str | None  # of the native AsyncLockStore; None: ThreadedAsyncStore
    extra: str | None  # the celery-lease[extra] installing the driver; None: stdlib
    example: str | None  # as listed in an error's "supported:" URLs; None: not listed


_MEMORY = "celery_lease.stores.memory:MemoryLockStore"
_SQLITE = "celery_lease.stores.sqlite:SQLiteLockStore"
_REDIS = "celery_lease.stores.redis:RedisLockStore"
_REDIS_ASYNC = "celery_lease.stores.redis_async:AsyncRedisLockStore"
_POSTGRES = "celery_lease.stores.postgres:PostgresLockStore"
_POSTGRES_ASYNC = "celery_lease.stores.postgres_async:AsyncPostgresLockStore"
_DJANGO = "celery_lease.stores.django:DjangoStore"
_DJANGO_ASYNC = "celery_lease.stores.django:AsyncDjangoStore"

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
        # settings.DATABASES (celery_lease.stores.django, imported when a django:// URL is used).
        "django": Entry(_DJANGO, _DJANGO_ASYNC, "django", "django://<alias>"),
    }
)
"""Lower-case URL scheme -> :class:`Entry`, in the order the schemes are listed to users."""


def resolve(path: str) -> Any:
    """The object a ``"module:name"`` string names, importing the module (``ImportError``
    when it or its driver is not installed)."""
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


def known_schemes() -> tuple[str, ...]:
    """Every scheme a store is built for, in the table's order."""
    return tuple(SCHEMES)


def examples() -> tuple[str, ...]:
    """The URL forms an error lists as ``supported:``."""
    return tuple(entry.example for entry in SCHEMES.values() if entry.example is not None)


def sync_class(scheme: str) -> type[Any]:
    """The synchronous store class of ``scheme`` (lower case, a ``KeyError`` if unknown)."""
    cls: type[Any] = resolve(SCHEMES[scheme].sync)
    return cls


def async_class(scheme: str) -> type[Any] | None:
    """The native async store class of ``scheme`` (as :func:`sync_class`), or ``None``."""
    path = SCHEMES[scheme].native_async
    if path is None:
        return None
    cls: type[Any] = resolve(path)
    return cls


def lazy_names() -> dict[str, tuple[str, str | None]]:
    """Class name -> ``(module, extra or None)`` of every class the table names: for the names
    :mod:`celery_lease` loads on first use."""
    names: dict[str, tuple[str, str | None]] = {}
    for entry in SCHEMES.values():
        for path in (entry.sync, entry.native_async):
            if path is not None:
                module_name, _, name = path.partition(":")
                names[name] = (module_name, entry.extra)
    return names


def store_from_url(url: str) -> LockStore:
    """Build a store from a URL.

    Supported forms:

    - ``memory://``: a new :class:`~celery_lease.MemoryLockStore` (one process only);
    - ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``;
    - ``redis://[[user]:password@]host[:port][/db]`` and ``rediss://...`` (TLS), query options as
      redis-py's ``from_url`` takes them;
    - ``redis+sentinel://[[user]:password@]host1:26379[,host2:26379]/service_name[/db]``: a
      Sentinel-managed master (``?sentinel_password=...`` for Sentinel's own auth);
    - ``postgresql://...`` / ``postgres://...``: a libpq DSN.

    The scheme picks the class in :data:`SCHEMES`, imported on first use.

    Raises:
        LeaseConfigError: (a ``ValueError``) for an unknown scheme, listing the supported ones.
    """
    scheme = _scheme_of(url)
    cls = sync_class(scheme)
    build = getattr(cls, "from_url", cls)  # RedisLockStore and PostgresLockStore take the URL
    return cast(LockStore, build(url))


def async_store_from_url(url: str) -> AsyncLockStore:
    """Build an :class:`AsyncLockStore` from a URL (the forms :func:`store_from_url` takes).

    - ``redis://``, ``rediss://``, ``redis+sentinel://``, ``unix://``:
      ``AsyncRedisLockStore.from_url(url)`` (``redis.asyncio``);
    - ``postgresql://`` / ``postgres://``: ``AsyncPostgresLockStore.from_url(url)`` (psycopg 3);
    - ``sqlite:///...`` and ``memory://``: a :class:`~.threaded.ThreadedAsyncStore` over the
      synchronous store (their calls are short and local: they run on a thread of the event
      loop's default executor). The adapter owns that store: ``aclose()`` closes it.

    Build it once per event loop and ``await store.aclose()`` when done (native async clients
    belong to the loop they were first used in).

    Raises:
        LeaseConfigError: (a ``ValueError``) for an unknown scheme, listing the supported ones.
    """
    scheme = _scheme_of(url)
    native = async_class(scheme)
    if native is not None:
        return cast(AsyncLockStore, native.from_url(url))
    return ThreadedAsyncStore(store_from_url(url), close_store=True)


def _scheme_of(url: str) -> str:
    """The lower-case scheme of ``url``; LeaseConfigError (listing the forms) if none or unknown."""
    if not isinstance(url, str) or "://" not in url:
        shown = redact_url(url) if isinstance(url, str) else url
        raise LeaseConfigError(
            f"store url={shown!r} is not a URL; supported: {', '.join(examples())}"
        )
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise LeaseConfigError(
            f"store url={redact_url(url)!r} has an unknown scheme {scheme!r}; supported: "
            f"{', '.join(examples())}"
        )
    return scheme
