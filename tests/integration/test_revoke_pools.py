"""``on_lost="revoke"`` on real ``celery worker`` processes, one per pool (prefork, solo, threads,
eventlet), with soft time limits beside it.

This module is also the workers' app (``-A tests.integration.test_revoke_pools:app``), configured
from ``RP_BROKER`` and ``RP_DIR``: a throwaway ``redis-server`` is the broker, the result backend
and (by default, the broker's Redis) the lock store, which the test force-releases to make a
running body lose its lease. Bodies leave marker files in ``RP_DIR``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery

from celery_lease import LockedTask, LockLostError, store_from_url
from celery_lease._celery import interrupt as _interrupt
from tests.integration.conftest import READY_TIMEOUT, WorkerEnv
from tests.integration.workers import STOP_TIMEOUT, CeleryWorker, stop_worker
from tests.support import service_missing

POLL = 0.01  # seconds between checks in bodies
WAIT = 20.0  # seconds a body runs at most when nothing stops it


def _append(path: Path, line: str) -> None:
    with open(path, "a") as out:
        out.write(line + "\n")


def _chain(exc: BaseException | None) -> list[str]:
    """The exception's type name, then those of the exceptions it was raised while handling."""
    names = []
    while exc is not None:
        names.append(type(exc).__name__)
        exc = exc.__context__
    return names


def make_app(broker: str, directory: str) -> Celery:
    """The workers' app; the test process builds the same one as a client."""
    app = Celery("rp", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_serializer="json",
        # A throwaway redis-server started by this session: no restart grace (see docs/stores.md).
        lease_restart_grace=0,
    )
    out = Path(directory)
    revoke = {"base": LockedTask, "lock_ttl": "0.6s", "lock_on_lost": "revoke", "shared": False}

    @app.task(name="rp.revoke_polling", lock_key="rp:{run}", **revoke)
    def revoke_polling(run: str) -> str:
        """Runs Python code between short sleeps (what the threads pool can interrupt)."""
        _append(out / f"held-{run}", str(os.getpid()))
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            time.sleep(POLL)
        return "finished"

    @app.task(name="rp.revoke_blocking", lock_key="rp:{run}", soft_time_limit=30, **revoke)
    def revoke_blocking(run: str) -> str:
        """One blocking sleep: only a signal interrupts it (prefork, solo)."""
        _append(out / f"held-{run}", str(os.getpid()))
        time.sleep(WAIT)
        return "finished"

    @app.task(name="rp.soft_and_lost", lock_key="rp:{run}", soft_time_limit=1.0, **revoke)
    def soft_and_lost(run: str) -> str:
        """The lease is lost, then the soft time limit expires, while the main thread blocks
        both signals: when it lets them in, each must arrive (none swallowed, none misread)."""
        ours = getattr(_interrupt, "INTERRUPT_SIGNAL", None)
        blocked = {signal.SIGUSR1} | ({ours} if ours is not None else set())
        held = soft_and_lost.request.lease
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        _append(out / f"held-{run}", str(os.getpid()))
        try:
            try:
                deadline = time.monotonic() + WAIT
                while time.monotonic() < deadline:
                    if held.lost and not (out / f"lost-seen-{run}").exists():
                        _append(out / f"lost-seen-{run}", "")
                    time.sleep(POLL)
            finally:  # the first exception came (or none): let the blocked signals in
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:  # the body's cleanup: the second lands here
                    time.sleep(POLL)
        except BaseException as exc:
            _append(out / f"chain-{run}", " ".join(_chain(exc)))
            raise
        return "finished"

    @app.task(name="rp.soft_only", soft_time_limit=0.5, shared=False)
    def soft_only() -> str:
        """A plain task with a soft time limit: SoftTimeLimitExceeded must arrive."""
        try:
            time.sleep(WAIT)
        except SoftTimeLimitExceeded:
            return "soft time limit"
        return "finished"

    @app.task(name="rp.ping", shared=False)
    def ping() -> str:
        return "pong"

    return app


if os.environ.get("RP_BROKER"):
    app = make_app(os.environ["RP_BROKER"], os.environ["RP_DIR"])


# The tests -----------------------------------------------------------------------------------

pytestmark = [pytest.mark.worker]

POOL_DB = {"prefork": 10, "solo": 11, "threads": 12, "eventlet": 13}
STOP_WITHIN = 5.0  # seconds from the force-release to the task's failure


@pytest.fixture(scope="module")
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], WorkerEnv]]:
    """Start (once per module) a ``-c 1`` worker of the given pool on the throwaway Redis."""
    started: dict[str, WorkerEnv] = {}

    def worker(pool: str) -> WorkerEnv:
        if pool not in started:
            if pool == "eventlet" and importlib.util.find_spec("eventlet") is None:
                service_missing("the eventlet package", "pip install -e '.[test]'")
            server = request.getfixturevalue("redis_server")
            broker = f"redis://127.0.0.1:{server.port}/{POOL_DB[pool]}"
            directory = tmp_path_factory.mktemp(f"revoke-{pool}")
            process, log = _start(pool, broker, directory)
            started[pool] = WorkerEnv(
                pool, pool, make_app(broker, str(directory)), store_from_url(broker),
                directory, process, log,
            )  # fmt: skip
        return started[pool]

    try:
        yield worker
    finally:
        for env in started.values():  # warm shutdowns in parallel (eventlet's takes seconds)
            if env.process.poll() is None:
                env.process.send_signal(signal.SIGTERM)
        for env in started.values():
            try:
                env.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                stop_worker(env.process)
            env.app.close()


def _start(pool: str, broker: str, directory: Path) -> tuple[subprocess.Popen[bytes], Path]:
    worker = CeleryWorker(
        "tests.integration.test_revoke_pools:app",
        directory / "worker.log",
        pool=pool,
        concurrency=1,
        name=f"rp-{pool}",
        env={"RP_BROKER": broker, "RP_DIR": str(directory)},
    )
    worker.wait_ready(READY_TIMEOUT)
    return worker.process, worker.log


def lose_and_expect_lock_lost(env: WorkerEnv, task: str) -> str:
    """Send ``task``, force-release its lease once the body holds it: LockLostError, quickly."""
    run = "r" + uuid.uuid4().hex[:12]  # a digits-only str is keyed ~str.<digits>
    result = env.app.send_task(task, (run,))
    env.wait_file(f"held-{run}")
    released = time.monotonic()
    env.store.force_release(f"rp:{run}")  # type: ignore[attr-defined]
    with pytest.raises(LockLostError) as info:
        env.get(result)
    assert info.value.key == f"rp:{run}"
    assert time.monotonic() - released < STOP_WITHIN, f"stopped late:\n{env.tail()}"
    return run


class TestPrefork:
    def test_blocking_sleep_is_interrupted_and_soft_limits_still_work(
        self, workers: Callable[[str], WorkerEnv]
    ) -> None:
        """A lost lease stops a body blocked in sleep(); the next task in the same child still
        gets its soft time limit (billiard's SIGUSR1 is untouched by our interrupt)."""
        env = workers("prefork")
        lose_and_expect_lock_lost(env, "rp.revoke_blocking")
        assert env.get(env.app.send_task("rp.soft_only")) == "soft time limit"

    def test_lease_loss_and_soft_time_limit_both_arrive(
        self, workers: Callable[[str], WorkerEnv]
    ) -> None:
        """Lease lost, then the soft time limit, both pending in the child's main thread: the
        body gets SoftTimeLimitExceeded first (when it expires) and then LockLostError."""
        env = workers("prefork")
        run = lose_and_expect_lock_lost(env, "rp.soft_and_lost")
        assert env.wait_file(f"lost-seen-{run}").exists()
        chain = env.wait_file(f"chain-{run}").read_text().split()
        assert chain == ["AsyncLockLost", "SoftTimeLimitExceeded"], f"{chain}\n{env.tail()}"
        assert env.get(env.app.send_task("rp.soft_only")) == "soft time limit"


class TestSolo:
    def test_blocking_sleep_in_the_main_process_is_interrupted(
        self, workers: Callable[[str], WorkerEnv]
    ) -> None:
        """Solo: the body in the worker's main thread is stopped; the worker goes on."""
        env = workers("solo")
        lose_and_expect_lock_lost(env, "rp.revoke_blocking")
        assert env.get(env.app.send_task("rp.ping")) == "pong"


class TestThreads:
    def test_polling_body_is_interrupted_and_the_thread_serves_the_next_task(
        self, workers: Callable[[str], WorkerEnv]
    ) -> None:
        """Threads (-c 1): the body is stopped; the next task on that thread runs normally."""
        env = workers("threads")
        lose_and_expect_lock_lost(env, "rp.revoke_polling")
        assert env.get(env.app.send_task("rp.ping")) == "pong"


class TestEventlet:
    def test_green_thread_body_is_interrupted(self, workers: Callable[[str], WorkerEnv]) -> None:
        """Eventlet: the body's green thread is thrown LockLostError at its next switch (it does
        not run on to its end)."""
        env = workers("eventlet")
        lose_and_expect_lock_lost(env, "rp.revoke_polling")
        assert env.get(env.app.send_task("rp.ping")) == "pong"
