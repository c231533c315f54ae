"""Prometheus metrics of locked tasks (``pip install 'celery-lease[prometheus]'``).

Prefork and ``PROMETHEUS_MULTIPROC_DIR``: docs/operations.md ("Metrics").
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import glob
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from celery_lease.errors import LeaseConfigError

__all__ = [
    "HOLD_BUCKETS",
    "RENEWAL_BUCKETS",
    "WAIT_BUCKETS",
    "PortsTaken",
    "PrometheusExporter",
    "PrometheusSink",
    "first_free_port",
    "port_in_use",
    "remove_dead_dirs",
]

logger = logging.getLogger("celery_lease.metrics.prometheus")

ENV = "PROMETHEUS_MULTIPROC_DIR"

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Seconds: buckets of ``celery_lease_wait_seconds``."""

HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)
"""Seconds: buckets of ``celery_lease_hold_seconds``."""

RENEWAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds: buckets of ``celery_lease_renewal_seconds``."""


class PrometheusSink:
    """The metrics, created once per process on ``registry`` (``None`` in multiprocess mode)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kw: dict[str, Any] = {"registry": registry}
        task = ["task"]
        self.acquired_total = Counter(
            "celery_lease_acquired", "Leases acquired by locked tasks.", task, **kw
        )
        self.rejected_total = Counter(
            "celery_lease_rejected", "Runs turned away: the key stayed held past wait.", task, **kw
        )
        self.lost_total = Counter(
            "celery_lease_lost",
            "Leases lost while the body ran, by reason (expired, taken, max_hold, released,"
            " replaced...).",
            ["task", "reason"],
            **kw,
        )
        self.released_total = Counter(
            "celery_lease_released",
            "Leases released (or kept for cooldown) after the body.",
            task,
            **kw,
        )
        self.wait_seconds = Histogram(
            "celery_lease_wait_seconds",
            "Seconds from the start of acquiring to holding the lease.",
            task,
            buckets=WAIT_BUCKETS,
            **kw,
        )
        self.hold_seconds = Histogram(
            "celery_lease_hold_seconds",
            "Seconds a lease was held, acquire to release.",
            task,
            buckets=HOLD_BUCKETS,
            **kw,
        )
        self.held = Gauge(
            "celery_lease_held",
            "Leases held now by running tasks.",
            task,
            multiprocess_mode="livesum",
            **kw,
        )
        self.renewal_seconds = Histogram(
            "celery_lease_renewal_seconds",
            "Seconds of one renewal round trip to the store.",
            task,
            buckets=RENEWAL_BUCKETS,
            **kw,
        )

    def acquired(
        self,
        task: str,
        key: str,
        task_id: str | None,
        wait_seconds: float,
        slot: int | None = None,
    ) -> None:
        """Counted by task; neither key nor slot is a label (docs/operations.md, "Metrics")."""
        self.acquired_total.labels(task).inc()
        self.wait_seconds.labels(task).observe(wait_seconds)
        self.held.labels(task).inc()

    def rejected(self, task: str) -> None:
        self.rejected_total.labels(task).inc()

    def lost(self, task: str, key: str, task_id: str | None, reason: str) -> None:
        self.lost_total.labels(task, reason).inc()
        self.held.labels(task).dec()

    def released(
        self, task: str, key: str, task_id: str | None, held_seconds: float, counted: bool = True
    ) -> None:
        self.released_total.labels(task).inc()
        self.hold_seconds.labels(task).observe(held_seconds)
        if counted:  # else another process counted it as held (a dead pool child)
            self.held.labels(task).dec()

    def renewal(self, task: str, seconds: float) -> None:
        self.renewal_seconds.labels(task).observe(seconds)


_PID = re.compile(r"_(\d+)\.db$")


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is no zombie (a killed child is one until the pool reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass  # no procfs: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True


class _MultiProcess:
    """``MultiProcessCollector`` that first drops the live gauges of processes gone."""

    def __init__(self, path: str) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.path = path
        self.inner = MultiProcessCollector(None, path=path)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Any]:
        from prometheus_client.multiprocess import mark_process_dead

        for name in glob.glob(os.path.join(self.path, "gauge_live*_*.db")):
            match = _PID.search(name)
            if match is not None and not _alive(int(match.group(1))):
                mark_process_dead(int(match.group(1)), self.path)  # type: ignore[no-untyped-call]
        try:
            return list(self.inner.collect())  # type: ignore[no-untyped-call]
        except Exception:  # one unreadable file (a process killed mid-write) fails no scrape
            files = glob.glob(os.path.join(self.path, "*.db"))
            readable = [name for name in files if _readable(name)]
            logger.warning(
                "celery-lease: skipped unreadable metrics files in %s: %s",
                self.path,
                sorted(set(files) - set(readable)),
            )
            return list(self.inner.merge(readable, accumulate=True))  # type: ignore[no-untyped-call]


def _readable(name: str) -> bool:
    """Whether prometheus_client can read the multiprocess metrics file ``name``."""
    from prometheus_client.multiprocess import MultiProcessCollector

    try:
        MultiProcessCollector.merge([name], accumulate=True)  # type: ignore[no-untyped-call]
    except Exception:
        return False
    return True


_sinks: dict[bool, PrometheusSink] = {}


def _mark_dead_on_exit(**_: Any) -> None:
    path = os.environ.get(ENV)
    if path:
        from prometheus_client.multiprocess import mark_process_dead

        with contextlib.suppress(OSError):
            mark_process_dead(os.getpid(), path)  # type: ignore[no-untyped-call]


def port_in_use(addr: str, port: int) -> OSError | None:
    """Why ``/metrics`` cannot listen on ``addr:port`` now (``EADDRINUSE``...), or ``None``
    (binds a socket as prometheus_client's server would; port 0 is never in use)."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(where)
    except OSError as exc:
        return exc
    return None


def first_free_port(addr: str, ports: Sequence[int]) -> tuple[int, OSError | None]:
    """``(port, None)``: the first of ``ports`` free at ``addr``; else ``(-1, why)``."""
    why: OSError | None = None
    for port in ports:
        why = port_in_use(addr, port)
        if why is None:
            return port, None
    return -1, why


SETTING = "lease_metrics_port"  # how the exporter names a port that came from the settings

LOCK_FILE = "owner.lock"
"""Lock file of a private multiprocess directory, locked by the worker that made it."""

DIR_PREFIX = "celery-lease-metrics-"
"""Name prefix of the private multiprocess directories, in :func:`tempfile.gettempdir`."""


def _shown_ports(ports: Sequence[int]) -> str:
    if len(ports) == 1:
        return str(ports[0])
    if list(ports) == list(range(ports[0], ports[0] + len(ports))):
        return f"{ports[0]}-{ports[-1]}"
    return ",".join(str(port) for port in ports)


class PortsTaken(Exception):
    """No port of the metrics setting is free; :meth:`message` is the ERROR line logged."""

    def __init__(self, setting: str, ports: Sequence[int], addr: str, exc: OSError | None) -> None:
        self.setting, self.ports, self.addr = setting, tuple(ports), addr
        self.why = (exc.strerror or str(exc)) if exc is not None else "in use"
        super().__init__(self.message(None))

    def message(self, node: str | None) -> str:
        """One line: what is taken, that ``node`` runs without metrics, and what to do."""
        shown = _shown_ports(self.ports)
        if self.setting == SETTING:
            named = f"{SETTING}={shown}"
            fix = (
                f"give each worker on a host its own port (from an environment variable set per"
                f" worker), or a range each worker takes the first free port of:"
                f" {SETTING}='9809-9818' (or range(9809, 9819)); or 0 for any free port"
            )
        else:
            named = f"celery_lease.metrics.install(port={shown})"
            fix = (
                "pass each worker its own port, or a range each worker takes the first free port"
                " of: install(app, port=range(9809, 9819)); or 0 for any free port"
            )
        what = "cannot be served" if len(self.ports) == 1 else "has no port left to serve"
        return (
            f"celery-lease metrics: {named} {what} on {self.addr}: {self.why} (another process"
            f" listens there: a second worker on this host?); worker {node or 'this worker'}"
            f" runs its tasks without metrics. To serve them, {fix}"
        )


def _lock_exclusive(handle: TextIO) -> bool:
    """Take ``handle``'s file lock without waiting: True when taken, False when it is held."""
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def remove_dead_dirs(parent: str) -> list[str]:
    """Remove the private directories in ``parent`` whose worker is gone (their
    :data:`LOCK_FILE` exists and can be locked, held while removing); the paths removed."""
    removed: list[str] = []
    for path in sorted(glob.glob(os.path.join(glob.escape(parent), DIR_PREFIX + "*"))):
        lock = os.path.join(path, LOCK_FILE)
        try:
            handle = open(lock)  # noqa: SIM115 - kept open while the directory is removed
        except OSError:
            continue  # being made, made by an older version, or not a directory of ours
        with handle:
            try:
                taken = _lock_exclusive(handle)
            except OSError:
                continue
            if not taken:
                continue  # a live worker's
            if not os.path.exists(lock):
                continue  # removed by another worker while we waited
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _make_owned_dir() -> tuple[str, TextIO]:
    """A new private directory with its :data:`LOCK_FILE` locked (renamed into place locked)."""
    path = tempfile.mkdtemp(prefix=DIR_PREFIX)
    hidden = os.path.join(path, f".{LOCK_FILE}.{os.getpid()}")
    handle = open(hidden, "w")  # noqa: SIM115 - held open (and locked) for the worker's life
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    os.rename(hidden, os.path.join(path, LOCK_FILE))
    return path, handle


class PrometheusExporter:
    """Set up in the worker's main process before the fork; serves ``/metrics`` from it.

    ``port`` 0 is any free port, a sequence the first free one (:class:`PortsTaken` if none,
    before anything is made); ``multiprocess`` for prefork (LeaseConfigError when
    ``prometheus_client`` was imported before ``PROMETHEUS_MULTIPROC_DIR`` was set).
    """

    def __init__(
        self,
        port: int | Sequence[int],
        addr: str,
        *,
        multiprocess: bool,
        node: str | None,
        setting: str = SETTING,
    ) -> None:
        self.ports: tuple[int, ...] = (port,) if isinstance(port, int) else tuple(port)
        self.addr, self.node, self.setting = addr, node, setting
        self.port, taken = first_free_port(addr, self.ports)
        if taken is not None:
            raise PortsTaken(setting, self.ports, addr, taken)
        self.multiprocess = multiprocess
        self.created_dir: str | None = None
        self._owner: TextIO | None = None  # the locked LOCK_FILE of created_dir
        self._made_here = os.getpid()  # only this process removes what it made
        self.server: Any = None
        self.thread: Any = None
        if multiprocess:
            self._prepare_dir()
        import prometheus_client
        from prometheus_client import values

        # the value class is chosen at import; MutexValue is the single-process one
        if multiprocess and values.ValueClass is values.MutexValue:
            self._forget_dir()
            raise LeaseConfigError(
                "celery-lease metrics: this worker runs tasks in pool processes, whose metrics"
                " reach /metrics only in prometheus_client's multiprocess mode, but"
                " prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set. Set"
                " PROMETHEUS_MULTIPROC_DIR=/an/empty/dir in the worker's environment, or do"
                " not import prometheus_client before the worker starts"
            )
        sink = _sinks.get(multiprocess)
        if sink is None:
            sink = _sinks[multiprocess] = PrometheusSink(
                None if multiprocess else prometheus_client.REGISTRY
            )
        self.sink = sink
        if multiprocess:
            from celery.signals import worker_process_shutdown

            worker_process_shutdown.connect(
                _mark_dead_on_exit, weak=False, dispatch_uid="celery_lease.metrics.dead"
            )
            self.registry: Any = prometheus_client.CollectorRegistry()
            self.registry.register(_MultiProcess(os.environ[ENV]))
        else:
            self.registry = prometheus_client.REGISTRY

    def _prepare_dir(self) -> None:
        if os.environ.get(ENV):
            os.makedirs(os.environ[ENV], exist_ok=True)
            return
        if "prometheus_client" in sys.modules:
            return  # too late: refused in __init__
        for gone in remove_dead_dirs(tempfile.gettempdir()):
            logger.info("celery-lease: removed %s, the metrics directory of a worker gone", gone)
        self.created_dir, self._owner = _make_owned_dir()
        os.environ[ENV] = self.created_dir
        atexit.register(self._forget_dir)  # a worker that ends without stopping its steps

    def _forget_dir(self) -> None:
        if self.created_dir is not None and self._made_here == os.getpid():
            shutil.rmtree(self.created_dir, ignore_errors=True)
            if os.environ.get(ENV) == self.created_dir:
                del os.environ[ENV]
            self.created_dir = None
            owner, self._owner = self._owner, None
            if owner is not None:
                owner.close()

    def start(self) -> None:
        """Serve ``/metrics`` on a daemon thread, on the chosen port or the next free one
        (:class:`PortsTaken`: none is free any more)."""
        from prometheus_client import start_http_server

        why: OSError | None = None
        for port in self.ports[self.ports.index(self.port) :]:
            try:
                self.server, self.thread = start_http_server(
                    port, self.addr, registry=self.registry
                )
            except OSError as exc:  # taken since __init__ checked it
                why = exc
                continue
            break
        else:
            raise PortsTaken(self.setting, self.ports, self.addr, why)
        self.port = port = self.server.server_port
        mode = f"multiprocess, {os.environ.get(ENV)}" if self.multiprocess else "one process"
        logger.info(
            "celery-lease: metrics of %s on http://%s:%d/metrics (%s)",
            self.node or "this worker",
            self.addr,
            port,
            mode,
        )

    @property
    def bound_port(self) -> int | None:
        """The port being served (the one chosen for port 0), or ``None`` before start."""
        return None if self.server is None else int(self.server.server_port)

    def stop(self) -> None:
        """Stop serving; remove the private multiprocess directory, if we made it."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        self._forget_dir()
