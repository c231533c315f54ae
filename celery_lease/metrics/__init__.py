"""Metrics of locked tasks: one line, ``celery_lease.metrics.install(app)``.

``pip install 'celery-lease[prometheus]'`` (or ``[otel]``), then in the module that defines the
app::

    import celery_lease.metrics

    celery_lease.metrics.install(app)                       # Prometheus on :9809/metrics
    celery_lease.metrics.install(app, port=0)               # any free port (logged at start)
    celery_lease.metrics.install(app, port=range(9809, 9819))  # the first free one of them
    celery_lease.metrics.install(app, exporter="otel")      # the OpenTelemetry API instead

or, without code, the settings ``app.conf.lease_metrics = "prometheus"`` (or ``"otel"``) and
``app.conf.lease_metrics_port = 9809`` (checked with the other ``lease_*`` settings at worker
start: a bad value or a misspelled name refuses the worker). A call of :func:`install` wins over
the settings.

Metrics never stop a worker. A port already taken on the host (a second worker given the same
port) is logged as one ERROR line naming ``lease_metrics_port`` (or ``install(port=...)``) and
the port, and the worker runs its tasks without metrics. Several workers on one host can share
one setting given as a range of ports (``lease_metrics_port = "9809-9818"``, ``range(9809,
9819)`` or a list: django-prometheus's ``PROMETHEUS_METRICS_EXPORT_PORT_RANGE`` convention):
each takes the first port of it that is free, and logs which.

Nothing happens at the call but checks (a bad argument or a missing client library is an error
here, at import of the app). The worker does the rest while it is built, in its main process,
before the pool forks (the :class:`MetricsStep` bootstep): it creates the metrics, connects the
receivers of :mod:`celery_lease.signals` and, for Prometheus, serves them over HTTP from the
main process. A process that is no worker (a producer, a test with eager tasks) gets no
receivers, so the task hot path sends no signal there: with no receiver connected, the engine
does not even build the signal's arguments.

What is measured (names as Prometheus shows them; ``task`` is the task name):

=========================================  =========  ============================================
``celery_lease_acquired_total{task}``      counter    leases taken (``lock_acquired``)
``celery_lease_rejected_total{task}``      counter    runs turned away: key held past ``wait``
``celery_lease_lost_total{task,reason}``   counter    leases lost while the body ran (``reason``)
``celery_lease_released_total{task}``      counter    leases released (or kept for ``cooldown``)
``celery_lease_wait_seconds{task}``        histogram  time taken to acquire (acquired runs)
``celery_lease_hold_seconds{task}``        histogram  time held, acquire to release
``celery_lease_held{task}``                gauge      leases held now by running tasks
``celery_lease_renewal_seconds{task}``     histogram  round trip of one renewal (see below)
=========================================  =========  ============================================

Renewal latency needs the renewer to report each renewal (``renewer.observe_renewals``); where
this version of the renewer has no such hook, the histogram is exported empty. A renewal counts
under the task whose lease it renews: the run lease of a locked task running in this process, or
the queued key (``queued:<key>``) its ``lock_unique="until_done"`` copy keeps while it runs.
Renewals of other leases (``lease()`` in a plain task body) are not counted.

``celery_lease_held`` is the number of leases held: each process counts the leases it took
and, on their release or loss, only those (a lease is known by its key and fencing token). So a
release sent in a process that never counted the lease as held does not decrease it: the main
process of a prefork worker releasing the lease of a pool child that died (``lock_released``
with ``reason="holder_died"``: counted in ``celery_lease_released_total``; the dead child's own
share of the gauge goes with it), or a debounced copy superseded after it took its run lease,
which ends without its body and never sent ``lock_acquired``.

Prefork: see :mod:`celery_lease.metrics.prometheus` for how the children's values reach the
main process (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from celery import bootsteps

from celery_lease import _forking as forking
from celery_lease import signals
from celery_lease._celery import pool
from celery_lease._celery.settings import (
    BUILTIN_METRICS_PORT,
    METRICS_EXPORTERS,
    get_settings,
    read_metrics_port,
)
from celery_lease._celery.spec import options_of
from celery_lease.errors import LeaseConfigError

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryApp, CeleryTask, WorkerLike
    from celery_lease.metrics.prometheus import PrometheusExporter

__all__ = [
    "DEFAULT_PORT",
    "EXPORTERS",
    "MetricsStep",
    "Sink",
    "connect",
    "disconnect",
    "install",
    "installed",
]

logger = logging.getLogger("celery_lease.metrics")

EXPORTERS = METRICS_EXPORTERS
"""Allowed ``exporter`` values of :func:`install` (and of the ``lease_metrics`` setting)."""

DEFAULT_PORT = BUILTIN_METRICS_PORT
"""TCP port of the Prometheus endpoint by default (celery-exporter's 9808, plus one)."""

_EXTRAS = {"prometheus": ("prometheus_client", "prometheus"), "otel": ("opentelemetry", "otel")}

UNKNOWN_TASK = "unknown"
"""``task`` label of a lease taken outside any task (a ``@locked`` function called directly)."""


class Sink(Protocol):
    """Where the receivers put what the signals say (one per exporter)."""

    def acquired(self, task: str, key: str, task_id: str | None, wait_seconds: float) -> None: ...
    def rejected(self, task: str) -> None: ...
    def lost(self, task: str, key: str, task_id: str | None, reason: str) -> None: ...
    def released(
        self, task: str, key: str, task_id: str | None, held_seconds: float, counted: bool = True
    ) -> None:
        """A lease was released; ``counted``: it was counted as held in this process."""

    def renewal(self, task: str, seconds: float) -> None: ...


_sink: Sink | None = None
_held: dict[tuple[str, int | None], tuple[str, str | None]] = {}
"""(key, token) -> (task name, queued key) of the leases counted as held in this process."""
_early: OrderedDict[tuple[str, int | None], Callable[[Sink], None]] = OrderedDict()
"""(key, token) -> what to tell the sink, of releases and losses that came before their
acquisition was counted (another thread sends them): told once it is. The oldest are dropped
past :data:`_EARLY_KEEP` (releases whose acquisition is never sent: superseded copies)."""
_EARLY_KEEP = 1024
_tasks_by_key: dict[str, str] = {}
"""Key -> task name of the leases held by running tasks in this process, and of the queued
keys their unique copies renew (for renewals)."""
_lock = threading.Lock()
_observing = False
"""The renewal observer is registered (once per process, with :data:`_lock` held)."""
_counting = threading.Lock()
"""Guards :data:`_held` and :data:`_early` (the receivers run on the task's thread and on the
dispatcher's); made anew in a forked child."""


def _new_counting_lock() -> None:
    global _counting
    _counting = threading.Lock()


forking.on_fork_child(_new_counting_lock, name="metrics: counting lock")


def _name(sender: object) -> str:
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) and name else UNKNOWN_TASK


def _queued_key(sender: object, key: str) -> str | None:
    """The queued key a running ``lock_unique="until_done"`` copy of ``sender`` renews."""
    options = options_of(type(sender))
    unique = getattr(options, "unique", None)
    if unique is None or unique.unique != "until_done" or unique.debounce is not None:
        return None
    try:
        prefix = get_settings(cast("CeleryTask", sender).app).key_prefix  # a LockedTask
    except Exception:  # no app, bad settings: its renewals are not counted
        return None
    from celery_lease._celery.unique import queued_key  # not at import: it connects receivers

    return queued_key(key, prefix)


def _on_acquired(
    sender: object = None,
    key: str = "",
    token: int | None = None,
    wait_seconds: float = 0.0,
    task_id: str | None = None,
    **_: object,
) -> None:
    sink = _sink
    if sink is None:
        return
    task = _name(sender)
    queued = _queued_key(sender, key)
    with _counting:
        ended = _early.pop((key, token), None)
        if ended is None:
            _held[(key, token)] = (task, queued)
            _tasks_by_key[key] = task
            if queued is not None:
                _tasks_by_key[queued] = task
    sink.acquired(task, key, task_id, float(wait_seconds or 0.0))
    if ended is not None:
        ended(sink)


def _ended(key: str, token: int | None, tell: Callable[[Sink], None]) -> bool:
    """The lease ``(key, token)`` ended: stop counting it as held here; True when it was
    (tell the sink now). Otherwise ``tell`` waits for its acquisition (see :data:`_early`)."""
    with _counting:
        counted = _held.pop((key, token), None)
        if counted is None:
            _early[(key, token)] = tell
            while len(_early) > _EARLY_KEEP:
                _early.popitem(last=False)
            return False
        _tasks_by_key.pop(key, None)
        if counted[1] is not None:
            _tasks_by_key.pop(counted[1], None)
        return True


def _on_rejected(sender: object = None, **_: object) -> None:
    sink = _sink
    if sink is not None:
        sink.rejected(_name(sender))


def _on_lost(
    sender: object = None,
    key: str = "",
    token: int | None = None,
    reason: str = "lost",
    task_id: str | None = None,
    **_: object,
) -> None:
    sink = _sink
    if sink is None:
        return
    task, why = _name(sender), str(reason)

    def tell(to: Sink) -> None:
        to.lost(task, key, task_id, why)

    if _ended(key, token, tell):
        tell(sink)


def _on_released(
    sender: object = None,
    key: str = "",
    token: int | None = None,
    held_seconds: float | None = 0.0,
    task_id: str | None = None,
    reason: str | None = None,
    **_: object,
) -> None:
    sink = _sink
    if sink is None:
        return
    task, held = _name(sender), float(held_seconds or 0.0)
    if reason == "holder_died":
        # Sent by the main process for a pool child that died holding it: counted as held by
        # that child only, whose share of the gauge went with it.
        sink.released(task, key, task_id, held, counted=False)
        return

    def tell(to: Sink) -> None:
        to.released(task, key, task_id, held)

    if _ended(key, token, tell):
        tell(sink)


def _on_renewal(key: str, token: int | None, seconds: float, ok: bool | None) -> None:
    """The renewer's observer (its thread; quick, never raises out)."""
    sink = _sink
    task = _tasks_by_key.get(key)
    if sink is not None and task is not None:
        sink.renewal(task, float(seconds))


_RECEIVERS = (
    (signals.lock_acquired, _on_acquired),
    (signals.lock_rejected, _on_rejected),
    (signals.lock_lost, _on_lost),
    (signals.lock_released, _on_released),
)


def connect(sink: Sink) -> None:
    """Send what the lock signals say to ``sink`` in this process (replaces any earlier one).

    Connected before the pool forks, the receivers are inherited by the children.
    """
    global _sink, _observing
    with _lock:
        _sink = sink
        for signal, receiver in _RECEIVERS:
            signal.connect(receiver, weak=False, dispatch_uid=f"celery_lease.metrics.{signal.name}")
        from celery_lease._core import renewer

        if not _observing:
            renewer.observe_renewals(_on_renewal)
            _observing = True


def disconnect() -> None:
    """Stop measuring in this process: the receivers are disconnected (the hot path is quiet)."""
    global _sink
    with _lock:
        _sink = None
        with _counting:
            _held.clear()
            _early.clear()
        _tasks_by_key.clear()
        for signal, receiver in _RECEIVERS:
            signal.disconnect(receiver, dispatch_uid=f"celery_lease.metrics.{signal.name}")


class _Options:
    __slots__ = ("addr", "exporter", "port", "setting")

    def __init__(self, exporter: str, port: int | tuple[int, ...], addr: str, setting: str) -> None:
        self.exporter, self.port, self.addr, self.setting = exporter, port, addr, setting


_installed: weakref.WeakKeyDictionary[CeleryApp, _Options] = weakref.WeakKeyDictionary()


def installed(app: object) -> bool:
    """Whether :func:`install` was called for ``app`` (in this process)."""
    return app in _installed


def install(
    app: CeleryApp,
    exporter: str = "prometheus",
    *,
    port: int | Sequence[int] | str = DEFAULT_PORT,
    addr: str = "0.0.0.0",
) -> None:
    """Export the lock metrics of ``app``'s workers.

    Args:
        app: the Celery app (its workers add the :class:`MetricsStep` bootstep).
        exporter: ``"prometheus"`` (default: served over HTTP by the worker's main process) or
            ``"otel"`` (instruments of the OpenTelemetry API, exported by the meter and tracer
            providers you configure; ``port`` and ``addr`` are not used).
        port: TCP port of ``/metrics`` (default :data:`DEFAULT_PORT`; 0: any free port, which
            the worker logs), or ports each worker takes the first free one of:
            ``range(9809, 9819)``, a list or tuple of ports, or ``"9809-9818"`` (see
            :func:`celery_lease._celery.settings.read_metrics_port`). A worker whose port is
            taken (a second worker on the host) logs one ERROR line naming it and runs on
            without metrics.
        addr: address to listen on (default all interfaces).

    Raises:
        LeaseConfigError: a bad argument, or the exporter's client library is not installed
            (the message names the extra to install).
    """
    if exporter not in EXPORTERS:
        raise LeaseConfigError(
            f"exporter={exporter!r} is not allowed: use one of {', '.join(EXPORTERS)}"
        )
    if isinstance(port, str):
        raise LeaseConfigError(
            f"port={port!r} is not allowed: use an int from 0 to 65535, or a range of ports"
            " (range(9809, 9819), a list or tuple)"
        )
    ports = read_metrics_port(port, "port")
    if not isinstance(addr, str) or not addr:
        raise LeaseConfigError(f"addr={addr!r} is not allowed: use a host address such as '::'")
    _check_library(exporter, "exporter")
    steps = getattr(app, "steps", None)
    if steps is None:
        raise LeaseConfigError(f"app={app!r} is not a Celery app (it has no .steps)")
    _installed[app] = _Options(exporter, ports, addr, "install(port)")
    from celery_lease._celery import startup  # not at import: it registers `inspect leases`

    startup.opt_in(app)  # its workers get celery-lease's hooks without a locked task
    steps["worker"].add(MetricsStep)


def _check_library(exporter: str, name: str) -> None:
    module, extra = _EXTRAS[exporter]
    if importlib.util.find_spec(module) is None:
        raise LeaseConfigError(
            f"{name}={exporter!r} needs the {module} package: pip install 'celery-lease[{extra}]'"
        )


def _options_of(app: CeleryApp) -> _Options | None:
    """What to export for ``app``'s worker: :func:`install`'s arguments, else the settings.

    A bad ``lease_*`` setting is left to the worker's configuration check (which refuses the
    worker with the message about it); a missing client library for ``lease_metrics`` is an
    error here.
    """
    options = _installed.get(app)
    if options is not None:
        return options
    try:
        settings = get_settings(app)
    except LeaseConfigError:
        return None  # celery_lease._celery.startup.LeaseCheck refuses the worker with this error
    if settings.metrics is None:
        return None
    _check_library(settings.metrics, "lease_metrics")
    return _Options(settings.metrics, settings.metrics_port, "0.0.0.0", "lease_metrics_port")


def _refuse(parent: WorkerLike, error: LeaseConfigError) -> None:
    """Log why the worker cannot serve its metrics, and remove what celery-lease made for it."""
    from celery_lease._celery import control  # not at import: it registers `inspect leases`

    logger.critical("Refusing to start worker %s: %s", getattr(parent, "hostname", "?"), error)
    control.cleanup_main()


class MetricsStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep added by :func:`install` (and by every worker's ``worker_init`` hook, for
    the ``lease_metrics`` setting; without either it does nothing): metrics set up before the
    pool forks.

    ``__init__`` (while Celery builds the worker, before any step starts) picks the port (the
    first free one of the setting), prepares the exporter (for Prometheus under a
    multi-process pool: the multiprocess directory, see
    :mod:`celery_lease.metrics.prometheus`) and connects the receivers; ``start`` (after the
    pool started) serves ``/metrics``; ``stop`` / ``terminate`` stop serving and disconnect.

    A Prometheus port in use never stops the worker: no port of the setting free in
    ``__init__`` (nothing is made then), or none left in ``start`` (taken in between), is
    logged as one ERROR line naming the setting and the ports, and the worker runs its tasks
    without metrics. Only a configuration that cannot work on any start refuses the worker,
    at CRITICAL with a :class:`~celery_lease.LeaseConfigError`: ``prometheus_client`` imported
    before ``PROMETHEUS_MULTIPROC_DIR`` was set under a multi-process pool.
    """

    label = "celery-lease metrics"
    requires = ("celery.worker.components:Pool", "celery_lease._celery.startup:LeaseCheck")
    """After the pool (its class decides multiprocess mode) and the configuration check (which
    refuses a bad ``lease_metrics`` setting first, with the message about it)."""

    def __init__(self, parent: WorkerLike, **kwargs: object) -> None:
        super().__init__(parent, **kwargs)
        self.exporter: PrometheusExporter | None = None
        options = _options_of(parent.app)
        if options is None:
            return
        if options.exporter == "prometheus":
            from celery_lease.metrics.prometheus import PortsTaken, PrometheusExporter

            node = getattr(parent, "hostname", None)
            try:
                self.exporter = PrometheusExporter(
                    options.port,
                    options.addr,
                    multiprocess=not pool.runs_tasks_in_main_process(parent.pool_cls),
                    node=node,
                    setting=options.setting,
                )
            except PortsTaken as taken:
                logger.error("%s", taken.message(node))
                return
            except LeaseConfigError as exc:
                _refuse(parent, exc)
                raise
        else:
            from celery_lease.metrics.otel import OtelSink

            self.exporter = None
            connect(OtelSink())
            return
        connect(self.exporter.sink)

    def start(self, parent: WorkerLike) -> None:
        """Serve ``/metrics`` (Prometheus), from the main process only; no port left: one ERROR
        line, and the worker runs on without metrics (its directory goes at ``stop``)."""
        from celery_lease.metrics.prometheus import PortsTaken

        exporter = self.exporter
        if exporter is not None:
            try:
                exporter.start()
            except PortsTaken as taken:
                logger.error("%s", taken.message(getattr(parent, "hostname", None)))

    def stop(self, parent: WorkerLike) -> None:
        """Stop serving; disconnect the receivers."""
        if self.exporter is not None:
            self.exporter.stop()
        disconnect()

    def terminate(self, parent: WorkerLike) -> None:
        """As :meth:`stop`."""
        self.stop(parent)
