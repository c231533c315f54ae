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
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_lease import LockedTask
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.integration.workers import CeleryWorker, filesystem_app
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
        app.conf.lease_metrics_port = 0
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
