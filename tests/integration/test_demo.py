"""``python -m example_project demo`` as a user runs it: a subprocess, real workers and beat.

Each run asserts the exit status, the timeline lines that prove each step of the story, and
that nothing was left behind (processes, the temporary directory, Redis keys).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.support import free_port

pytestmark = [pytest.mark.worker, pytest.mark.slow]

DEMO_TIMEOUT = 110.0
"""Seconds a whole demo run may take here (it takes about 20 s; CI machines are noisy)."""

ROOT = Path(__file__).resolve().parents[2]

STORY = [
    # step 1: the report runs once, beat duplicates and a late copy are skipped
    r"acquired  nightly-report  token \d+",
    r"rejected  nightly-report  held by another execution -> skipped",
    r"ok: the report ran once",
    # step 2: fencing
    r"rejected  account:1 +held by another execution -> fails with LockNotAcquiredError",
    r"SIGSTOP alpha's pool child \(pid \d+\)",
    r"account:1 expired in the store",
    r"ok: bravo's token \d+ > alpha's \d+",
    r"SIGCONT alpha's pool child",
    r"LOST      account:1 +token \d+",
    r"caused by StaleWriteError: write to account 1 with token \d+ rejected",
    # step 3: hand-off
    r"bravo +acquired  cache:prices +token \d+  \(waited",
    r"reused    cache prices",
    # final rows
    r"accounts  id=1 balance=12500 fence=\d+",
    r"reports   id=1 ",
    r"demo OK in [\d.]+s",
]


def run_demo(*args: str, timeout: float = DEMO_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run the demo as a user would, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "example_project", "demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def started_pids(output: str) -> list[int]:
    """The worker and beat pids the demo announced."""
    line = next(x for x in output.splitlines() if "demo    started alpha" in x)
    return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", line)]


def demo_directory(output: str) -> Path:
    """The temporary directory the demo announced."""
    match = re.search(r"directory: (\S+)", output)
    assert match, output
    return Path(match.group(1))


def assert_gone(pids: list[int], directory: Path) -> None:
    """None of ``pids`` runs any more and ``directory`` was removed."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    assert alive == []
    assert not directory.exists()


def assert_story(output: str) -> None:
    """Every line of the story appears in the timeline, in order."""
    position = 0
    for pattern in STORY:
        match = re.compile(pattern).search(output, position)
        assert match, f"missing {pattern!r} after position {position} in:\n{output}"
        position = match.end()


class TestDemo:
    def test_embedded_default_tells_the_whole_story(self) -> None:
        """With no server, the demo runs every step in order, exits 0 and leaves nothing behind."""
        result = run_demo()
        assert result.returncode == 0, result.stdout + result.stderr
        assert_story(result.stdout)
        assert "broker: filesystem://" in result.stdout
        assert_gone(started_pids(result.stdout), demo_directory(result.stdout))

    @pytest.mark.redis
    def test_redis_runs_the_same_story_and_deletes_its_keys(
        self, redis_url: str, redis_client: redis.Redis
    ) -> None:
        """``--redis URL`` tells the same story on Redis and leaves the database empty."""
        redis_client.set("someone-else", "kept")
        result = run_demo("--redis", redis_url)
        assert result.returncode == 0, result.stdout + result.stderr
        assert_story(result.stdout)
        assert f"broker: {redis_url}" in result.stdout
        assert redis_client.keys("*") == [b"someone-else"]
        assert_gone(started_pids(result.stdout), demo_directory(result.stdout))

    def test_interrupt_cleans_up_a_paused_worker(self) -> None:
        """Ctrl-C while a pool child is stopped: exit 130, every process and file gone."""
        # Python keeps SIGINT ignored if it inherits it ignored (a background job): restore it.
        launcher = (
            "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.argv = ['example_project', 'demo']; "
            "runpy.run_module('example_project', run_name='__main__', alter_sys=True)"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", launcher],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        deadline = time.monotonic() + DEMO_TIMEOUT
        try:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                if "SIGSTOP alpha's pool child" in line or time.monotonic() > deadline:
                    break
            process.send_signal(signal.SIGINT)
            rest, errors = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        output = "".join(lines) + rest
        assert "SIGSTOP alpha's pool child" in output, output + errors
        assert process.returncode == 130, output + errors
        assert "demo interrupted: cleaning up" in errors
        assert_gone(started_pids(output), demo_directory(output))


class TestDemoArguments:
    def test_unreachable_redis_is_one_line_and_status_2(self) -> None:
        """``--redis`` to a port nobody listens on: a one-line error, exit 2, no traceback."""
        result = run_demo("--redis", f"redis://127.0.0.1:{free_port()}/0", timeout=30)
        assert result.returncode == 2
        assert "cannot reach Redis" in result.stderr
        assert "Traceback" not in result.stderr

    def test_unknown_command_is_status_2(self) -> None:
        """``python -m example_project frobnicate`` prints the usage and exits 2."""
        result = subprocess.run(
            [sys.executable, "-m", "example_project", "frobnicate"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 2
        assert "usage: python -m example_project demo" in result.stderr

    def test_cli_demo_command_reaches_the_same_entry_point(self) -> None:
        """``celery-lease demo --redis <bad>`` runs example_project.demo.main (status 2 here)."""
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                "from celery_lease.cli import main; main()",
                "demo",
                "--redis",
                f"redis://127.0.0.1:{free_port()}/0",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 2
        assert "cannot reach Redis" in result.stderr
