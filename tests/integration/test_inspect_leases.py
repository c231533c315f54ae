"""``celery -A proj inspect leases``: a real worker answers with the leases its processes hold.

Real ``celery worker`` subprocesses (prefork -c 2, threads -c 2, solo) on a throwaway
``redis-server`` broker, lock store in that Redis. The worker runs the app defined at the top of
this module (``-A tests.integration.test_inspect_leases:app``, configured from ``IL_*``
environment variables). Bodies say they hold their key by writing a marker file and hold it until
the test writes ``done-<run>``; the test then asks the worker, as an operator would: through
Celery's remote control (``app.control.inspect``) and with the ``celery inspect leases`` command.

Under prefork the leases live in the pool children, which the worker's main process asks over a
unix socket each (see :mod:`celery_lease._celery.control`); under threads and solo they are the main
process's own. A solo worker runs the body on the thread that answers remote control, so it can
answer only while no body runs: its leases held outside a body (here: by a thread a task
started) are the ones it reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import LockedTask, StoreUnavailableError, lease, store_from_url
from tests.faults.harness import wait_stopped
from tests.integration.workers import ROOT
from tests.support import complete_lines

TIMEOUT = 30.0  # seconds a test waits for a marker file or a condition
WAIT = 60.0  # seconds a body holds its key at most
FAILING = "failing"  # renewals of keys containing this fail (the store wrapper below)

pytestmark = [pytest.mark.worker, pytest.mark.slow]


# The app the workers run -----------------------------------------------------------------------


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def _hold_until_done(out: Path, run: str) -> None:
    deadline = time.monotonic() + WAIT
    while not (out / f"done-{run}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


class FailingRenewals:
    """The worker's lock store; every renewal of a key containing ``failing`` fails."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "renew_many":  # one renewal per call, so each key fails on its own
            raise AttributeError(name)
        return getattr(self.inner, name)

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.inner.acquire(key, owner, ttl_ms)  # type: ignore[no-any-return]

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if FAILING in key:
            raise StoreUnavailableError(f"injected renewal failure of {key}")
        return self.inner.renew(key, owner, ttl_ms)  # type: ignore[no-any-return]

    def release(self, key: str, owner: str) -> None:
        self.inner.release(key, owner)


def make_app(broker: str, directory: str, queue: str) -> Celery:
    """The test app: the worker (from the environment) and the test process build it alike."""
    app = Celery("il", broker=broker, backend=broker, set_as_current=False)
    out = Path(directory)
    app.conf.update(
        lease_store=FailingRenewals(store_from_url(broker)),
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,  # one queue per worker: no message outlives its test
    )

    @app.task(
        shared=False, name="il.hold", bind=True, base=LockedTask, lock_key="il:{run}", lock_ttl="3s"
    )
    def hold(self: Any, run: str) -> None:
        """Hold ``il:<run>`` (renewed every second) until the test says done."""
        _append(out / f"held-{run}", json.dumps([os.getpid(), self.request.lock_token]))
        _hold_until_done(out, run)

    @app.task(
        shared=False,
        name="il.failing",
        bind=True,
        base=LockedTask,
        lock_key="il:{run}",
        lock_ttl="9s",
    )
    def failing(self: Any, run: str) -> None:
        """Hold ``il:<run>`` (whose renewals fail, the first after 3 s) until the test says done."""
        _append(out / f"held-{run}", json.dumps([os.getpid(), self.request.lock_token]))
        _hold_until_done(out, run)

    @app.task(shared=False, name="il.background")
    def background(run: str) -> None:
        """Start a thread that holds ``il:<run>`` after this body returned (solo answers then)."""

        def hold_in_thread() -> None:
            with lease(f"il:{run}", store=store_from_url(broker), ttl="3s") as held:
                _append(out / f"held-{run}", json.dumps([os.getpid(), held.token]))
                _hold_until_done(out, run)

        threading.Thread(target=hold_in_thread, daemon=True).start()

    return app


if os.environ.get("IL_BROKER"):
    app = make_app(os.environ["IL_BROKER"], os.environ["IL_DIR"], os.environ["IL_QUEUE"])


# The harness -----------------------------------------------------------------------------------


@dataclass
class Worker:
    """A running worker of this module's app, a client app like it, and its environment."""

    app: Celery
    pool: str
    node: str
    env: dict[str, str]
    directory: Path
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def held(self, run: str) -> tuple[int, int]:
        """Wait until the body of ``run`` holds its key: ``(pid, token)``."""
        path = self.directory / f"held-{run}"
        deadline = time.monotonic() + TIMEOUT
        while not complete_lines(path):
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited ({self.process.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{run} not held within {TIMEOUT}s; log:\n{self.tail()}")
            time.sleep(0.02)
        pid, token = json.loads(complete_lines(path)[0])
        return int(pid), int(token)

    def done(self, run: str) -> None:
        (self.directory / f"done-{run}").write_text("")

    def inspect(self, timeout: float = 5.0) -> dict[str, Any]:
        """This worker's answer to ``inspect leases`` (through the remote-control API)."""
        inspector = self.app.control.inspect(destination=[self.node], timeout=timeout)
        replies = inspector._request("leases") or {}
        assert self.node in replies, f"no answer from {self.node}: {replies}; log:\n{self.tail()}"
        return replies[self.node]  # type: ignore[no-any-return]

    def inspect_until(self, accept: Any, what: str) -> dict[str, Any]:
        """Ask again until ``accept(answer)`` holds (renewals happen on the worker's schedule)."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            answer = self.inspect()
            if accept(answer):
                return answer
            if time.monotonic() > deadline:
                raise AssertionError(f"never {what}: {answer}; log:\n{self.tail()}")
            time.sleep(0.2)

    def rows(self, answer: dict[str, Any], run: str) -> list[dict[str, Any]]:
        return [row for row in answer["leases"] if row["key"] == f"il:{run}"]


def _worker(
    request: pytest.FixtureRequest, tmp_path: Path, pool: str, concurrency: int
) -> Iterator[Worker]:
    from tests.fixtures_redis import RedisServer
    from tests.integration.test_dead_holders import READY_TIMEOUT
    from tests.integration.workers import start_worker, stop_worker

    server: RedisServer = request.getfixturevalue("redis_server")
    broker = f"redis://127.0.0.1:{server.port}/4"
    name = f"il{uuid.uuid4().hex[:6]}"
    env = {"IL_BROKER": broker, "IL_DIR": str(tmp_path), "IL_QUEUE": name}
    client = make_app(broker, str(tmp_path), name)
    process, log = start_worker(
        "tests.integration.test_inspect_leases:app",
        name,
        pool,
        concurrency,
        env,
        tmp_path,
        READY_TIMEOUT,
    )
    try:
        yield Worker(client, pool, f"{name}@{os.uname().nodename}", env, tmp_path, process, log)
    finally:
        for path in tmp_path.glob("held-*"):
            (tmp_path / path.name.replace("held-", "done-", 1)).write_text("")
        stop_worker(process)
        client.close()


@pytest.fixture(params=[("prefork", 2), ("threads", 2)], ids=["prefork", "threads"])
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Worker]:
    """A worker whose pool runs two bodies at once."""
    pool, concurrency = request.param
    yield from _worker(request, tmp_path, pool, concurrency)


@pytest.fixture
def solo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Worker]:
    yield from _worker(request, tmp_path, "solo", 1)


def run_id() -> str:
    return "r" + uuid.uuid4().hex[:10]


# The tests -------------------------------------------------------------------------------------


class TestInspectLeases:
    def test_each_running_body_is_listed_with_its_process_task_and_times(self, worker: Worker):
        """Two bodies hold a key each: both are listed with the holding pid, token, task id,
        held for, validity left, renewals (they renew every second) and no renewal error."""
        runs = [run_id(), run_id()]
        results = {run: worker.app.send_task("il.hold", kwargs={"run": run}) for run in runs}
        held = {run: worker.held(run) for run in runs}
        main_pid = worker.process.pid

        def renewed(answer: dict[str, Any]) -> bool:
            rows = [worker.rows(answer, run) for run in runs]
            return all(len(r) == 1 and r[0]["renewals"] >= 1 for r in rows)

        answer = worker.inspect_until(renewed, "renewed")
        assert answer["pool"] == ("prefork" if worker.pool == "prefork" else "thread")
        assert answer["unanswered"] == []
        for run in runs:
            (row,) = worker.rows(answer, run)
            pid, token = held[run]
            assert (row["pid"], row["token"]) == (pid, token)
            assert (row["task"], row["task_id"]) == ("il.hold", results[run].id)
            assert row["node"] == worker.node
            assert 1.0 <= row["held_seconds"] < TIMEOUT + 5
            assert 0 < row["valid_for_seconds"] <= 3
            assert row["last_renewal_error"] is None
            assert f"/{pid}/" in row["owner"]
        pids = {held[run][0] for run in runs}
        if worker.pool == "prefork":
            assert len(pids) == 2 and main_pid not in pids  # each child answered for its own
        else:
            assert pids == {main_pid}
        for run in runs:
            worker.done(run)
            results[run].get(timeout=TIMEOUT)
        after = worker.inspect()
        assert [worker.rows(after, run) for run in runs] == [[], []]

    def test_a_failed_renewal_is_reported(self, worker: Worker):
        """A lease whose renewal failed shows the error (and still its validity left)."""
        run = f"{run_id()}-{FAILING}"
        result = worker.app.send_task("il.failing", kwargs={"run": run})
        worker.held(run)
        answer = worker.inspect_until(
            lambda a: any(r["last_renewal_error"] for r in worker.rows(a, run)), "a renewal error"
        )
        (row,) = worker.rows(answer, run)
        assert row["last_renewal_error"].startswith("StoreUnavailableError: injected")
        assert row["renewals"] == 0
        worker.done(run)
        result.get(timeout=TIMEOUT, propagate=False)

    def test_the_celery_inspect_command_prints_the_answer(self, worker: Worker):
        """``celery -A app inspect leases --json`` is accepted and prints the worker's leases."""
        run = run_id()
        result = worker.app.send_task("il.hold", kwargs={"run": run})
        pid, token = worker.held(run)
        command = [
            sys.executable, "-m", "celery", "-A", "tests.integration.test_inspect_leases:app",
            "inspect", "leases", "--json", "-d", worker.node, "--timeout", "10",
        ]  # fmt: skip
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, **worker.env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        print(f"\n$ celery -A ... inspect leases --json -d {worker.node}\n{done.stdout}")
        replies = json.loads(done.stdout)
        (row,) = [r for r in replies[worker.node]["leases"] if r["key"] == f"il:{run}"]
        assert (row["pid"], row["token"], row["task_id"]) == (pid, token, result.id)
        worker.done(run)
        result.get(timeout=TIMEOUT)


class TestPreforkChildren:
    def test_a_child_that_cannot_answer_is_named_not_shown_empty(self, request, tmp_path: Path):
        """A stopped child (SIGSTOP) is listed in ``unanswered``; the others still answer."""
        gen = _worker(request, tmp_path, "prefork", 2)
        worker = next(gen)
        try:
            run, stuck = run_id(), run_id()
            first = worker.app.send_task("il.hold", kwargs={"run": run})
            second = worker.app.send_task("il.hold", kwargs={"run": stuck})
            pid, _ = worker.held(run)
            stuck_pid, _ = worker.held(stuck)
            os.kill(stuck_pid, signal.SIGSTOP)
            try:
                # Stopped only once a thread of it took the signal: one blocked in a system call
                # (the body's file write) leaves its answering thread running until then.
                wait_stopped(stuck_pid)
                answer = worker.inspect()
            finally:
                os.kill(stuck_pid, signal.SIGCONT)
            assert [u["pid"] for u in answer["unanswered"]] == [stuck_pid]
            assert "no answer within" in answer["unanswered"][0]["error"]
            assert [r["pid"] for r in worker.rows(answer, run)] == [pid]
            assert worker.rows(answer, stuck) == []
            worker.done(run)
            worker.done(stuck)
            first.get(timeout=TIMEOUT)
            second.get(timeout=TIMEOUT)
        finally:
            gen.close()


class TestSolo:
    def test_solo_answers_with_the_leases_of_its_process(self, solo: Worker):
        """A solo worker answers from its own process: a lease a thread holds after its task
        returned is listed with the main process's pid (during a body, solo answers nothing)."""
        run = run_id()
        solo.app.send_task("il.background", kwargs={"run": run}).get(timeout=TIMEOUT)
        pid, token = solo.held(run)
        assert pid == solo.process.pid
        answer = solo.inspect_until(lambda a: len(solo.rows(a, run)) == 1, "listed")
        assert answer["pool"] == "solo" and answer["unanswered"] == []
        (row,) = solo.rows(answer, run)
        assert (row["pid"], row["token"]) == (pid, token)
        assert row["node"] == solo.node
        solo.done(run)
        solo.inspect_until(lambda a: solo.rows(a, run) == [], "released")
