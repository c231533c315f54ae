"""``lease(key, app=app)`` and a task with ``lock_key=key`` exclude each other under a prefix.

A real ``celery worker`` (prefork -c 1, filesystem broker, file results) runs a locked task of an
app with ``lease_key_prefix = "nc5:"`` whose lease store is a throwaway ``redis-server``; this
process builds the same app and takes ``lease("cache:prices", app=app)``: the same store, the same
prefixed key, so each side is refused while the other holds it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LockedTask, LockNotAcquiredError, lease
from celery_lease._celery import settings as config
from tests.fixtures_redis import RedisServer
from tests.integration.workers import CeleryWorker, filesystem_app
from tests.support import complete_lines

pytestmark = [pytest.mark.worker]

START_TIMEOUT = 60.0  # seconds for the worker to log "ready."
TIMEOUT = 30.0  # seconds for a marker file or a result
POLL = 0.02
PREFIX = "nc5:"


def make_app(directory: str, store: str, late: bool = False) -> Celery:
    """The app of the worker and of this process: ``lease_store=store``, prefix ``nc5:``.

    ``late``: configured as a ``proj/celery.py`` that imports a helper module first, whose
    ``@lease(..., app=app)`` runs before ``app.config_from_object(...)``: the app's tasks must
    still use the configured store and prefix."""
    app = filesystem_app("al", directory, POLL)
    # A throwaway redis-server, new for the module: no restart grace to wait out.
    settings = {
        "lease_store": store,
        "lease_key_prefix": PREFIX,
        "result_extended": False,
        "lease_restart_grace": 0,
    }

    def helper() -> Callable[[], str]:
        """A helper module's ``@lease("nightly", app=app)`` function, made at its import."""

        @lease("nightly", app=app)
        def nightly() -> str:
            return "ran"

        return nightly

    if late:
        nightly = helper()  # imported before the app is configured
        app.config_from_object(settings)
    else:
        app.conf.update(settings)
        nightly = helper()

    @app.task(name="al.nightly", shared=False)
    def run_nightly() -> str:
        """Call the helper's leased function in the worker's pool process."""
        return nightly()

    @app.task(
        name="al.hold", base=LockedTask, lock_key="cache:prices", lock_on_held="raise", shared=False
    )
    def hold(run: str) -> str:
        """Say it started (``<run>.started``), then hold the key until ``<run>.go`` exists."""
        folder = Path(directory)
        (folder / f"{run}.started").write_text("started\n")
        deadline = time.monotonic() + TIMEOUT
        while not (folder / f"{run}.go").exists() and time.monotonic() < deadline:
            time.sleep(POLL)
        return run

    return app


if os.environ.get("AL_DIR"):
    app = make_app(os.environ["AL_DIR"], os.environ["AL_STORE"], bool(os.environ.get("AL_LATE")))


LATE = "decorated-before-configuration"


@pytest.fixture(scope="module", params=["configured-first", LATE])
def directory(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of one worker, for each form of its app module (:func:`make_app`)."""
    return tmp_path_factory.mktemp(f"app-lease-{request.param}-")


@pytest.fixture(scope="module")
def worker(directory: Path, redis_server: RedisServer) -> Iterator[Celery]:
    """The worker, started once per form of its app module (configured before anything reads
    it, or with a ``@lease(..., app=app)`` made before ``config_from_object``); yields this
    process's client app (same store, same prefix). Each test uses run ids of its own."""
    late = f"-{LATE}-" in directory.name
    redis_server.ensure_running()
    redis_url = redis_server.url
    tmp_path = directory
    started = CeleryWorker(
        f"{__name__}:app",
        tmp_path / "worker.log",
        pool="prefork",
        concurrency=1,
        name="al",
        env={"AL_DIR": str(tmp_path), "AL_STORE": redis_url, **({"AL_LATE": "1"} if late else {})},
    )
    client = make_app(str(tmp_path), redis_url)
    try:
        started.wait_ready(START_TIMEOUT)
        yield client
    finally:
        started.stop()
        config.reset(client)
        client.close()


def wait_file(path: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not complete_lines(path):
        assert time.monotonic() < deadline, f"{path.name} not written within {TIMEOUT}s"
        time.sleep(POLL)


class TestExclusionUnderAPrefix:
    def test_a_running_task_refuses_lease_with_the_app(self, worker: Celery, directory: Path):
        """While the task holds ``nc5:cache:prices``, ``lease("cache:prices", app=app)`` is
        refused; once it ended, it is taken."""
        result = worker.send_task("al.hold", args=["r1"])
        wait_file(directory / "r1.started")
        with pytest.raises(LockNotAcquiredError) as refused, lease("cache:prices", app=worker):
            pass
        assert refused.value.key == PREFIX + "cache:prices"
        (directory / "r1.go").write_text("go\n")
        assert result.get(timeout=TIMEOUT, interval=POLL) == "r1"
        with lease("cache:prices", app=worker, wait=TIMEOUT) as held:
            assert held.key == PREFIX + "cache:prices"

    def test_lease_with_the_app_refuses_the_task(self, worker: Celery, directory: Path):
        """While ``lease("cache:prices", app=app)`` is held, the task (``lock_on_held="raise"``)
        fails with LockNotAcquiredError for ``nc5:cache:prices`` and its body never starts."""
        (directory / "r2.go").write_text("go\n")
        with lease("cache:prices", app=worker):
            result = worker.send_task("al.hold", args=["r2"])
            outcome = result.get(timeout=TIMEOUT, interval=POLL, propagate=False)
        assert isinstance(outcome, LockNotAcquiredError), outcome
        assert outcome.key == PREFIX + "cache:prices"
        assert not (directory / "r2.started").exists()

    def test_a_function_decorated_with_the_app_holds_its_prefixed_key(self, worker: Celery) -> None:
        """``@lease("nightly", app=app)`` called in the worker's pool process holds
        ``nc5:nightly`` in the configured store, even when it was made before the app was
        configured: while this process holds it, the call is refused."""
        with lease("nightly", app=worker) as held:
            assert held.key == PREFIX + "nightly"
            outcome = worker.send_task("al.nightly").get(
                timeout=TIMEOUT, interval=POLL, propagate=False
            )
        assert isinstance(outcome, LockNotAcquiredError), outcome
        assert outcome.key == PREFIX + "nightly"
        result = worker.send_task("al.nightly").get(timeout=TIMEOUT, interval=POLL)
        assert result == "ran"
