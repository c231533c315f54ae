"""Settings on ``app.conf``, and the one precedence rule: task option, app setting, default.

==============================  =====================================  ========================
setting (``app.conf``)          meaning                                built-in default
==============================  =====================================  ========================
``lease_store``                 a store URL or a ``LockStore``         see :func:`get_store`
``lease_default_ttl``           ttl of tasks that set none (duration)  30 s
``lease_default_wait``          wait of tasks that set none (duration)  0
``lease_key_prefix``            prepended to every task's key (str)    ``""``
``lease_metrics``               ``"prometheus"``, ``"otel"`` or None    ``None`` (no metrics)
``lease_metrics_port``          port of the Prometheus ``/metrics``    9809
                                (or a range: the first free one)
``lease_default_queue_ttl``     an unstarted unique copy's key (dur.)  1 h
``lease_defer_release``         may a worker skip waiting for the      ``True``
                                release's reply (bool; see engine)
``lease_store_check``           a store that does not answer at        ``"refuse"``
                                worker start: ``"refuse"``, ``"warn"``
                                or ``"off"`` (see the startup module)
``lease_restart_grace``         how long after its start a Redis       ``lease_default_ttl``
                                server that may have lost leases
                                refuses free keys to a store built
                                from a URL (duration; 0 off)
``lease_require_shared_store``  refuse the host-local SQLite           ``False``
                                fallback (bool; see :func:`get_store`)
``lease_beat_scheduler``        the scheduler ``celery_lease.beat``'s  ``"celery.beat:
                                ``LeasedScheduler`` wraps (a class or   PersistentScheduler"``
                                its ``"module:Class"`` name)
``lease_beat_key``              the key the leased beat holds (str)    ``"celery-beat:<main>"``
``lease_beat_ttl``              the ttl of that lease (duration)       30 s
==============================  =====================================  ========================

:data:`SETTINGS` is the one list of these names. Settings are read and validated the first time
a locked task of the app needs them, and at worker start-up (:mod:`celery_lease._celery.startup`
refuses to start the worker), so a bad value *or a misspelled name* fails loudly instead of quietly
selecting another store. Celery keeps any key it does not know and never complains, so
:mod:`celery_lease._celery.setting_typos` looks at every configured key: a key that looks
like one of ours (``lease_stor``, ``CELERY_LEASE_STOR``) or a known name in a spelling Celery
never reads (``LEASE_STORE`` without a namespace) is an error naming the key, the setting meant
and the settings. Celery's namespaces apply: with ``config_from_object(..., namespace="CELERY")``,
Django's ``CELERY_LEASE_STORE`` is ``lease_store``.

The store is resolved once per app in each process and rebuilt after ``fork``. Settings read
before the app was configured do not outlive its configuration: Celery replaces ``app.conf``
when ``config_from_object`` follows a first read, and the settings (and, when their values
changed, the store) are read again then (:func:`get_settings`).

The lock and the fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
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
from celery_lease.stores import _registry, store_from_url
from celery_lease.stores.base import LockStore, conforms, redact_url

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp

__all__ = [
    "BUILTIN_KEY_PREFIX",
    "BUILTIN_METRICS_PORT",
    "BUILTIN_TTL",
    "BUILTIN_WAIT",
    "METRICS_EXPORTERS",
    "SETTINGS",
    "STORE_CHECKS",
    "STORE_SCHEMES",
    "LeaseSettings",
    "broker_store_url",
    "cached",
    "close_stores",
    "default_sqlite_path",
    "get_settings",
    "get_store",
    "host_local_fallback",
    "host_local_message",
    "is_process_local",
    "pick",
    "read_metrics_port",
    "recheck",
    "refuse",
    "reset",
    "store_option",
    "warn_host_local",
    "with_restart_grace",
]

logger = logging.getLogger("celery_lease.config")

BUILTIN_TTL = 30.0
"""Seconds: the ttl of a task that sets none when ``lease_default_ttl`` is unset."""

BUILTIN_WAIT = 0.0
"""Seconds: the wait of a task that sets none when ``lease_default_wait`` is unset."""

BUILTIN_KEY_PREFIX = ""
"""Prepended to task keys when ``lease_key_prefix`` is unset."""

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
"""Every ``app.conf`` setting of celery-lease, in documentation order: the one list.

A new setting is one line here, plus its :class:`LeaseSettings` field (named without the
``lease_`` prefix) and its parsing in ``_read``; the typo check and its messages follow this list.
"""

STORE_SCHEMES: tuple[str, ...] = _registry.known_schemes()
"""URL schemes :func:`~celery_lease.stores.store_from_url` builds a store for: those of the one
table of stores (:mod:`celery_lease.stores._registry`). The settings check reads that table when
the settings are read, so that a misspelled scheme fails at worker start, not at the first task."""

METRICS_EXPORTERS: tuple[str, ...] = ("prometheus", "otel")
"""Allowed ``lease_metrics`` values (besides ``None``: no metrics); see
:mod:`celery_lease.metrics`."""

STORE_CHECKS: tuple[str, ...] = ("refuse", "warn", "off")
"""Allowed ``lease_store_check`` values: what a worker does when a store its locked tasks use does
not answer at start (``"refuse"``, the default: it does not start; ``"warn"``: it logs an error and
starts; ``"off"``: no round trip at start). See :mod:`celery_lease._celery.startup`."""

BUILTIN_METRICS_PORT = 9809
"""The port of the Prometheus endpoint when ``lease_metrics_port`` is unset (celery-exporter's
9808, plus one)."""

SQLITE_FILE = "leases.sqlite3"
"""File name of the host-local fallback store inside :func:`default_sqlite_dir`."""

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
    """The validated ``lease_*`` settings of one app.

    Attributes:
        store: ``lease_store`` as given (a URL, a ``LockStore``), or ``None`` when unset.
        default_ttl: seconds (``lease_default_ttl``, else 30).
        default_wait: seconds (``lease_default_wait``, else 0).
        key_prefix: ``lease_key_prefix``, else ``""``.
        metrics: ``lease_metrics``: ``"prometheus"``, ``"otel"``, or ``None`` (no metrics).
        metrics_port: ``lease_metrics_port``, else 9809 (0: any free port); a tuple of
            ports for a range (the worker takes the first free one, see
            :func:`read_metrics_port`).
        default_queue_ttl: seconds (``lease_default_queue_ttl``), or ``None`` (unset: 1 h).
        defer_release: ``lease_defer_release``, else ``True``: a worker may send a task's
            release without waiting for its reply when nothing is published after the body
            (see :mod:`celery_lease._celery.deferral`); ``False`` waits for every release's reply.
        store_check: ``lease_store_check``, else ``"refuse"`` (one of :data:`STORE_CHECKS`).
        restart_grace: seconds (``lease_restart_grace``), or ``None`` (unset: the default
            ttl): the ``restart_grace`` of a Redis store built from a URL that sets none.
        require_shared_store: ``lease_require_shared_store``, else ``False``: when ``True``, the
            host-local SQLite fallback (:func:`host_local_fallback`) is refused instead of used
            with a warning.
        beat_scheduler: ``lease_beat_scheduler`` as given (a ``"module:Class"`` name or a
            class), or ``None`` (unset: Celery's ``PersistentScheduler``); imported and checked
            when a leased beat starts (:mod:`celery_lease.beat`).
        beat_key: ``lease_beat_key``, or ``None`` (unset: ``"celery-beat:<app main name>"``).
        beat_ttl: seconds (``lease_beat_ttl``), or ``None`` (unset: 30).
    """

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
# Each app's settings with (a reference to) the ``app.conf`` they were read from, and its store
# with the settings it was built from: Celery replaces ``app.conf`` when the app is configured
# after a first read (``config_from_object`` on an app whose configuration was already loaded,
# which any read of ``app.conf`` does), so an entry read from another ``app.conf`` is stale.
_settings: weakref.WeakKeyDictionary[CeleryApp, tuple[Callable[[], object], LeaseSettings]] = (
    weakref.WeakKeyDictionary()
)
_stores: weakref.WeakKeyDictionary[CeleryApp, tuple[LeaseSettings, LockStore]] = (
    weakref.WeakKeyDictionary()
)
_refusals: weakref.WeakKeyDictionary[CeleryApp, str] = weakref.WeakKeyDictionary()
_warned_local = False


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
        elif (scheme := urlsplit(store.strip()).scheme.lower()) not in _registry.SCHEMES:
            raise LeaseConfigError(
                f"lease_store={redact_url(store)!r} has an unknown scheme {scheme!r}; supported:"
                f" {', '.join(s + '://' for s in _registry.known_schemes())}"
            )
    ttl = conf.get("lease_default_ttl")
    wait = conf.get("lease_default_wait")
    prefix = conf.get("lease_key_prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise LeaseConfigError(f"lease_key_prefix={prefix!r} must be a str (default '')")
    metrics, metrics_port = _read_metrics(conf.get("lease_metrics"), conf.get("lease_metrics_port"))
    return LeaseSettings(
        store=cast("str | LockStore | None", store),
        default_ttl=pick(
            None if ttl is None else to_seconds(ttl, name="lease_default_ttl", inclusive=False),
            None,
            BUILTIN_TTL,
        ),
        default_wait=pick(
            None if wait is None else to_seconds(wait, name="lease_default_wait"),
            None,
            BUILTIN_WAIT,
        ),
        key_prefix=pick(prefix, None, BUILTIN_KEY_PREFIX),
        metrics=metrics,
        metrics_port=metrics_port,
        default_queue_ttl=None
        if conf.get("lease_default_queue_ttl") is None
        else to_seconds(
            conf.get("lease_default_queue_ttl"), name="lease_default_queue_ttl", inclusive=False
        ),
        defer_release=_read_bool(conf.get("lease_defer_release"), "lease_defer_release", True),
        store_check=_read_store_check(conf.get("lease_store_check")),
        restart_grace=None
        if conf.get("lease_restart_grace") is None
        else to_seconds(conf.get("lease_restart_grace"), name="lease_restart_grace"),
        require_shared_store=_read_bool(
            conf.get("lease_require_shared_store"), "lease_require_shared_store", False
        ),
        beat_scheduler=_read_beat_scheduler(conf.get("lease_beat_scheduler")),
        beat_key=_read_beat_key(conf.get("lease_beat_key")),
        beat_ttl=None
        if conf.get("lease_beat_ttl") is None
        else to_seconds(conf.get("lease_beat_ttl"), name="lease_beat_ttl", inclusive=False),
    )


def _read_beat_scheduler(value: object) -> str | type | None:
    """``lease_beat_scheduler``: a non-empty ``"module:Class"`` name or a class, ``None`` unset.

    Only its type is checked here; the leased beat imports it when it starts
    (:func:`celery_lease.beat.config.scheduler_class`)."""
    if value is None or isinstance(value, type) or (isinstance(value, str) and value.strip()):
        return value
    raise LeaseConfigError(
        f"lease_beat_scheduler={value!r} is not allowed: use a celery.beat.Scheduler subclass or"
        " its name ('module:Class', default 'celery.beat:PersistentScheduler')"
    )


def _read_beat_key(value: object) -> str | None:
    """``lease_beat_key``: a non-empty string, ``None`` unset."""
    if value is None or (isinstance(value, str) and value):
        return value
    raise LeaseConfigError(
        f"lease_beat_key={value!r} is not allowed: use a non-empty str"
        " (default 'celery-beat:<app main name>')"
    )


def _read_store_check(value: object) -> str:
    """``lease_store_check``: one of :data:`STORE_CHECKS`, ``None`` (unset) for ``"refuse"``."""
    if value is None:
        return STORE_CHECKS[0]
    if value not in STORE_CHECKS:
        raise LeaseConfigError(
            f"lease_store_check={value!r} is not allowed: use one of"
            f" {', '.join(repr(c) for c in STORE_CHECKS)} (default {STORE_CHECKS[0]!r})"
        )
    return str(value)


def _read_bool(value: object, name: str, default: bool) -> bool:
    """A boolean setting: ``True`` / ``False``, or ``None`` (unset) for ``default``."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LeaseConfigError(
            f"{name}={value!r} is not allowed: use True or False (default {default})"
        )
    return value


def _read_metrics(exporter: object, port: object) -> tuple[str | None, int | tuple[int, ...]]:
    """``lease_metrics`` and ``lease_metrics_port``, checked (an empty string is unset)."""
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
    """A metrics port setting, checked: an ``int`` for one port, a tuple for a range.

    Accepted (django-prometheus's ``PROMETHEUS_METRICS_EXPORT_PORT_RANGE`` convention for the
    ranges: the worker takes the first port of it that is free, in the order given):

    - an int from 0 to 65535 (0: any free port, chosen by the kernel), or a str of digits (from
      an environment variable);
    - a range: ``range(9809, 9819)`` (its ports, in order), ``"9809-9818"`` (first and last,
      both included: the form for an environment variable), or a list or tuple of ports; each
      from 1 to 65535, at least one.

    Raises:
        LeaseConfigError: any other value (a bool, a float, a set: no order to take the first
            of, an empty or reversed range, a port out of bounds), naming ``name``.
    """
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
    """Whether ``ports`` is not empty and both its ends are ports (1 to 65535), read from its
    ends without listing it."""
    try:
        if len(ports) == 0:
            return False
    except OverflowError:  # longer than sys.maxsize: far more than 65535 ports
        return False
    first, last = ports[0], ports[-1]
    return min(first, last) >= 1 and max(first, last) <= 65535


def cached(cache: MutableMapping[_K, _V], key: _K, build: Callable[[], _V]) -> _V:
    """``cache[key]``, built by ``build()`` once per process when missing.

    Double-checked under this module's lock (renewed after ``fork``), so concurrent first uses
    build one value; later reads take no lock.
    """
    value = cache.get(key)
    if value is None:
        with _lock:
            value = cache.get(key)
            if value is None:
                value = cache[key] = build()
    return value


def get_settings(app: CeleryApp) -> LeaseSettings:
    """The validated lease settings of ``app``, read once per configuration (cached per app).

    Read again when ``app.conf`` is no longer the one they were read from: Celery replaces it
    when the app is configured (``config_from_object``) after something read it, so settings
    read before the app was configured (a module imported first) do not outlive that.

    Raises:
        LeaseConfigError: a setting has a bad value or a misspelled name (the message names the
            key, the setting meant and the settings), or the worker refused this app's
            configuration at start-up (:func:`refuse`).
    """
    if _refusals:
        _raise_refusal(app)
    conf = app.conf  # loads the app's configuration if nothing did yet (as its tasks would)
    entry = _settings.get(app)
    if entry is None or entry[0]() is not conf:
        with _lock:
            entry = _settings.get(app)
            if entry is None or entry[0]() is not conf:
                entry = _settings[app] = (_reference(conf), _read(app))
    return entry[1]


def _reference(conf: object) -> Callable[[], object]:
    """A weak reference to ``conf`` where it takes one (Celery's ``Settings``), else a strong
    one (a plain mapping in a test)."""
    try:
        return weakref.ref(conf)
    except TypeError:
        return lambda: conf


def refuse(app: CeleryApp, message: str) -> None:
    """Make every later :func:`get_settings` / :func:`get_store` of ``app`` raise.

    Called by the worker when it refuses a configuration at start-up, so that even if the worker
    went on, every locked execution of ``app`` in this process, and in the pool processes forked
    from it, fails with ``LeaseConfigError(message)`` instead of running unexcluded. Undone by
    :func:`reset` (not by the per-process reset of a new pool process).
    """
    with _lock:
        _refusals[app] = message


def recheck(app: CeleryApp) -> None:
    """Forget ``app``'s cached settings and refusal (not its store): the next read checks anew.

    A worker build calls it first, so that a refusal recorded by an earlier build in this
    process (a worker that never started) does not refuse a configuration that is fine now.
    """
    with _lock:
        _settings.pop(app, None)
        _refusals.pop(app, None)


def _raise_refusal(app: CeleryApp) -> None:
    message = _refusals.get(app)
    if message is not None:
        raise LeaseConfigError(message)


def is_process_local(store: str | LockStore | None) -> bool:
    """Whether ``store`` keeps leases in one process's memory (excludes nothing across processes).

    True for a :class:`~celery_lease.MemoryLockStore` (or subclass) and for a ``memory://`` URL,
    which builds a new one in every process. ``None`` (the app's store) is not process-local: it
    resolves to a shared or host-local store unless ``lease_store`` itself is process-local.
    """
    if isinstance(store, str):
        return urlsplit(store.strip()).scheme.lower() == "memory"
    from celery_lease.stores.memory import MemoryLockStore

    return isinstance(store, MemoryLockStore)


def broker_store_url(app: CeleryApp) -> str | None:
    """The lock-store URL of the app's broker when it is Redis, else ``None``.

    ``redis://`` and ``rediss://`` are used as they are; Celery's ``sentinel://h1;sentinel://h2``
    form becomes ``redis+sentinel://h1,h2/<master_name>/<db>`` with ``master_name`` from
    ``broker_transport_options``.
    """
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
    """The per-user directory of the host-local fallback store (created 0o700 by us).

    ``<tempdir>/celery-lease-<uid>``; every worker of this user on this host shares it.
    """
    uid = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"celery-lease-{uid}")


def default_sqlite_path() -> str:
    """Create (if needed) and check the per-user directory; return the fallback store's path.

    The directory is 0o700 and owned by this user, the file 0o600, so another local user can
    neither take nor free our keys.

    An existing file is never opened here, only examined (``lstat``) and, when its mode is
    wrong, ``chmod``-ed: this process may already hold an SQLite connection to it (a second
    app, a store rebuilt after :func:`reset`), and closing *any* descriptor of a file drops
    every POSIX lock the process holds on it, SQLite's included. Without its shared lock, the
    next process to close its connection would believe itself the last one, checkpoint and
    delete the WAL, and this process would go on committing into the deleted WAL, unseen by
    every other process: two holders of one key (see :mod:`celery_lease.stores.sqlite`). Only a
    file this call creates (``O_EXCL``: no connection can have it open yet) is opened.

    Raises:
        LeaseConfigError: the directory exists but belongs to another user or is not a
            directory, or the file is not a regular file of this user (a symlink is refused,
            not followed).
    """
    directory = default_sqlite_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    _check_owned(directory, stat.S_ISDIR, "directory", 0o700)
    path = os.path.join(directory, SQLITE_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: no symlink
    except FileExistsError:
        # Never opened: lstat (a symlink is refused) and chmod only. chmod follows a symlink,
        # but only this user (or root) can put one in its place after the check: the
        # directory is ours and 0o700.
        _check_owned(path, stat.S_ISREG, "regular file", 0o600)
        return path
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
    return path


def _check_owned(path: str, is_kind: Callable[[int], bool], what: str, mode: int) -> None:
    """Refuse ``path`` unless ``lstat`` shows a ``what`` (``is_kind`` of its mode) of this user;
    then give it ``mode``."""
    info = os.lstat(path)
    if not is_kind(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise LeaseConfigError(
            f"{path!r} is not a {what} owned by this user; set lease_store to a store"
            " URL (redis://..., sqlite:////abs/path.db) instead of the host-local default"
        )
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)


def store_option(app: CeleryApp) -> str | LockStore:
    """What the app's store is built from, resolved as :func:`get_store` resolves it, unbuilt.

    ``lease_store`` (a URL or a ``LockStore``), else the broker's Redis URL, else the
    ``sqlite:///`` URL of the host-local fallback file (its directory is made, as
    :func:`get_store` would). For a check that must not touch the store this process's tasks
    use (:func:`celery_lease._celery.startup.ping_store` opens a store of its own from a URL).

    Raises:
        LeaseConfigError: as :func:`get_settings`, or as :func:`default_sqlite_path`.
    """
    configured = get_settings(app).store
    if configured is not None:
        return configured
    broker = broker_store_url(app)
    if broker is not None:
        return broker
    return f"sqlite:///{default_sqlite_path()}"


_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")


def with_restart_grace(url: str, settings: LeaseSettings) -> str:
    """``url`` with the app's ``restart_grace`` in its query when it is a Redis URL that sets
    none: ``lease_restart_grace``, else the default ttl (the longest a holder of a default
    lease goes on without hearing it lost it). Other URLs as they are."""
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
    """Whether ``app``'s store is the host-local SQLite file: ``lease_store`` unset and a broker
    that is not Redis (RabbitMQ, SQS...). It excludes only the workers of one host.

    Raises:
        LeaseConfigError: as :func:`get_settings`.
    """
    return get_settings(app).store is None and broker_store_url(app) is None


def host_local_message(app: CeleryApp, path: str) -> str:
    """What is said about the host-local file at ``path``: a warning, or with
    ``lease_require_shared_store`` the refusal (both name the settings to change)."""
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
    """Log :func:`host_local_message` as a warning, once per process (and in no pool process
    forked after the worker's main process logged it at start)."""
    global _warned_local
    if not _warned_local:
        _warned_local = True
        logger.warning("%s", host_local_message(app, path))


def _build_store(app: CeleryApp) -> LockStore:
    """The store :func:`store_option` names, built (the host-local file refused or warned of)."""
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


def get_store(app: CeleryApp) -> LockStore:
    """The lock store of ``app`` in this process, resolved on first use (and again when the
    app's settings are read again: :func:`get_settings`).

    Order: ``app.conf.lease_store`` (URL or instance) -> the broker's Redis when the broker URL
    is ``redis://``, ``rediss://`` or ``sentinel://`` -> a SQLite file shared by every worker of
    this user on this host (logged once as host-local only: by a worker's main process at start,
    :mod:`celery_lease._celery.startup`). Rebuilt after ``fork``.

    Raises:
        LeaseConfigError: as :func:`get_settings`; and instead of the host-local file when
            ``lease_require_shared_store`` is ``True``.
    """
    settings = get_settings(app)
    entry = _stores.get(app)
    if entry is None or entry[0] is not settings:
        with _lock:
            entry = _stores.get(app)
            if entry is not None and entry[0] is not settings and entry[0] == settings:
                # The same values read again (recheck, a configuration reloaded unchanged):
                # the same store.
                entry = _stores[app] = (settings, entry[1])
            elif entry is None or entry[0] is not settings:
                # Other values (the app configured after a first read): a store of its own.
                # The previous one is left open: a lease taken in it may still be held.
                entry = _stores[app] = (settings, _build_store(app))
    return entry[1]


def reset(app: CeleryApp | None = None, *, refusals: bool = True) -> None:
    """Forget cached settings and stores (of ``app``, or all): the next use reads them again.

    Args:
        app: the app to forget, or ``None`` for every app.
        refusals: also forget refusals recorded by :func:`refuse` (default); a new pool
            process passes ``False`` so that it keeps its parent's refusal.
    """
    with _lock:
        if app is None:
            _settings.clear()
            _stores.clear()
            if refusals:
                _refusals.clear()
        else:
            _settings.pop(app, None)
            _stores.pop(app, None)
            if refusals:
                _refusals.pop(app, None)


def close_stores(app: CeleryApp | None = None) -> None:
    """Close the stores this module built (of ``app``, or of every app) and forget them: the
    next use builds them anew. A ``LockStore`` given as ``lease_store`` is the caller's: it is
    forgotten, not closed. For a test runner about to drop the database a store is connected
    to (``celery_lease.testing.close_lease_stores``); never while a lease in them is held."""
    with _lock:
        apps = list(_stores.keys()) if app is None else [app]
        entries = [entry for a in apps if (entry := _stores.pop(a, None)) is not None]
    for settings, store in entries:
        if not isinstance(settings.store, LockStore):
            close = getattr(store, "close", None)
            if callable(close):
                close()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    _stores.clear()


forking.on_fork_child(_after_fork_in_child, name="config: lock, resolved stores")


def _forget_for_new_process() -> None:
    reset(refusals=False)  # a refusal recorded at the worker's start stays


forking.on_new_process(_forget_for_new_process, name="config: settings and stores of every app")
