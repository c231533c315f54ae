"""Two real ``celery beat`` processes and ``lock_unique="until_done"``: one message per tick.

Stock beat has no locking: two beats send two messages per tick. Both beats here schedule
``uq.tick`` every second (``relative``: due on whole seconds, so they tick together) onto a queue
nobody consumes, on a throwaway redis-server; ``queue_ttl`` 0.6 s frees the key between ticks.
The messages are counted on the broker (``LLEN``), the ticks from the beats' own logs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.fixtures_redis import RedisServer
from tests.integration.test_unique_workers import TIMEOUT, Env, client_env, run_id
from tests.integration.workers import ROOT, stop_worker

pytestmark = [pytest.mark.worker, pytest.mark.redis]

POLL = 0.05
COMMON_TICKS = 4  # ticks both beats must have sent in before they are stopped
SENT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/\w+\] Scheduler: Sending due")


@pytest.fixture(scope="module")
def env(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The client app on the throwaway Redis (broker db 14, results db 15)."""
    with client_env(redis_server, tmp_path_factory.mktemp("unique-beat"), 14) as env:
        yield env


def start_beat(env: Env, name: str, run: str, queue: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``celery beat`` on the test app, its schedule file and log in the test's directory."""
    log = env.directory / f"beat-{name}.log"
    cmd = [
        sys.executable, "-m", "celery", "-A", "tests.integration.unique_app:app", "beat",
        "-s", str(env.directory / f"schedule-{name}"), "--pidfile", "",
        "--loglevel", "INFO", "--max-interval", "1",
    ]  # fmt: skip
    environ = {
        **os.environ,
        "UQ_BROKER": env.broker,
        "UQ_BACKEND": env.backend,
        "UQ_DIR": str(env.directory),
        "UQ_BEAT_RUN": run,
        "UQ_BEAT_QUEUE": queue,
        "PYTHONPATH": str(ROOT),
    }
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd, cwd=env.directory, env=environ, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return process, log


def ticks(log: Path) -> set[int]:
    """The ticks (whole seconds, rounded to the nearest) in which a beat logged a send."""
    found = set()
    for line in log.read_text(errors="replace").splitlines():
        match = SENT.match(line)
        if match:
            at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.add(round(at))
    return found


class TestTwoBeats:
    def test_two_beat_processes_publish_one_message_per_tick(self, env: Env) -> None:
        """Both beats send uq.tick every second; the broker holds one message per tick."""
        run, queue = run_id(), f"beat-{run_id()}"
        beats = [start_beat(env, name, run, queue) for name in ("one", "two")]
        try:
            deadline = time.monotonic() + TIMEOUT
            while len(ticks(beats[0][1]) & ticks(beats[1][1])) < COMMON_TICKS:
                for process, log in beats:
                    assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, [log.read_text()[-2000:] for _, log in beats]
                time.sleep(POLL)
        finally:
            for process, _ in beats:
                stop_worker(process)
        one, two = ticks(beats[0][1]), ticks(beats[1][1])
        sent = one | two
        messages = env.redis.llen(queue)
        # Every tick published at most one message (a beat stopped between its log line and
        # its publish may have left the last tick without one).
        assert len(sent) - 1 <= messages <= len(sent), (sorted(one), sorted(two), messages)
        assert env.lines(f"calls-{run}") == []  # nothing consumed the queue
