"""Real ``celery worker`` subprocesses (prefork -c 2, threads, gevent) on real brokers.

``worker_env`` is parametrised over a throwaway ``redis-server`` broker (lock store: the broker's
Redis, as resolved by default) and kombu's filesystem transport (lock store: a SQLite file), each
with a prefork and a threads worker, started once per test module.
"""

from __future__ import annotations

import itertools
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import LockStore, store_from_url
from tests.fixtures_redis import RedisServer
from tests.integration.worker_app import make_app
from tests.integration.workers import start_worker, stop_worker
from tests.support import complete_lines

READY_TIMEOUT = 40.0  # seconds for a worker to log "ready."
TIMEOUT = 30.0  # seconds a test waits for a result or a marker file
POLL = 0.02

pytestmark = [pytest.mark.worker]


@dataclass
class WorkerEnv:
    """A running worker, a client app configured like it, and the lock store it uses."""

    name: str
    pool: str
    app: Celery
    store: LockStore
    directory: Path
    process: subprocess.Popen[bytes]
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def run_id(self) -> str:
        # A letter first: an all-digit string is keyed with a type tag (``~str.``) in templates.
        return "r" + uuid.uuid4().hex[:11]

    def wait_file(self, name: str, timeout: float = TIMEOUT) -> Path:
        """Wait (polling) for a marker file written by a task body or receiver: its first line."""
        path = self.directory / name
        deadline = time.monotonic() + timeout
        while not complete_lines(path):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not written within {timeout}s; log:\n{self.tail()}")
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited ({self.process.returncode}):\n{self.tail()}")
            time.sleep(POLL)
        return path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def get(self, result: Any, timeout: float = TIMEOUT, propagate: bool = True) -> Any:
        return result.get(timeout=timeout, interval=POLL, propagate=propagate)


def _variant(
    name: str,
    pool: str,
    broker: str,
    backend: str,
    store: str,
    directory: Path,
    serializer: str = "json",
    concurrency: int = 2,
) -> Iterator[WorkerEnv]:
    directory.mkdir(parents=True, exist_ok=True)
    env = {
        "IT_BROKER": broker,
        "IT_BACKEND": backend,
        "IT_STORE": store,
        "IT_DIR": str(directory),
        "IT_RESULT_SERIALIZER": serializer,
    }
    app = make_app(broker, backend, store, str(directory), serializer)
    process, log = start_worker(
        "tests.integration.worker_app:app", name, pool, concurrency, env, directory, READY_TIMEOUT
    )
    lock_store = store_from_url(store or broker)
    try:
        yield WorkerEnv(name, pool, app, lock_store, directory, process, log)
    finally:
        stop_worker(process)
        app.close()


VARIANTS = ["redis-prefork", "redis-threads", "fs-prefork", "fs-threads"]


@pytest.fixture(scope="module", params=VARIANTS)
def worker_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerEnv]:
    """One real worker per (broker, pool), shared by a module's tests (stopped after it)."""
    variant: str = request.param
    broker_kind, pool = variant.split("-")
    directory = tmp_path_factory.mktemp(variant)
    if broker_kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        db = 2 if pool == "prefork" else 5
        base = f"redis://127.0.0.1:{server.port}"
        yield from _variant(
            variant,
            pool,
            f"{base}/{db}",
            f"{base}/{db + 1}",
            "",  # unset: the broker's Redis is the lock store
            directory,
            serializer="pickle" if pool == "prefork" else "json",
        )
    else:
        (directory / "results").mkdir()
        yield from _variant(
            variant,
            pool,
            "filesystem://",
            f"file://{directory / 'results'}",
            f"sqlite:///{directory / 'leases.db'}",
            directory,
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the ``worker_env`` variants a ``@pytest.mark.pools(...)`` test excludes.

    A test that pauses a pool child with SIGSTOP has nothing to pause on a threads worker: that
    combination is not collected at all, so no skip can hide a test that should have run.
    """
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("pools")
        callspec = getattr(item, "callspec", None)
        variant = callspec.params.get("worker_env") if callspec is not None else None
        if marker is not None and variant is not None and variant.split("-")[1] not in marker.args:
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="module")
def gevent_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerEnv]:
    """A gevent worker (-c 5) on the throwaway Redis broker."""
    server: RedisServer = request.getfixturevalue("redis_server")
    base = f"redis://127.0.0.1:{server.port}"
    yield from _variant(
        "redis-gevent",
        "gevent",
        f"{base}/8",
        f"{base}/9",
        "",
        tmp_path_factory.mktemp("gevent"),
        concurrency=5,
    )


def intervals(env: WorkerEnv, run: str) -> list[tuple[float, float]]:
    """The ``(start, end)`` wall-clock intervals recorded by duplicate bodies of ``run``."""
    path = env.directory / f"intervals-{run}"
    if not path.exists():
        return []
    pairs = [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line]
    return sorted((a, b) for a, b in pairs)


def assert_no_overlap(spans: list[tuple[float, float]]) -> None:
    """Recorded body intervals never overlap."""
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"bodies overlapped: {spans}"
