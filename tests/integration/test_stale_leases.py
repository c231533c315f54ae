"""After a whole worker dies, ``celery lease show`` and ``list`` say its lease is stale.

A real ``celery worker`` (solo pool, filesystem broker, file results, an SQLite store file) runs
a locked task with a 6 s ttl; the test SIGKILLs the worker's whole process group, so nothing is
left to renew or free the lease. Until the key frees itself, the CLI must not keep saying plainly
"held (running)": once the lease has not been renewed for a third of its ttl (plus the margin)
it is marked stale.
"""

from __future__ import annotations

import json
import os
import signal
import time
import types
from pathlib import Path

import pytest
from celery import Celery
from click.testing import CliRunner

from celery_lease import LockedTask
from celery_lease._celery import settings as config
from celery_lease.cli import lease_group, stale_margin
from tests.integration.workers import CeleryWorker, filesystem_app
from tests.support import complete_lines

pytestmark = [pytest.mark.worker]

START_TIMEOUT = 60.0  # seconds for the worker to log "ready."
TIMEOUT = 30.0  # seconds for a marker file
POLL = 0.05
TTL = 6.0  # the lease's ttl: renewed every 2 s, stale past 3 s (1 s margin), free after 6 s


def make_app(directory: str) -> Celery:
    app = filesystem_app("stale", directory, POLL)
    app.conf.update(lease_store=f"sqlite:///{directory}/leases.db", lease_default_ttl=TTL)

    @app.task(name="stale.hold", base=LockedTask, lock_key="report:{run}", shared=False)
    def hold(run: str) -> None:
        """Say it started, then hold the key until the worker is killed."""
        (Path(directory) / f"{run}.started").write_text("started\n")
        time.sleep(TIMEOUT)

    return app


if os.environ.get("ST_DIR"):
    app = make_app(os.environ["ST_DIR"])


def test_a_dead_workers_lease_is_shown_stale_until_it_expires(tmp_path: Path) -> None:
    worker = CeleryWorker(
        f"{__name__}:app",
        tmp_path / "worker.log",
        pool="solo",
        concurrency=1,
        name="stale",
        env={"ST_DIR": str(tmp_path)},
    )
    client = make_app(str(tmp_path))
    obj = types.SimpleNamespace(app=client)
    try:
        worker.wait_ready(START_TIMEOUT)
        client.send_task("stale.hold", args=["r1"])
        deadline = time.monotonic() + TIMEOUT
        while not complete_lines(tmp_path / "r1.started"):
            assert time.monotonic() < deadline, worker.text()
            time.sleep(POLL)
        os.killpg(worker.process.pid, signal.SIGKILL)  # the whole worker: nobody frees the key
        worker.process.wait()
        seen: list[dict[str, object]] = []
        shown = ""
        while True:  # until the key frees itself: ends within one ttl
            listed = CliRunner().invoke(lease_group, ["list", "--json"], obj=obj)
            assert listed.exit_code == 0, listed.output
            rows = json.loads(listed.stdout)
            if not rows:
                break
            seen.append(rows[0])
            if rows[0]["stale"] and not shown:
                shown = CliRunner().invoke(lease_group, ["show", "report:r1"], obj=obj).stdout
            time.sleep(POLL)
    finally:
        worker.stop()
        config.reset(client)
        client.close()
    assert seen, "the lease was gone before the first look"
    assert seen[0]["state"] == "running"
    stale = [row for row in seen if row["stale"]]
    assert stale, [(row["renewed_seconds_ago"], row["expires_in"]) for row in seen]
    threshold = TTL / 3 + stale_margin(TTL)
    assert all(float(row["renewed_seconds_ago"]) > threshold for row in stale)  # type: ignore[arg-type]
    assert shown.startswith("report:r1: held (running, stale: not renewed for "), shown
