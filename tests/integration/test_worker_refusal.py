"""Real ``celery worker`` processes refuse a configuration under which the lock cannot exclude.

- A process-local store (``MemoryLockStore()`` or ``memory://``, as the app's ``lease_store``
  or a task's ``lock_store``) on a worker that runs tasks in several processes (prefork -c 2):
  each pool process has its own memory, so two bodies of one key ran at the same moment.
- A misspelled setting (``lease_stor``): ignored by Celery, so the task used another store.

The worker must exit non-zero at start-up with the message, before it consumes anything; a
worker that runs tasks in one process (prefork -c 1, solo, threads) keeps the memory store.

The worker app is defined below and configured from ``LR_*`` environment variables (the worker
imports this module as ``-A tests.integration.test_worker_refusal:app``); the broker is the
multi-process-safe filesystem transport of ``example_project.transport``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LockedTask, MemoryLockStore
from tests.integration.conftest import assert_no_overlap
from tests.integration.workers import CeleryWorker, filesystem_app

pytestmark = [pytest.mark.worker]

START_TIMEOUT = 40.0  # seconds for a worker to log "ready." or to exit (a loaded machine)
RESULT_TIMEOUT = 30.0
POLL = 0.05


def make_app(
    directory: str, store: str, typo: bool = False, task_store: str = "", extra: str = ""
) -> Celery:
    """The app the worker runs and the test sends from (built alike by both).

    Args:
        directory: broker folder, results and interval files live here.
        store: ``"instance"`` (a ``MemoryLockStore()``) or a store URL for ``lease_store``.
        typo: configure ``lease_stor`` (misspelled) instead of ``lease_store``.
        task_store: ``lock_store`` of the task ``lr.own_store`` (``""``: none).
        extra: comma-separated names of other settings to set (other libraries' settings).
    """
    app = filesystem_app("lr", directory, POLL)
    app.conf.update(worker_prefetch_multiplier=1)
    value: object = MemoryLockStore() if store == "instance" else store
    app.conf["lease_stor" if typo else "lease_store"] = value
    for name in filter(None, extra.split(",")):
        app.conf[name] = "x"
    out = Path(directory)

    def body(run: str, hold: float) -> str:
        start = time.time()
        time.sleep(hold)
        with open(out / f"intervals-{run}", "a") as handle:
            handle.write(f"{start} {time.time()}\n")
        return "ran"

    @app.task(name="lr.hold", base=LockedTask, lock_key="hold:{run}", lock_wait="20s", shared=False)
    def hold(run: str, hold: float) -> str:
        return body(run, hold)

    if task_store:

        @app.task(
            name="lr.own_store", base=LockedTask, lock_key="own:{run}", lock_store=task_store,
            lock_wait="20s", shared=False,
        )  # fmt: skip
        def own_store(run: str, hold: float) -> str:
            return body(run, hold)

    return app


if os.environ.get("LR_DIR"):
    app = make_app(
        os.environ["LR_DIR"],
        os.environ["LR_STORE"],
        os.environ.get("LR_TYPO") == "1",
        os.environ.get("LR_TASK_STORE", ""),
        os.environ.get("LR_EXTRA", ""),
    )


class Worker:
    """A ``celery worker`` subprocess of :func:`make_app` and a client app configured alike."""

    def __init__(
        self,
        directory: Path,
        pool: str,
        concurrency: int,
        store: str,
        typo: bool,
        task_store: str,
        extra: str = "",
    ) -> None:
        self.directory = directory
        self.client = make_app(str(directory), store, typo, task_store, extra)
        self.log = directory / "worker.log"
        self.worker = CeleryWorker(
            "tests.integration.test_worker_refusal:app",
            self.log,
            pool=pool,
            concurrency=concurrency,
            name=f"lr-{uuid.uuid4().hex[:6]}",
            env={
                "LR_DIR": str(directory),
                "LR_STORE": store,
                "LR_TYPO": "1" if typo else "0",
                "LR_TASK_STORE": task_store,
                "LR_EXTRA": extra,
            },
        )
        self.process = self.worker.process

    def text(self) -> str:
        return self.worker.text()

    def wait_ready_or_exit(self) -> bool:
        """True once the worker logged ``ready.``; False once it exited (polling, deadline)."""
        return self.worker.ready_or_exited(START_TIMEOUT, POLL)

    def run_two(self, task: str) -> list[tuple[float, float]]:
        """Send two 1 s bodies of one key at once; their recorded (start, end) intervals."""
        run = "r" + uuid.uuid4().hex[:8]
        results = [self.client.send_task(task, (run, 1.0)) for _ in range(2)]
        for result in results:
            assert result.get(timeout=RESULT_TIMEOUT, interval=POLL) == "ran"
        path = self.directory / f"intervals-{run}"
        pairs = [tuple(map(float, line.split())) for line in path.read_text().splitlines()]
        return sorted((a, b) for a, b in pairs)

    def stop(self) -> None:
        self.worker.stop()
        self.client.close()


StartWorker = Callable[..., Worker]
"""``start(pool, concurrency, store, typo=False, task_store="", extra="")`` -> a started Worker."""


@pytest.fixture
def start(tmp_path: Path) -> Iterator[StartWorker]:
    """``start(pool, concurrency, store, typo=False, task_store="", extra="")`` -> a Worker."""
    started: list[Worker] = []

    def _start(
        pool: str,
        concurrency: int,
        store: str,
        typo: bool = False,
        task_store: str = "",
        extra: str = "",
    ) -> Worker:
        directory = tmp_path / f"w{len(started)}"
        directory.mkdir()
        worker = Worker(directory, pool, concurrency, store, typo, task_store, extra)
        started.append(worker)
        return worker

    yield _start
    for worker in started:
        worker.stop()


def _assert_refused(worker: Worker, task: str, *fragments: str) -> None:
    if worker.wait_ready_or_exit():
        spans = worker.run_two(task)  # the danger itself, for the failure message
        raise AssertionError(f"worker started and ran two bodies of one key at {spans}")
    text = worker.text()
    assert worker.process.returncode != 0, text
    assert "LeaseConfigError" in text, text
    for fragment in fragments:
        assert fragment in text, text
    assert "ready." not in text


class TestRefusedAtStart:
    @pytest.mark.parametrize("store", ["instance", "memory://"])
    def test_memory_lease_store_on_prefork_c2(self, start: StartWorker, store: str) -> None:
        """lease_store in memory on prefork -c 2: the worker exits 1 naming the problem."""
        worker = start("prefork", 2, store)
        _assert_refused(worker, "lr.hold", "lease_store", "2 processes", "prefork")

    def test_memory_task_store_on_prefork_c2(self, start: StartWorker, tmp_path: Path) -> None:
        """A task's lock_store="memory://" on prefork -c 2 is refused, naming the task."""
        worker = start("prefork", 2, f"sqlite:///{tmp_path / 'shared.db'}", task_store="memory://")
        _assert_refused(worker, "lr.own_store", "'lr.own_store'", "lock_store")

    def test_misspelled_setting(self, start: StartWorker, tmp_path: Path) -> None:
        """lease_stor (a typo) stops the worker, naming lease_store."""
        worker = start("solo", 1, f"sqlite:///{tmp_path / 'meant.db'}", typo=True)
        _assert_refused(worker, "lr.hold", "'lease_stor'", "did you mean 'lease_store'?")


class TestAcceptedInOneProcess:
    @pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 1), ("solo", 1), ("threads", 2)])
    def test_memory_store_excludes_in_one_process(
        self, start: StartWorker, pool: str, concurrency: int
    ) -> None:
        """One process runs the tasks: the worker starts and two bodies of a key never overlap."""
        worker = start(pool, concurrency, "instance")
        assert worker.wait_ready_or_exit(), worker.text()
        assert_no_overlap(worker.run_two("lr.hold"))
        assert "process-local" in worker.text()  # the warning about other worker processes


class TestOtherLibrariesSettings:
    def test_worker_with_other_libraries_settings_starts(
        self, start: StartWorker, tmp_path: Path
    ) -> None:
        """Settings of other libraries that share words with ours do not stop the worker.

        Each of these is close to a lease setting by spelling alone; taken for "a misspelled
        lease setting", it would make the worker exit 1.
        """
        extra = "CACHE_KEY_PREFIX,redis_key_prefix,REDIS_DEFAULT_TTL,default_wait,release_store"
        worker = start("solo", 1, f"sqlite:///{tmp_path / 'shared.db'}", extra=extra)
        assert worker.wait_ready_or_exit(), worker.text()
        assert_no_overlap(worker.run_two("lr.hold"))
