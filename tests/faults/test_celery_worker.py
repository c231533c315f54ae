"""Fault 6: a Celery worker is SIGKILLed mid-task with ``acks_late``; the task is redelivered."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest

from celery_lease.stores.redis import RedisLockStore
from tests.faults.harness import CELERY_TTL, ROOT, make_celery_app, now
from tests.fixtures_redis import RedisServer
from tests.support import complete_lines

pytestmark = [pytest.mark.slow, pytest.mark.worker]

READY_TIMEOUT = 60.0  # seconds for a worker to log "ready." on a loaded machine
# kombu's Redis transport restores unacked messages (visibility timeout passed) on a 10 s timer;
# before kombu 5.7 its restore_visible() acted on only every 10th call, so a dead worker's
# message came back after up to ~100 s (tox's Celery 5.4-5.6 environments), on 5.7 within ~10 s.
PROMPT_RESTORE = kombu.VERSION >= (5, 7)
TIMEOUT = 40.0 if PROMPT_RESTORE else 150.0  # seconds for the redelivered task to finish


def _wait(predicate: Any, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = now() + timeout
    while not predicate():
        if now() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"{what} not within {timeout} s\n{tails}")
        time.sleep(0.02)  # deadline polling of files, not a synchronisation by sleeping


@pytest.fixture
def celery_env(own_redis: RedisServer, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two ``celery worker`` processes (prefork, one child each) on a throwaway Redis broker."""
    base = f"redis://127.0.0.1:{own_redis.port}"
    env = {
        **os.environ,
        "FAULTS_BROKER": f"{base}/0",
        "FAULTS_BACKEND": f"{base}/2",
        "FAULTS_STORE": f"{base}/1",
        "FAULTS_DIR": str(tmp_path),
    }
    workers: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"worker-{name}.log" for name in "ab"]
    try:
        for name, log in zip("ab", logs, strict=True):
            command = [
                sys.executable, "-m", "celery", "-A", "tests.faults.harness:celery_app",
                "worker", "-P", "prefork", "-c", "1", "-n", f"{name}@%h", "--loglevel=INFO",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
                f"--logfile={log}",
            ]  # fmt: skip
            workers.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # one process group per worker: killpg kills it all
                )
            )
        for log in logs:
            _wait(
                lambda log=log: log.exists() and " ready." in log.read_text(),
                READY_TIMEOUT,
                f"{log.name} ready",
                logs,
            )
        yield {
            "env": env,
            "workers": workers,
            "logs": logs,
            "dir": tmp_path,
            "app": make_celery_app(
                env["FAULTS_BROKER"], env["FAULTS_BACKEND"], env["FAULTS_STORE"], str(tmp_path)
            ),
            "store": RedisLockStore(env["FAULTS_STORE"]),
        }
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def _bodies(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in complete_lines(path) if line.strip()]


def test_redelivered_task_runs_after_the_dead_workers_lease_expires(
    celery_env: dict[str, Any],
) -> None:
    """After SIGKILL of the worker running it, the task is redelivered to the other worker and
    its body starts only once the lease expired: exactly one body at a time."""
    run = "r" + uuid.uuid4().hex[:10]  # a digits-only str is keyed ~str.<digits>
    bodies_file: Path = celery_env["dir"] / f"{run}.bodies"
    logs = celery_env["logs"]
    result = celery_env["app"].send_task("faults.exclusive", kwargs={"run": run, "hold": 0.3})
    _wait(lambda: _bodies(bodies_file), 30, "the first body's start", logs)
    first = _bodies(bodies_file)[0]

    victim = next(w for w in celery_env["workers"] if w.pid == first["ppid"])
    os.killpg(victim.pid, signal.SIGKILL)
    killed_at = now()
    held = celery_env["store"].get(f"exclusive:{run}")
    assert held is not None and held.token == first["token"], held
    expires_at = killed_at + held.expires_in  # the dead holder's lease runs out then, at the latest

    assert result.get(timeout=TIMEOUT) == "done"
    bodies = _bodies(bodies_file)
    starts = [b for b in bodies if b["event"] == "start"]
    ends = [b for b in bodies if b["event"] == "end"]
    assert len(starts) == 2 and len(ends) == 1, bodies
    second = starts[1]
    assert second["pid"] != first["pid"] and second["token"] > first["token"]
    assert second["at"] >= expires_at - 0.005, (
        f"redelivered body started {expires_at - second['at']:.3f} s before the lease expired"
    )
    if PROMPT_RESTORE or second["waited"]:
        # The message came back while the dead holder's lease was live: the body waited for it
        # and must start within a ttl of its expiry. (A message restored late, only possible on
        # older kombu, arrives after the expiry and acquires at once: nothing to bound.)
        assert second["at"] - expires_at <= CELERY_TTL, "the redelivered body waited too long"
    print(
        f"killed at +{killed_at - first['at']:.3f} s,"
        f" lease expired at +{expires_at - first['at']:.3f} s,"
        f" redelivered body started at +{second['at'] - first['at']:.3f} s"
        f" (waited for the lease: {second['waited']})"
    )
    intervals = sorted([(first["at"], killed_at), (second["at"], ends[0]["at"])])
    assert intervals[0][1] <= intervals[1][0], f"two bodies at once: {intervals}"
