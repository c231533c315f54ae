"""A run skipped by ``on_held="skip"`` is visible as skipped, on a real worker.

A skipped run must not end SUCCESS with ``None``, like a run that returned ``None``. Celery
offers: a custom state (``update_state("SKIPPED")``: not in ``READY_STATES``, ``get()`` blocks);
``Ignore`` alone (stores nothing: PENDING forever, ``get()`` blocks, no task event); FAILURE
(``task_failure``, ``on_failure`` and error trackers fire for what is no error); REVOKED
(``backend.mark_as_revoked(id, reason)``: ready, ``get()`` raises ``TaskRevokedError(reason)`` at
once, and a ``task-revoked`` event makes Flower show the task REVOKED). The engine does the last,
then raises ``Ignore`` so that the tracer does not overwrite it with SUCCESS and the message is
acknowledged.

The worker is real (prefork -c 2, filesystem broker, file result backend, SQLite store),
started with ``-E`` (task events on), and the test process listens to its events as Flower does.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_lease import LockedTask
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.integration.workers import CeleryWorker, filesystem_app

pytestmark = [pytest.mark.worker, pytest.mark.slow]

START_TIMEOUT = 40.0
RESULT_TIMEOUT = 30.0
POLL = 0.05


def make_app(directory: str) -> Celery:
    app = filesystem_app("sv", directory, POLL)
    app.conf.update(
        worker_prefetch_multiplier=1,
        lease_store=f"sqlite:///{directory}/leases.db",
    )

    @app.task(
        name="sv.skip", base=LockedTask, lock_key="sv:{run}", lock_on_held="skip",
        shared=False,
    )  # fmt: skip
    def skip(run: str) -> str:
        return run

    return app


if os.environ.get("SV_DIR"):
    app = make_app(os.environ["SV_DIR"])


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[Celery, Path]]:
    worker = CeleryWorker(
        "tests.integration.test_skip_visible:app",
        tmp_path / "worker.log",
        pool="prefork",
        concurrency=2,
        name=f"sv-{uuid.uuid4().hex[:6]}",
        env={"SV_DIR": str(tmp_path)},
        args=["-E"],
    )
    client = make_app(str(tmp_path))
    try:
        worker.wait_ready(START_TIMEOUT, POLL)
        yield client, tmp_path
    finally:
        worker.stop()
        client.close()


class Events:
    """The worker's task events, received in this process as Flower receives them."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.seen: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        self.connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self.connection, handlers={"*": self.on_event})
        self.thread = threading.Thread(
            target=self.receiver.capture,
            kwargs={"limit": None, "timeout": None, "wakeup": False},
            daemon=True,
        )

    def on_event(self, event: dict[str, Any]) -> None:
        with self.changed:
            self.seen.append(event)
            self.changed.notify_all()

    def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.seen if match(e)]
            return bool(found)

        with self.changed:
            if not self.changed.wait_for(seen, timeout):
                raise AssertionError(f"no such event in {self.seen!r}")
        return found[0]

    def start(self) -> None:
        """Start receiving; return once an event of our own came back (the queue is bound)."""
        self.thread.start()
        ping = uuid.uuid4().hex
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send("lease-test-ping", uuid=ping)
            with self.changed:
                if self.changed.wait_for(
                    lambda: any(e.get("uuid") == ping for e in self.seen), POLL * 4
                ):
                    return
            if time.monotonic() > deadline:
                raise AssertionError("the event receiver never received its own ping")

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(RESULT_TIMEOUT)
        self.connection.release()


def test_skipped_run_is_revoked_with_reason_and_get_does_not_block(
    worker: tuple[Celery, Path],
) -> None:
    """Key held elsewhere: the run is REVOKED 'skipped: ...' in the backend, get() raises at
    once, a task-revoked event for it reaches event receivers (Flower); a run of the free key
    still succeeds with its value."""
    client, directory = worker
    events = Events(client)
    events.start()
    try:
        run = f"r{uuid.uuid4().hex[:8]}"
        store = SQLiteLockStore(str(directory / "leases.db"))
        assert store.acquire(f"sv:{run}", "someone-else", 60_000) is not None
        result = client.send_task("sv.skip", (run,))
        with pytest.raises(TaskRevokedError, match=f"skipped: 'sv:{run}' held"):
            result.get(timeout=RESULT_TIMEOUT, interval=POLL)
        assert result.state == "REVOKED"
        assert result.ready()
        revoked = events.wait_for(
            lambda e: e["type"] == "task-revoked" and e.get("uuid") == result.id, RESULT_TIMEOUT
        )
        assert "skipped: " in revoked["reason"] and revoked["terminated"] is False
        store.release(f"sv:{run}", "someone-else")
        free = client.send_task("sv.skip", (run,))
        assert free.get(timeout=RESULT_TIMEOUT, interval=POLL) == run
        events.wait_for(
            lambda e: e["type"] == "task-succeeded" and e.get("uuid") == free.id, RESULT_TIMEOUT
        )
    finally:
        events.stop()
