"""Review of unique at enqueue (issue 9) with real workers on a throwaway redis-server.

A second delivery of a running copy (what acks_late redelivery does) is forced by publishing
the copy's own message again, same task id and ``lease_queued`` header, to a second worker.
``uq.brief`` (run ttl 2 s) is the copy when the test waits for the second delivery to come back.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_lease import unique as unique_module
from tests.fixtures_redis import RedisServer
from tests.integration.conftest import stop_worker
from tests.integration.test_unique_workers import TIMEOUT, Env, client_env, run_id, start_worker

pytestmark = [pytest.mark.worker, pytest.mark.redis]

POLL = 0.02


@pytest.fixture(scope="module")
def env(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The client app on the throwaway Redis (broker db 12, results db 13)."""
    with client_env(redis_server, tmp_path_factory.mktemp("unique-review"), 12) as env:
        yield env


def wait_log(env: Env, log: Any, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log.read_text()[-3000:]}"
        time.sleep(POLL)


def wait_turned_away(env: Env, log: Any) -> None:
    """Wait until the second worker handled the second delivery without running its body
    (the fix logs the deferral; before it, Celery logged the LockNotAcquiredError)."""
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
        headers={unique_module.HEADER: [qkey, held.owner]},
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
