"""Worker hooks: per-process state rebuilt in each pool process, the configuration checked at start.

Connected when :mod:`celery_lease._celery.task` is imported (before the pool forks, so prefork
children
inherit the receivers):

- ``worker_init`` (main process): remember the main process id and add :class:`LeaseCheck`,
  :class:`DeadHolders` and :class:`celery_lease.metrics.MetricsStep` to the worker's bootsteps
  (``app.steps["worker"]``, read by Celery right after this signal);
- ``worker_process_init`` (each prefork child; the main process under solo): forget stores and
  caches inherited from the parent (:func:`celery_lease._forking.reset_child_state`; the
  at-fork
  hooks of :mod:`celery_lease._forking` already forget the stores after every fork; the signal
  also covers pools that start processes otherwise) and note whether this process is a pool
  child.

When that happens, whatever the layout of the project. ``celery worker`` imports the app's task
modules (``include``, ``imports``, and ``autodiscover_tasks()``, Django's included, through the
``import_modules`` signal) in ``loader.init_worker()``, the first thing ``WorkController``
does, before it sends ``worker_init``; it reads ``app.steps["worker"]`` after ``worker_init``,
and builds every step (their ``__init__``) before any step starts: before the pool forks. So a
task module that defines a locked task has imported this module (through
:mod:`celery_lease._celery.task`) before ``worker_init``, whichever module ``-A`` names. The
``celery`` program itself loads :mod:`celery_lease.cli` (the ``celery.commands`` entry point)
in every invocation, ``celery inspect`` included, which registers the remote-control command
``leases`` there (:mod:`celery_lease._celery.control`): the inspect client checks the name against
its
own registry, and imports only the ``-A`` module, never the task modules.

Every worker of a process that imported celery-lease gets the hooks (the configuration check,
the socket directory of ``inspect leases``, the dead-holder reaper): they touch no store. The
store ping at start (``lease_store_check``) runs only for an app that **uses celery-lease**
(:func:`uses_celery_lease`), decided when the worker is built (the app is final then, every
task module imported): the app has a locked task (a ``LockedTask`` or a ``@locked`` body),
configures a ``lease_*`` setting, or called :func:`celery_lease.metrics.install`. A worker of
any other app pings no store.

Checked at start (:class:`LeaseCheck`, in this order; each refusal stops the worker as below):

1. the configuration (see "Refusing a bad configuration");
2. that every store the app's locked tasks use answers one round trip (``get`` of a key of
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

Who holds what. ``worker_init`` makes the worker's node name (``w1@host``) the default node of
every owner id made in the worker's processes (:func:`celery_lease._core.owners.set_node`), and
``task_prerun`` / ``task_postrun`` make the running task's name and id the default task of owner
ids made during it (:func:`celery_lease._core.owners.push_task`), so a ``lease()`` inside a task
body
names its task too. :mod:`celery_lease._celery.control` (imported here) registers ``celery inspect
leases``; every pool child serves its snapshot for it (see there).

Dead holders freed at once (:class:`DeadHolders`, a bootstep of prefork workers). When a pool
child dies while it runs a task (``SIGKILL``, the OOM killer, a segfault: Celery's
``WorkerLostError``; a hard time limit; ``revoke(terminate=True)``), the main process releases
the leases that child took for the tasks it was running, instead of leaving them for a ttl:

1. only after billiard has joined (reaped) the child: the step wraps the pool's
   ``_join_exited_workers`` (and ``mark_as_worker_lost``), and acts on a child only once it has
   left the pool with an exit code, i.e. ``waitpid`` returned for it: it no longer runs, not even
   as a zombie;
2. only leases whose owner id (:func:`celery_lease._core.owners.parse_owner`) names this host, the
dead
   child's pid, this worker's node (when the owner names one) and a task id that was running on
   that child when it died (accepted by it, or written to it, and not finished by it, as the
   worker's requests or the pool's own jobs say: a ``revoke(terminate=True)`` request leaves the
   former first; or ended by its hard time limit, counted for the next child killed only), made
   before the child was reaped (a new child with the recycled pid, running the redelivered task,
   keeps its lease). A lease the child kept for ``cooldown`` after a task that succeeded
   is therefore kept; so is one taken outside any task, and one of a task whose SUCCESS the
   result backend already holds (killed between storing its result and handing it to the
   pool: its key is then its cooldown);
3. found with the store's ``list()`` and released with ``release(key, owner)``, owner-checked,
   with that exact owner: if the lease already expired and someone else holds the key, nothing
   is removed;
4. on a thread of its own (the event loop never waits for a store), except that the requeue of
   an ``acks_late`` task lost with its worker (``task_reject_on_worker_lost``) waits up to
   :data:`DEAD_HOLDER_WAIT` seconds for the release, so that the redelivered task does not find
   its own key still taken (once per hung store: while the release thread is past that wait,
   later requeues do not wait). Errors of this bookkeeping are logged, never raised into
   billiard's maintenance or the event loop.

The event loop learns of a death from the child's sentinel pipe, which closes a moment before
the child can be reaped; billiard then waits for its 5 s maintenance timer. The step watches such
a child with a pidfd and reaps it the moment it can (see :meth:`_Reaper.watch_exit`), which is
also what makes Celery's own ``WorkerLostError`` and the requeue come at once.

Each release is logged at WARNING and sent as ``lock_released`` with ``reason="holder_died"``
(plus ``pid`` and ``exitcode``), from the lease dispatcher's thread. A store that cannot list
leases (a custom store without :class:`~celery_lease.SupportsInspection`), or a store error, leaves
the key to its ttl (logged). Pools that run tasks in the main process (solo, threads, gevent,
eventlet) have no child to lose: when that process dies, the keys free themselves at their ttl.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import queue
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from billiard.exceptions import TimeLimitExceeded
from billiard.pool import EX_RECYCLE as _EX_RECYCLE
from celery import bootsteps
from celery.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_shutdown,
)

from celery_lease import _forking as forking
from celery_lease._celery import control
from celery_lease._core import owners
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import LockStore, SupportsInspection, redact_url, store_from_url

__all__ = [
    "DEAD_HOLDER_WAIT",
    "PING_KEY",
    "STORE_CHECK_TIMEOUT",
    "Check",
    "DeadHolders",
    "LeaseCheck",
    "check_app",
    "check_worker",
    "in_pool_child",
    "ping_store",
    "ping_stores",
    "pool_processes",
    "recheck_in_pool_process",
    "reset_process_state",
    "uses_celery_lease",
]

logger = logging.getLogger("celery_lease.worker")

_main_pid: int | None = None
_pool_child = False
_app: weakref.ref[Any] | None = None
"""The app of the worker whose check passed in this process (inherited by pool processes)."""
_processes = 0
"""How many processes that worker runs tasks in (:func:`pool_processes`), 0 before a check."""
_pool_label = ""

IN_PROCESS_POOLS = (
    "celery.concurrency.solo",
    "celery.concurrency.thread",
    "celery.concurrency.gevent",
    "celery.concurrency.eventlet",
)
"""Modules of Celery's pools that run every task inside the worker's main process."""


def reset_process_state() -> None:
    """Forget every per-process cache (settings, stores resolved from settings and URLs).

    Runs the resets registered with :func:`celery_lease._forking.on_new_process`. A refusal
    recorded at worker start (:func:`celery_lease._celery.settings.refuse`) is kept.
    """
    forking.reset_child_state()


def runs_one_task_at_a_time() -> bool:
    """True in a worker process that runs one task at a time: a solo worker, a prefork child.

    False outside a worker, in the main process of a prefork worker, and under the threads,
    gevent and eventlet pools (and pools of other packages), where executions run side by side.
    """
    return _pool_label == "solo" or (_pool_label == "prefork" and _pool_child)


def in_pool_child() -> bool:
    """True in a prefork pool child process (where terminating the process is like revoke)."""
    return _pool_child


def _pool_name(pool_cls: Any) -> str:
    """``prefork``, ``thread``... for Celery's pools, else the class's repr."""
    module = str(getattr(pool_cls, "__module__", ""))
    if module.startswith("celery.concurrency."):
        return module.rsplit(".", 1)[-1]
    return repr(pool_cls)


def pool_processes(pool_cls: Any, concurrency: int, autoscale: Any = None) -> int:
    """How many processes may run this worker's tasks at once.

    Args:
        pool_cls: the worker's pool class (``WorkController.pool_cls`` once resolved).
        concurrency: ``-c`` (an int; 0 or ``None`` count as 1).
        autoscale: ``--autoscale`` as Celery passes it (``"10,3"`` or ``(10, 3)``), or ``None``.

    Returns:
        1 for a pool that runs tasks in the main process (solo, threads, gevent, eventlet, or a
        subclass of one), else the larger of ``concurrency`` and the autoscale maximum (prefork,
        and any pool this function does not know: counted on the safe side).
    """
    modules = {getattr(cls, "__module__", "") for cls in getattr(pool_cls, "__mro__", (pool_cls,))}
    if modules.intersection(IN_PROCESS_POOLS):
        return 1
    most = int(concurrency or 1)
    if isinstance(autoscale, str):
        autoscale = autoscale.partition(",")[0]
    if isinstance(autoscale, Sequence) and not isinstance(autoscale, str):
        autoscale = autoscale[0] if autoscale else None
    if autoscale:
        most = max(most, int(autoscale))
    return most


def _locked_tasks(app: Any) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(task name, its lock_store or None)`` for every locked task of ``app``, by name.

    LockedTask keeps its validated options on the class; a ``@locked`` body carries them on
    the function (see the module of the task layer). Reading ``app.tasks`` finalizes the app.
    """
    for name, task in sorted(app.tasks.items()):
        for carrier in (type(task), getattr(task, "run", None)):
            options = getattr(carrier, "_lock_options", None)
            if options is not None:
                store: str | LockStore | None = getattr(options, "store", None)
                yield name, store
                break


def _stores_in_use(
    app: Any, configured: str | LockStore | None
) -> Iterator[tuple[str, str | LockStore | None]]:
    """``(where, store option)`` for the app's ``lease_store`` and every task's ``lock_store``."""
    yield "lease_store", configured
    for name, store in _locked_tasks(app):
        if store is not None:
            yield f"task {name!r} lock_store", store


def uses_celery_lease(app: Any) -> bool:
    """Whether a worker of ``app`` gets celery-lease's hooks (checks, reaper, ``inspect``).

    True when the app has a locked task (a ``LockedTask`` or a ``@locked`` body), configures
    one of the ``lease_*`` settings (:data:`celery_lease._celery.settings.SETTINGS`: an app that
    uses
    ``lease()`` in plain task bodies opts in so), or called
    :func:`celery_lease.metrics.install`. Read once the app is final (a worker's steps are
    built after it imported every task module); reading it finalizes the app.
    """
    from celery_lease._celery import settings as config
    from celery_lease.metrics import installed

    if any(True for _ in _locked_tasks(app)):
        return True
    conf = app.conf
    return any(conf.get(name) is not None for name in config.SETTINGS) or installed(app)


def _describe(store: str | LockStore | None) -> str:
    return repr(store) if isinstance(store, str) else f"{type(store).__name__}()"


def check_worker(
    app: Any, pool_cls: Any, concurrency: int, autoscale: Any = None
) -> LeaseConfigError | None:
    """The reason ``app``'s lease configuration cannot run on this worker, or ``None``.

    Checks the ``lease_*`` settings (values and names) and, when tasks run in more than one
    process (:func:`pool_processes`), that no store in use keeps its leases in one process's
    memory. Logs a warning when a process-local store is accepted (one process): it cannot
    exclude other worker processes, which this worker cannot see.
    """
    return _check(app, pool_processes(pool_cls, concurrency, autoscale), _pool_name(pool_cls))


def _check(app: Any, processes: int, pool: str, *, warn: bool = True) -> LeaseConfigError | None:
    from celery_lease._celery import settings as config

    try:
        settings = config.get_settings(app)
    except LeaseConfigError as exc:
        return exc
    local = [
        (where, store)
        for where, store in _stores_in_use(app, settings.store)
        if config.is_process_local(store)
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

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        """``ok    lease_store redis://:***@h:6379/1: answered in 0.8 ms`` or ``FAIL  ...``."""
        subject = f"{self.what} {self.shown}" if self.shown else self.what
        if self.error is not None:
            return f"FAIL  {subject}: {self.error}"
        if self.note is not None:
            return f"ok    {subject}: {self.note}"
        if self.shown:
            return f"ok    {subject}: answered in {self.seconds * 1000:.1f} ms"
        return f"ok    {subject}"


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
    from celery_lease._celery import settings as config

    started: list[tuple[str, str | LockStore, threading.Event, list[float | BaseException]]] = []
    checks: dict[int, Check] = {}
    for index, (what, option) in enumerate(stores):
        if config.is_process_local(option):
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
    store: Any = None
    began = time.monotonic()
    try:
        store = store_from_url(option) if isinstance(option, str) else option
        if isinstance(store, SupportsInspection):
            store.get(key)
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


def _stores_to_ping(app: Any, every: bool) -> list[tuple[str, str | LockStore]]:
    """``(what, store option)`` of each store to check, each store once.

    The app's store (``lease_store``, else what it defaults to) when ``every`` is true, when
    ``lease_store`` is set, or when a locked task has no ``lock_store`` of its own; and every
    task's ``lock_store``.
    """
    from celery_lease._celery import settings as config

    configured = config.get_settings(app).store
    tasks = list(_locked_tasks(app))
    pairs: list[tuple[str, str | LockStore]] = []
    if every or configured is not None or any(store is None for _, store in tasks):
        option = config.store_option(app)
        if configured is not None:
            what = "lease_store"
        elif isinstance(option, str) and option.startswith("sqlite:"):
            what = "lease_store (unset: the host-local SQLite file)"
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


def check_app(app: Any, timeout: float = STORE_CHECK_TIMEOUT) -> list[Check]:
    """The checks of ``celery lease check``: the settings, then every store of the app.

    Stores are those of :func:`_stores_to_ping` with the app's own store always included
    (the deploy script asks about it even before any task module names a locked task).
    Nothing is pinged when the settings are bad.
    """
    from celery_lease._celery import settings as config

    try:
        settings = config.get_settings(app)
    except LeaseConfigError as exc:
        return [Check("settings", error=str(exc))]
    checks = [Check("settings")]
    try:
        stores = _stores_to_ping(app, every=True)
    except LeaseConfigError as exc:
        return [*checks, Check("lease_store", error=str(exc))]
    key = settings.key_prefix + PING_KEY
    checks.extend(ping_stores(stores, key, timeout))
    return checks


def _check_stores(app: Any, settings: Any) -> LeaseConfigError | None:
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

    def __init__(self, parent: Any, autoscale: Any = None, **kwargs: Any) -> None:
        global _app, _processes, _pool_label
        super().__init__(parent, **kwargs)
        from celery_lease._celery import settings as config

        app = parent.app
        config.recheck(app)
        processes = pool_processes(parent.pool_cls, parent.concurrency, autoscale)
        error = _check(app, processes, _pool_name(parent.pool_cls))
        if error is None and uses_celery_lease(app):
            error = _check_stores(app, config.get_settings(app))
        if error is not None:
            config.refuse(app, str(error))
            logger.critical(
                "Refusing to start worker %s: %s", getattr(parent, "hostname", "?"), error
            )
            raise error
        _app, _processes, _pool_label = weakref.ref(app), processes, _pool_name(parent.pool_cls)
        control.prepare_main()

    def start(self, parent: Any) -> None:
        """Nothing to start: the check ran when the worker was built."""

    def stop(self, parent: Any) -> None:
        """Nothing to stop."""

    def terminate(self, parent: Any) -> None:
        """Nothing to terminate."""


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    global _main_pid
    _main_pid = os.getpid()
    node = getattr(sender, "hostname", None)
    owners.set_node(node if isinstance(node, str) else None)
    app = getattr(sender, "app", None)
    if app is not None:
        app.steps["worker"].add(LeaseCheck)  # read by the blueprint right after this signal
        app.steps["worker"].add(DeadHolders)
        from celery_lease.metrics import MetricsStep  # a no-op unless lease_metrics / install()

        app.steps["worker"].add(MetricsStep)


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
    error = _check(app, _processes, _pool_label, warn=False)
    if error is not None:
        from celery_lease._celery import settings as config

        config.refuse(app, str(error))
        logger.critical(
            "celery-lease: pool process %d refuses locked tasks: %s", os.getpid(), error
        )


def _on_worker_process_init(**_: Any) -> None:
    global _pool_child
    _pool_child = _main_pid is not None and os.getpid() != _main_pid
    reset_process_state()
    if _pool_child:
        recheck_in_pool_process()
        control.serve_in_child()


def _on_worker_shutdown(**_: Any) -> None:
    if os.getpid() == _main_pid:
        control.cleanup_main()


# The running task, as the default of owner ids made during it (owners.push_task) --------------

_task_tokens: contextvars.ContextVar[list[tuple[str, Any]] | None] = contextvars.ContextVar(
    "celery_lease_task_tokens", default=None
)


def _on_task_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    stack = _task_tokens.get()
    if stack is None:
        stack = []
        _task_tokens.set(stack)
    name = getattr(task, "name", None)
    stack.append((str(task_id), owners.push_task(name if isinstance(name, str) else None, task_id)))


def _on_task_postrun(task_id: str | None = None, **_: Any) -> None:
    stack = _task_tokens.get()
    if not stack or stack[-1][0] != str(task_id):
        return
    token = stack.pop()[1]
    with contextlib.suppress(ValueError):  # made in another context (should not happen)
        owners.pop_task(token)


# Dead holders freed at once --------------------------------------------------------------------

DEAD_HOLDER_WAIT = 1.0
"""Seconds the requeue of a task lost with its pool child waits for that child's leases to be
released (they are released on a thread of their own; the event loop waits only for this)."""

_REAP_RETRY_FIRST = 0.005  # seconds before the first retry of a reap without pidfd
_REAP_RETRY_FOR = 5.0  # seconds of retries at most (then billiard's own 5 s timer reaps it)
_TIMED_OUT_KEEP = 600.0  # seconds a hard-time-limited task id is remembered for its child's death

_timed_out: dict[str, tuple[str | None, float]] = {}
"""Task ids ended by their hard time limit in this main process -> (task name, when)."""


def _on_task_failure(
    sender: Any = None, task_id: str | None = None, exception: object = None, **_: Any
) -> None:
    """In the main process: note tasks ended by a hard time limit (their child is killed next)."""
    if not isinstance(exception, TimeLimitExceeded) or os.getpid() != _main_pid or not task_id:
        return
    now = time.monotonic()
    for old in [k for k, (_, at) in _timed_out.items() if now - at > _TIMED_OUT_KEEP]:
        del _timed_out[old]
    name = getattr(sender, "name", None)
    _timed_out[task_id] = (name if isinstance(name, str) else None, now)


def _job_pids(job: Any) -> set[int]:
    """The pool children a billiard job was accepted by, written to or scheduled for."""
    pids = {pid for pid in job.worker_pids() if pid}
    for attr in ("_write_to", "_scheduled_for"):
        pid = getattr(getattr(job, attr, None), "pid", None)
        if pid:
            pids.add(pid)
    return pids


def _runs_again(task: Any, retries: int = 0, *, timed_out: bool = False) -> bool:
    """Whether Celery runs a task again when its pool child dies (as ``Request.on_failure``
    and ``on_timeout`` decide): ``retry_on_worker_lost`` below ``max_retries``; ``acks_late``
    with ``reject_on_worker_lost`` (requeued); after a hard time limit, ``acks_late`` without
    ``acks_on_timeout``. Otherwise the copy ends FAILURE. Unknown task: False."""
    if task is None:
        return False
    acks_late = bool(getattr(task, "acks_late", False))
    if timed_out:
        acks = getattr(task, "acks_on_timeout", None)
        if acks is None:
            acks = getattr(task, "acks_on_failure_or_timeout", None)
        return acks_late and acks is not None and not acks
    if getattr(task, "retry_on_worker_lost", False):
        most = getattr(task, "max_retries", None)
        if most is None or retries < int(most):
            return True
    return acks_late and bool(getattr(task, "reject_on_worker_lost", False))


def _ends_failed_ids() -> set[str]:
    """The ids of the worker's requests that end FAILURE, not run again, if their child dies.

    Positive evidence only: a request the worker still tracks (active or reserved, not
    cancelled) whose task Celery does not requeue or retry (:func:`_runs_again`). A task known
    only from the pool's jobs (a request cancelled at shutdown or on a lost connection has left
    the active requests and its message stays unacknowledged: it is redelivered) is not here.
    """
    from celery.worker import state as worker_state

    fails: set[str] = set()
    for request in [*worker_state.active_requests, *worker_state.reserved_requests]:
        if getattr(request, "_already_cancelled", False):
            continue
        retries = (getattr(request, "request_dict", None) or {}).get("retries") or 0
        if not _runs_again(getattr(request, "task", None), int(retries)):
            fails.add(request.id)
    return fails


def _running_by_pid(pool: Any = None) -> dict[int, dict[str, str | None]]:
    """pid -> {task id: task name} of the requests a pool child accepted or was written.

    Also the unfinished jobs of ``pool`` (their ``correlation_id`` is the task id): a request
    revoked with ``terminate=True`` has left the worker's active requests before its child is
    reaped, but its job stays in the pool until then.
    """
    from celery.worker import state as worker_state

    running: dict[int, dict[str, str | None]] = {}
    for request in [*worker_state.active_requests, *worker_state.reserved_requests]:
        pids = set()
        if request.worker_pid:
            pids.add(request.worker_pid)
        ref = getattr(request, "_apply_result", None)
        job = ref() if ref is not None else None
        if job is not None:
            pids.update(_job_pids(job))
        for pid in pids:
            running.setdefault(pid, {})[request.id] = request.name
    cache = getattr(pool, "_cache", None)
    for job in list(cache.values()) if isinstance(cache, dict) else []:
        task_id = getattr(job, "correlation_id", None)
        if isinstance(task_id, str) and task_id and not job.ready():
            for pid in _job_pids(job):
                running.setdefault(pid, {}).setdefault(task_id, None)
    return running


class _Death:
    """A reaped pool child and the tasks it was running; ``done`` is set once handled.

    ``fails``: the ids of those tasks known to end FAILURE with this death (neither requeued
    nor retried, see :func:`_ends_failed_ids`): only their unique copy's queued key is freed.
    """

    __slots__ = ("at", "done", "exitcode", "fails", "pid", "tasks")

    def __init__(
        self,
        pid: int,
        exitcode: int,
        tasks: dict[str, str | None],
        fails: Collection[str] = (),
    ) -> None:
        self.pid = pid
        self.exitcode = exitcode
        self.tasks = tasks
        self.fails = frozenset(fails)
        self.done = threading.Event()
        self.at = time.time()  # made once reaped: no owner id of the dead child is newer


_REAPER_FAILED = (
    "celery-lease: handling a dead pool process failed; its leases free themselves at their ttl"
)


class _Reaper:
    """Releases the leases of reaped pool children of one prefork pool (see the module)."""

    def __init__(self, app: Any, node: str | None, pool: Any) -> None:
        self.app = app
        self.node = node
        self.pool = pool
        self.host = socket.gethostname()
        self.deaths: queue.SimpleQueue[_Death] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.before: dict[int, Any] = {}  # pid -> process, during a join
        self.running: dict[int, dict[str, str | None]] = {}
        self.fails: set[str] = set()  # of the running tasks: the ids that end FAILURE
        self.handled: set[int] = set()
        self.stuck = False  # the release thread overran a requeue's wait and is still busy

    def install(self) -> None:
        join = self.pool._join_exited_workers
        mark = self.pool.mark_as_worker_lost

        def join_exited_workers(*args: Any, **kwargs: Any) -> Any:
            self.handled = set()
            try:
                self.before = {p.pid: p for p in list(self.pool._pool) if p.pid}
                self.running = _running_by_pid(self.pool)
                self.fails = _ends_failed_ids()
            except Exception:
                logger.exception("celery-lease: cannot note the pool's running tasks")
                self.running = {}
                self.fails = set()
            try:
                return join(*args, **kwargs)
            finally:
                try:
                    present = {id(p) for p in self.pool._pool}
                    for pid, process in self.before.items():
                        if id(process) not in present and pid not in self.handled:
                            self.reaped(pid, process, wait=False)
                except Exception:
                    logger.exception(_REAPER_FAILED)
                self.before = {}

        def mark_as_worker_lost(job: Any, exitcode: Any) -> Any:
            try:
                for pid in job.worker_pids():
                    process = self.before.get(pid)
                    if process is not None and pid not in self.handled:
                        self.reaped(pid, process, wait=True)
            except Exception:
                logger.exception(_REAPER_FAILED)
            return mark(job, exitcode)

        self.pool._join_exited_workers = join_exited_workers
        self.pool.mark_as_worker_lost = mark_as_worker_lost
        exited = getattr(self.pool, "_event_process_exit", None)
        if exited is not None:  # billiard's AsynPool (the event loop); the hub looks it up later

            def event_process_exit(hub: Any, process: Any) -> Any:
                try:
                    return exited(hub, process)
                finally:
                    try:
                        if process in self.pool._pool:  # closed its files, not yet reapable
                            self.watch_exit(hub, process)
                    except Exception:
                        logger.exception(
                            "celery-lease: cannot watch pool process %s exit; billiard's timer"
                            " reaps it within 5 s",
                            getattr(process, "pid", "?"),
                        )

            self.pool._event_process_exit = event_process_exit

    def watch_exit(self, hub: Any, process: Any) -> None:
        """Run the pool's maintenance again as soon as ``process`` can be reaped.

        The event loop learns of a child's death when the child's end of its sentinel pipe
        closes; the kernel closes a dying process's files before it makes it a zombie
        (``waitpid`` finds nothing yet), and a child with several threads (the renewer's) stays
        in between long enough for the loop's ``waitpid(WNOHANG)`` to miss it often (most
        tries of a probe with three threads). billiard then stops watching that sentinel and
        only its 5 s maintenance timer reaps the child. Here a pidfd (Linux >= 5.3), readable
        once the child is a zombie whose threads are all gone, wakes the loop for it; elsewhere
        the maintenance is retried after 5, 10, 20 ... ms (at most :data:`_REAP_RETRY_FOR` s).
        """
        try:
            fd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):  # no pidfd here: retry on the loop's timer
            self._retry_reap(hub, process, _REAP_RETRY_FIRST, 0.0)
            return

        def readable() -> None:
            hub.remove_reader(fd)
            os.close(fd)
            self.pool.maintain_pool()

        try:
            hub.add_reader(fd, readable)
        except BaseException:
            os.close(fd)
            raise

    def _retry_reap(self, hub: Any, process: Any, delay: float, waited: float) -> None:
        def retry() -> None:
            self.pool.maintain_pool()
            if process in self.pool._pool and waited + delay < _REAP_RETRY_FOR:
                self._retry_reap(hub, process, delay * 2, waited + delay)

        hub.call_later(delay, retry)

    def reaped(self, pid: int, process: Any, *, wait: bool) -> None:
        """Child ``pid`` left the pool: release its running tasks' leases if it was reaped."""
        self.handled.add(pid)
        if process in self.pool._pool:
            return
        exitcode = process.exitcode  # not None only once waitpid() returned for it: reaped
        if exitcode is None:
            logger.debug("celery-lease: pool process %d left the pool unreaped", pid)
            return
        control.forget_child(pid)
        tasks = dict(self.running.get(pid, {}))
        fails = {task_id for task_id in tasks if task_id in self.fails}
        if exitcode not in (0, _EX_RECYCLE):  # killed: the next death after a hard time limit
            for task_id in list(_timed_out):  # used once, so a later exit cannot reuse it
                name = tasks[task_id] = _timed_out.pop(task_id)[0]
                task = self.app.tasks.get(name) if name else None
                if task is not None and not _runs_again(task, timed_out=True):
                    fails.add(task_id)
                else:
                    fails.discard(task_id)
        if not tasks:
            return
        death = _Death(pid, exitcode, tasks, fails)
        self.deaths.put(death)
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(
                target=self._run, name="celery-lease dead holders", daemon=True
            )
            self.thread.start()
        if wait and not self.stuck and not death.done.wait(DEAD_HOLDER_WAIT):
            self.stuck = not death.done.is_set()  # until it ends a death, requeues do not wait
            logger.warning(
                "celery-lease: the leases of dead pool process %d are not released after %gs;"
                " its tasks are requeued now (a redelivery may find its key still held)",
                pid,
                DEAD_HOLDER_WAIT,
            )

    def _run(self) -> None:
        while True:
            death = self.deaths.get()
            try:
                self.release(death)
            except Exception:
                logger.exception(
                    "celery-lease: releasing the leases of dead pool process %d failed; "
                    "its keys free themselves at their ttl",
                    death.pid,
                )
            finally:
                death.done.set()
                self.stuck = False

    def _stores(self) -> list[LockStore]:
        from celery_lease._celery import execution as engine
        from celery_lease._celery import settings as config

        try:
            settings = config.get_settings(self.app)
        except LeaseConfigError:
            return []
        stores: dict[int, LockStore] = {}
        for where, option in _stores_in_use(self.app, settings.store):
            try:
                store = engine.store_for(option, self.app)
            except Exception as exc:
                logger.warning("celery-lease: cannot open the store of %s: %s", where, exc)
                continue
            stores.setdefault(id(store), store)
        return list(stores.values())

    def succeeded(self, task_id: str | None) -> bool:
        """Whether the result backend holds SUCCESS for ``task_id`` (kept then: see the module).

        A child killed after its task stored SUCCESS but before the pool read the result back
        looks lost (Celery says "succeeded before the worker was lost"), and the key it holds
        then is the task's ``cooldown`` (applied before the result is stored). Without a
        backend that stores results, or when it cannot be read, the answer is False: the lease
        is released (a cooldown cut short by that race) rather than left for its ttl.
        """
        if not task_id:
            return False
        backend = getattr(self.app, "backend", None)
        get = getattr(backend, "_get_task_meta_for", None)
        as_uri = getattr(backend, "as_uri", None)
        if get is None or type(backend).__name__ == "DisabledBackend":
            return False
        try:
            if callable(as_uri) and str(as_uri()).startswith("rpc://"):
                return False  # results live on the caller's queue
            return bool(get(task_id).get("status") == "SUCCESS")
        except Exception as exc:
            logger.debug("celery-lease: cannot read the state of task %s: %s", task_id, exc)
            return False

    def release(self, death: _Death) -> None:
        """List every store of the app and release the dead child's leases of its tasks.

        Also, for each run lease released here, the queued key of its unique copy
        (``lock_unique``: ``queued:<key>``, owned by that very task id) when Celery does not
        run the copy again (:func:`_runs_again`): the copy is FAILURE, and its queued key would
        refuse new calls for up to a ttl. A copy that Celery requeues keeps it (it runs again).
        """
        from celery_lease._core.dispatch import get_dispatcher

        for store in self._stores():
            if not isinstance(store, SupportsInspection):
                logger.warning(
                    "celery-lease: %s cannot list leases: the leases of dead pool process %d"
                    " (if any) free themselves at their ttl",
                    type(store).__name__,
                    death.pid,
                )
                continue
            try:
                infos = store.list()
            except Exception as exc:
                logger.warning(
                    "celery-lease: cannot list the leases of dead pool process %d (%s); they"
                    " free themselves at their ttl",
                    death.pid,
                    exc,
                )
                continue
            by_key = {info.key: info for info in infos}
            for info in infos:
                owner = owners.parse_owner(info.owner)
                if (
                    owner.host != self.host
                    or owner.pid != death.pid
                    or owner.task_id not in death.tasks
                    or (owner.node is not None and owner.node != self.node)
                    # made after the reap: a new child with the recycled pid took it
                    or (owner.taken_at is not None and owner.taken_at > death.at)
                ):
                    continue
                if self.succeeded(owner.task_id):
                    logger.info(
                        "celery-lease: pool process %d died after task %s[%s] succeeded: its"
                        " lease on %r (a cooldown) is kept",
                        death.pid,
                        owner.task,
                        owner.task_id,
                        info.key,
                    )
                    continue
                try:
                    store.release(info.key, info.owner)
                except Exception as exc:
                    logger.warning(
                        "celery-lease: releasing %r of dead pool process %d failed (%s); it"
                        " frees itself within %.1fs",
                        info.key,
                        death.pid,
                        exc,
                        info.expires_in,
                    )
                    continue
                _timed_out.pop(owner.task_id or "", None)
                held = None if owner.taken_at is None else max(0.0, time.time() - owner.taken_at)
                logger.warning(
                    "celery-lease: pool process %d died (exit code %s) holding %r for task"
                    " %s[%s]; released it (owner %s, token %d)",
                    death.pid,
                    death.exitcode,
                    info.key,
                    owner.task,
                    owner.task_id,
                    info.owner,
                    info.token,
                )
                task = self.app.tasks.get(owner.task) if owner.task else None
                named = {
                    "key": info.key,
                    "token": info.token,
                    "held_seconds": held,
                    "task_id": owner.task_id,
                    "reason": "holder_died",
                    "pid": death.pid,
                    "exitcode": death.exitcode,
                }
                get_dispatcher().submit(
                    _send_released, (task, named), f"lock_released of {info.key!r} (holder died)"
                )
                if owner.task_id in death.fails:
                    self._release_queued(store, by_key, info.key, owner.task_id, death)

    def _release_queued(
        self, store: LockStore, by_key: dict[str, Any], key: str, task_id: str | None, death: _Death
    ) -> None:
        """The run lease ``key`` of ``task_id`` (a copy that ends with ``death``) was released:
        release its queued key too, if that copy holds it (owner-checked, that exact owner)."""
        from celery_lease._celery.unique import queued_key

        qkey = queued_key(key, self._prefix())
        info = by_key.get(qkey)
        if (
            info is None
            or not owners.is_queued_owner(info.owner)
            or owners.parse_owner(info.owner).task_id != task_id
        ):
            return
        try:
            store.release(qkey, info.owner)
        except Exception as exc:
            logger.warning(
                "celery-lease: releasing the queued key %r of dead pool process %d failed (%s);"
                " it frees itself within %.1fs",
                qkey,
                death.pid,
                exc,
                info.expires_in,
            )
            return
        logger.warning(
            "celery-lease: pool process %d died running unique copy %s[%s], which is not run"
            " again; released its queued key %r (owner %s)",
            death.pid,
            death.tasks.get(task_id or ""),
            task_id,
            qkey,
            info.owner,
        )

    def _prefix(self) -> str:
        """The app's ``lease_key_prefix`` (``""`` if the settings cannot be read)."""
        from celery_lease._celery import settings as config

        try:
            return config.get_settings(self.app).key_prefix
        except Exception:
            return ""


def _send_released(args: tuple[Any, dict[str, Any]]) -> None:
    from celery_lease import signals

    task, named = args
    signals.send(signals.lock_released, task, **named)


class DeadHolders(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: release the leases of pool children that die running a task.

    Starts after the pool; does nothing for a pool without children (solo, threads, gevent,
    eventlet) or one whose internals are not billiard's (see the module docstring).
    """

    name = "celery_lease.worker.DeadHolders"  # a fixed step name, wherever the class lives
    label = "celery-lease dead holders"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.reaper: _Reaper | None = None

    def start(self, parent: Any) -> None:
        """Wrap the prefork pool's join of exited children (nothing for other pools)."""
        inner = getattr(getattr(parent, "pool", None), "_pool", None)
        if not all(
            hasattr(inner, name)
            for name in ("_join_exited_workers", "mark_as_worker_lost", "_pool")
        ):
            return
        self.reaper = _Reaper(parent.app, getattr(parent, "hostname", None), inner)
        self.reaper.install()

    def stop(self, parent: Any) -> None:
        """Nothing to stop: the release thread is a daemon and ends with the process."""

    def terminate(self, parent: Any) -> None:
        """Nothing to terminate."""


worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_lease.worker_init")
worker_process_init.connect(
    _on_worker_process_init, weak=False, dispatch_uid="celery_lease.worker_process_init"
)
worker_shutdown.connect(
    _on_worker_shutdown, weak=False, dispatch_uid="celery_lease.worker_shutdown"
)
task_prerun.connect(_on_task_prerun, weak=False, dispatch_uid="celery_lease.task_prerun")
task_postrun.connect(_on_task_postrun, weak=False, dispatch_uid="celery_lease.task_postrun")
task_failure.connect(_on_task_failure, weak=False, dispatch_uid="celery_lease.task_failure")
