"""Metrics scraped over HTTP from a real prefork worker (``celery_lease.metrics.install``).

The worker app is defined below and configured from ``MW_*`` environment variables (the worker
imports this module as ``-A tests.integration.test_metrics_worker:app``): filesystem broker and
results, SQLite lock store, ``prefork -c 2``. ``PROMETHEUS_MULTIPROC_DIR`` is unset, so the
worker makes its own multiprocess directory; the bodies run in pool children and the endpoint
is the main process's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_lease import LockedTask
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.integration.workers import STOP_TIMEOUT, CeleryWorker, filesystem_app
from tests.support import complete_lines

pytestmark = [pytest.mark.worker, pytest.mark.slow]

START_TIMEOUT = 40.0
RESULT_TIMEOUT = 30.0
POLL = 0.05


def make_app(directory: str) -> Celery:
    """The app the worker runs and the test sends from."""
    app = filesystem_app("mw", directory, POLL)
    app.conf.update(
        worker_prefetch_multiplier=1,
        lease_store=f"sqlite:///{directory}/leases.db",
    )
    out = Path(directory)

    @app.task(name="mw.work", base=LockedTask, lock_key="work:{run}", shared=False)
    def work(run: str) -> str:
        return run

    @app.task(name="mw.hold", base=LockedTask, lock_key="work:{run}", lock_ttl="0.6s", shared=False)
    def hold(run: str) -> bool:
        (out / f"held-{run}").write_text(f"{os.getpid()}\n")
        lease = hold.request.lease
        return bool(lease.wait_lost(20.0))

    @app.task(
        name="mw.skip", base=LockedTask, lock_key="work:{run}", lock_on_held="skip", shared=False
    )
    def skip(run: str) -> str:
        return run

    return app


if os.environ.get("MW_DIR"):
    app = make_app(os.environ["MW_DIR"])
    if os.environ.get("MW_MODE") == "setting":  # no code: the settings alone
        app.conf.lease_metrics = "prometheus"
        app.conf.lease_metrics_port = os.environ.get("MW_PORT", "0")  # as from the environment
    else:
        import celery_lease.metrics

        celery_lease.metrics.install(app, port=0, addr="127.0.0.1")


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[Celery, Path, subprocess.Popen[bytes]]]:
    """A worker whose app calls ``celery_lease.metrics.install(app, port=0)``."""
    yield from start_worker(tmp_path, "install")


@pytest.fixture
def setting_worker(tmp_path: Path) -> Iterator[tuple[Celery, Path, subprocess.Popen[bytes]]]:
    """A worker whose app only sets ``lease_metrics = "prometheus"``, ``lease_metrics_port = 0``."""
    yield from start_worker(tmp_path, "setting")


def start_worker(
    tmp_path: Path, mode: str
) -> Iterator[tuple[Celery, Path, subprocess.Popen[bytes]]]:
    # Not at module level: the worker imports this module, and importing prometheus_client
    # there before the worker sets PROMETHEUS_MULTIPROC_DIR makes it refuse (as it should).
    pytest.importorskip("prometheus_client")
    worker = CeleryWorker(
        "tests.integration.test_metrics_worker:app",
        tmp_path / "worker.log",
        pool="prefork",
        concurrency=2,
        name=f"mw-{uuid.uuid4().hex[:6]}",
        env={"MW_DIR": str(tmp_path), "MW_MODE": mode},
        unset=["PROMETHEUS_MULTIPROC_DIR"],
    )
    client = make_app(str(tmp_path))
    try:
        worker.wait_ready(START_TIMEOUT, POLL)
        yield client, worker.log, worker.process
    finally:
        worker.stop()
        client.close()


def scrape(log: Path) -> str:
    match = re.search(r"metrics of .* on http://([\d.]+):(\d+)/metrics", log.read_text())
    assert match is not None, f"no metrics line in the log:\n{log.read_text()[-3000:]}"
    url = f"http://{match.group(1)}:{match.group(2)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def sample(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_prefork_children_metrics_scraped_from_main_process(
    worker: tuple[Celery, Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """Runs in pool children are counted at the main process's endpoint: acquired, released,
    rejected, lost by reason, hold histogram, and nothing held once they ended."""
    client, log, _ = worker
    runs = [f"r{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for run in runs:
        assert client.send_task("mw.work", (run,)).get(timeout=RESULT_TIMEOUT) == run
    held_run = f"h{uuid.uuid4().hex[:8]}"
    holding = client.send_task("mw.hold", (held_run,))
    marker = tmp_path / f"held-{held_run}"
    deadline = time.monotonic() + RESULT_TIMEOUT
    while not marker.exists():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(POLL)
    during = scrape(log)
    with pytest.raises(TaskRevokedError, match="skipped: "):  # on_held="skip": REVOKED
        client.send_task("mw.skip", (held_run,)).get(timeout=RESULT_TIMEOUT)
    store = SQLiteLockStore(str(tmp_path / "leases.db"))
    assert store.force_release(f"work:{held_run}") is not None  # the operator frees it
    assert holding.get(timeout=RESULT_TIMEOUT) is True  # the holder saw the loss
    deadline = time.monotonic() + RESULT_TIMEOUT
    text = scrape(log)
    while sample(text, "celery_lease_lost_total", 'reason="released",task="mw.hold"') < 1:
        assert time.monotonic() < deadline, text
        time.sleep(POLL)
        text = scrape(log)
    assert sample(during, "celery_lease_held", 'task="mw.hold"') == 1
    assert sample(text, "celery_lease_acquired_total", 'task="mw.work"') == 3
    assert sample(text, "celery_lease_released_total", 'task="mw.work"') == 3
    assert sample(text, "celery_lease_hold_seconds_count", 'task="mw.work"') == 3
    assert sample(text, "celery_lease_rejected_total", 'task="mw.skip"') == 1
    assert sample(text, "celery_lease_held", 'task="mw.hold"') == 0
    assert sample(text, "celery_lease_held", 'task="mw.work"') == 0
    assert "multiprocess" in log.read_text()


def test_killed_child_leaves_no_lease_counted_as_held(
    worker: tuple[Celery, Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """A pool child SIGKILLed while it holds a lease: its share of ``celery_lease_held`` is
    dropped at the next scrape (its pid is gone), its acquired count stays."""
    import signal

    client, log, _ = worker
    run = f"k{uuid.uuid4().hex[:8]}"
    client.send_task("mw.hold", (run,))
    marker = tmp_path / f"held-{run}"
    deadline = time.monotonic() + RESULT_TIMEOUT
    while not complete_lines(marker):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(POLL)
    assert sample(scrape(log), "celery_lease_held", 'task="mw.hold"') == 1
    child = int(complete_lines(marker)[0])
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + RESULT_TIMEOUT
    while _alive(child):
        assert time.monotonic() < deadline, f"child {child} still there"
        time.sleep(POLL)
    text = scrape(log)
    assert sample(text, "celery_lease_held", 'task="mw.hold"') == 0, text
    assert sample(text, "celery_lease_acquired_total", 'task="mw.hold"') == 1, text


def _alive(pid: int) -> bool:
    """The pid exists and is no zombie (billiard reaps its children)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_setting_alone_serves_metrics_from_the_worker(
    setting_worker: tuple[Celery, Path, subprocess.Popen[bytes]],
) -> None:
    """``app.conf.lease_metrics = "prometheus"`` (no install() call): the worker serves the
    children's counts on ``lease_metrics_port`` (0: a free port, logged)."""
    client, log, _ = setting_worker
    run = f"s{uuid.uuid4().hex[:8]}"
    assert client.send_task("mw.work", (run,)).get(timeout=RESULT_TIMEOUT) == run
    text = scrape(log)
    assert sample(text, "celery_lease_acquired_total", 'task="mw.work"') == 1, text
    assert sample(text, "celery_lease_released_total", 'task="mw.work"') == 1, text
    assert "multiprocess" in log.read_text()


# Workers sharing one host: a port, a range of ports, a temporary directory -----------------------


class HostWorker:
    """A prefork worker of this module's app with ``lease_metrics_port=port`` (a str, as from
    the environment), its own broker and store under ``directory``, and ``TMPDIR=tmp``."""

    def __init__(self, directory: Path, port: str, tmp: Path) -> None:
        pytest.importorskip("prometheus_client")
        directory.mkdir()
        self.directory = directory
        self.worker = CeleryWorker(
            "tests.integration.test_metrics_worker:app",
            directory / "worker.log",
            pool="prefork",
            concurrency=1,
            name=f"mw-{uuid.uuid4().hex[:6]}",
            env={"MW_DIR": str(directory), "MW_MODE": "setting", "MW_PORT": port,
                 "TMPDIR": str(tmp)},
            unset=["PROMETHEUS_MULTIPROC_DIR"],
        )  # fmt: skip
        self.client = make_app(str(directory))

    def text(self) -> str:
        return self.worker.text()

    def runs_a_task(self) -> None:
        run = f"t{uuid.uuid4().hex[:8]}"
        assert self.client.send_task("mw.work", (run,)).get(timeout=RESULT_TIMEOUT) == run

    def served_port(self) -> int:
        match = re.search(r"metrics of .* on http://[\d.]+:(\d+)/metrics", self.text())
        assert match is not None, f"no metrics line in the log:\n{self.text()[-3000:]}"
        return int(match.group(1))

    def stop(self) -> None:
        self.worker.stop()
        self.client.close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Callable[..., HostWorker]]:
    """``host(port, tmp=None)`` -> a started HostWorker (stopped at teardown); ``tmp``: its
    TMPDIR (default: one shared by every worker of the test)."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    started: list[HostWorker] = []

    def _start(port: str, tmp: Path | None = None) -> HostWorker:
        worker = HostWorker(tmp_path / f"w{len(started)}", port, tmp or shared)
        started.append(worker)
        return worker

    yield _start
    running = [w for w in started if w.worker.process.poll() is None]
    for worker in running:  # all at once: their warm shutdowns overlap
        worker.worker.process.send_signal(signal.SIGTERM)
    for worker in running:
        try:
            worker.worker.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(worker.worker.process.pid, signal.SIGKILL)
            worker.worker.process.wait()
    for worker in started:
        worker.stop()  # nothing left to stop: closes the client


def free_ports(count: int) -> range:
    """``count`` consecutive TCP ports free on every interface right now."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("0.0.0.0", 0))
            first = int(probe.getsockname()[1])
        ports = range(first, first + count)
        if ports[-1] <= 65535 and all(_free(port) for port in ports):
            return ports
    raise AssertionError(f"no {count} consecutive free ports found")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _group_alive(pgid: int) -> list[int]:
    """Pids of the processes of group ``pgid`` that are not zombies (they closed their files)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _wait_group_gone(pgid: int) -> None:
    deadline = time.monotonic() + RESULT_TIMEOUT
    while _group_alive(pgid):
        assert time.monotonic() < deadline, f"group {pgid} still alive: {_group_alive(pgid)}"
        time.sleep(POLL)


def metrics_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("celery-lease-metrics-*"))


def test_a_second_worker_on_a_taken_port_runs_tasks_with_one_error_line(
    host: Callable[..., HostWorker],
) -> None:
    """Two workers, one ``lease_metrics_port``: the second logs ONE error naming the setting (no
    traceback), runs tasks without metrics; the first serves its metrics on."""
    port = free_ports(1)[0]
    first = host(str(port))
    first.worker.wait_ready(START_TIMEOUT, POLL)
    assert first.served_port() == port
    second = host(str(port))
    second.worker.wait_ready(START_TIMEOUT, POLL)
    second.runs_a_task()
    text = second.text()
    errors = [line for line in text.splitlines() if "ERROR" in line or "CRITICAL" in line]
    assert len(errors) == 1, text
    assert f"lease_metrics_port={port}" in errors[0], errors[0]
    assert "without metrics" in errors[0], errors[0]
    assert "Traceback" not in text, text
    assert "metrics of" not in text, text
    first.runs_a_task()
    assert "celery_lease_acquired_total" in scrape(first.worker.log)


def test_workers_given_a_range_serve_on_the_first_free_ports_of_it(
    host: Callable[..., HostWorker], tmp_path: Path
) -> None:
    """``lease_metrics_port="A-B"``: each worker takes the first port of the range that is free
    and logs it; both serve their own metrics; neither removes the other's directory."""
    ports = free_ports(3)
    first = host(f"{ports[0]}-{ports[-1]}")
    first.worker.wait_ready(START_TIMEOUT, POLL)
    second = host(f"{ports[0]}-{ports[-1]}")
    second.worker.wait_ready(START_TIMEOUT, POLL)
    # The first free ones, in order (a port of the range taken meanwhile by another program
    # on the host only moves both on).
    assert first.served_port() in ports and second.served_port() in ports
    assert first.served_port() < second.served_port()
    first.runs_a_task()
    second.runs_a_task()
    for worker in (first, second):
        text = scrape(worker.worker.log)
        assert sample(text, "celery_lease_acquired_total", 'task="mw.work"') == 1, text
        assert "ERROR" not in worker.text(), worker.text()
    assert len(metrics_dirs(tmp_path / "tmp")) == 2


def test_a_killed_workers_metrics_directory_is_removed_at_the_next_start(
    host: Callable[..., HostWorker], tmp_path: Path
) -> None:
    """A worker SIGKILLed (its whole process group) leaves its multiprocess directory; the next
    worker started with the same TMPDIR removes it, and keeps its own."""
    killed = host("0")
    killed.worker.wait_ready(START_TIMEOUT, POLL)
    killed.runs_a_task()
    left = metrics_dirs(tmp_path / "tmp")
    assert len(left) == 1
    os.killpg(killed.worker.process.pid, signal.SIGKILL)
    killed.worker.process.wait(RESULT_TIMEOUT)
    _wait_group_gone(killed.worker.process.pid)  # the pool children too (they hold the lock)
    assert metrics_dirs(tmp_path / "tmp") == left  # nothing removed it
    after = host("0")
    after.worker.wait_ready(START_TIMEOUT, POLL)
    now = metrics_dirs(tmp_path / "tmp")
    assert left[0] not in now, now
    assert len(now) == 1, now
    after.runs_a_task()
