"""The Celery app of the unique-at-enqueue integration tests (``test_unique_workers.py``).

Configured from ``UQ_BROKER``, ``UQ_BACKEND`` and ``UQ_DIR`` (the lock store is the broker's
Redis, or ``UQ_STORE``); the test process builds the same app as a client with
:func:`make_app`. Bodies record what they did as files in ``UQ_DIR``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.schedules import schedule

from celery_lease import LockedTask

POLL = 0.02  # seconds between checks of a marker file
WAIT = 20.0  # seconds a body waits for the test at most


def _wait_file(path: Path) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(POLL)


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def make_app(broker: str, backend: str, directory: str, store: str = "") -> Celery:
    """Build the test app; the worker and the test process build it alike."""
    app = Celery("uq", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        lease_store=store,
        # A throwaway redis-server started by this session: no restart grace (see docs/stores.md).
        lease_restart_grace=0,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        task_default_queue="uq",
    )
    if broker.startswith("filesystem"):
        folder = os.path.join(directory, "broker")
        os.makedirs(folder, exist_ok=True)
        app.conf.broker_transport = "example_project.transport:FilesystemTransport"
        app.conf.broker_transport_options = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": os.path.join(folder, "control"),
            "polling_interval": 0.05,
        }
    out = Path(directory)

    def record(run: str, n: Any, gate: bool) -> Any:
        _append(out / f"calls-{run}", repr(n))
        if gate:
            _append(out / f"started-{run}", str(os.getpid()))
            _wait_file(out / f"go-{run}")
        return n

    @app.task(
        name="uq.until_done", base=LockedTask, lock_key="ud:{run}", lock_unique="until_done",
        shared=False,
    )  # fmt: skip
    def until_done(run: str, n: Any = 0, gate: bool = False) -> Any:
        return record(run, n, gate)

    @app.task(
        name="uq.while_queued", base=LockedTask, lock_key="wq:{run}",
        lock_unique="while_queued", shared=False,
    )  # fmt: skip
    def while_queued(run: str, n: Any = 0, gate: bool = False) -> Any:
        return record(run, n, gate)

    @app.task(
        name="uq.debounced", base=LockedTask, lock_key="db:{run}", lock_unique="while_queued",
        lock_debounce="1s", shared=False,
    )  # fmt: skip
    def debounced(run: str, n: Any = 0) -> Any:
        return record(run, n, False)

    @app.task(
        name="uq.burst", base=LockedTask, lock_key="bu:{run}", lock_unique="while_queued",
        lock_debounce="0.3s", shared=False,
    )  # fmt: skip
    def burst(run: str, n: Any = 0) -> Any:
        return record(run, n, False)

    @app.task(name="uq.errback", shared=False)
    def errback(request: Any, exc: Any, traceback: Any, run: str) -> None:
        _append(out / f"errback-{run}", str(request.id))

    @app.task(
        name="uq.short", base=LockedTask, lock_key="sh:{run}", lock_unique="until_done",
        lock_queue_ttl="2s", shared=False,
    )  # fmt: skip
    def short(run: str, gate: bool = False) -> str:
        _append(out / f"calls-{run}", "short")
        if gate:
            _append(out / f"started-{run}", str(os.getpid()))
            _wait_file(out / f"go-{run}")
        return "short"

    @app.task(
        name="uq.brief", base=LockedTask, lock_key="br:{run}", lock_unique="until_done",
        lock_ttl="2s", lock_queue_ttl="3s", shared=False,
    )  # fmt: skip
    def brief(run: str, n: Any = 0, gate: bool = False) -> Any:
        return record(run, n, gate)

    @app.task(
        name="uq.tick", base=LockedTask, lock_key="tk:{run}", lock_unique="until_done",
        lock_queue_ttl="0.6s", shared=False,
    )  # fmt: skip
    def tick(run: str) -> str:
        _append(out / f"calls-{run}", "tick")
        return "tick"

    @app.task(
        name="uq.cool", base=LockedTask, lock_key="cl:{run}", lock_unique="until_done",
        lock_cooldown="30s", shared=False,
    )  # fmt: skip
    def cool(run: str) -> str:
        _append(out / f"calls-{run}", "cool")
        return "cool"

    @app.task(
        name="uq.retrying", bind=True, base=LockedTask, lock_key="rt:{run}",
        lock_unique="until_done", max_retries=5, shared=False,
    )  # fmt: skip
    def retrying(self: Any, run: str, times: int) -> int:
        _append(out / f"calls-{run}", str(self.request.retries))
        if self.request.retries < times:
            raise self.retry(countdown=0.3)
        _append(out / f"started-{run}", str(os.getpid()))  # the last attempt waits for the test
        _wait_file(out / f"go-{run}")
        return int(self.request.retries)

    @app.task(name="uq.blocker", shared=False)
    def blocker(run: str) -> str:
        _append(out / f"started-{run}", str(os.getpid()))
        _wait_file(out / f"go-{run}")
        return "unblocked"

    return app


app = make_app(
    os.environ.get("UQ_BROKER", "memory://"),
    os.environ.get("UQ_BACKEND", "cache+memory://"),
    os.environ.get("UQ_DIR", "."),
    os.environ.get("UQ_STORE", ""),
)

if os.environ.get("UQ_BEAT_RUN"):  # ``celery beat`` of test_unique_beat.py: uq.tick every 1 s
    app.conf.beat_schedule = {
        "uq-tick": {
            "task": "uq.tick",
            # relative: due on whole seconds, so two beats started apart tick together
            "schedule": schedule(timedelta(seconds=1), relative=True),
            "args": (os.environ["UQ_BEAT_RUN"],),
            "options": {"queue": os.environ["UQ_BEAT_QUEUE"]},
        }
    }
