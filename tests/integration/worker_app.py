"""The Celery app the integration tests run in real ``celery worker`` processes.

Configured from the environment (``IT_BROKER``, ``IT_BACKEND``, ``IT_STORE``, ``IT_DIR``,
``IT_RESULT_SERIALIZER``) so the test process can build the same app as a client with
:func:`make_app`. Bodies record what they did as files in ``IT_DIR``.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import celery
from celery import Celery
from celery.signals import task_prerun, task_retry, worker_ready

from celery_lease import LockedTask, get_lock_token, locked
from celery_lease.signals import lock_acquired, lock_lost

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


def make_app(
    broker: str, backend: str, store: str, directory: str, result_serializer: str = "json"
) -> Celery:
    """Build the test app; the worker and the test process build it alike."""
    app = Celery("it", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        lease_store=store,
        # A throwaway redis-server started by this session: no restart grace (see docs/stores.md).
        lease_restart_grace=0,
        result_serializer=result_serializer,
        accept_content=["json", "pickle"],
        result_accept_content=["json", "pickle"],
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_extended=False,
    )
    if broker.startswith("filesystem"):
        folder = os.path.join(directory, "broker")
        os.makedirs(folder, exist_ok=True)
        # kombu's own filesystem transport races between processes (see the module).
        app.conf.broker_transport = "example_project.transport:FilesystemTransport"
        app.conf.broker_transport_options = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": os.path.join(folder, "control"),  # default: ./control in the cwd
            "polling_interval": 0.05,
        }
    out = Path(directory)

    def dup_body(run: str, hold: float) -> str:
        start = time.time()
        time.sleep(hold)
        _append(out / f"intervals-{run}", f"{start} {time.time()}")
        return "ran"

    @app.task(name="it.dup_raise", base=LockedTask, lock_key="dup:{run}", shared=False)
    def dup_raise(run: str, hold: float) -> str:
        return dup_body(run, hold)

    @app.task(
        name="it.dup_skip", base=LockedTask, lock_key="dup:{run}", lock_on_held="skip",
        shared=False,
    )  # fmt: skip
    def dup_skip(run: str, hold: float) -> str:
        return dup_body(run, hold)

    @app.task(
        name="it.dup_retry", base=LockedTask, lock_key="dup:{run}", lock_on_held="retry",
        lock_retry_countdown=0.02, max_retries=500, shared=False,
    )  # fmt: skip
    def dup_retry(run: str, hold: float) -> str:
        return dup_body(run, hold)

    @app.task(
        name="it.fenced", base=LockedTask, lock_key="fence:{run}", lock_ttl="1s",
        lock_wait="15s", shared=False,
    )  # fmt: skip
    def fenced(run: str, resource: str, pause: bool) -> list[Any]:
        token = fenced.request.lock_token
        if pause:
            _append(out / f"started-{run}", str(os.getpid()))
            _wait_file(out / f"go-{run}")
        db = sqlite3.connect(resource, timeout=10)
        try:
            with db:
                rows = db.execute(
                    "UPDATE resource SET fence = ?, writer = ? WHERE id = 1 AND fence < ?",
                    (token, os.getpid(), token),
                ).rowcount
        finally:
            db.close()
        if pause:
            fenced.request.lease.wait_lost(WAIT)
        return [rows, token, bool(fenced.request.lock_lost)]

    # A ttl the renewer's next renewal (ttl/3) cannot miss on a loaded machine: with 0.6 s, a
    # pool child stalled past it read the force-released key as "expired" when it looked.
    @app.task(name="it.lost", base=LockedTask, lock_key="lost:{run}", lock_ttl="3s", shared=False)
    def lost(run: str) -> None:
        _append(out / f"held-{run}", str(os.getpid()))
        lost.request.lease.wait_lost(WAIT)
        lost.request.lease.check()

    @app.task(
        name="it.revoke", base=LockedTask, lock_key="revoke:{run}", lock_ttl="0.6s",
        lock_on_lost="revoke", shared=False,
    )  # fmt: skip
    def revoke(run: str) -> str:
        _append(out / f"held-{run}", str(os.getpid()))
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return "finished"

    @app.task(name="it.retry_once", bind=True, base=LockedTask, lock_key="r:{run}", shared=False)
    def retry_once(self: Any, run: str) -> list[Any]:
        _append(out / f"tokens-{run}", str(self.request.lock_token))
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return [self.request.retries, self.request.lock_key]

    @locked(key="re:{run}")
    def inner(run: str) -> int | None:
        return get_lock_token()

    @app.task(name="it.outer", base=LockedTask, lock_key="re:{run}", shared=False)
    def outer(run: str) -> list[Any]:
        return [outer.request.lock_token, inner(run)]

    @app.task(name="it.boom", base=LockedTask, lock_key="boom:{run}", shared=False)
    def boom(run: str) -> str:
        return "ok"

    @app.task(name="it.unkeyable", base=LockedTask, shared=False)
    def unkeyable(thing: Any) -> str:
        return "ran"

    @app.task(
        name="it.stored_result",
        bind=True,
        base=LockedTask,
        lock_key="stored:{run}",
        ignore_result=False,
        shared=False,
    )
    def stored_result(self: Any, run: str) -> Any:
        # Whether this process's result backend reads deferred release replies before it writes
        # (set by an earlier execution's release, never by this one's).
        return getattr(self.backend, "_celery_lease_reads_releases_first", None)

    @app.task(name="it.ping", shared=False)
    def ping() -> str:
        return "pong"

    return app


def _raising_receiver(key: str = "", **_: Any) -> None:
    if key.startswith("boom:"):
        raise RuntimeError("a receiver that raises")


def _marker_dir() -> Path | None:
    """Where receivers in a test worker leave marker files (``None`` outside one)."""
    directory = os.environ.get("IT_DIR")
    return Path(directory) if directory else None


def _record_loss(key: str = "", reason: str = "", **_: Any) -> None:
    directory = _marker_dir()
    if directory is not None:
        _append(directory / f"lost-{key.replace(':', '-')}", reason)


def _record_retry(request: Any = None, **_: Any) -> None:
    """``task_retry`` is sent after the tracer stored RETRY: mark that for the retried copy."""
    directory = _marker_dir()
    if directory is not None and request is not None:
        _append(directory / f"retried-{request.id}-{request.retries}", "")


def _wait_for_earlier_retries(task: Any = None, task_id: str = "", **_: Any) -> None:
    """A retried copy starts only after every attempt before it has stored its RETRY state.

    Celery publishes the retry (``Task.retry``) before the tracer stores RETRY for the same task
    id; on a concurrent worker a quick copy can store SUCCESS first and the late RETRY then
    replaces it, so ``result.get()`` never returns (celery/celery#6115; the filesystem backend's
    truncate-then-write makes the window wide). That is Celery's ordering, not the lock's:
    ``task_prerun`` (before ``LockedTask`` acquires) waits for :func:`_record_retry`'s markers.
    """
    directory = _marker_dir()
    if directory is not None and task is not None:
        for earlier in range(task.request.retries):
            _wait_file(directory / f"retried-{task_id}-{earlier}")


lock_acquired.connect(_raising_receiver, weak=False)
task_retry.connect(_record_retry, weak=False)
task_prerun.connect(_wait_for_earlier_retries, weak=False)
lock_lost.connect(_record_loss, weak=False)


def _prompt_acks_on_threads(sender: Any = None, **_: Any) -> None:
    """Work around celery/celery#6941 on a threads worker before Celery 5.7.

    With ``-P threads``, ``task_acks_late`` and ``worker_prefetch_multiplier=1``, Celery 5.4-5.6
    send an ack only when the consumer's event loop next wakes (up to ~5 s later), and until then
    the worker fetches nothing: 20 tasks of 50 ms took 12-14 s there (0.5 s on Celery 5.7 or on
    prefork), which turns the duplicate-delivery tests into timeouts. A timer entry every 0.1 s
    keeps the loop waking, as suggested in that issue. It changes nothing about locking.
    """
    if sender is not None and type(sender.pool).__module__ == "celery.concurrency.thread":
        sender.timer.call_repeatedly(0.1, lambda: None)


if celery.VERSION < (5, 7):  # pragma: no cover - only in tox's older-Celery environments
    worker_ready.connect(_prompt_acks_on_threads, weak=False)

if os.environ.get("IT_BROKER"):
    app = make_app(
        os.environ["IT_BROKER"],
        os.environ["IT_BACKEND"],
        os.environ["IT_STORE"],
        os.environ["IT_DIR"],
        os.environ.get("IT_RESULT_SERIALIZER", "json"),
    )
