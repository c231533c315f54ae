"""``celery -A example_project lease list`` shows a lease held by a task running on a real worker.

One ``celery worker -P solo`` of the example app runs on its embedded defaults (kombu's filesystem
broker and the SQLite lease store, both in ``EXAMPLE_DATA_DIR``, a temporary directory). A slow
``rebuild_cache`` holds ``cache:<name>`` while the test runs the CLI as an operator would: a
separate ``celery -A example_project lease ...`` process with the same environment.
"""

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
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Celery
from celery._state import _set_current_app, get_current_app

from celery_lease import LeaseInfo
from celery_lease.stores.sqlite import SQLiteLockStore

pytestmark = [pytest.mark.worker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CACHE = "example_project.tasks.rebuild_cache"

BUILD_SECONDS = 20.0
"""How long the task holds its lease: longer than the test needs, cut short by the clean-up."""

TTL = "6s"
"""The worker's ``lease_default_ttl``: short, so the lease is being renewed while we list it."""

HELD_TIMEOUT = 40.0
"""Seconds for the worker to start and take the lease (a loaded CI machine imports slowly)."""

CLI_TIMEOUT = 30.0
"""Seconds one ``celery ... lease`` command may take."""

STOP_TIMEOUT = 5.0
"""Seconds the worker gets after SIGTERM (a warm shutdown waits for the task) before SIGKILL."""

POLL = 0.05


@dataclass
class LiveWorker:
    """The running worker, its environment and log, and a client app configured like it."""

    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path
    client: Celery
    store_path: Path

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the worker's log."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def celery(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``celery -A example_project <args>`` in a subprocess, with the worker's env."""
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "example_project", *args],
            cwd=ROOT,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
            check=False,
        )

    def wait_held(self, key: str) -> LeaseInfo:
        """Poll the SQLite lease store until ``key`` is held; fail with the log after a deadline."""
        deadline = time.monotonic() + HELD_TIMEOUT
        store: SQLiteLockStore | None = None
        try:
            while True:
                if store is None and self.store_path.exists():
                    store = SQLiteLockStore(self.store_path)
                info = store.get(key) if store is not None else None
                if info is not None:
                    return info
                if self.process.poll() is not None:
                    raise AssertionError(
                        f"worker exited ({self.process.returncode}):\n{self.tail()}"
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{key} not held within {HELD_TIMEOUT:g}s; worker log:\n{self.tail()}"
                    )
                time.sleep(POLL)
        finally:
            if store is not None:
                store.close()


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker; SIGKILL its process group if it has not exited after STOP_TIMEOUT."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever is left of its group
    process.wait()


@pytest.fixture
def live_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveWorker]:
    """One solo worker of the example app, everything in ``tmp_path``; stopped after the test."""
    data = tmp_path / "data"
    env = {
        "EXAMPLE_DATA_DIR": str(data),
        "EXAMPLE_DATABASE_URL": str(tmp_path / "accounts.sqlite3"),
        "EXAMPLE_LEASE_TTL": TTL,
        "EXAMPLE_REMOTE_CONTROL": "0",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        # Configured like the worker would be by default, but without inheriting the caller's.
        "EXAMPLE_BROKER_URL": "",
        "EXAMPLE_RESULT_BACKEND": "",
        "EXAMPLE_LEASE_STORE": "",
        "EXAMPLE_EVENTS_FILE": "",
        "CELERY_LEASE_STORE": "",
    }
    previous = get_current_app()
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # importing the app must not touch the default data dir
    from example_project.app import create_app

    client = create_app(env, main="lease_list_client")
    _set_current_app(previous)
    log = tmp_path / "worker.log"
    command = [
        sys.executable, "-m", "celery", "-A", "example_project.app", "worker",
        "-P", "solo", "-n", "live@%h", "-l", "INFO",
        "--without-mingle", "--without-gossip", "--without-heartbeat",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield LiveWorker(env, process, log, client, data / "leases.sqlite3")
    finally:
        stop(process)
        client.close()


def test_lease_list_and_show_report_the_lease_of_a_running_task(live_worker: LiveWorker) -> None:
    """While rebuild_cache runs, `lease list --json` and `lease show` give its key, owner, token."""
    name = f"live-{uuid.uuid4().hex[:8]}"
    key = f"cache:{name}"
    live_worker.client.send_task(CACHE, kwargs={"name": name, "build_seconds": BUILD_SECONDS})
    held = live_worker.wait_held(key)

    listed = live_worker.celery("lease", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["key"]: row for row in json.loads(listed.stdout)}
    assert key in rows, listed.stdout
    row = rows[key]
    assert set(row) == {
        "key", "slot", "owner", "replaced", "token", "expires_in", "node", "host", "pid", "task",
        "task_id", "label", "taken_at", "held_seconds", "state", "ttl", "cooldown",
        "renewed_seconds_ago", "stale",
    }  # fmt: skip
    assert (row["slot"], row["replaced"]) == (None, False)  # a key without a limit
    assert row["ttl"] == 6.0  # recorded in the owner id; stale or not depends on the load
    assert (row["task"], row["pid"]) == (CACHE, live_worker.process.pid)
    assert isinstance(row["token"], int)
    assert row["token"] == held.token > 0
    assert row["owner"] == held.owner
    # owner ids are host/pid/random; a solo worker runs the task in its own process
    assert row["owner"].split("/")[1] == str(live_worker.process.pid)
    assert 0 < row["expires_in"] <= 6.0

    shown = live_worker.celery("lease", "show", key)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"{key}: held (running) by task {CACHE}[")
    assert f", token {held.token}, expires in" in shown.stdout
    assert f"  owner:    {held.owner}" in shown.stdout

    assert live_worker.process.poll() is None, live_worker.tail()
