"""The checks at worker start and in new pool processes: the configuration, the store ping.

Wired into the worker by :mod:`celery_lease._celery.worker` (which adds :class:`LeaseCheck` to
the worker's bootsteps and calls :func:`recheck_in_pool_process` from ``worker_process_init``).

Every worker of a process that imported celery-lease gets the hooks (the configuration check,
the socket directory of ``inspect leases``, the dead-holder reaper): they touch no store. The
store ping at start (``lease_store_check``) runs only for an app that **uses celery-lease**
(:func:`uses_celery_lease`), decided when the worker is built (the app is final then, every
task module imported): the app has a locked task (a ``LockedTask`` or a ``@locked`` body),
configures a ``lease_*`` setting, or called :func:`celery_lease.metrics.install`. A worker of
any other app pings no store.

Checked at start (:class:`LeaseCheck`, in this order; each refusal stops the worker as below):

1. the configuration (see "Refusing a bad configuration");
2. the host-local fallback: with ``lease_store`` unset and a broker that is not Redis, the app's
   store is an SQLite file of this host (:func:`celery_lease._celery.settings.get_store`), which
   excludes nothing across hosts. The worker's main process says so in one WARNING while it is
   built, before ``ready.`` (pool processes do not repeat it), or, with
   ``lease_require_shared_store = True``, refuses to start, naming the setting
   (:func:`check_host_local`). ``celery lease check`` prints ``WARN`` (or ``FAIL``) for it;
3. that every store the app's locked tasks use answers one round trip (``get`` of a key of
   its own, or an owner-checked ``release`` of it for a store that cannot read), within
   :data:`STORE_CHECK_TIMEOUT` seconds: a wrong URL (port, database, socket path) would
   otherwise let the worker say "ready" and fail every locked task with
   ``StoreUnavailableError``. The error names the setting (``lease_store``, or the task's
   ``lock_store``) and the URL with its password masked (``redact_url``). ``lease_store_check``
   says what to do: ``"refuse"`` (the default) refuses the worker; ``"warn"`` logs the error and
   starts it (a store that may be down while workers are deployed, for workers that also run
   tasks needing no lease); ``"off"`` sends nothing. ``celery -A proj lease check`` runs the
   same checks from a deploy script (:func:`check_app`).

Refusing a bad configuration. Celery's ``Signal.send`` logs and swallows what a receiver raises
(``except Exception``), so an error raised in ``worker_init`` does not stop the worker. A worker
bootstep does: :class:`LeaseCheck` runs :func:`check_worker` while Celery builds the worker's
blueprint (after logging is set up, before any step starts: no pool process is forked, no broker
connection made, no message consumed) and raises the error from there, as Celery itself raises
``ImproperlyConfigured`` for an unknown queue while the worker is built. ``celery worker`` then
exits with status 1 (the message is logged at CRITICAL, the traceback goes to stderr), and
``celery.contrib.testing.worker.start_worker`` raises it at once. (Raising from the step's
``start`` instead goes through Celery's "Unrecoverable error" path, also exit 1, but only after
the pool started, and ``start_worker`` then waits forever for a worker that never becomes
ready.) The refusal is also recorded with :func:`celery_lease._celery.settings.refuse`, so a worker
that
went on anyway would fail every locked execution of the app, in every pool process, with the
same :class:`~celery_lease.LeaseConfigError`. It refuses:

- a misspelled or bad ``lease_*`` setting (:func:`celery_lease._celery.settings.get_settings`);
- a process-local store (``MemoryLockStore``, ``memory://``) as ``lease_store`` or as a task's
  ``lock_store`` when the worker runs tasks in more than one process (prefork with concurrency,
  or ``--autoscale`` maximum, above 1; a pool we do not know counts as one process per slot).
  solo, threads, gevent and eventlet run every task in the main process: a memory store then
  excludes within this worker, and a warning says that other worker processes (a second worker
  on this host, or on another) are not excluded: those the worker cannot see;
- a misspelled store URL scheme (``reddis://``).

Every build of a worker checks afresh (a refusal left by an earlier build in this process is
forgotten first). A multi-process worker's pool processes check again when they start
(:func:`recheck_in_pool_process`): a task registered after the start-up check with a
process-local ``lock_store`` fails in every pool process forked after it (by
``--max-tasks-per-child`` or ``--autoscale``) instead of running unexcluded. Under ``celery
multi`` each node is a worker of its own and checks itself; a refused node logs the refusal and
exits, although ``celery multi start`` (which detaches) has already printed ``OK``.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
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
from typing import TYPE_CHECKING, cast
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
from celery_lease.errors import LeaseConfigError
from celery_lease.stores import store_from_url
from celery_lease.stores.base import LockStore, SupportsInspection, conforms, redact_url

if TYPE_CHECKING:
    from celery_lease._celery.pool import Autoscale
    from celery_lease._celery.protocols import CeleryApp, WorkerLike

__all__ = [
    "PING_KEY",
    "STORE_CHECK_TIMEOUT",
    "Check",
    "LeaseCheck",
    "check_app",
    "check_host_local",
    "check_worker",
    "locked_tasks",
    "opt_in",
    "ping_store",
    "ping_stores",
    "recheck_in_pool_process",
    "stores_in_use",
    "uses_celery_lease",
]

logger = logging.getLogger("celery_lease.worker")

_app: weakref.ref[CeleryApp] | None = None
"""The app of the worker whose check passed in this process (inherited by pool processes)."""
_processes = 0
"""How many processes that worker runs tasks in
(:func:`celery_lease._celery.pool.pool_processes`), 0 before a check."""


def locked_tasks(app: CeleryApp) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(task name, its lock_store or None)`` for every locked task of ``app``, by name.

    LockedTask keeps its validated options on the class; a ``@locked`` body carries them on
    the function (see the module of the task layer). Reading ``app.tasks`` finalizes the app.
    """
    for name, task in sorted(app.tasks.items()):
        for carrier in (type(task), getattr(task, "run", None)):
            options = options_of(carrier)
            if options is not None:
                store: str | LockStore | None = getattr(options, "store", None)
                yield name, store
                break


def stores_in_use(
    app: CeleryApp, configured: str | LockStore | None
) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(where, store option)`` for the app's ``lease_store`` and every task's ``lock_store``."""
    yield "lease_store", configured
    for name, store in locked_tasks(app):
        if store is not None:
            yield f"task {name!r} lock_store", store


def uses_celery_lease(app: CeleryApp) -> bool:
    """Whether a worker of ``app`` gets celery-lease's hooks (checks, reaper, ``inspect``).

    True when the app has a locked task (a ``LockedTask`` or a ``@locked`` body), configures
    one of the ``lease_*`` settings (:data:`celery_lease._celery.settings.SETTINGS`: an app that
    uses ``lease()`` in plain task bodies opts in so), or called
    :func:`celery_lease.metrics.install`. Read once the app is final (a worker's steps are
    built after it imported every task module); reading it finalizes the app.
    """
    if any(True for _ in locked_tasks(app)):
        return True
    conf = app.conf
    return any(conf.get(name) is not None for name in SETTINGS) or app in _opted_in


_opted_in: weakref.WeakSet[CeleryApp] = weakref.WeakSet()
"""Apps that use celery-lease without a locked task or a setting (:func:`opt_in`)."""


def opt_in(app: CeleryApp) -> None:
    """Count ``app`` as using celery-lease (:func:`uses_celery_lease`) though it has no locked
    task and no ``lease_*`` setting: called by :func:`celery_lease.metrics.install`, an add-on
    above this layer that this module does not import."""
    _opted_in.add(app)


def _describe(store: str | LockStore | None) -> str:
    return repr(store) if isinstance(store, str) else f"{type(store).__name__}()"


def check_worker(
    app: CeleryApp, pool_cls: object, concurrency: int, autoscale: Autoscale = None
) -> LeaseConfigError | None:
    """The reason ``app``'s lease configuration cannot run on this worker, or ``None``.

    Checks the ``lease_*`` settings (values and names) and, when tasks run in more than one
    process (:func:`celery_lease._celery.pool.pool_processes`), that no store in use keeps its
    leases in one process's memory. Logs a warning when a process-local store is accepted (one
    process): it cannot exclude other worker processes, which this worker cannot see.
    """
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


# The stores at start ----------------------------------------------------------------------------

STORE_CHECK_TIMEOUT = 6.0
"""Seconds a worker (and ``celery lease check``) waits for one store's answer at start before it
counts the store as not answering (a little over the stores' own 5 s connect timeouts, so that
their error is the one shown)."""

PING_KEY = "celery-lease:start-check"
"""The key (after ``lease_key_prefix``) a start check reads: never taken by anything."""


@dataclass(frozen=True)
class Check:
    """One line of a start check: what was checked, and why it failed (``None``: it passed).

    Attributes:
        what: ``"settings"``, ``"lease_store"``, ``"task 'x' lock_store"``...
        shown: the store's URL with its password masked, or the class of a store instance, or
            ``""`` (settings).
        error: why it failed, or ``None``.
        seconds: how long the store took to answer (0 for the settings).
        note: said instead of the time of an answer (a store with nothing to reach).
    """

    what: str
    shown: str = ""
    error: str | None = None
    seconds: float = 0.0
    note: str | None = None
    warning: str | None = None
    """Why a check that passed still needs attention (the host-local fallback), or ``None``."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        """``ok    lease_store redis://:***@h:6379/1: answered in 0.8 ms``, ``WARN  ...`` (it
        answered, but see the warning) or ``FAIL  ...``."""
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
    """``text`` (a store's error) without the password of ``option``'s URL, if it holds one."""
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
    """One round trip to the store ``option`` (a URL, or a ``LockStore``), at most ``timeout`` s.

    A URL gets a store of its own, closed afterwards (the stores this process's tasks use are
    left alone, and nothing stays open across the pool's fork). The round trip is ``get(key)``
    where the store can read (:class:`~celery_lease.SupportsInspection`), else an owner-checked
    ``release(key, <an owner nobody has>)``: it changes nothing. A process-local store
    (``memory://``) has nothing to reach. The call runs on a daemon thread, so a store without a
    socket timeout delays the start by ``timeout`` at most.
    """
    return ping_stores([(what, option)], key, timeout)[0]


def ping_stores(
    stores: Sequence[tuple[str, str | LockStore]], key: str, timeout: float = STORE_CHECK_TIMEOUT
) -> list[Check]:
    """:func:`ping_store` for each ``(what, option)``, all at once: ``timeout`` s in all."""
    started: list[tuple[str, str | LockStore, threading.Event, list[float | BaseException]]] = []
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
        started.append((what, option, answered, outcome))
    deadline = time.monotonic() + timeout
    pending = iter(started)
    for index, (what, option) in enumerate(stores):
        if index in checks:
            continue
        _, _, answered, outcome = next(pending)
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
    """The round trip of :func:`ping_store`, on its thread: the seconds it took, or the error."""
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
    """``(what, store option)`` of each store to check, each store once.

    The app's store (``lease_store``, else what it defaults to) when ``every`` is true, when
    ``lease_store`` is set, or when a locked task has no ``lock_store`` of its own; and every
    task's ``lock_store``.
    """
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
    seen: set[object] = set()
    unique: list[tuple[str, str | LockStore]] = []
    for what, option in pairs:
        identity: object = option if isinstance(option, str) else id(option)
        if identity not in seen:
            seen.add(identity)
            unique.append((what, option))
    return unique


HOST_LOCAL = "lease_store (unset: the host-local SQLite file)"
"""What a check calls the app's store when it is the host-local fallback."""

HOST_LOCAL_WARNING = (
    "excludes only workers on this host: set lease_store to a store every host shares"
    " (lease_require_shared_store=True makes this a failure)"
)
"""Why ``celery lease check`` says ``WARN`` for the host-local fallback."""


def check_app(app: CeleryApp, timeout: float = STORE_CHECK_TIMEOUT) -> list[Check]:
    """The checks of ``celery lease check``: the settings, then every store of the app.

    Stores are those of :func:`_stores_to_ping` with the app's own store always included
    (the deploy script asks about it even before any task module names a locked task).
    Nothing is pinged when the settings are bad. The host-local fallback is a warning
    (:attr:`Check.warning`: ``WARN``) when it answers, and a failure when
    ``lease_require_shared_store`` is set.
    """
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
    """Whether locked executions of ``app`` may use its store: a locked task without a
    ``lock_store`` of its own, or no locked task (``lease()`` in plain task bodies)."""
    tasks = list(locked_tasks(app))
    return not tasks or any(store is None for _, store in tasks)


def check_host_local(app: CeleryApp) -> LeaseConfigError | None:
    """At worker start, in the main process: the host-local fallback warned about, or refused.

    When ``app``'s store is the host-local SQLite file
    (:func:`celery_lease._celery.settings.host_local_fallback`) and its tasks may use it: with
    ``lease_require_shared_store`` the refusal is returned; otherwise the warning is logged
    now, before the worker says ``ready.``, once per process (the pool processes forked later
    do not repeat it when they open the store).
    """
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
    """At worker start: ping every store in use (``lease_store_check``); the refusal, if any."""
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
    """Worker bootstep: refuse to build the worker when the lease configuration cannot exclude,
    or when a store its locked tasks use does not answer (``lease_store_check``).

    The stores are pinged only for an app that uses celery-lease (:func:`uses_celery_lease`).
    Raises :func:`check_worker`'s error, or the stores' (:func:`ping_store`), from ``__init__``
    (Celery builds every step of the blueprint before starting any), after logging it and
    recording it as a refusal of the app. Each build checks afresh: a refusal recorded by an
    earlier build of a worker in this process (one that never started) is forgotten first. An
    accepted check is remembered, so that every pool process started later checks again the
    tasks registered since (see :func:`recheck_in_pool_process`); then the socket directory of
    ``inspect leases`` is made (before the pool forks: the children serve there).
    """

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
            error = check_host_local(app) or _check_stores(app, get_settings(app))
        if error is not None:
            refuse(app, str(error))
            logger.critical(
                "Refusing to start worker %s: %s", getattr(parent, "hostname", "?"), error
            )
            raise error
        _app, _processes = weakref.ref(app), processes
        pool.set_pool_label(pool.pool_name(parent.pool_cls))
        control.prepare_main()

    def start(self, parent: WorkerLike) -> None:
        """Nothing to start: the check ran when the worker was built."""

    def stop(self, parent: WorkerLike) -> None:
        """Nothing to stop."""

    def terminate(self, parent: WorkerLike) -> None:
        """Nothing to terminate."""


def recheck_in_pool_process() -> None:
    """In a new pool process of a multi-process worker: check the stores again, refuse if bad.

    A task registered after the worker's start-up check (a module imported late, in a process
    that pool children are forked from again by ``--max-tasks-per-child`` or ``--autoscale``)
    was never checked: when it (or ``lease_store``, changed since) keeps leases in process
    memory, every locked execution of the app in this process fails with the refusal instead of
    running unexcluded.
    """
    app = _app() if _app is not None else None
    if app is None or _processes <= 1:
        return
    error = _check(app, _processes, pool.pool_label(), warn=False)
    if error is not None:
        refuse(app, str(error))
        logger.critical(
            "celery-lease: pool process %d refuses locked tasks: %s", os.getpid(), error
        )
