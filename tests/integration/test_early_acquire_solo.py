"""A real solo worker (``celery worker -P solo``) on a real Redis broker and lock store: the
acquire is sent when the message arrives (the key is held at ``task_prerun``), and each task still
costs one acquire script and one release script on the lock server."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.fixtures_redis import RedisServer
from tests.integration.workers import start_worker, stop_worker
from tests.support import complete_lines

pytestmark = [pytest.mark.worker, pytest.mark.redis]

READY_TIMEOUT = 40.0
TIMEOUT = 30.0
TASKS = 20


def _script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha"))


def test_a_solo_worker_holds_the_key_before_the_prologue_with_the_same_commands(
    redis_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    server = redis_server_factory()
    url = server.url
    env = {"EA_BROKER": url, "EA_DIR": str(tmp_path)}
    process, log = start_worker(
        "tests.integration.early_acquire_app:app", "ea", "solo", 1, env, tmp_path, READY_TIMEOUT
    )
    client = redis.Redis.from_url(url)
    app = Celery("ea", broker=url, set_as_current=False)
    try:
        app.send_task("ea.keyed", (0,))  # warm: scripts loaded, connections open
        _wait_lines(tmp_path / "prerun", 1, log)
        _wait_released(client, range(1))
        before = _script_calls(client)
        for n in range(1, TASKS + 1):
            app.send_task("ea.keyed", (n,))
        lines = _wait_lines(tmp_path / "prerun", TASKS + 1, log)
        _wait_released(client, range(1, TASKS + 1))
        after = _script_calls(client)
    finally:
        stop_worker(process)
        app.close()
        client.close()
    assert lines[1:] == [f"{n} held" for n in range(1, TASKS + 1)]
    # One acquire and one release per task; the prerun's inspection adds one more.
    assert after - before == 3 * TASKS


def _wait_lines(path: Path, count: int, log: Path) -> list[str]:
    deadline = time.monotonic() + TIMEOUT
    while len(lines := complete_lines(path)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name}: {lines}; log:\n{log.read_text(errors='replace')}")
        time.sleep(0.02)
    return lines


def _wait_released(client: redis.Redis, numbers: range) -> None:
    deadline = time.monotonic() + TIMEOUT
    while any(client.exists(f"celery-lease:{{ea:{n}}}:lease") for n in numbers):
        if time.monotonic() > deadline:
            raise AssertionError("a lease was not released")
        time.sleep(0.02)
