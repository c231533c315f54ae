"""What a prefork worker's main process does when a pool child dies: gauges and unique keys.

A real ``celery worker -P prefork -c 2`` of the app below (``-A`` this module, configured from
``KC_*`` environment variables) on a throwaway ``redis-server`` (broker, results and lock store),
with Prometheus metrics (``celery_lease.metrics.install(app, port=0)``) scraped over HTTP from
the worker's main process, as Prometheus would.

- ``celery_lease_held`` is the number of leases held: 0 again after a SIGKILLed child's lease
  was released by the main process (which never counted that lease as held), and after
  superseded debounce copies ended without their body.
- Renewals of a unique copy's queued key are counted under the copy's task, never under a
  ``task="unknown"`` series.
- A SIGKILLed child's ``lock_unique="until_done"`` copy, which Celery marks FAILURE
  (WorkerLostError), frees its ``queued:`` key together with its run lease, so a new call
  enqueues a new copy at once; a copy that Celery requeues (``acks_late`` with
  ``reject_on_worker_lost``) keeps it: it runs again.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError, WorkerLostError

from celery_lease import LockedTask, store_from_url
from celery_lease.stores.base import SupportsInspection
from tests.fixtures_redis import RedisServer
from tests.integration.workers import CeleryWorker
from tests.support import complete_lines, service_missing

pytestmark = [pytest.mark.worker, pytest.mark.slow]

READY_TIMEOUT = 60.0  # seconds for a worker to log "ready." on a loaded machine
TIMEOUT = 30.0  # seconds a test waits for a marker file, a key, a result or a sample
FREED_BOUND = 5.0  # seconds: a dead child's keys (ttl 30 s) go well within this
POLL = 0.02
WAIT = 60.0  # seconds a body waits for the test at most


# The app the worker runs -----------------------------------------------------------------------


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _attempt(out: Path, run: str) -> int:
    """Record an attempt of ``run`` (this pid); the number of attempts so far."""
    path = out / f"held-{run}"
    with open(path, "a") as handle:
        handle.write(f"{os.getpid()}\n")
    return len(path.read_text().splitlines())


def make_app(broker: str, directory: str, queue: str) -> Celery:
    """The test app: the worker (from the environment) and the test process build it alike."""
    app = Celery("kc", broker=broker, backend=broker, set_as_current=False)
    out = Path(directory)
    app.conf.update(
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        # A throwaway redis-server started by this session: no restart grace (see docs/stores.md).
        lease_restart_grace=0,
    )

    @app.task(name="kc.hold", base=LockedTask, lock_key="kc:{run}", lock_ttl="30s", shared=False)
    def hold(run: str) -> None:
        """Hold the key until killed."""
        _attempt(out, run)
        _wait_for(out / f"go-{run}")

    @app.task(
        name="kc.unique", base=LockedTask, lock_key="kcu:{run}", lock_ttl="30s",
        lock_unique="until_done", shared=False,
    )  # fmt: skip
    def unique(run: str) -> None:
        """An until_done copy holding its run lease and its queued key until killed."""
        _attempt(out, run)
        _wait_for(out / f"go-{run}")

    @app.task(
        name="kc.requeued", base=LockedTask, lock_key="kcr:{run}", lock_ttl="30s",
        lock_unique="until_done", acks_late=True, reject_on_worker_lost=True, shared=False,
    )  # fmt: skip
    def requeued(run: str) -> int:
        """As kc.unique, but Celery requeues it when its child dies: it runs again."""
        attempts = _attempt(out, run)
        _wait_for(out / f"go-{run}")
        return attempts

    @app.task(
        name="kc.debounced", base=LockedTask, lock_key="kcd:{run}", lock_unique="while_queued",
        lock_debounce="0.3s", lock_wait="10s", shared=False,
    )  # fmt: skip
    def debounced(run: str, n: int) -> int:
        """Copies due at once may meet at the run lease (a superseded one holds it while it
        reads its tombstone): the winner waits for it."""
        return n

    @app.task(
        name="kc.renewing", base=LockedTask, lock_key="kcn:{run}", lock_ttl="0.6s",
        lock_unique="until_done", shared=False,
    )  # fmt: skip
    def renewing(run: str) -> None:
        """Both keys renewed every 0.2 s until the test says go."""
        _attempt(out, run)
        _wait_for(out / f"go-{run}")

    return app


if os.environ.get("KC_BROKER"):
    app = make_app(os.environ["KC_BROKER"], os.environ["KC_DIR"], os.environ["KC_QUEUE"])
    import celery_lease.metrics

    celery_lease.metrics.install(app, port=0, addr="127.0.0.1")


# The harness -----------------------------------------------------------------------------------


@dataclass
class Worker:
    app: Celery
    store: Any
    directory: Path
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def attempts(self, run: str, count: int = 1) -> list[int]:
        """Wait until ``run`` made ``count`` attempts; the pids that made them."""
        path = self.directory / f"held-{run}"
        deadline = time.monotonic() + TIMEOUT
        while True:
            pids = [int(x) for x in complete_lines(path)]
            if len(pids) >= count:
                return pids
            assert self.process.poll() is None, f"worker exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{run}: {pids}; log:\n{self.tail()}"
            time.sleep(POLL)

    def go(self, run: str) -> None:
        (self.directory / f"go-{run}").write_text("")

    def freed_within(self, key: str, bound: float) -> None:
        start = time.monotonic()
        while self.store.get(key) is not None:
            assert time.monotonic() - start < bound, f"{key} still held; log:\n{self.tail()}"
            time.sleep(POLL)

    def scrape(self) -> str:
        match = re.search(r"metrics of .* on http://([\d.]+):(\d+)/metrics", self.log.read_text())
        assert match is not None, f"no metrics line in the log:\n{self.tail()}"
        url = f"http://{match.group(1)}:{match.group(2)}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    def sample_until(self, name: str, labels: str, accept: Any) -> str:
        """Scrape until ``accept(value)`` holds for the sample; the last scrape."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            text = self.scrape()
            if accept(sample(text, name, labels)):
                return text
            assert time.monotonic() < deadline, f"{name}{{{labels}}}:\n{text}"
            time.sleep(0.1)


def sample(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One prefork worker (-c 2) of this module's app, for the module."""
    if importlib.util.find_spec("prometheus_client") is None:
        service_missing("prometheus_client", "pip install 'celery-lease[prometheus]'")
    directory = tmp_path_factory.mktemp("killed-child")
    broker = f"redis://127.0.0.1:{redis_server.port}/14"
    queue = f"kc-{uuid.uuid4().hex[:6]}"
    started = CeleryWorker(
        f"{__name__}:app",
        directory / "worker.log",
        pool="prefork",
        concurrency=2,
        name=f"kc-{uuid.uuid4().hex[:6]}",
        env={"KC_BROKER": broker, "KC_DIR": str(directory), "KC_QUEUE": queue},
        unset=["PROMETHEUS_MULTIPROC_DIR"],
    )
    client = make_app(broker, str(directory), queue)
    store = store_from_url(broker)
    assert isinstance(store, SupportsInspection)
    running = Worker(client, store, directory, started.process, started.log)
    try:
        started.wait_ready(READY_TIMEOUT)
        yield running
    finally:
        for marker in directory.glob("held-*"):
            (directory / marker.name.replace("held-", "go-", 1)).write_text("")
        started.stop()
        client.close()


def run_id() -> str:
    return "r" + uuid.uuid4().hex[:10]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


# The tests -------------------------------------------------------------------------------------


class TestHeldGauge:
    def test_is_zero_after_a_killed_childs_lease_was_released_by_the_main_process(
        self, worker: Worker
    ) -> None:
        """The child counted the lease as held and died; the main process released it (and
        counts the release), but it never counted the lease as held: the gauge is 0, not -1."""
        run = run_id()
        worker.app.send_task("kc.hold", (run,))
        (pid,) = worker.attempts(run)
        worker.sample_until("celery_lease_held", 'task="kc.hold"', lambda v: v == 1)
        kill(pid)
        worker.freed_within(f"kc:{run}", FREED_BOUND)
        text = worker.sample_until(
            "celery_lease_released_total", 'task="kc.hold"', lambda v: v >= 1
        )
        assert sample(text, "celery_lease_held", 'task="kc.hold"') == 0, text
        assert sample(text, "celery_lease_acquired_total", 'task="kc.hold"') == 1, text

    def test_is_zero_after_superseded_debounce_copies(self, worker: Worker) -> None:
        """Three debounced calls: two copies are superseded (they end at the worker without
        their body), one runs. Acquired once, released once, nothing held."""
        run = run_id()
        task = worker.app.tasks["kc.debounced"]
        results = [task.delay(run, n) for n in (1, 2, 3)]
        assert results[-1].get(timeout=TIMEOUT) == 3
        for old in results[:-1]:
            with pytest.raises(TaskRevokedError, match="superseded"):
                old.get(timeout=TIMEOUT)
        text = worker.scrape()
        assert sample(text, "celery_lease_held", 'task="kc.debounced"') == 0, text
        assert sample(text, "celery_lease_acquired_total", 'task="kc.debounced"') == 1, text
        assert sample(text, "celery_lease_released_total", 'task="kc.debounced"') == 1, text


class TestRenewals:
    def test_a_unique_copys_renewals_are_counted_under_its_task(self, worker: Worker) -> None:
        """An until_done copy renews its run lease and its queued key: every renewal is in the
        copy's task series, none in a ``task="unknown"`` one."""
        run = run_id()
        result = worker.app.tasks["kc.renewing"].delay(run)
        worker.attempts(run)
        labels = 'task="kc.renewing"'
        worker.sample_until("celery_lease_renewal_seconds_count", labels, lambda v: v >= 6)
        worker.go(run)
        result.get(timeout=TIMEOUT)
        text = worker.scrape()
        unknown = [x for x in text.splitlines() if 'task="unknown"' in x]
        assert unknown == [], unknown


class TestQueuedKeyOfAKilledCopy:
    def test_is_freed_with_its_run_lease(self, worker: Worker) -> None:
        """The copy is FAILURE (WorkerLostError): its queued key goes with its run lease, and a
        new call enqueues a new copy at once."""
        run = run_id()
        task = worker.app.tasks["kc.unique"]
        copy = task.delay(run)
        (pid,) = worker.attempts(run)
        assert worker.store.get(f"queued:kcu:{run}") is not None
        kill(pid)
        worker.freed_within(f"kcu:{run}", FREED_BOUND)
        worker.freed_within(f"queued:kcu:{run}", FREED_BOUND)
        with pytest.raises(WorkerLostError):
            copy.get(timeout=TIMEOUT)
        again = task.apply_async((run,), queue=f"idle-{run}")  # nobody consumes it
        assert again.id != copy.id

    def test_is_kept_when_the_copy_is_requeued(self, worker: Worker) -> None:
        """``acks_late`` + ``reject_on_worker_lost``: Celery requeues the copy, which runs again
        under the same id and keeps its queued key, so a call meanwhile is its duplicate."""
        run = run_id()
        task = worker.app.tasks["kc.requeued"]
        copy = task.delay(run)
        (pid,) = worker.attempts(run)
        kill(pid)
        worker.attempts(run, 2)  # redelivered, running again
        assert worker.store.get(f"queued:kcr:{run}") is not None
        assert task.apply_async((run,), queue=f"idle-{run}").id == copy.id
        worker.go(run)
        assert copy.get(timeout=TIMEOUT) == 2
        worker.freed_within(f"queued:kcr:{run}", FREED_BOUND)
