"""The checks at worker start and in new pool processes: the configuration, the store ping
(``docs/celery.md#the-store-at-start``). A bootstep (``Signal.send`` swallows what a
``worker_init`` receiver raises): :class:`LeaseCheck` raises from ``__init__``, before anything
forks (from ``start``, ``start_worker`` would wait forever). The refusal is recorded
(:func:`~celery_lease._celery.settings.refuse`); pool processes check again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from celery import bootsteps

from celery_lease._celery import control, pool
from celery_lease._celery.settings import (
    SETTINGS,
    LeaseSettings,
    default_sqlite_path,
    get_settings,
    host_local_fallback,
    host_local_message,
    is_process_local,
    recheck,
    refuse,
    store_option,
    warn_host_local,
)
from celery_lease._celery.spec import options_of
from celery_lease._core.options import LockOptions
from celery_lease.errors import LeaseConfigError
from celery_lease.stores import registry, store_from_url
from celery_lease.stores.base import LockStore, SupportsInspection, conforms, redact_url

if TYPE_CHECKING:
    from celery_lease._celery.pool import Autoscale
    from celery_lease._celery.protocols import CeleryApp, WorkerLike

logger = logging.getLogger("celery_lease.worker")

_app: weakref.ref[CeleryApp] | None = None  # whose worker check passed here (children inherit)
_processes = 0  # how many processes that worker runs tasks in; 0 before a check


def locked_tasks(app: CeleryApp) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(task name, its lock_store or None)`` for every locked task of ``app``; finalizes the
    app."""
    for name, options in _locked_options(app):
        store: str | LockStore | None = getattr(options, "store", None)
        yield name, store


def _locked_options(app: CeleryApp) -> Iterator[tuple[str, LockOptions]]:
    """``(task name, its lock options)`` for every locked task of ``app``, by name."""
    for name, task in sorted(app.tasks.items()):
        for carrier in (type(task), getattr(task, "run", None)):
            options = options_of(carrier)
            if options is not None:
                yield name, options
                break


def check_replace_stores(app: CeleryApp) -> LeaseConfigError | None:
    """Why an ``on_held="replace"`` task of ``app`` cannot run on its store (its ``lock_store``
    or the app's), or ``None``. Read from the store's class, nothing is connected; a store
    known only once built (``django://``, an async store) is checked at the task's call."""
    for name, options in _locked_options(app):
        if options.on_held != "replace":
            continue
        option = options.store if options.store is not None else store_option(app)
        cls = _store_class(option)
        if cls is None or (
            callable(getattr(cls, "mark_replaced", None)) and callable(getattr(cls, "get", None))
        ):
            continue
        return LeaseConfigError(
            f"celery-lease: task {name!r} has lock_on_held='replace', which needs a store that"
            f" can ask the holder of a key to stop (mark_replaced, SupportsReplace), and its"
            f" store {_shown(option)} ({cls.__name__}) cannot; use such a store (memory://, or"
            " a store of this version that implements it) or on_held raise, skip or retry"
        )
    return None


def warn_mixed_limits(app: CeleryApp) -> None:
    """Log a WARNING for each ``lock_key`` template string that tasks of ``app`` share where
    one has a ``limit`` and another has none: the key itself and its slots are two lock spaces
    that do not exclude each other, so their executions of one key would run side by side."""
    limited: dict[str, list[str]] = {}
    plain: dict[str, list[str]] = {}
    for name, options in _locked_options(app):
        if isinstance(options.key, str):
            kind = plain if options.limit is None else limited
            kind.setdefault(options.key, []).append(name)
    for template in sorted(limited.keys() & plain.keys()):
        logger.warning(
            "celery-lease: lock_key %r is used by tasks with a limit (%s) and without one (%s):"
            " with a limit a task holds the key's slots, without one the key itself, and the"
            " two do not exclude each other; give every task of this key a limit, or none",
            template,
            ", ".join(map(repr, limited[template])),
            ", ".join(map(repr, plain[template])),
        )


def _store_class(option: str | LockStore) -> type[Any] | None:
    """The class a store option builds (or is), when known without building it."""
    if not isinstance(option, str):
        return None if hasattr(type(option), "aclose") else type(option)
    scheme = urlsplit(option).scheme.lower()
    if scheme not in registry.SCHEMES:
        return None  # the store's own check names it
    try:
        cls = registry.sync_class(scheme)
    except ImportError:
        return None  # the store check names the missing driver
    return cls if callable(getattr(cls, "acquire", None)) else None  # django://: built later


def stores_in_use(
    app: CeleryApp, configured: str | LockStore | None
) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(where, store option)`` for the app's ``lease_store`` and every task's ``lock_store``."""
    yield "lease_store", configured
    for name, store in locked_tasks(app):
        if store is not None:
            yield f"task {name!r} lock_store", store


def uses_celery_lease(app: CeleryApp) -> bool:
    """Whether ``app`` has a locked task, a ``lease_*`` setting or :func:`opt_in`; finalizes the
    app."""
    if any(True for _ in locked_tasks(app)):
        return True
    conf = app.conf
    return any(conf.get(name) is not None for name in SETTINGS) or app in _opted_in


_opted_in: weakref.WeakSet[CeleryApp] = weakref.WeakSet()


def opt_in(app: CeleryApp) -> None:
    """Count ``app`` as using celery-lease (:func:`celery_lease.metrics.install`, a layer above)."""
    _opted_in.add(app)


def _describe(store: str | LockStore | None) -> str:
    return repr(store) if isinstance(store, str) else f"{type(store).__name__}()"


def check_worker(
    app: CeleryApp, pool_cls: object, concurrency: int, autoscale: Autoscale = None
) -> LeaseConfigError | None:
    """Why ``app``'s configuration cannot run on this worker, or ``None``."""
    return _check(
        app, pool.pool_processes(pool_cls, concurrency, autoscale), pool.pool_name(pool_cls)
    )


def _check(
    app: CeleryApp, processes: int, pool: str, *, warn: bool = True
) -> LeaseConfigError | None:
    try:
        settings = get_settings(app)
    except LeaseConfigError as exc:
        return exc
    local = [
        (where, store)
        for where, store in stores_in_use(app, settings.store)
        if is_process_local(store)
    ]
    if not local:
        return None
    uses = ", ".join(f"{where}={_describe(store)}" for where, store in local)
    if processes > 1:
        return LeaseConfigError(
            f"celery-lease: {uses} keeps leases in one process's memory, but this worker runs"
            f" tasks in {processes} processes ({pool} pool): they would not"
            " exclude each other and two bodies of one key would run at the same time. Use a"
            " store shared by every worker (lease_store='redis://...' or 'postgresql://...',"
            " or 'sqlite:////abs/path.db' on one host), or run tasks in one process"
            " (-P solo, -P threads, or -c 1)"
        )
    if warn:
        logger.warning(
            "celery-lease: %s is process-local: it excludes only tasks of this worker process;"
            " another worker process (on this host or another) using it is not excluded",
            uses,
        )
    return None


# Seconds to wait for one store's answer at start: a little over the stores' own 5 s connect
# timeouts, so that their error is the one shown.
STORE_CHECK_TIMEOUT = 6.0
# The key (after ``lease_key_prefix``) a start check reads: never taken.
PING_KEY = "celery-lease:start-check"


@dataclass(frozen=True)
class Check:
    """One line of a start check; ``error`` ``None`` means it passed. ``shown``: the redacted URL
    or a store's class; ``note``: said instead of the time; ``warning``: why a passed check
    needs attention."""

    what: str
    shown: str = ""
    error: str | None = None
    seconds: float = 0.0
    note: str | None = None
    warning: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        """``ok    lease_store redis://...: answered in 0.8 ms``, ``WARN  ...`` or ``FAIL  ...``."""
        subject = f"{self.what} {self.shown}" if self.shown else self.what
        if self.error is not None:
            return f"FAIL  {subject}: {self.error}"
        if self.note is not None:
            told = self.note
        elif self.shown:
            told = f"answered in {self.seconds * 1000:.1f} ms"
        else:
            told = ""
        if self.warning is not None:
            return f"WARN  {subject}: {told + '; ' if told else ''}{self.warning}"
        return f"ok    {subject}: {told}" if told else f"ok    {subject}"


def _shown(option: str | LockStore) -> str:
    return redact_url(option) if isinstance(option, str) else f"{type(option).__name__}()"


def _masked(text: str, option: str | LockStore) -> str:
    if not isinstance(option, str):
        return text
    text = text.replace(option, redact_url(option))
    try:
        password = urlsplit(option).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def ping_store(
    what: str, option: str | LockStore, key: str, timeout: float = STORE_CHECK_TIMEOUT
) -> Check:
    """One round trip (at most ``timeout`` s, on a daemon thread) to ``option``; a URL's store is
    closed afterwards."""
    return ping_stores([(what, option)], key, timeout)[0]


def ping_stores(
    stores: Sequence[tuple[str, str | LockStore]], key: str, timeout: float = STORE_CHECK_TIMEOUT
) -> list[Check]:
    """:func:`ping_store` for each ``(what, option)`` concurrently: ``timeout`` s in all."""
    started: dict[int, tuple[threading.Event, list[float | BaseException]]] = {}
    checks: dict[int, Check] = {}
    for index, (what, option) in enumerate(stores):
        if is_process_local(option):
            checks[index] = Check(
                what, _shown(option), note="in one process's memory: nothing to reach"
            )
            continue
        answered = threading.Event()
        outcome: list[float | BaseException] = []
        threading.Thread(
            target=_ping,
            args=(option, key, answered, outcome),
            name="celery-lease store check",
            daemon=True,
        ).start()
        started[index] = (answered, outcome)
    deadline = time.monotonic() + timeout
    for index, (answered, outcome) in started.items():
        what, option = stores[index]
        shown = _shown(option)
        if not answered.wait(max(0.0, deadline - time.monotonic())):
            checks[index] = Check(what, shown, f"no answer within {timeout:g} s", timeout)
            continue
        result = outcome[0]
        if isinstance(result, BaseException):
            error = " ".join(f"{type(result).__name__}: {result}".split())  # one line
            checks[index] = Check(what, shown, _masked(error, option))
        else:
            checks[index] = Check(what, shown, None, result)
    return [checks[index] for index in range(len(stores))]


def _ping(
    option: str | LockStore,
    key: str,
    answered: threading.Event,
    outcome: list[float | BaseException],
) -> None:
    store: LockStore | None = None
    began = time.monotonic()
    try:
        store = store_from_url(option) if isinstance(option, str) else option
        if conforms(store, SupportsInspection):
            cast(SupportsInspection, store).get(key)
        else:
            store.release(key, f"start-check/{os.getpid()}/{uuid.uuid4().hex}")
        outcome.append(time.monotonic() - began)
    except BaseException as exc:
        outcome.append(exc)
    finally:
        answered.set()
        close = getattr(store, "close", None)
        if isinstance(option, str) and callable(close):
            with contextlib.suppress(Exception):
                close()


def _stores_to_ping(app: CeleryApp, every: bool) -> list[tuple[str, str | LockStore]]:
    configured = get_settings(app).store
    tasks = list(locked_tasks(app))
    pairs: list[tuple[str, str | LockStore]] = []
    if every or configured is not None or any(store is None for _, store in tasks):
        option = store_option(app)
        if configured is not None:
            what = "lease_store"
        elif isinstance(option, str) and option.startswith("sqlite:"):
            what = HOST_LOCAL
        else:
            what = "lease_store (unset: the broker's Redis)"
        pairs.append((what, option))
    pairs.extend((f"task {name!r} lock_store", store) for name, store in tasks if store is not None)
    unique: dict[object, tuple[str, str | LockStore]] = {}
    for what, option in pairs:
        unique.setdefault(option if isinstance(option, str) else id(option), (what, option))
    return list(unique.values())


HOST_LOCAL = "lease_store (unset: the host-local SQLite file)"

HOST_LOCAL_WARNING = (
    "excludes only workers on this host: set lease_store to a store every host shares"
    " (lease_require_shared_store=True makes this a failure)"
)


def check_app(app: CeleryApp, timeout: float = STORE_CHECK_TIMEOUT) -> list[Check]:
    """The checks of ``celery lease check``: the settings, then every store."""
    try:
        settings = get_settings(app)
    except LeaseConfigError as exc:
        return [Check("settings", error=str(exc))]
    checks = [Check("settings")]
    try:
        stores = _stores_to_ping(app, every=True)
    except LeaseConfigError as exc:
        return [*checks, Check("lease_store", error=str(exc))]
    key = settings.key_prefix + PING_KEY
    for check in ping_stores(stores, key, timeout):
        if check.what == HOST_LOCAL and check.ok:
            if settings.require_shared_store:
                path = default_sqlite_path()
                check = dataclasses.replace(check, error=host_local_message(app, path))
            else:
                check = dataclasses.replace(check, warning=HOST_LOCAL_WARNING)
        checks.append(check)
    return checks


def _uses_app_store(app: CeleryApp) -> bool:
    tasks = list(locked_tasks(app))
    return not tasks or any(store is None for _, store in tasks)


def check_host_local(app: CeleryApp) -> LeaseConfigError | None:
    """In the main process at start: refuse the host-local fallback, or warn of it once."""
    try:
        if not host_local_fallback(app) or not _uses_app_store(app):
            return None
        path = default_sqlite_path()
    except LeaseConfigError as exc:
        return exc
    if get_settings(app).require_shared_store:
        return LeaseConfigError(host_local_message(app, path))
    warn_host_local(app, path)
    return None


def _check_stores(app: CeleryApp, settings: LeaseSettings) -> LeaseConfigError | None:
    if settings.store_check == "off":
        return None
    try:
        stores = _stores_to_ping(app, every=False)
    except LeaseConfigError as exc:
        return exc
    key = settings.key_prefix + PING_KEY
    failed = [check for check in ping_stores(stores, key) if not check.ok]
    if not failed:
        return None
    what = "; ".join(f"{c.what}={c.shown} did not answer ({c.error})" for c in failed)
    if settings.store_check == "warn":
        logger.error(
            "celery-lease: %s. Starting anyway (lease_store_check='warn'): every locked task"
            " fails with StoreUnavailableError until the store answers",
            what,
        )
        return None
    return LeaseConfigError(
        f"celery-lease: {what}. Every locked task would fail with StoreUnavailableError: check"
        " the URL (host, port, database, socket path) and that the store runs; set"
        " lease_store_check='warn' to start workers while the store is down"
    )


class LeaseCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: refuse to build the worker (each build checks afresh); makes the
    ``inspect leases`` socket directory before the pool forks."""

    name = "celery_lease.worker.LeaseCheck"  # a fixed step name, wherever the class lives
    label = "celery-lease check"

    def __init__(self, parent: WorkerLike, autoscale: Autoscale = None, **kwargs: object) -> None:
        global _app, _processes
        super().__init__(parent, **kwargs)
        app = parent.app
        recheck(app)
        processes = pool.pool_processes(parent.pool_cls, parent.concurrency, autoscale)
        error = _check(app, processes, pool.pool_name(parent.pool_cls))
        if error is None and uses_celery_lease(app):
            error = (
                check_host_local(app)
                or check_replace_stores(app)
                or _check_stores(app, get_settings(app))
            )
        if error is not None:
            refuse(app, str(error))
            logger.critical(
                "Refusing to start worker %s: %s", getattr(parent, "hostname", "?"), error
            )
            raise error
        if uses_celery_lease(app):
            warn_mixed_limits(app)
        _app, _processes = weakref.ref(app), processes
        pool.set_pool_label(pool.pool_name(parent.pool_cls))
        control.prepare_main()


def recheck_in_pool_process() -> None:
    """In a new pool child: refuse the app if a later task is process-local."""
    app = _app() if _app is not None else None
    if app is None or _processes <= 1:
        return
    error = _check(app, _processes, pool.pool_label(), warn=False)
    if error is not None:
        refuse(app, str(error))
        logger.critical(
            "celery-lease: pool process %d refuses locked tasks: %s", os.getpid(), error
        )
