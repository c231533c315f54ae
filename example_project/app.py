"""The example project's Celery app, configured from environment variables.

Run it yourself (each in its own terminal)::

    celery -A example_project worker -l INFO -c 2
    celery -A example_project beat -l INFO
    celery -A example_project lease list

With nothing set it needs no server: kombu's filesystem broker, the ``file://`` result backend
and the SQLite lease store, all in ``<tmp>/celery-lease-example-<uid>``, so every worker on this
host shares them. Point it at real infrastructure with:

=============================  ===============================================================
variable                       meaning (default)
=============================  ===============================================================
``EXAMPLE_DATA_DIR``           where the embedded broker, results and SQLite files live
``EXAMPLE_BROKER_URL``         broker URL (``filesystem://`` in the data dir)
``EXAMPLE_RESULT_BACKEND``     result backend URL (``file://`` in the data dir)
``EXAMPLE_LEASE_STORE``        lease store URL (SQLite file in the data dir; with a Redis
                               broker, unset: celery-lease uses the broker's Redis)
``EXAMPLE_KEY_PREFIX``         with a Redis broker: prefix of every Redis key the app writes
                               (broker and lease store), so apps can share one Redis
``EXAMPLE_DATABASE_URL``       the accounts database: SQLite path or ``postgresql://`` DSN
``EXAMPLE_LEASE_TTL``          ``lease_default_ttl`` (``30s``)
``EXAMPLE_REPORT_EVERY``       run the report every N seconds instead of nightly at 02:00 UTC
``EXAMPLE_EVENTS_FILE``        also append every lease event to this file as JSON lines
``EXAMPLE_REMOTE_CONTROL``     ``0`` turns off the workers' remote control (default on)
=============================  ===============================================================

The lease signals are logged (and written to ``EXAMPLE_EVENTS_FILE``) by receivers connected
below, at import, so that prefork children inherit them: a pattern to copy for telemetry.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from celery import Celery
from celery.schedules import crontab
from celery.signals import (
    beat_init,
    celeryd_init,
    task_failure,
    task_postrun,
    task_prerun,
    task_success,
    worker_process_init,
    worker_ready,
)

from celery_lease.signals import lock_acquired, lock_lost, lock_rejected, lock_released
from example_project.transport import FilesystemTransport

__all__ = ["FilesystemTransport", "app", "create_app", "data_dir", "record_event"]

logger = logging.getLogger("example_project")

REPORT_TASK = "example_project.tasks.nightly_report"


def data_dir(environ: Mapping[str, str]) -> str:
    """``EXAMPLE_DATA_DIR``, else ``<tmp>/celery-lease-example-<uid>`` (shared on this host)."""
    return environ.get("EXAMPLE_DATA_DIR") or os.path.join(
        tempfile.gettempdir(), f"celery-lease-example-{os.getuid()}"
    )


def _redis_store(url: str, prefix: str) -> Any:
    from celery_lease.stores.redis import RedisLockStore

    return RedisLockStore(url, prefix=prefix)


def create_app(
    environ: Mapping[str, str] | None = None, *, main: str = "example_project"
) -> Celery:
    """Build the app from ``environ`` (default: ``os.environ``); see the module docstring.

    Creates the data directory (and the filesystem broker's folders) when they are used.

    Args:
        environ: the variables to read.
        main: the app's name (a client app built by the demo uses another).
    """
    env = os.environ if environ is None else environ
    data = data_dir(env)
    broker = env.get("EXAMPLE_BROKER_URL") or "filesystem://"
    backend = env.get("EXAMPLE_RESULT_BACKEND") or f"file://{os.path.join(data, 'results')}"
    every = env.get("EXAMPLE_REPORT_EVERY")
    schedule: Any = timedelta(seconds=float(every)) if every else crontab(hour=2, minute=0)

    app = Celery(main, include=["example_project.tasks"], set_as_current=main == "example_project")
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        broker_connection_retry_on_startup=True,
        # A task is acknowledged when it ends, and a worker reserves one message at a time: a
        # stalled worker does not sit on messages that another worker could run.
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        worker_enable_remote_control=env.get("EXAMPLE_REMOTE_CONTROL", "1") != "0",
        result_expires=timedelta(hours=1),
        timezone="UTC",
        lease_default_ttl=env.get("EXAMPLE_LEASE_TTL") or "30s",
        # Unset: a Redis store refuses free keys until lease_default_ttl after the server's
        # start when the server may have lost leases (docs/stores.md, restart grace).
        lease_restart_grace=env.get("EXAMPLE_LEASE_RESTART_GRACE"),
        beat_schedule={"nightly-report": {"task": REPORT_TASK, "schedule": schedule}},
    )
    store = env.get("EXAMPLE_LEASE_STORE")
    prefix = env.get("EXAMPLE_KEY_PREFIX")
    if broker.startswith("filesystem://"):
        folders = {
            "data_folder_in": os.path.join(data, "broker"),
            "data_folder_out": os.path.join(data, "broker"),
            "processed_folder": os.path.join(data, "processed"),
            "control_folder": os.path.join(data, "control"),
        }
        for folder in folders.values():
            os.makedirs(folder, exist_ok=True)
        app.conf.broker_transport = "example_project.transport:FilesystemTransport"
        app.conf.broker_transport_options = {
            **folders,
            "store_processed": True,  # keep read messages in our folder, not in the global /tmp
            "polling_interval": 0.1,
        }
        store = store or f"sqlite:///{os.path.join(os.path.abspath(data), 'leases.sqlite3')}"
    elif prefix and broker.startswith(("redis://", "rediss://")):
        app.conf.broker_transport_options = {"global_keyprefix": prefix}
        store = _redis_store(store or broker, prefix)
    if backend.startswith("file://"):
        os.makedirs(backend.removeprefix("file://"), exist_ok=True)
    if store:
        app.conf.lease_store = store
    return app


app = create_app()


# Telemetry: every lease event is logged, and written as a JSON line when EXAMPLE_EVENTS_FILE is
# set (the demo reads its timeline from there). Connected at import, before the pool forks.

_node: str | None = None


def record_event(kind: str, **fields: Any) -> None:
    """Append one event as a JSON line to ``EXAMPLE_EVENTS_FILE`` (no-op when unset).

    One ``write()`` on an ``O_APPEND`` descriptor per line, so lines written by several processes
    at once never interleave.
    """
    path = os.environ.get("EXAMPLE_EVENTS_FILE")
    if not path:
        return
    event = {"t": time.time(), "kind": kind, "node": _node, "pid": os.getpid(), **fields}
    line = (json.dumps(event, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _task_fields(sender: Any) -> dict[str, Any]:
    """The task's name and (in the task's own thread) the execution's id."""
    request = getattr(sender, "request", None)
    return {"task": getattr(sender, "name", None), "task_id": getattr(request, "id", None)}


@celeryd_init.connect(weak=False, dispatch_uid="example_project.node")
def _remember_node(sender: Any = None, **_: Any) -> None:
    global _node
    _node = str(sender).split("@", 1)[0] if sender else None


@worker_ready.connect(weak=False, dispatch_uid="example_project.worker_ready")
def _on_worker_ready(**_: Any) -> None:
    record_event("worker_ready")


@worker_process_init.connect(weak=False, dispatch_uid="example_project.process_init")
def _on_process_init(**_: Any) -> None:
    record_event("process_init")


@beat_init.connect(weak=False, dispatch_uid="example_project.beat_init")
def _on_beat_init(**_: Any) -> None:
    record_event("beat_ready")


@lock_acquired.connect(weak=False, dispatch_uid="example_project.acquired")
def _on_acquired(
    sender: Any, key: str, token: int, waited: bool, wait_seconds: float, **_: Any
) -> None:
    logger.info("lease acquired: %s token %d (waited: %s)", key, token, waited)
    record_event(
        "acquired",
        key=key,
        token=token,
        waited=waited,
        wait_seconds=wait_seconds,
        **_task_fields(sender),
    )


@lock_rejected.connect(weak=False, dispatch_uid="example_project.rejected")
def _on_rejected(sender: Any, key: str, **_: Any) -> None:
    logger.info("lease rejected: %s is held by another execution", key)
    record_event("rejected", key=key, **_task_fields(sender))


@lock_lost.connect(weak=False, dispatch_uid="example_project.lost")
def _on_lost(sender: Any, key: str, token: int, reason: str, **_: Any) -> None:
    logger.warning("lease LOST: %s token %d (%s)", key, token, reason)
    record_event("lost", key=key, token=token, reason=reason, task=getattr(sender, "name", None))


@lock_released.connect(weak=False, dispatch_uid="example_project.released")
def _on_released(sender: Any, key: str, token: int, held_seconds: float, **_: Any) -> None:
    logger.info("lease released: %s token %d after %.2fs", key, token, held_seconds)
    record_event(
        "released", key=key, token=token, held_seconds=held_seconds, **_task_fields(sender)
    )


@task_prerun.connect(weak=False, dispatch_uid="example_project.prerun")
def _on_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    record_event("started", task=getattr(sender, "name", None), task_id=task_id)


@task_postrun.connect(weak=False, dispatch_uid="example_project.postrun")
def _on_postrun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    record_event("finished", task=getattr(sender, "name", None), task_id=task_id)


@task_success.connect(weak=False, dispatch_uid="example_project.success")
def _on_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    record_event("succeeded", result=result, **_task_fields(sender))


@task_failure.connect(weak=False, dispatch_uid="example_project.failure")
def _on_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    cause = exception.__cause__ if exception is not None else None
    record_event(
        "failed",
        task=getattr(sender, "name", None),
        task_id=task_id,
        error=type(exception).__name__,
        message=str(exception),
        cause=None if cause is None else type(cause).__name__,
        cause_message=None if cause is None else str(cause),
    )
