"""The lease store of a Django database: ``lease_store = "django://default"``.

``django://<alias>`` gives a PostgreSQL or SQLite store by the alias's ``ENGINE`` prefix (anything
else is refused); settings are read when the store is built. See docs/django.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import AsyncLockStore, LockStore, redact_url

__all__ = [
    "POSTGRESQL_ENGINES",
    "SCHEME",
    "SQLITE_ENGINES",
    "AsyncDjangoStore",
    "DjangoStore",
    "async_database_store",
    "database_store",
]

SCHEME = "django"
"""The URL scheme: ``django://<alias>``."""

POSTGRESQL_ENGINES = ("postgresql", "postgis")
"""How the last part of an ``ENGINE`` path served by the PostgreSQL store begins."""

SQLITE_ENGINES = ("sqlite", "spatialite")
"""How the last part of an ``ENGINE`` path served by the SQLite store begins."""

_NOT_LIBPQ = frozenset(
    {
        "assume_role",
        "context",
        "cursor_factory",
        "isolation_level",
        "pool",
        "prepare_threshold",
        "server_side_binding",
    }
)
"""Keys of a PostgreSQL alias's ``OPTIONS`` that Django reads itself (never libpq's)."""


def _alias_of(url: str) -> str:
    """The alias a ``django://<alias>`` URL names (``django://``: ``"default"``); a URL of
    another form (a path, a query, another scheme) raises LeaseConfigError."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if (
        parts is None
        or parts.scheme.lower() != SCHEME
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        raise LeaseConfigError(
            f"store url={redact_url(url) if isinstance(url, str) else url!r} is not a Django"
            " database URL: use django://<alias>, an alias of settings.DATABASES"
            " (django://default; django:// is default too)"
        )
    return parts.netloc or "default"


def _database(alias: str) -> dict[str, Any]:
    """``settings.DATABASES[alias]``, read now."""
    try:
        from django.conf import settings
        from django.core.exceptions import ImproperlyConfigured
    except ImportError as exc:
        raise LeaseConfigError(
            f"the store django://{alias} reads Django's settings.DATABASES, but Django is not"
            f" installed ({exc})"
        ) from None
    try:
        databases = settings.DATABASES
    except ImproperlyConfigured as exc:
        raise LeaseConfigError(
            f"the store django://{alias} reads Django's settings.DATABASES, but Django's settings"
            f" are not configured ({exc}). Set DJANGO_SETTINGS_MODULE before the store is built"
            " (in proj/celery.py, before the Celery app is made)"
        ) from None
    if not isinstance(databases, dict) or alias not in databases:
        known = ", ".join(repr(name) for name in databases) if isinstance(databases, dict) else ""
        raise LeaseConfigError(
            f"the store django://{alias} names the alias {alias!r}, which settings.DATABASES does"
            f" not have (its aliases: {known or 'none'})"
        )
    database = databases[alias]
    if not isinstance(database, dict):
        raise LeaseConfigError(f"settings.DATABASES[{alias!r}] is not a dict: {database!r}")
    return database


def _kind(alias: str, database: dict[str, Any]) -> str:
    """``"postgresql"`` or ``"sqlite"``: the store of ``database``'s ENGINE."""
    engine = database.get("ENGINE")
    last = engine.rpartition(".")[2] if isinstance(engine, str) else ""
    if last.startswith(POSTGRESQL_ENGINES):
        return "postgresql"
    if last.startswith(SQLITE_ENGINES):
        return "sqlite"
    raise LeaseConfigError(
        f"the store django://{alias}: DATABASES[{alias!r}]['ENGINE']={engine!r} has no lease"
        " store. Allowed engines: PostgreSQL (django.db.backends.postgresql, or an engine whose"
        " path's last part begins with postgresql or postgis) and SQLite"
        " (django.db.backends.sqlite3, or a last part beginning with sqlite or spatialite); for"
        " another database, use a Redis store: lease_store='redis://...'"
    )


def _quoted(value: object) -> str:
    """A libpq ``key=value`` value, quoted (backslash and quote escaped)."""
    text = str(value)
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _postgresql_dsn(alias: str, database: dict[str, Any]) -> str:
    """The libpq ``key=value`` DSN of a PostgreSQL ``DATABASES`` entry, as Django connects;
    LeaseConfigError without ``NAME`` and ``OPTIONS['service']`` (as Django refuses)."""
    options = database.get("OPTIONS") or {}
    if not isinstance(options, dict):
        raise LeaseConfigError(f"DATABASES[{alias!r}]['OPTIONS'] is not a dict: {options!r}")
    params: dict[str, object] = {}
    name = database.get("NAME")
    if name is None:
        params["dbname"] = "postgres"  # as Django: the maintenance database
    elif name:
        params["dbname"] = name
    elif not options.get("service"):
        raise LeaseConfigError(
            f"the store django://{alias}: DATABASES[{alias!r}] has no NAME and no"
            " OPTIONS['service']: give one of them"
        )
    for key, value in options.items():
        if key not in _NOT_LIBPQ and isinstance(value, (str, int, float)):
            params[key] = value
    for setting, key in (("USER", "user"), ("PASSWORD", "password"), ("HOST", "host")):
        if database.get(setting):
            params[key] = database[setting]
    if database.get("PORT"):
        params["port"] = database["PORT"]
    return " ".join(f"{key}={_quoted(value)}" for key, value in params.items())


def _sqlite_path(alias: str, database: dict[str, Any]) -> str:
    """The file of an SQLite ``DATABASES`` entry; LeaseConfigError when it has none (in
    memory, or no ``NAME``)."""
    name = database.get("NAME")
    path = os.fspath(name) if isinstance(name, (str, os.PathLike)) else None
    if not path or path == ":memory:" or str(path).startswith("file:") or "mode=memory" in path:
        raise LeaseConfigError(
            f"the store django://{alias}: DATABASES[{alias!r}]['NAME']={name!r} is not a file"
            " (an in-memory SQLite database, as Django's test database for SQLite is, is not"
            " shared between processes). Give the alias a file, or replace the store in tests"
            " (celery_lease.testing's lease_store fixture)"
        )
    return str(path)


@contextlib.contextmanager
def _driver(alias: str) -> Iterator[None]:
    """A missing PostgreSQL driver as the error naming the extra to install."""
    try:
        yield
    except ImportError as exc:
        raise LeaseConfigError(
            f"the store django://{alias} is a PostgreSQL database: it needs the postgres extra,"
            f" pip install 'celery-lease[postgres]' ({exc})"
        ) from exc


def database_store(alias: str = "default") -> LockStore:
    """The lease store of ``settings.DATABASES[alias]``, read now.

    Raises:
        LeaseConfigError: Django not installed or not configured, an unknown alias, an engine
            without a lease store, an in-memory SQLite database (see the module docstring).
    """
    database = _database(alias)
    if _kind(alias, database) == "postgresql":
        with _driver(alias):
            from celery_lease.stores.postgres import PostgresLockStore

        return PostgresLockStore(_postgresql_dsn(alias, database))
    from celery_lease.stores.sqlite import SQLiteLockStore

    return SQLiteLockStore(_sqlite_path(alias, database))


def async_database_store(alias: str = "default") -> AsyncLockStore:
    """The asyncio lease store of ``settings.DATABASES[alias]``, read now: an
    :class:`~celery_lease.AsyncPostgresLockStore`, or SQLite's in a
    :class:`~celery_lease.ThreadedAsyncStore` (which owns it).

    Raises:
        LeaseConfigError: as :func:`database_store`.
    """
    database = _database(alias)
    if _kind(alias, database) == "postgresql":
        with _driver(alias):
            from celery_lease.stores.postgres_async import AsyncPostgresLockStore

        return AsyncPostgresLockStore(_postgresql_dsn(alias, database))
    from celery_lease.stores.sqlite import SQLiteLockStore
    from celery_lease.stores.threaded import ThreadedAsyncStore

    return ThreadedAsyncStore(SQLiteLockStore(_sqlite_path(alias, database)), close_store=True)


class DjangoStore:
    """The ``django`` scheme of the store table; :meth:`from_url` never returns an instance."""

    @classmethod
    def from_url(cls, url: str) -> LockStore:
        """:func:`database_store` of the alias ``url`` names (``django://<alias>``)."""
        return database_store(_alias_of(url))


class AsyncDjangoStore:
    """The ``django`` scheme's asyncio entry of the store table."""

    @classmethod
    def from_url(cls, url: str) -> AsyncLockStore:
        """:func:`async_database_store` of the alias ``url`` names (``django://<alias>``)."""
        return async_database_store(_alias_of(url))
