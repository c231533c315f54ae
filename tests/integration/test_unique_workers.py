"""Unique at enqueue on a real broker (throwaway redis-server) and real workers.

Messages are counted on the broker (``LLEN`` of the queue); the lock store is the broker's Redis.
Tests that need no worker publish to a queue of their own that nobody consumes.
"""

from __future__ import annotations

import contextlib
import itertools
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
import redis
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_lease import LockStore, store_from_url
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import parse_owner
from tests.fixtures_redis import RedisServer
from tests.integration import workers
from tests.integration.unique_app import make_app
from tests.integration.workers import ROOT, stop_worker
from tests.support import complete_lines, free_port

pytestmark = [pytest.mark.worker, pytest.mark.redis]

READY_TIMEOUT = 40.0  # seconds for a worker to log "ready."
TIMEOUT = 30.0  # seconds a test waits for a result, a file or a key
POLL = 0.02
UNIQUES = ["until_done", "while_queued"]
PREFIX = {"until_done": "ud", "while_queued": "wq"}


@dataclass
class Env:
    app: Celery
    store: LockStore
    redis: redis.Redis
    broker: str
    backend: str
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def wait_file(self, name: str) -> Path:
        path = self.directory / name
        deadline = time.monotonic() + TIMEOUT
        while not complete_lines(path):
            assert time.monotonic() < deadline, f"{name} not written; log:\n{self.tail()}"
            time.sleep(POLL)
        return path

    def wait_free(self, key: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.store.get(key) is not None:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, f"{key} still held; log:\n{self.tail()}"
            time.sleep(POLL)

    def lines(self, name: str) -> list[str]:
        return complete_lines(self.directory / name)

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])


def run_id() -> str:
    return "r" + uuid.uuid4().hex[:11]


def start_worker(
    env: Env, name: str, queue: str = "uq", store: str = ""
) -> tuple[subprocess.Popen[bytes], Path]:
    """A prefork -c 1 worker of ``unique_app`` consuming ``queue``, once it logged ``ready.``."""
    return workers.start_worker(
        "tests.integration.unique_app:app",
        name,
        "prefork",
        1,
        {
            "UQ_BROKER": env.broker,
            "UQ_BACKEND": env.backend,
            "UQ_DIR": str(env.directory),
            "UQ_STORE": store,
        },
        env.directory,
        READY_TIMEOUT,
        args=["-Q", queue],
    )


@contextlib.contextmanager
def client_env(redis_server: RedisServer, directory: Path, broker_db: int) -> Iterator[Env]:
    """The client app on the throwaway Redis: broker db ``broker_db``, results the next one."""
    base = f"redis://127.0.0.1:{redis_server.port}"
    broker, backend = f"{base}/{broker_db}", f"{base}/{broker_db + 1}"
    app = make_app(broker, backend, str(directory))
    env = Env(app, store_from_url(broker), redis.Redis.from_url(broker), broker, backend, directory)
    try:
        yield env
    finally:
        app.close()


@pytest.fixture(scope="module")
def client(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The client app on the throwaway Redis (broker db 10, results db 11), no worker."""
    with client_env(redis_server, tmp_path_factory.mktemp("unique"), 10) as env:
        yield env


@pytest.fixture(scope="module")
def worker(client: Env) -> Iterator[Env]:
    """One prefork worker (-c 1) consuming the ``uq`` queue, for the module."""
    process, log = start_worker(client, "uq1")
    client.process, client.log = process, log
    try:
        yield client
    finally:
        stop_worker(process)
        client.process = None


def task(env: Env, name: str) -> Any:
    return env.app.tasks[f"uq.{name}"]


class TestOneMessage:
    @pytest.mark.parametrize("unique", UNIQUES)
    def test_fifty_threads_publish_one_message(self, client: Env, unique: str) -> None:
        """50 concurrent delay() with one key: LLEN of the queue is 1, one task id for all."""
        run, queue = run_id(), f"idle-{run_id()}"
        body = task(client, unique)
        barrier = threading.Barrier(50)
        ids: list[str] = []
        guard = threading.Lock()

        def call() -> None:
            barrier.wait()
            result = body.apply_async((run,), queue=queue)
            with guard:
                ids.append(result.id)

        threads = [threading.Thread(target=call) for _ in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(ids) == 50 and len(set(ids)) == 1
        assert client.redis.llen(queue) == 1
        holder = client.store.get(f"queued:{PREFIX[unique]}:{run}")  # type: ignore[attr-defined]
        assert holder is not None and parse_owner(holder.owner).task_id == ids[0]

    @pytest.mark.parametrize("unique", UNIQUES)
    def test_two_processes_publish_one_message(self, client: Env, unique: str) -> None:
        """25 threads in each of 2 processes: one message, the same id in both."""
        run, queue = run_id(), f"idle-{run_id()}"
        go = client.directory / f"go-{run}"
        script = (
            "import json, sys, threading, time, pathlib\n"
            "from tests.integration.unique_app import make_app\n"
            "broker, backend, directory, name, run, queue, go = sys.argv[1:]\n"
            "app = make_app(broker, backend, directory)\n"
            "task = app.tasks[name]\n"
            "barrier = threading.Barrier(25)\n"
            "ids = []\n"
            "def call():\n"
            "    barrier.wait()\n"
            "    ids.append(task.apply_async((run,), queue=queue).id)\n"
            "print('ready', flush=True)\n"
            "while not pathlib.Path(go).exists():\n"
            "    time.sleep(0.005)\n"
            "threads = [threading.Thread(target=call) for _ in range(25)]\n"
            "[t.start() for t in threads]\n"
            "[t.join() for t in threads]\n"
            "print(json.dumps(ids), flush=True)\n"
        )
        args = [client.broker, client.backend, str(client.directory), f"uq.{unique}", run, queue]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, *args, str(go)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        go.touch()
        ids: list[str] = []
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0
            ids += json.loads(out.strip().splitlines()[-1])
        assert len(ids) == 50 and len(set(ids)) == 1
        assert client.redis.llen(queue) == 1


class TestFreedKey:
    def test_a_failed_publish_frees_the_key(self, client: Env, redis_server: RedisServer) -> None:
        """The broker is down: the call raises and the queued key is free at once."""
        run = run_id()
        down = make_app(
            f"redis://127.0.0.1:{free_port()}/0", client.backend, str(client.directory),
            store=client.broker,
        )  # fmt: skip
        try:
            with pytest.raises(Exception, match=r"(?i)connect|refused"):
                down.tasks["uq.until_done"].apply_async((run,), retry=False)
        finally:
            down.close()
        assert client.store.get(f"queued:ud:{run}") is None  # type: ignore[attr-defined]
        queue = f"idle-{run_id()}"
        task(client, "until_done").apply_async((run,), queue=queue)
        assert client.redis.llen(queue) == 1

    def test_the_queue_ttl_counts_from_the_eta(self, client: Env) -> None:
        """countdown=5 with queue_ttl 2 s: the key is held for about 7 s, not 2 s."""
        run = run_id()
        task(client, "short").apply_async((run,), countdown=5, queue=f"idle-{run_id()}")
        held = client.store.get(f"queued:sh:{run}")  # type: ignore[attr-defined]
        assert held is not None and 5.0 < held.expires_in <= 7.0


class TestWithWorker:
    def test_until_done_holds_the_key_while_the_body_runs(self, worker: Env) -> None:
        """A call while the copy runs publishes nothing and gets its id; after, a new copy."""
        run = run_id()
        body = task(worker, "until_done")
        first = body.delay(run, 1, True)
        worker.wait_file(f"started-{run}")
        again = body.delay(run, 2)
        assert again.id == first.id
        assert worker.redis.llen("uq") == 0
        (worker.directory / f"go-{run}").touch()
        assert first.get(timeout=TIMEOUT) == 1
        worker.wait_free(f"ud:{run}")
        later = body.delay(run, 3)
        assert later.id != first.id
        assert later.get(timeout=TIMEOUT) == 3
        assert worker.lines(f"calls-{run}") == ["1", "3"]

    def test_task_protocol_1_hands_the_queued_key_over_and_frees_it(self, worker: Env) -> None:
        """A client on ``task_protocol = 1`` (the task id and our header in the message body's
        protocol-1 form): the worker still recognises the copy's queued lease, keeps it while
        the body runs and frees both keys at the end, so the next call is a new copy."""
        client = make_app(worker.broker, worker.backend, str(worker.directory))
        client.conf.task_protocol = 1
        try:
            run = run_id()
            body = client.tasks["uq.until_done"]
            first = body.delay(run, 1, True)
            worker.wait_file(f"started-{run}")
            assert body.delay(run, 2).id == first.id
            held = worker.store.get(f"queued:ud:{run}")  # type: ignore[attr-defined]
            assert held is not None and parse_owner(held.owner).task_id == first.id
            (worker.directory / f"go-{run}").touch()
            assert first.get(timeout=TIMEOUT) == 1
            worker.wait_free(f"ud:{run}")
            worker.wait_free(f"queued:ud:{run}")
            later = body.delay(run, 3)
            assert later.id != first.id
            assert later.get(timeout=TIMEOUT) == 3
            assert worker.lines(f"calls-{run}") == ["1", "3"]
        finally:
            client.close()

    def test_the_running_copy_keeps_its_queued_key_past_queue_ttl(self, worker: Env) -> None:
        """until_done: at start the queued key is taken over for the run lease's ttl (30 s,
        renewed), no longer the 2 s queue_ttl, under the same owner."""
        run = run_id()
        copy = task(worker, "short").delay(run, True)
        worker.wait_file(f"started-{run}")
        deadline = time.monotonic() + TIMEOUT
        while True:  # the renewer renews it once the body starts
            held = worker.store.get(f"queued:sh:{run}")  # type: ignore[attr-defined]
            assert held is not None and parse_owner(held.owner).task_id == copy.id
            if held.expires_in > 2.0:
                break
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(POLL)
        (worker.directory / f"go-{run}").touch()
        assert copy.get(timeout=TIMEOUT) == "short"
        worker.wait_free(f"queued:sh:{run}")

    def test_cooldown_keeps_the_finished_copy_the_existing_one(self, worker: Env) -> None:
        """until_done with lock_cooldown: calls in the cooldown get the finished copy (throttle)."""
        run = run_id()
        body = task(worker, "cool")
        first = body.delay(run)
        assert first.get(timeout=TIMEOUT) == "cool"
        assert body.delay(run).id == first.id
        assert worker.redis.llen("uq") == 0
        assert worker.lines(f"calls-{run}") == ["cool"]

    def test_while_queued_lets_one_copy_wait_beside_the_running_one(self, worker: Env) -> None:
        """while_queued: one copy waits while one runs; more calls get the waiting one."""
        run = run_id()
        body = task(worker, "while_queued")
        running = body.delay(run, 1, True)
        worker.wait_file(f"started-{run}")
        waiting = body.delay(run, 2)
        assert waiting.id != running.id
        assert body.delay(run, 3).id == waiting.id
        (worker.directory / f"go-{run}").touch()
        assert running.get(timeout=TIMEOUT) == 1
        assert waiting.get(timeout=TIMEOUT) == 2
        assert worker.lines(f"calls-{run}") == ["1", "2"]

    def test_retries_keep_their_key_and_are_not_duplicates(self, worker: Env) -> None:
        """A copy that retries twice: every call meanwhile gets its id; it ends with success."""
        run = run_id()
        body = task(worker, "retrying")
        first = body.delay(run, 2)
        seen: set[str] = set()
        deadline = time.monotonic() + TIMEOUT
        # Until the last attempt runs (it waits for go-): calls during the attempts and the
        # retries' countdowns all find the copy.
        while not (worker.directory / f"started-{run}").exists():
            assert time.monotonic() < deadline, worker.tail()
            seen.add(body.delay(run, 2).id)
            time.sleep(POLL)
        seen.add(body.delay(run, 2).id)
        (worker.directory / f"go-{run}").touch()
        assert first.get(timeout=TIMEOUT) == 2
        assert seen == {first.id}
        assert worker.lines(f"calls-{run}") == ["0", "1", "2"]
        worker.wait_free(f"queued:rt:{run}")

    def test_revoke_frees_the_key_when_the_worker_sees_it(self, worker: Env) -> None:
        """A revoked waiting copy frees its key when the worker takes the message."""
        run = run_id()
        blocker = task(worker, "blocker").delay(run)
        worker.wait_file(f"started-{run}")
        copy = task(worker, "until_done").delay(run, 1)
        copy.revoke()
        assert worker.store.get(f"queued:ud:{run}") is not None  # type: ignore[attr-defined]
        (worker.directory / f"go-{run}").touch()
        assert blocker.get(timeout=TIMEOUT) == "unblocked"
        worker.wait_free(f"queued:ud:{run}")
        with pytest.raises(TaskRevokedError):
            copy.get(timeout=TIMEOUT)
        assert worker.lines(f"calls-{run}") == []

    def test_debounce_runs_the_body_once_with_the_last_arguments(self, worker: Env) -> None:
        """5 calls 0.1 s apart, window 1 s: one body, the last arguments; the others REVOKED."""
        run = run_id()
        body = task(worker, "debounced")
        results = []
        for n in range(5):
            results.append(body.delay(run, n))
            time.sleep(0.1)  # the scenario: calls 0.1 s apart
        assert results[-1].get(timeout=TIMEOUT) == 4
        for old, newer in itertools.pairwise(results):
            with pytest.raises(TaskRevokedError, match=f"superseded by {newer.id}"):
                old.get(timeout=TIMEOUT)
        assert worker.lines(f"calls-{run}") == ["4"]


class TestKilledWorker:
    def test_a_copy_lost_with_its_worker_frees_the_key_within_queue_ttl(self, client: Env) -> None:
        """The worker is SIGKILLed holding the unstarted copy: the key frees after queue_ttl."""
        process, log = start_worker(client, "uqkill", queue="uqkill")  # alone on its queue
        run = run_id()
        try:
            copy = task(client, "short").apply_async((run,), countdown=1, queue="uqkill")
            deadline = time.monotonic() + TIMEOUT
            while f"uq.short[{copy.id}]" not in log.read_text(errors="replace"):
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(POLL)
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        held = client.store.get(f"queued:sh:{run}")  # type: ignore[attr-defined]
        assert held is not None and held.expires_in <= 3.0  # countdown 1 s + queue_ttl 2 s
        client.wait_free(f"queued:sh:{run}")
        assert client.lines(f"calls-{run}") == []
        again = task(client, "short").apply_async((run,), queue=f"idle-{run_id()}")
        assert again.id != copy.id

    def test_a_worker_killed_mid_body_frees_both_keys_and_a_new_call_runs(
        self, client: Env
    ) -> None:
        """until_done: the whole worker is SIGKILLed while the body runs (no reaper survives):
        the run lease and the queued lease free by themselves within the run ttl (2 s; the
        queued one at most queue_ttl, 3 s, if its first renewal had not landed), and a new
        delay() for the key then publishes a new copy, which runs."""
        process, _log = start_worker(client, "uqmid", queue="uqmid")
        run = run_id()
        body = task(client, "brief")
        try:
            copy = body.apply_async((run, 1, True), queue="uqmid")
            client.wait_file(f"started-{run}")
            assert client.store.get(f"br:{run}") is not None  # type: ignore[attr-defined]
            assert client.store.get(f"queued:br:{run}") is not None  # type: ignore[attr-defined]
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        killed = time.monotonic()
        assert body.apply_async((run, 9), queue=f"idle-{run}").id == copy.id  # still held
        client.wait_free(f"br:{run}")
        client.wait_free(f"queued:br:{run}")
        assert time.monotonic() - killed < 3.0 + 1.0  # max(ttl, queue_ttl) + polling slack
        queue = f"after-{run}"
        again = body.apply_async((run, 2), queue=queue)
        assert again.id != copy.id
        assert client.redis.llen(queue) == 1
        process, _log = start_worker(client, "uqafter", queue=queue)
        try:
            assert again.get(timeout=TIMEOUT, interval=POLL) == 2
        finally:
            stop_worker(process)
        assert client.lines(f"calls-{run}") == ["1", "2"]


@pytest.fixture(scope="module")
def fs_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """kombu's filesystem transport, a SQLite lock store and one prefork worker (-c 1)."""
    directory = tmp_path_factory.mktemp("unique-fs")
    (directory / "results").mkdir()
    broker, backend = "filesystem://", f"file://{directory / 'results'}"
    store = f"sqlite:///{directory / 'leases.db'}"
    app = make_app(broker, backend, str(directory), store=store)
    env = Env(app, store_from_url(store), None, broker, backend, directory)  # type: ignore[arg-type]
    env.process, env.log = start_worker(env, "uqfs", store=store)
    try:
        yield env
    finally:
        stop_worker(env.process)
        app.close()


class TestFilesystemTransport:
    @pytest.mark.parametrize("unique", UNIQUES)
    def test_fifty_threads_publish_one_message(self, fs_worker: Env, unique: str) -> None:
        """50 concurrent delay() on the filesystem transport: one message file, one id."""
        run, queue = run_id(), f"idle{run_id()}"
        body = task(fs_worker, unique)
        barrier = threading.Barrier(50)
        ids: list[str] = []
        guard = threading.Lock()

        def call() -> None:
            barrier.wait()
            result = body.apply_async((run,), queue=queue)
            with guard:
                ids.append(result.id)

        threads = [threading.Thread(target=call) for _ in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(ids) == 50 and len(set(ids)) == 1
        messages = list((fs_worker.directory / "broker").glob(f"*.{queue}.msg"))
        assert len(messages) == 1

    def test_until_done_runs_once_and_frees_the_key(self, fs_worker: Env) -> None:
        """A worker on the filesystem transport hands the key over and frees it at the end."""
        run = run_id()
        body = task(fs_worker, "until_done")
        first = body.delay(run, 1, True)
        fs_worker.wait_file(f"started-{run}")
        assert body.delay(run, 2).id == first.id
        (fs_worker.directory / f"go-{run}").touch()
        assert first.get(timeout=TIMEOUT, interval=POLL) == 1
        fs_worker.wait_free(f"ud:{run}")
        fs_worker.wait_free(f"queued:ud:{run}")
        assert fs_worker.lines(f"calls-{run}") == ["1"]


# A second delivery of a running copy (acks_late redelivery), forced by publishing again --------


@pytest.fixture(scope="module")
def env(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The client app on the throwaway Redis (broker db 12, results db 13)."""
    with client_env(redis_server, tmp_path_factory.mktemp("unique-redelivery"), 12) as env:
        yield env


def wait_log(env: Env, log: Any, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log.read_text()[-3000:]}"
        time.sleep(POLL)


def wait_turned_away(env: Env, log: Any) -> None:
    """Wait until the second worker handled the second delivery: it logs the deferral, or
    Celery logs a LockNotAcquiredError should the delivery be refused instead (each test's
    assertions tell the two apart)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        text = log.read_text(errors="replace")
        if "delivered again while" in text or "LockNotAcquiredError" in text:
            return
        assert time.monotonic() < deadline, f"second delivery not handled:\n{text[-3000:]}"
        time.sleep(POLL)


def deliver_again(env: Env, name: str, first: Any, run: str, prefix: str, queue: str) -> None:
    """Publish the running copy's own message again (same id and header) to ``queue``."""
    qkey = f"queued:{prefix}:{run}"
    held = env.store.get(qkey)  # type: ignore[attr-defined]
    assert held is not None
    env.app.send_task(
        name,
        args=(run, 1, True),
        task_id=first.id,
        headers={unique_common.HEADER: [qkey, held.owner]},
        queue=queue,
    )


def start_and_deliver_again(
    env: Env, name: str, prefix: str, queue: str, again_queue: str, again_log: Any
) -> tuple[str, Any]:
    """Start a copy of ``name`` (key ``prefix:run``) on ``queue``, its body held by its go file;
    once it runs, deliver its message again to ``again_queue`` and wait until that worker (log
    ``again_log``) turned it away. Returns the run id and the copy's AsyncResult."""
    run = run_id()
    first = env.app.tasks[name].apply_async((run, 1, True), queue=queue)
    env.wait_file(f"started-{run}")
    deliver_again(env, name, first, run, prefix, again_queue)
    wait_turned_away(env, again_log)
    return run, first


class TestRedelivery:
    def test_a_second_delivery_of_the_running_copy_keeps_its_queued_key(self, env: Env) -> None:
        """until_done: the running copy's message delivered again to another worker is turned
        away by the run lease, and the queued key stays held: no new copy is published."""
        a_proc, _a_log = start_worker(env, "rva", queue="rva")
        b_proc, b_log = start_worker(env, "rvb", queue="rvb")
        try:
            run, first = start_and_deliver_again(env, "uq.until_done", "ud", "rva", "rvb", b_log)
            body = env.app.tasks["uq.until_done"]
            qkey = f"queued:ud:{run}"
            assert env.store.get(qkey) is not None  # type: ignore[attr-defined]
            again = body.apply_async((run, 2), queue="idle-" + run)
            assert again.id == first.id
            assert env.redis.llen("idle-" + run) == 0
            (env.directory / f"go-{run}").touch()
            deadline = time.monotonic() + TIMEOUT
            while env.lines(f"calls-{run}") != ["1"] or env.store.get(f"ud:{run}") is not None:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, env.lines(f"calls-{run}")
                time.sleep(POLL)
        finally:
            stop_worker(a_proc)
            stop_worker(b_proc)

    def test_a_second_delivery_does_not_fail_the_running_copy(self, env: Env) -> None:
        """The second delivery of a running copy is not a duplicate of itself: the copy's
        result is not set to FAILURE while its body still runs, and the copy ends in SUCCESS."""
        a_proc, _a_log = start_worker(env, "rfa", queue="rfa")
        b_proc, b_log = start_worker(env, "rfb", queue="rfb")
        try:
            run, first = start_and_deliver_again(env, "uq.until_done", "ud", "rfa", "rfb", b_log)
            state = first.state  # the body still waits for its go file
            (env.directory / f"go-{run}").touch()
            assert state != "FAILURE", first.result
            assert first.get(timeout=TIMEOUT, interval=POLL) == 1
        finally:
            stop_worker(a_proc)
            stop_worker(b_proc)

    def test_a_second_delivery_runs_the_body_when_the_running_copy_died(self, env: Env) -> None:
        """The worker of the running copy is SIGKILLed: the deferred second delivery runs the
        body once the run lease has freed (the work is never dropped), and stores its result."""
        a_proc, _a_log = start_worker(env, "rda", queue="rda")
        b_proc, b_log = start_worker(env, "rdb", queue="rdb")
        try:
            run, first = start_and_deliver_again(env, "uq.brief", "br", "rda", "rdb", b_log)
            os.killpg(a_proc.pid, signal.SIGKILL)
            a_proc.wait()
            deadline = time.monotonic() + TIMEOUT
            while len(env.lines(f"started-{run}")) < 2:  # the second delivery's body started
                assert time.monotonic() < deadline, b_log.read_text()[-3000:]
                time.sleep(POLL)
            (env.directory / f"go-{run}").touch()
            assert first.get(timeout=TIMEOUT, interval=POLL) == 1
            assert env.lines(f"calls-{run}") == ["1", "1"]
        finally:
            stop_worker(a_proc)
            stop_worker(b_proc)

    def test_a_second_delivery_of_a_finished_copy_does_not_run_again(self, env: Env) -> None:
        """The running copy ends in SUCCESS while its second delivery waits: when that comes
        back it sees the stored result, ends without its body, and stores nothing over it."""
        a_proc, _a_log = start_worker(env, "rsa", queue="rsa")
        b_proc, b_log = start_worker(env, "rsb", queue="rsb")
        try:
            run, first = start_and_deliver_again(env, "uq.brief", "br", "rsa", "rsb", b_log)
            (env.directory / f"go-{run}").touch()
            assert first.get(timeout=TIMEOUT, interval=POLL) == 1
            wait_log(env, b_log, "delivered again after it finished")
            assert env.lines(f"calls-{run}") == ["1"]
            assert first.state == "SUCCESS"
            env.wait_free(f"br:{run}")
            assert env.store.get(f"queued:br:{run}") is None  # type: ignore[attr-defined]
        finally:
            stop_worker(a_proc)
            stop_worker(b_proc)
