"""Settings on ``app.conf`` (``docs/celery.md#app-settings``) and the one precedence rule: task
option, app setting, default. Validated on first use and at worker start (a bad or misspelled
one refuses the worker); Celery's namespaces apply. The store is resolved once per app and
process.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast
from urllib.parse import parse_qsl, urlsplit

from celery_lease import _forking as forking
from celery_lease._celery.setting_typos import check_names
from celery_lease.durations import to_seconds
from celery_lease.errors import LeaseConfigError
from celery_lease.stores import registry, store_from_url
from celery_lease.stores.base import LockStore, conforms, redact_url

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp

logger = logging.getLogger("celery_lease.config")

BUILTIN_TTL = 30.0
BUILTIN_WAIT = 0.0
BUILTIN_KEY_PREFIX = ""

# Every ``app.conf`` setting, in documentation order. A new one is a line here, a
# :class:`LeaseSettings` field and its parsing in ``_read``; the typo check follows this list.
SETTINGS: tuple[str, ...] = (
    "lease_store",
    "lease_default_ttl",
    "lease_default_wait",
    "lease_key_prefix",
    "lease_metrics",
    "lease_metrics_port",
    "lease_default_queue_ttl",
    "lease_defer_release",
    "lease_store_check",
    "lease_restart_grace",
    "lease_require_shared_store",
    "lease_beat_scheduler",
    "lease_beat_key",
    "lease_beat_ttl",
)

# Schemes of the one store table (:mod:`celery_lease.stores.registry`).
STORE_SCHEMES: tuple[str, ...] = registry.known_schemes()
# Allowed ``lease_metrics`` values besides ``None``.
METRICS_EXPORTERS: tuple[str, ...] = ("prometheus", "otel")
# Allowed ``lease_store_check`` values (see :mod:`celery_lease._celery.startup`).
STORE_CHECKS: tuple[str, ...] = ("refuse", "warn", "off")
BUILTIN_METRICS_PORT = 9809  # celery-exporter's 9808, plus one.
SQLITE_FILE = "leases.sqlite3"
T = TypeVar("T")
_K = TypeVar("_K")
_V = TypeVar("_V")


def pick(option: T | None, setting: T | None, builtin: T) -> T:
    """The precedence rule, in one place: the task option, else the app setting, else default."""
    if option is not None:
        return option
    if setting is not None:
        return setting
    return builtin


@dataclass(frozen=True)
class LeaseSettings:
    """The validated ``lease_*`` settings of one app; fields drop the ``lease_`` prefix,
    durations are seconds, and ``None`` means a default derived later. ``metrics_port`` is a
    tuple for a range."""

    store: str | LockStore | None
    default_ttl: float
    default_wait: float
    key_prefix: str
    metrics: str | None = None
    metrics_port: int | tuple[int, ...] = BUILTIN_METRICS_PORT
    default_queue_ttl: float | None = None
    defer_release: bool = True
    store_check: str = "refuse"
    restart_grace: float | None = None
    require_shared_store: bool = False
    beat_scheduler: str | type | None = None
    beat_key: str | None = None
    beat_ttl: float | None = None


_lock = threading.RLock()
# Settings keyed by app with the ``app.conf`` they were read from (Celery replaces it when the
# app is configured after a first read), and each store with the settings it was built from.
_settings: weakref.WeakKeyDictionary[CeleryApp, tuple[Callable[[], object], LeaseSettings]] = (
    weakref.WeakKeyDictionary()
)
_stores: weakref.WeakKeyDictionary[CeleryApp, tuple[LeaseSettings, LockStore]] = (
    weakref.WeakKeyDictionary()
)
_refusals: weakref.WeakKeyDictionary[CeleryApp, str] = weakref.WeakKeyDictionary()
_warned_local = False
# The number of the last change after which get_settings / get_store (or a store option) may
# answer otherwise for an app whose ``app.conf`` is the same object (see :func:`changes`): each
# drawn once from ``_numbers``, so a value read is never written again by a later change.
_numbers = itertools.count(1)
_changes = 0


def changes() -> int:
    """A number that is new after every change after which :func:`get_settings` or
    :func:`get_store` may answer otherwise for an app with the same ``app.conf`` object (settings
    read again, a refusal, a store built or forgotten, a fork, :func:`changed`): what was
    resolved from them after reading a number is still what they give while it is read again."""
    return _changes


def changed() -> None:
    """Give :func:`changes` a new number: something resolved from the settings may differ now."""
    global _changes
    _changes = next(_numbers)


def _read(app: CeleryApp) -> LeaseSettings:
    conf = app.conf
    check_names(conf, SETTINGS)
    store = conf.get("lease_store")
    if store is not None and not isinstance(store, str) and not conforms(store, LockStore):
        raise LeaseConfigError(
            f"lease_store={store!r} is not allowed: use a store URL (redis://, sqlite:///...,"
            " postgresql://, memory://) or a LockStore instance"
        )
    if isinstance(store, str):
        if not store.strip():
            store = None
        elif "://" not in store:
            raise LeaseConfigError(
                f"lease_store={redact_url(store)!r} is not a URL: use redis://...,"
                " sqlite:////abs/path.db,"
                " postgresql://... or memory://"
            )
        elif (scheme := urlsplit(store.strip()).scheme.lower()) not in registry.SCHEMES:
            raise LeaseConfigError(
                f"lease_store={redact_url(store)!r} has an unknown scheme {scheme!r}; supported:"
                f" {', '.join(s + '://' for s in registry.known_schemes())}"
            )
    prefix = conf.get("lease_key_prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise LeaseConfigError(f"lease_key_prefix={prefix!r} must be a str (default '')")
    metrics, metrics_port = _read_metrics(conf.get("lease_metrics"), conf.get("lease_metrics_port"))

    def seconds(name: str, *, inclusive: bool = True) -> float | None:
        value = conf.get(name)
        return None if value is None else to_seconds(value, name=name, inclusive=inclusive)

    return LeaseSettings(
        store=cast("str | LockStore | None", store),
        default_ttl=pick(seconds("lease_default_ttl", inclusive=False), None, BUILTIN_TTL),
        default_wait=pick(seconds("lease_default_wait"), None, BUILTIN_WAIT),
        key_prefix=pick(prefix, None, BUILTIN_KEY_PREFIX),
        metrics=metrics,
        metrics_port=metrics_port,
        default_queue_ttl=seconds("lease_default_queue_ttl", inclusive=False),
        defer_release=_read_bool(conf.get("lease_defer_release"), "lease_defer_release", True),
        store_check=_read_store_check(conf.get("lease_store_check")),
        restart_grace=seconds("lease_restart_grace"),
        require_shared_store=_read_bool(
            conf.get("lease_require_shared_store"), "lease_require_shared_store", False
        ),
        beat_scheduler=_read_beat_scheduler(conf.get("lease_beat_scheduler")),
        beat_key=_read_beat_key(conf.get("lease_beat_key")),
        beat_ttl=seconds("lease_beat_ttl", inclusive=False),
    )


def _read_beat_scheduler(value: object) -> str | type | None:
    """A non-empty ``"module:Class"`` or a class; imported when the leased beat starts."""
    if value is None or isinstance(value, type) or (isinstance(value, str) and value.strip()):
        return value
    raise LeaseConfigError(
        f"lease_beat_scheduler={value!r} is not allowed: use a celery.beat.Scheduler subclass or"
        " its name ('module:Class', default 'celery.beat:PersistentScheduler')"
    )


def _read_beat_key(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise LeaseConfigError(
        f"lease_beat_key={value!r} is not allowed: use a non-empty str"
        " (default 'celery-beat:<app main name>')"
    )


def _read_store_check(value: object) -> str:
    if value is None:
        return STORE_CHECKS[0]
    if value not in STORE_CHECKS:
        raise LeaseConfigError(
            f"lease_store_check={value!r} is not allowed: use one of"
            f" {', '.join(repr(c) for c in STORE_CHECKS)} (default {STORE_CHECKS[0]!r})"
        )
    return str(value)


def _read_bool(value: object, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LeaseConfigError(
            f"{name}={value!r} is not allowed: use True or False (default {default})"
        )
    return value


def _read_metrics(exporter: object, port: object) -> tuple[str | None, int | tuple[int, ...]]:
    if isinstance(exporter, str) and not exporter.strip():
        exporter = None
    if exporter is not None and exporter not in METRICS_EXPORTERS:
        raise LeaseConfigError(
            f"lease_metrics={exporter!r} is not allowed: use one of"
            f" {', '.join(repr(e) for e in METRICS_EXPORTERS)}, or None for no metrics"
        )
    if port is None or (isinstance(port, str) and not port.strip()):
        return exporter, BUILTIN_METRICS_PORT
    return exporter, read_metrics_port(port, "lease_metrics_port")


_PORT_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def read_metrics_port(value: object, name: str) -> int | tuple[int, ...]:
    """A metrics port: an ``int`` 0..65535 (0: any; digits in a str), or ports to take the first
    free one of: ``range(9809, 9819)``, ``"9809-9818"``, a list or tuple (each 1..65535). Else
    ``LeaseConfigError``."""
    ports: object = value
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            ports = int(text)
        elif (match := _PORT_RANGE.match(text)) is not None:
            first, last = int(match.group(1)), int(match.group(2))
            ports = range(first, last + 1) if 1 <= first <= last <= 65535 else ()
    if isinstance(ports, int) and not isinstance(ports, bool) and 0 <= ports <= 65535:
        return ports
    if isinstance(ports, range) and not _range_within_ports(ports):
        ports = ()  # checked from its ends: a range past 65535 is never listed
    if isinstance(ports, (range, list, tuple)):
        candidates = tuple(ports)
        if candidates and all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in candidates
        ):
            return candidates
    raise LeaseConfigError(
        f"{name}={value!r} is not allowed: use a port from 0 to 65535 (0: any free port; default"
        f" {BUILTIN_METRICS_PORT}), or ports each worker takes the first free one of:"
        f" range(9809, 9819), '9809-9818' (first-last, both included) or a list of ports, each"
        " from 1 to 65535"
    )


def _range_within_ports(ports: range) -> bool:
    """Whether ``ports`` is non-empty with both ends in 1..65535 (not listed: it may be huge)."""
    try:
        if len(ports) == 0:
            return False
    except OverflowError:  # longer than sys.maxsize: far more than 65535 ports
        return False
    first, last = ports[0], ports[-1]
    return min(first, last) >= 1 and max(first, last) <= 65535


def cached(cache: MutableMapping[_K, _V], key: _K, build: Callable[[], _V]) -> _V:
    """``cache[key]``, built once per process (double-checked under the module's lock)."""
    value = cache.get(key)
    if value is None:
        with _lock:
            value = cache.get(key)
            if value is None:
                value = cache[key] = build()
    return value


def get_settings(app: CeleryApp) -> LeaseSettings:
    """The validated lease settings of ``app``, cached per ``app.conf`` object (Celery replaces
    it when configured after a first read); ``LeaseConfigError`` for a bad or misspelled
    setting, or a refused configuration."""
    if _refusals and (refusal := _refusals.get(app)) is not None:
        raise LeaseConfigError(refusal)
    conf = app.conf  # loads the app's configuration if nothing did yet (as its tasks would)
    entry = _settings.get(app)
    if entry is None or entry[0]() is not conf:
        with _lock:
            entry = _settings.get(app)
            if entry is None or entry[0]() is not conf:
                entry = _settings[app] = (_reference(conf), _read(app))
                changed()
    return entry[1]


def _reference(conf: object) -> Callable[[], object]:
    """A weak reference to ``conf`` where possible (Celery's ``Settings``), else a strong one."""
    try:
        return weakref.ref(conf)
    except TypeError:
        return lambda: conf


def refuse(app: CeleryApp, message: str) -> None:
    """Make every later :func:`get_settings` / :func:`get_store` of ``app`` raise ``message``, so
    a worker that refused the configuration runs nothing unexcluded, in any pool child. Undone
    by :func:`reset` only."""
    with _lock:
        _refusals[app] = message
        changed()


def recheck(app: CeleryApp) -> None:
    """Forget ``app``'s settings and refusal (not its store): a new worker build checks afresh."""
    with _lock:
        _settings.pop(app, None)
        _refusals.pop(app, None)
        changed()


def is_process_local(store: str | LockStore | None) -> bool:
    """Whether ``store`` is a ``MemoryLockStore`` or ``memory://`` (``None``, the app's, is not)."""
    if isinstance(store, str):
        return urlsplit(store.strip()).scheme.lower() == "memory"
    from celery_lease.stores.memory import MemoryLockStore

    return isinstance(store, MemoryLockStore)


def broker_store_url(app: CeleryApp) -> str | None:
    """The broker's Redis URL as a lock-store URL (sentinel included), else ``None``."""
    url = app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if not isinstance(url, str) or not url:
        return None
    first = url.split(";", 1)[0].strip()
    scheme = urlsplit(first).scheme.lower()
    if scheme in ("redis", "rediss"):
        return first
    if scheme == "sentinel":
        options = app.conf.broker_transport_options or {}
        master = options.get("master_name")
        if not master:
            return None
        hosts: list[str] = []
        userinfo = ""
        db = ""
        for part in url.split(";"):
            parts = urlsplit(part.strip())
            if parts.hostname is None:
                continue
            if parts.password and not userinfo:
                userinfo = f"{parts.username or ''}:{parts.password}@"
            if parts.path.strip("/") and not db:
                db = parts.path.strip("/")
            hosts.append(f"{parts.hostname}:{parts.port or 26379}")
        if not hosts:
            return None
        suffix = f"/{db}" if db else ""
        return f"redis+sentinel://{userinfo}{','.join(hosts)}/{master}{suffix}"
    return None


def default_sqlite_dir() -> str:
    """``<tempdir>/celery-lease-<uid>``: shared by every worker of this user on this host."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"celery-lease-{uid}")


def default_sqlite_path() -> str:
    """Create and check the per-user directory (0o700); return the fallback file's path (0o600).

    An existing file is never opened (closing any descriptor drops the process's POSIX locks,
    SQLite's too: :mod:`celery_lease.stores.sqlite`). ``LeaseConfigError`` for a path not this
    user's or not of its kind.
    """
    directory = default_sqlite_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    _check_owned(directory, stat.S_ISDIR, "directory", 0o700)
    path = os.path.join(directory, SQLITE_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: no symlink
    except FileExistsError:
        # chmod follows a symlink, but only this user can plant one: the directory is 0o700.
        _check_owned(path, stat.S_ISREG, "regular file", 0o600)
        return path
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
    return path


def _check_owned(path: str, is_kind: Callable[[int], bool], what: str, mode: int) -> None:
    """Refuse ``path`` unless ``lstat`` shows a ``what`` of this user; then set ``mode``."""
    info = os.lstat(path)
    if not is_kind(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise LeaseConfigError(
            f"{path!r} is not a {what} owned by this user; set lease_store to a store"
            " URL (redis://..., sqlite:////abs/path.db) instead of the host-local default"
        )
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)


def store_option(app: CeleryApp) -> str | LockStore:
    """What :func:`get_store` would build from, unbuilt (for checks)."""
    configured = get_settings(app).store
    if configured is not None:
        return configured
    broker = broker_store_url(app)
    if broker is not None:
        return broker
    return f"sqlite:///{default_sqlite_path()}"


_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")


def with_restart_grace(url: str, settings: LeaseSettings) -> str:
    """A Redis ``url`` with ``restart_grace`` added when it sets none (default: the default ttl)."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in _REDIS_SCHEMES:
        return url
    if any(name == "restart_grace" for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
        return url
    grace = pick(settings.restart_grace, None, settings.default_ttl)
    base, hash_mark, fragment = url.partition("#")
    joint = "&" if parts.query else ("" if base.endswith("?") else "?")
    return f"{base}{joint}restart_grace={grace:g}{hash_mark}{fragment}"


def host_local_fallback(app: CeleryApp) -> bool:
    """Whether the store is the host-local SQLite file (no ``lease_store``, broker not Redis)."""
    return get_settings(app).store is None and broker_store_url(app) is None


def host_local_message(app: CeleryApp, path: str) -> str:
    """The host-local warning, or the refusal under ``lease_require_shared_store``."""
    if get_settings(app).require_shared_store:
        return (
            f"celery-lease: lease_store is unset and the broker is not Redis, so the lease"
            f" store would be the host-local SQLite file {path}, which excludes only workers on"
            " this host; lease_require_shared_store=True refuses it: set lease_store to a store"
            " every worker shares (redis://..., postgresql://...)"
        )
    return (
        f"celery-lease: lease_store is unset and the broker is not Redis: using {path}, which"
        " excludes only workers on this host; set lease_store to share locks across hosts"
        " (lease_require_shared_store=True refuses to start without one)"
    )


def warn_host_local(app: CeleryApp, path: str) -> None:
    """Log :func:`host_local_message` once per process (pool children inherit the flag)."""
    global _warned_local
    if not _warned_local:
        _warned_local = True
        logger.warning("%s", host_local_message(app, path))


def _build_store(app: CeleryApp) -> LockStore:
    settings = get_settings(app)
    if not host_local_fallback(app):
        option = store_option(app)
        return (
            store_from_url(with_restart_grace(option, settings))
            if isinstance(option, str)
            else option
        )
    from celery_lease.stores.sqlite import SQLiteLockStore

    path = default_sqlite_path()
    if settings.require_shared_store:
        raise LeaseConfigError(host_local_message(app, path))
    warn_host_local(app, path)
    return SQLiteLockStore(path)


def get_store(app: CeleryApp, settings: LeaseSettings | None = None) -> LockStore:
    """The lock store of ``app`` in this process: ``lease_store``, else the broker's Redis, else
    a SQLite file shared by this user's workers on this host (warned of once, or refused under
    ``lease_require_shared_store``). Rebuilt after ``fork`` and after a settings change.
    ``settings``: ``get_settings(app)`` when the caller has just read it (default: read here)."""
    if settings is None:
        settings = get_settings(app)
    entry = _stores.get(app)
    if entry is None or entry[0] is not settings:
        with _lock:
            entry = _stores.get(app)
            if entry is not None and entry[0] is not settings and entry[0] == settings:
                # The same values read again (recheck, an unchanged reload): the same store.
                entry = _stores[app] = (settings, entry[1])
            elif entry is None or entry[0] is not settings:
                # Other values: a new store; the old one stays open (a lease in it may be held).
                entry = _stores[app] = (settings, _build_store(app))
                changed()
    return entry[1]


def reset(app: CeleryApp | None = None, *, refusals: bool = True) -> None:
    """Forget settings, stores and (unless told not) refusals of ``app`` (``None``: all)."""
    with _lock:
        for cache in (_settings, _stores, _refusals) if refusals else (_settings, _stores):
            if app is None:
                cache.clear()
            else:
                cache.pop(app, None)
        changed()


def close_stores(app: CeleryApp | None = None) -> None:
    """Close and forget the stores this module built (of ``app``, or all); a ``LockStore`` given as
    ``lease_store`` is the caller's and only forgotten. For a test runner about to drop a store's
    database; never while a lease in them is held."""
    with _lock:
        apps = list(_stores.keys()) if app is None else [app]
        entries = [entry for a in apps if (entry := _stores.pop(a, None)) is not None]
        changed()
    for settings, store in entries:
        if not isinstance(settings.store, LockStore):
            close = getattr(store, "close", None)
            if callable(close):
                close()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    _stores.clear()
    changed()


forking.on_fork_child(_after_fork_in_child, name="config: lock, resolved stores")


def _forget_for_new_process() -> None:
    reset(refusals=False)  # a refusal recorded at the worker's start stays


forking.on_new_process(_forget_for_new_process, name="config: settings and stores of every app")
