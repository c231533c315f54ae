"""Metrics of locked tasks: ``celery_lease.metrics.install(app)`` (or ``lease_metrics``); names,
ports, prefork behaviour and what ``celery_lease_held`` counts: docs/operations.md ("Metrics").
:func:`install` only checks its arguments; the worker's :class:`MetricsStep` connects receivers.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

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
from celery_lease.stores.slots import SLOT_MARK, split_slot

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

    def acquired(
        self,
        task: str,
        key: str,
        task_id: str | None,
        wait_seconds: float,
        slot: int | None = None,
    ) -> None:
        """A lease was taken; ``slot``: its slot, when the signal named one."""

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
"""(key, token) -> what to tell the sink of an end that came (from another thread) before its
acquisition was counted; bounded by :data:`_EARLY_KEEP` (superseded copies never acquire)."""
_EARLY_KEEP = 1024
_tasks_by_key: dict[str, str] = {}
"""Key (or queued key of a unique copy) -> task name, of leases held here (for renewals); a
slot's renewals are found under its key."""
_holds_by_key: dict[str, int] = {}
"""Key -> how many leases counted in :data:`_held` hold it (slots of one key: several)."""
_lock = threading.Lock()
_observing = False  # the renewal observer is registered (once per process, under _lock)
_counting = threading.Lock()  # guards _held and _early (task, dispatcher threads); new after fork


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


def _key_and_slot(key: str, slot: object) -> tuple[str, int | None]:
    """The key and slot a signal names: a slot's store key (the reaper's) is split."""
    if SLOT_MARK in key:
        base, found = split_slot(key)
        if found is not None:
            return base, found
    return key, slot if isinstance(slot, int) and not isinstance(slot, bool) else None


def _on_acquired(
    sender: object = None,
    key: str = "",
    token: int | None = None,
    wait_seconds: float = 0.0,
    task_id: str | None = None,
    slot: int | None = None,
    **_: object,
) -> None:
    sink = _sink
    if sink is None:
        return
    task = _name(sender)
    key, slot = _key_and_slot(key, slot)
    queued = _queued_key(sender, key)
    with _counting:
        ended = _early.pop((key, token), None)
        if ended is None:
            _held[(key, token)] = (task, queued)
            _tasks_by_key[key] = task
            _holds_by_key[key] = _holds_by_key.get(key, 0) + 1
            if queued is not None:
                _tasks_by_key[queued] = task
    if slot is None:
        sink.acquired(task, key, task_id, float(wait_seconds or 0.0))
    else:
        sink.acquired(task, key, task_id, float(wait_seconds or 0.0), slot=slot)
    if ended is not None:
        ended(sink)


def _ended(key: str, token: int | None, tell: Callable[[Sink], None]) -> bool:
    """Stop counting ``(key, token)`` as held; True if it was (tell now), else ``tell`` waits."""
    with _counting:
        counted = _held.pop((key, token), None)
        if counted is None:
            _early[(key, token)] = tell
            while len(_early) > _EARLY_KEEP:
                _early.popitem(last=False)
            return False
        holds = _holds_by_key.pop(key, 1) - 1
        if holds > 0:  # another slot of the key is still held here: its renewals go on
            _holds_by_key[key] = holds
        else:
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
    slot: int | None = None,
    **_: object,
) -> None:
    sink = _sink
    if sink is None:
        return
    task, why = _name(sender), str(reason)
    key = _key_and_slot(key, slot)[0]

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
    slot: int | None = None,
    **_: object,
) -> None:
    sink = _sink
    if sink is None:
        return
    task, held = _name(sender), float(held_seconds or 0.0)
    key = _key_and_slot(key, slot)[0]
    if reason == "holder_died":  # counted by the dead child only, whose gauge share went with it
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
    if task is None and SLOT_MARK in key:  # a slot's store key: its task is under the key
        task = _tasks_by_key.get(split_slot(key)[0])
    if sink is not None and task is not None:
        sink.renewal(task, float(seconds))


_RECEIVERS = (
    (signals.lock_acquired, _on_acquired),
    (signals.lock_rejected, _on_rejected),
    (signals.lock_lost, _on_lost),
    (signals.lock_released, _on_released),
)


def connect(sink: Sink) -> None:
    """Send the lock signals to ``sink`` in this process (replacing any earlier one); children
    forked after it inherit the receivers."""
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
    """Stop measuring in this process: the receivers are disconnected."""
    global _sink
    with _lock:
        _sink = None
        with _counting:
            _held.clear()
            _early.clear()
            _holds_by_key.clear()
        _tasks_by_key.clear()
        for signal, receiver in _RECEIVERS:
            signal.disconnect(receiver, dispatch_uid=f"celery_lease.metrics.{signal.name}")


class _Options(NamedTuple):
    exporter: str
    port: int | tuple[int, ...]
    addr: str
    setting: str


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
        port: TCP port of ``/metrics`` (default :data:`DEFAULT_PORT`; 0: any free port, logged),
            or ports to take the first free one of (``range(9809, 9819)``, a list or tuple).
            A port taken: one ERROR line, and the worker runs on without metrics.
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
    """What to export for ``app``'s worker: :func:`install`'s arguments, else the settings."""
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


class MetricsStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep (added by :func:`install` or ``lease_metrics``): ``__init__`` (before the
    fork) picks the port and connects the receivers, ``start`` serves ``/metrics``. No free port
    is one ERROR line; only ``prometheus_client`` imported before ``PROMETHEUS_MULTIPROC_DIR``
    was set under a multi-process pool refuses the worker."""

    label = "celery-lease metrics"
    requires = ("celery.worker.components:Pool", "celery_lease._celery.startup:LeaseCheck")
    """After the pool (its class decides multiprocess mode) and the configuration check."""

    def __init__(self, parent: WorkerLike, **kwargs: object) -> None:
        super().__init__(parent, **kwargs)
        self.exporter: PrometheusExporter | None = None
        options = _options_of(parent.app)
        if options is None:
            return
        if options.exporter == "otel":
            from celery_lease.metrics.otel import OtelSink

            connect(OtelSink())
            return
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
            from celery_lease._celery import control  # not at import: it registers a command

            logger.critical("Refusing to start worker %s: %s", node or "?", exc)
            control.cleanup_main()
            raise
        connect(self.exporter.sink)

    def start(self, parent: WorkerLike) -> None:
        """Serve ``/metrics`` from the main process; no port left: one ERROR line."""
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

    terminate = stop
