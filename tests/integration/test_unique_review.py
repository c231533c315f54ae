"""Review of unique at enqueue (issue 9) with real workers on a throwaway redis-server.

A second delivery of a running copy (what acks_late redelivery does) is forced by publishing
the copy's own message again, same task id and ``lease_queued`` header, to a second worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_lease import store_from_url
from celery_lease import unique as unique_module
from tests.fixtures_redis import RedisServer
from tests.integration.conftest import stop_worker
from tests.integration.test_unique_workers import TIMEOUT, Env, run_id, start_worker
from tests.integration.unique_app import make_app

pytestmark = [pytest.mark.worker, pytest.mark.redis]

POLL = 0.02


@pytest.fixture(scope="module")
def env(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The client app on the throwaway Redis (broker db 12, results db 13)."""
    base = f"redis://127.0.0.1:{redis_server.port}"
    directory = tmp_path_factory.mktemp("unique-review")
    broker, backend = f"{base}/12", f"{base}/13"
    app = make_app(broker, backend, str(directory))
    env = Env(app, store_from_url(broker), redis.Redis.from_url(broker), broker, backend, directory)
    try:
        yield env
    finally:
        app.close()


def wait_log(env: Env, log: Any, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log.read_text()[-3000:]}"
        time.sleep(POLL)


class TestRedelivery:
    def test_a_second_delivery_of_the_running_copy_keeps_its_queued_key(self, env: Env) -> None:
        """until_done: the running copy's message delivered again to another worker is turned
        away by the run lease, and the queued key stays held: no new copy is published."""
        a_proc, _a_log = start_worker(env, "rva", queue="rva")
        b_proc, b_log = start_worker(env, "rvb", queue="rvb")
        try:
            run = run_id()
            body = env.app.tasks["uq.until_done"]
            first = body.apply_async((run, 1, True), queue="rva")
            env.wait_file(f"started-{run}")
            qkey = f"queued:ud:{run}"
            held = env.store.get(qkey)  # type: ignore[attr-defined]
            assert held is not None
            env.app.send_task(
                "uq.until_done",
                args=(run, 1, True),
                task_id=first.id,
                headers={unique_module.HEADER: [qkey, held.owner]},
                queue="rvb",
            )
            wait_log(env, b_log, "LockNotAcquiredError")
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

    @pytest.mark.xfail(
        strict=True,
        reason="engine.py: a delivery turned away by its own task id's run lease raises"
        " LockNotAcquiredError (on_held='raise') and stores FAILURE under the running copy's id",
    )
    def test_a_second_delivery_does_not_fail_the_running_copy(self, env: Env) -> None:
        """The second delivery of a running copy is not a duplicate of itself: the copy's
        result is not set to FAILURE while its body still runs."""
        a_proc, _a_log = start_worker(env, "rfa", queue="rfa")
        b_proc, b_log = start_worker(env, "rfb", queue="rfb")
        try:
            run = run_id()
            body = env.app.tasks["uq.until_done"]
            first = body.apply_async((run, 1, True), queue="rfa")
            env.wait_file(f"started-{run}")
            qkey = f"queued:ud:{run}"
            held = env.store.get(qkey)  # type: ignore[attr-defined]
            assert held is not None
            env.app.send_task(
                "uq.until_done",
                args=(run, 1, True),
                task_id=first.id,
                headers={unique_module.HEADER: [qkey, held.owner]},
                queue="rfb",
            )
            wait_log(env, b_log, f"[{first.id}]")
            wait_log(env, b_log, "LockNotAcquiredError")
            state = first.state  # the body still waits for its go file
            (env.directory / f"go-{run}").touch()
            assert state != "FAILURE", first.result
        finally:
            stop_worker(a_proc)
            stop_worker(b_proc)
