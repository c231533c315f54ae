"""A worker checks at start what would otherwise fail every locked task later.

- Its lock store must answer one round trip: a wrong URL (a port nobody listens on, a unix
  socket path that does not exist) refuses the worker, naming the setting and the URL with its
  password masked; ``lease_store_check = "warn"`` starts it anyway and says so loudly.
- Its metrics port is taken (by another process on the host): the worker starts anyway, with
  one ERROR line naming the setting and the port, and makes nothing for metrics.

Real ``celery worker`` subprocesses (prefork -c 1) of the app defined below (configured from
``SC_*`` environment variables) on the multi-process-safe filesystem transport of
``example_project.transport``; each worker gets a TMPDIR of its own, so what it leaves there is
the test's to see.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LockedTask
from tests.integration.workers import CeleryWorker, filesystem_app
from tests.support import free_port, service_missing

pytestmark = [pytest.mark.worker]

START_TIMEOUT = 60.0  # seconds for a worker to log "ready." or to exit (a loaded machine)
POLL = 0.05
PASSWORD = "s3cret-pw"


def make_app(directory: str, store: str, extra: dict[str, object]) -> Celery:
    """The app the worker runs: filesystem broker and results, ``lease_store=store``."""
    app = filesystem_app("sc", directory, POLL)
    app.conf.update(lease_store=store, **extra)

    @app.task(name="sc.locked", base=LockedTask, lock_key="sc:{run}", shared=False)
    def locked(run: str) -> str:
        return run

    return app


def _extra_from_env() -> dict[str, object]:
    extra: dict[str, object] = {}
    if os.environ.get("SC_METRICS_PORT"):
        extra["lease_metrics"] = "prometheus"
        extra["lease_metrics_port"] = int(os.environ["SC_METRICS_PORT"])
    if os.environ.get("SC_STORE_CHECK"):
        extra["lease_store_check"] = os.environ["SC_STORE_CHECK"]
    return extra


if os.environ.get("SC_DIR"):
    app = make_app(os.environ["SC_DIR"], os.environ["SC_STORE"], _extra_from_env())


class Worker:
    """A ``celery worker`` subprocess of this module's app, with a TMPDIR of its own."""

    def __init__(self, directory: Path, store: str, env: dict[str, str]) -> None:
        self.directory = directory
        # Short: a unix socket path under it must stay within 107 bytes.
        self.tmp = Path(tempfile.mkdtemp(prefix="sc-"))
        self.log = directory / "worker.log"
        self.worker = CeleryWorker(
            f"{__name__}:app",
            self.log,
            pool="prefork",
            concurrency=1,
            name=f"sc-{uuid.uuid4().hex[:6]}",
            env={"SC_DIR": str(directory), "SC_STORE": store, **env, "TMPDIR": str(self.tmp)},
            unset=["PROMETHEUS_MULTIPROC_DIR"],
        )
        self.process = self.worker.process

    def text(self) -> str:
        return self.worker.text()

    def ready_or_exited(self) -> bool:
        """True once the worker logged ``ready.``; False once it exited (polling, deadline)."""
        return self.worker.ready_or_exited(START_TIMEOUT, POLL)

    def left_behind(self) -> list[str]:
        """What celery-lease left in the worker's TMPDIR (billiard's pymp-* is not ours)."""
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("celery-lease"))

    def stop(self) -> None:
        self.worker.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


Start = Callable[..., Worker]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """``start(store, **env)`` -> a started Worker (stopped at teardown)."""
    started: list[Worker] = []

    def _start(store: str, **env: str) -> Worker:
        directory = tmp_path / f"w{len(started)}"
        directory.mkdir()
        worker = Worker(directory, store, env)
        started.append(worker)
        return worker

    yield _start
    for worker in started:
        worker.stop()


def assert_refused(worker: Worker, *fragments: str) -> str:
    """The worker exited non-zero before ``ready.``, its log naming every fragment."""
    started = worker.ready_or_exited()
    text = worker.text()
    assert not started, f"the worker started:\n{text}"
    assert worker.process.returncode != 0, text
    assert "ready." not in text
    for fragment in fragments:
        assert fragment in text, text
    return text


class TestStoreAtStart:
    @pytest.mark.parametrize("kind", ["closed-port", "missing-socket"])
    def test_a_store_that_does_not_answer_refuses_the_worker(
        self, start: Start, tmp_path: Path, kind: str
    ) -> None:
        """A wrong ``lease_store`` URL (a port nobody listens on, a socket path that does not
        exist): the worker exits 1 before ``ready.``, naming ``lease_store`` and the URL with its
        password masked; nothing is left in its TMPDIR."""
        if kind == "closed-port":
            port = free_port()
            url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
            shown = f"redis://:***@127.0.0.1:{port}/0"
        else:
            url = shown = f"unix://{tmp_path}/missing/redis.sock?db=0"
        worker = start(url)
        text = assert_refused(worker, "LeaseConfigError", "lease_store", shown)
        assert PASSWORD not in text
        assert worker.left_behind() == []

    def test_lease_store_check_warn_starts_the_worker_and_says_so(
        self, start: Start, tmp_path: Path
    ) -> None:
        """``lease_store_check = "warn"``: a store that does not answer at start (down during a
        deploy) is logged at ERROR with its masked URL, and the worker starts."""
        port = free_port()
        worker = start(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", SC_STORE_CHECK="warn")
        assert worker.ready_or_exited(), worker.text()
        text = worker.text()
        assert f"redis://:***@127.0.0.1:{port}/0" in text, text
        assert "ERROR/MainProcess" in text, text
        assert PASSWORD not in text


class TestMetricsPort:
    def test_a_taken_metrics_port_starts_the_worker_without_metrics(
        self, start: Start, tmp_path: Path
    ) -> None:
        """``lease_metrics_port`` already taken by another process: the worker logs one ERROR
        line naming the setting and the port (no raw ``OSError``, no traceback), gets ready,
        and makes no metrics directory."""
        if importlib.util.find_spec("prometheus_client") is None:
            service_missing("prometheus_client", "pip install 'celery-lease[prometheus]'")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("0.0.0.0", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            worker = start(f"sqlite:///{tmp_path / 'leases.db'}", SC_METRICS_PORT=str(port))
            assert worker.ready_or_exited(), worker.text()
        text = worker.text()
        assert "OSError" not in text and "Traceback" not in text, text
        errors = [x for x in text.splitlines() if "ERROR/" in x or "CRITICAL/" in x]
        assert len(errors) == 1, text
        assert f"lease_metrics_port={port}" in errors[0] and "in use" in errors[0], errors[0]
        assert [x for x in worker.left_behind() if x.startswith("celery-lease-metrics-")] == []
