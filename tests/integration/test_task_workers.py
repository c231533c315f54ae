"""LockedTask on real ``celery worker`` processes: exclusion, policies, fencing, retry, errors."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from celery import group
from celery.exceptions import TaskRevokedError

from celery_lease import LeaseConfigError, LockLostError, LockNotAcquiredError
from tests.integration.conftest import (
    TIMEOUT,
    WorkerEnv,
    assert_no_overlap,
    intervals,
)
from tests.integration.workers import ROOT

pytestmark = [pytest.mark.worker, pytest.mark.slow]

DUPLICATES = 20
HOLD = 0.05  # seconds each duplicate body runs


def send_duplicates(env: WorkerEnv, task: str, run: str) -> list[object]:
    """Deliver the same key DUPLICATES times; return the final results."""
    results = group(env.app.signature(task, (run, HOLD)) for _ in range(DUPLICATES)).apply_async()
    return list(results.get(timeout=TIMEOUT * 2, interval=0.02, propagate=False))


class TestDuplicates:
    def test_raise(self, worker_env: WorkerEnv) -> None:
        """on_held="raise": bodies never overlap; the rest fail with LockNotAcquiredError."""
        run = worker_env.run_id()
        results = send_duplicates(worker_env, "it.dup_raise", run)
        spans = intervals(worker_env, run)
        assert_no_overlap(spans)
        ran = [r for r in results if r == "ran"]
        rejected = [r for r in results if isinstance(r, LockNotAcquiredError)]
        other = [r for r in results if r != "ran" and not isinstance(r, LockNotAcquiredError)]
        assert not other, f"neither ran nor rejected: {other!r}"
        assert len(ran) == len(spans) >= 1 and len(ran) + len(rejected) == DUPLICATES
        assert all(r.key == f"dup:{run}" for r in rejected)

    def test_skip(self, worker_env: WorkerEnv) -> None:
        """on_held="skip": the runs that held the key succeed, the others end REVOKED with a
        'skipped' reason (not SUCCESS with None); no overlap."""
        run = worker_env.run_id()
        results = send_duplicates(worker_env, "it.dup_skip", run)
        spans = intervals(worker_env, run)
        assert_no_overlap(spans)
        skipped = [r for r in results if isinstance(r, TaskRevokedError)]
        assert all(f"skipped: 'dup:{run}' held" in str(r) for r in skipped), skipped
        assert results.count("ran") == len(spans) >= 1
        assert len(skipped) + len(spans) == DUPLICATES, results

    def test_retry(self, worker_env: WorkerEnv) -> None:
        """on_held="retry": every duplicate eventually runs, one at a time."""
        run = worker_env.run_id()
        results = send_duplicates(worker_env, "it.dup_retry", run)
        spans = intervals(worker_env, run)
        assert_no_overlap(spans)
        assert results == ["ran"] * DUPLICATES and len(spans) == DUPLICATES


class TestBehaviour:
    def test_retry_gets_a_new_token_and_same_key(self, worker_env: WorkerEnv) -> None:
        """self.retry() releases first; the retry runs with the same key and a new token."""
        run = worker_env.run_id()
        result = worker_env.app.send_task("it.retry_once", (run,))
        assert worker_env.get(result) == [1, f"r:{run}"]
        tokens = (worker_env.directory / f"tokens-{run}").read_text().split()
        assert len(tokens) == 2 and int(tokens[1]) > int(tokens[0])

    def test_reentrant_call_reuses_lease(self, worker_env: WorkerEnv) -> None:
        """A locked task calling a @locked function with the same key reuses its token."""
        run = worker_env.run_id()
        outer, inner = worker_env.get(worker_env.app.send_task("it.outer", (run,)))
        assert outer == inner and isinstance(outer, int)

    def test_a_stored_result_is_visible_only_after_the_key_is_free(
        self, worker_env: WorkerEnv
    ) -> None:
        """Results stored in the worker's real backend (Redis, or ``file://``): each result,
        once visible, finds its key free. In a prefork child (one task at a time) on the Redis
        store (which can release without waiting; SQLite cannot, so nothing is deferred there)
        the backend is made to read release replies before it writes (it says so from a
        child's second task on: six calls on two children give one a second); a threads
        worker waits for each reply as before. The order itself (reply read, then write) is
        pinned by ``test_deferral.TestAStoredResultIsWrittenAfterTheReply``: on loopback the
        release already sent is read by the server long before a client could see the
        result."""
        marks = []
        for _ in range(6):
            run = worker_env.run_id()
            marks.append(worker_env.get(worker_env.app.send_task("it.stored_result", (run,))))
            assert worker_env.store.get(f"stored:{run}") is None
        if worker_env.pool == "prefork" and worker_env.name.startswith("redis"):
            assert True in marks, marks
        else:
            assert set(marks) == {None}, marks

    def test_raising_receiver_does_not_break_task(self, worker_env: WorkerEnv) -> None:
        """A lock_acquired receiver that raises leaves the task successful."""
        assert worker_env.get(worker_env.app.send_task("it.boom", ("x",))) == "ok"

    def test_lost_lease_fails_with_lock_lost_error(self, worker_env: WorkerEnv) -> None:
        """A body that checks after an operator force-released its lease fails with
        LockLostError(key); the loss reason says ``"released"`` (not ``"taken"``: nobody else
        holds it)."""
        run = worker_env.run_id()
        result = worker_env.app.send_task("it.lost", (run,))
        worker_env.wait_file(f"held-{run}")
        assert worker_env.store.force_release(f"lost:{run}") is not None  # type: ignore[attr-defined]
        with pytest.raises(LockLostError) as info:
            worker_env.get(result)
        assert info.value.key == f"lost:{run}"
        assert worker_env.wait_file(f"lost-lost-{run}").read_text().strip() == "released"

    def test_revoke_stops_the_body(self, worker_env: WorkerEnv) -> None:
        """on_lost="revoke": the running body is stopped with LockLostError (FAILURE)."""
        run = worker_env.run_id()
        result = worker_env.app.send_task("it.revoke", (run,))
        worker_env.wait_file(f"held-{run}")
        started = time.monotonic()
        worker_env.store.force_release(f"revoke:{run}")  # type: ignore[attr-defined]
        with pytest.raises(LockLostError):
            worker_env.get(result)
        assert result.state == "FAILURE" and time.monotonic() - started < 10

    def test_held_error_round_trips(self, worker_env: WorkerEnv) -> None:
        """LockNotAcquiredError comes back from the result backend with its key."""
        run = worker_env.run_id()
        assert worker_env.store.acquire(f"dup:{run}", "test", 60_000) is not None
        with pytest.raises(LockNotAcquiredError) as info:
            worker_env.get(worker_env.app.send_task("it.dup_raise", (run, 0)))
        assert info.value.key == f"dup:{run}"

    def test_unkeyable_argument(self, worker_env: WorkerEnv) -> None:
        """An argument the default key cannot canonicalise fails with a clear error."""
        result = worker_env.app.send_task("it.unkeyable", (Fraction(1, 3),), serializer="pickle")
        with pytest.raises(LeaseConfigError, match=r"argument 'thing'.*pass `key`"):
            worker_env.get(result)


@pytest.mark.pools("prefork")
def test_fencing_end_to_end(worker_env: WorkerEnv, tmp_path: Path) -> None:
    """A paused holder loses its key to a higher token; its late write is rejected."""
    env = worker_env
    assert env.pool == "prefork"
    resource = tmp_path / "resource.db"
    db = sqlite3.connect(resource)
    with db:
        db.execute("CREATE TABLE resource (id INTEGER PRIMARY KEY, fence INTEGER, writer INT)")
        db.execute("INSERT INTO resource VALUES (1, 0, 0)")
    db.close()
    run = env.run_id()
    first = env.app.send_task("it.fenced", (run, str(resource), True))
    child = int(env.wait_file(f"started-{run}").read_text().split()[0])
    os.kill(child, signal.SIGSTOP)
    try:
        second = env.app.send_task("it.fenced", (run, str(resource), False))
        rows, second_token, _ = env.get(second)  # waits (lock_wait) until the ttl ran out
        assert rows == 1
    finally:
        (env.directory / f"go-{run}").touch()
        os.kill(child, signal.SIGCONT)
    rows, first_token, lost = env.get(first)
    assert second_token > first_token
    assert rows == 0 and lost is True
    assert env.wait_file(f"lost-fence-{run}").read_text().strip() in ("taken", "expired")
    db = sqlite3.connect(resource)
    assert db.execute("SELECT fence FROM resource").fetchone()[0] == second_token
    db.close()


def test_template_with_unknown_parameter_stops_worker_start(tmp_path: Path) -> None:
    """An app defining a template with an unknown parameter fails when it finalizes."""
    module = tmp_path / "bad_app.py"
    module.write_text(
        "from celery import Celery\n"
        "from celery_lease import LockedTask\n"
        "app = Celery('bad', broker='memory://')\n"
        "@app.task(base=LockedTask, lock_key='acct:{acount_id}')\n"
        "def charge(account_id): ...\n"
    )
    probe = subprocess.run(
        [sys.executable, "-c", "import bad_app; bad_app.app.finalize()"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0, probe.stdout
    assert "LeaseConfigError" in probe.stderr and "{acount_id}" in probe.stderr
    assert "parameters are: account_id" in probe.stderr
