"""``on_held="replace"`` on a real worker: a second call replaces a long running first one.

With ``on_lost="revoke"`` the first body is stopped and ends REVOKED (reason: replaced by a newer
call; not FAILURE, so neither a retry policy nor ``autoretry_for`` brings it back to take the key
from the second), and the second runs once, to completion, with a higher token. With
``on_lost="mark"`` the first runs on to its end (``request.lock_lost`` True) and the second
starts only once the first's lease is gone (no longer renewed, it expires); the first's late
fenced write is then rejected (``StaleTokenError``) because the second wrote with its higher
token.

The worker runs ``-P threads -c 2`` on a throwaway redis-server broker with the process's
memory store (both bodies share it); the Redis-store variant runs prefork ``-c 2`` on the same
server's Redis store once that store can mark a holder (``SupportsReplace``).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_lease import LockedTask
from celery_lease.errors import StaleTokenError
from celery_lease.fencing.redis import fenced_set
from celery_lease.signals import lock_lost
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import RedisServer
from tests.integration.workers import CeleryWorker
from tests.support import complete_lines

pytestmark = [pytest.mark.worker, pytest.mark.slow]

START_TIMEOUT = 40.0
RESULT_TIMEOUT = 30.0
POLL = 0.02
BODY_WAIT = 20.0  # seconds a body waits for a marker at most
TTL = "0.9s"  # short, so a replaced holder hears it (at its next renewal) within 0.3 s


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def _wait_path(path: Path, timeout: float = BODY_WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL)
    return True


def make_app(broker: str, backend: str, store: str, directory: str) -> Celery:
    """The app of the worker and of the test's client alike."""
    app = Celery("rp", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        lease_store=store,
        lease_restart_grace=0,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    out = Path(directory)

    @app.task(
        name="rp.revoke", bind=True, base=LockedTask, lock_key="rp:{run}", lock_ttl=TTL,
        lock_on_held="replace", lock_on_lost="revoke", shared=False,
    )  # fmt: skip
    def revoke(self: Any, run: str, label: str, hold: float) -> int:
        token = self.request.lock_token
        _append(out / f"start-{run}-{label}", f"{token} {int(self.request.lock_waited)}")
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            time.sleep(0.05)
        _append(out / f"end-{run}-{label}", str(token))
        return int(token)

    @app.task(
        name="rp.mark", bind=True, base=LockedTask, lock_key="rp:{run}", lock_ttl=TTL,
        lock_on_held="replace", lock_on_lost="mark", shared=False,
    )  # fmt: skip
    def mark(self: Any, run: str, label: str, resource: str) -> list[Any]:
        token = int(self.request.lock_token)
        client = redis.Redis.from_url(broker)
        try:
            fenced_set(client, f"{resource}:{run}", label, token=token)
            _append(out / f"start-{run}-{label}", f"{token} {int(self.request.lock_waited)}")
            if label == "first":
                # Runs on after the ask until the replacing call wrote, then writes late.
                seen = _wait_path(out / f"start-{run}-second")
                try:
                    fenced_set(client, f"{resource}:{run}", "first-late", token=token)
                    late = "written"
                except StaleTokenError:
                    late = "stale"
                return [token, bool(self.request.lock_lost), seen, late]
            return [token, bool(self.request.lock_lost), True, "none"]
        finally:
            client.close()

    return app


def _record_loss(key: str = "", reason: str = "", **_: Any) -> None:
    directory = os.environ.get("RP_DIR")
    if directory:
        _append(Path(directory) / f"lost-{key.replace(':', '-')}", reason)


lock_lost.connect(_record_loss, weak=False)

if os.environ.get("RP_DIR"):
    app = make_app(
        os.environ["RP_BROKER"], os.environ["RP_BACKEND"], os.environ["RP_STORE"],
        os.environ["RP_DIR"],
    )  # fmt: skip


class Env:
    def __init__(self, app: Celery, directory: Path, worker: CeleryWorker) -> None:
        self.app = app
        self.directory = directory
        self.worker = worker

    def lines(self, name: str, timeout: float = RESULT_TIMEOUT) -> list[str]:
        path = self.directory / name
        deadline = time.monotonic() + timeout
        while not complete_lines(path):
            if time.monotonic() > deadline or self.worker.process.poll() is not None:
                raise AssertionError(f"{name} not written; log:\n{self.worker.text()[-4000:]}")
            time.sleep(POLL)
        return complete_lines(path)


REDIS_REPLACES = callable(getattr(RedisLockStore, "mark_replaced", None))

VARIANTS = [
    pytest.param(("memory", "threads", 10), id="memory-threads"),
    pytest.param(
        ("redis", "prefork", 12),
        id="redis-prefork",
        marks=pytest.mark.skipif(
            not REDIS_REPLACES,
            reason="the Redis store cannot mark a holder yet (SupportsReplace lands with it)",
        ),
    ),
]


@pytest.fixture(scope="module", params=VARIANTS)
def env(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    kind, pool, db = request.param
    directory = tmp_path_factory.mktemp(f"replace-{kind}")
    base = f"redis://127.0.0.1:{redis_server.port}"
    broker, backend = f"{base}/{db}", f"{base}/{db + 1}"
    store = "memory://" if kind == "memory" else broker
    worker = CeleryWorker(
        "tests.integration.test_replace_workers:app",
        directory / "worker.log",
        pool=pool,
        concurrency=2,
        name=f"rp-{kind}",
        env={"RP_BROKER": broker, "RP_BACKEND": backend, "RP_STORE": store,
             "RP_DIR": str(directory)},
    )  # fmt: skip
    worker.wait_ready(START_TIMEOUT)
    app = make_app(broker, backend, store, str(directory))
    try:
        yield Env(app, directory, worker)
    finally:
        worker.stop()
        app.close()


def _run() -> str:
    return "r" + uuid.uuid4().hex[:11]


class TestReplaceOnAWorker:
    def test_revoke_the_first_ends_revoked_as_replaced_and_the_second_runs_once(
        self, env: Env
    ) -> None:
        """on_lost="revoke": the first body is stopped and ends REVOKED, replaced; the second
        runs once to its end with a higher token, after waiting."""
        run = _run()
        first = env.app.send_task("rp.revoke", (run, "first", BODY_WAIT))
        [first_start] = env.lines(f"start-{run}-first")
        second = env.app.send_task("rp.revoke", (run, "second", 0.0))
        with pytest.raises(TaskRevokedError, match="replaced: a newer call took over"):
            first.get(timeout=RESULT_TIMEOUT, interval=POLL)
        assert first.state == "REVOKED"
        second_token = second.get(timeout=RESULT_TIMEOUT, interval=POLL)
        first_token = int(first_start.split()[0])
        assert second_token > first_token
        [second_start] = env.lines(f"start-{run}-second")
        assert second_start == f"{second_token} 1"  # waited for the first to leave
        assert env.lines(f"end-{run}-second") == [str(second_token)]
        assert not (env.directory / f"end-{run}-first").exists()
        assert env.lines(f"lost-rp-{run}") == ["replaced"]

    def test_mark_the_first_runs_on_and_its_late_fenced_write_is_rejected(self, env: Env) -> None:
        """on_lost="mark": the first runs on to its end, its lease read lost; the second starts
        once the first's lease expired (not renewed since the ask), with a higher token; the
        first's later fenced write is stale."""
        run = _run()
        first = env.app.send_task("rp.mark", (run, "first", "res"))
        [first_start] = env.lines(f"start-{run}-first")
        second = env.app.send_task("rp.mark", (run, "second", "res"))
        first_token, first_lost, saw_second, late = first.get(timeout=RESULT_TIMEOUT, interval=POLL)
        second_token, second_lost, _, _ = second.get(timeout=RESULT_TIMEOUT, interval=POLL)
        assert first_token == int(first_start.split()[0])
        assert first_lost is True and saw_second is True
        assert late == "stale"
        assert second_token > first_token and second_lost is False
        assert env.lines(f"start-{run}-second") == [f"{second_token} 1"]
        assert env.lines(f"lost-rp-{run}") == ["replaced"]
