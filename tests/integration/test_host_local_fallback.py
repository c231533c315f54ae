"""A worker whose lease store falls back to the host-local SQLite file says so before ``ready.``.

``lease_store`` unset and a RabbitMQ broker: the app's leases go to an SQLite file of this host,
which excludes nothing across hosts. The worker's main process logs one WARNING while it is built,
before ``ready.``, not a pool process at the first locked task; with
``lease_require_shared_store = True`` the worker refuses to start, naming the setting.

Real ``celery worker`` subprocesses (prefork -c 2) on the shared RabbitMQ, each with a TMPDIR of
its own (where the fallback file goes) and a queue of its own.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LockedTask
from tests.integration.workers import CeleryWorker
from tests.support import service_missing

pytestmark = [pytest.mark.worker]

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
START_TIMEOUT = 60.0  # seconds for a worker to log "ready." or to exit (a loaded machine)
WARNING = "excludes only workers on this host"


def make_app(queue: str, require: bool) -> Celery:
    """The worker's app: RabbitMQ, no result backend, no ``lease_store``, one locked task."""
    app = Celery("hl", broker=RABBITMQ, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        worker_enable_remote_control=False,
        broker_connection_retry_on_startup=True,
    )
    if require:
        app.conf.lease_require_shared_store = True

    @app.task(name="hl.locked", base=LockedTask, lock_key="hl:{run}", shared=False)
    def locked(run: str) -> str:
        return run

    return app


if os.environ.get("HL_QUEUE"):
    app = make_app(os.environ["HL_QUEUE"], os.environ.get("HL_REQUIRE") == "1")


@pytest.fixture
def rabbitmq() -> None:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        service_missing("RabbitMQ on 127.0.0.1:5672", "apt-get install -y rabbitmq-server")


def start(tmp_path: Path, require: bool) -> tuple[CeleryWorker, Path]:
    scratch = Path(tempfile.mkdtemp(prefix="hl-"))
    worker = CeleryWorker(
        f"{__name__}:app",
        tmp_path / "worker.log",
        pool="prefork",
        concurrency=2,
        name=f"hl-{uuid.uuid4().hex[:6]}",
        env={
            "HL_QUEUE": f"hl-{uuid.uuid4().hex}",
            "HL_REQUIRE": "1" if require else "0",
            "TMPDIR": str(scratch),
        },
    )
    return worker, scratch


@pytest.mark.usefixtures("rabbitmq")
class TestHostLocalFallback:
    def test_the_main_process_warns_before_ready(self, tmp_path: Path) -> None:
        """One WARNING from the main process, logged before ``ready.``, naming the file and
        ``lease_store``; no pool process repeats it."""
        worker, scratch = start(tmp_path, require=False)
        try:
            assert worker.ready_or_exited(START_TIMEOUT), worker.text()
            text = worker.text()
        finally:
            worker.stop()
            shutil.rmtree(scratch, ignore_errors=True)
        before_ready = text[: text.index("ready.")]
        warned = [line for line in text.splitlines() if WARNING in line]
        assert len(warned) == 1, text
        assert warned[0] in before_ready, text
        assert "WARNING/MainProcess" in warned[0], text
        assert str(scratch) in warned[0] and "lease_store" in warned[0], text

    def test_requiring_a_shared_store_refuses_the_worker(self, tmp_path: Path) -> None:
        """``lease_require_shared_store = True``: the worker exits before ``ready.``, saying why
        and naming the setting."""
        worker, scratch = start(tmp_path, require=True)
        try:
            assert not worker.ready_or_exited(START_TIMEOUT), worker.text()
            text = worker.text()
        finally:
            worker.stop()
            shutil.rmtree(scratch, ignore_errors=True)
        assert worker.process.returncode != 0
        assert "lease_require_shared_store" in text and WARNING in text, text
