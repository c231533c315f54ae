"""Debounced bursts on real workers with more than one slot (threads -c 4, prefork -c 2).

Every copy of a burst reaches the worker a few milliseconds after the one it superseded, so two
slots start copies of one key at once: the superseded copy must end REVOKED without ever holding
the run key, and the newest must run its body. A throwaway redis-server is the broker, the
result backend and the lock store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError

from tests.fixtures_redis import RedisServer
from tests.integration import workers
from tests.integration.unique_app import make_app
from tests.integration.workers import stop_worker
from tests.support import complete_lines

pytestmark = [pytest.mark.worker, pytest.mark.redis]

READY_TIMEOUT = 40.0  # seconds for a worker to log "ready."
TIMEOUT = 30.0  # seconds a test waits for a result
BURSTS = 12  # bursts per pool, each on a key of its own
CALLS = 3  # calls per burst, back to back


@pytest.fixture(scope="module", params=[("threads", 4), ("prefork", 2)], ids=["threads", "prefork"])
def pool_env(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, Path, Path, str]]:
    """A client app and one worker of the given pool consuming a queue of its own."""
    pool, concurrency = request.param
    directory = tmp_path_factory.mktemp(f"burst-{pool}")
    db = 14 if pool == "threads" else 12
    base = f"redis://127.0.0.1:{redis_server.port}"
    broker, backend = f"{base}/{db}", f"{base}/{db + 1}"
    app = make_app(broker, backend, str(directory))
    queue = f"burst-{pool}"
    process, log = workers.start_worker(
        "tests.integration.unique_app:app",
        f"burst-{pool}",
        pool,
        concurrency,
        {"UQ_BROKER": broker, "UQ_BACKEND": backend, "UQ_DIR": str(directory), "UQ_STORE": ""},
        directory,
        READY_TIMEOUT,
        args=["-Q", queue],
    )
    try:
        yield app, directory, log, queue
    finally:
        stop_worker(process)
        app.close()


def test_a_burst_runs_the_newest_body_once_and_revokes_the_rest(
    pool_env: tuple[Any, Path, Path, str],
) -> None:
    """Bursts of calls a few milliseconds apart, each on its own key, on a worker with several
    slots: once every burst went quiet, each key ran exactly one body, with the newest
    arguments; every older call ended REVOKED (superseded), none FAILURE, and no errback fired."""
    app, directory, log, queue = pool_env
    body, errback = app.tasks["uq.burst"], app.tasks["uq.errback"]
    runs = ["r" + uuid.uuid4().hex[:11] for _ in range(BURSTS)]
    results = {
        run: [
            body.apply_async((run, n), queue=queue, link_error=errback.s(run)) for n in range(CALLS)
        ]
        for run in runs
    }
    outcome: dict[str, list[str]] = {}
    for run, calls in results.items():
        states = []
        for result in calls:
            try:
                states.append(f"SUCCESS {result.get(timeout=TIMEOUT)}")
            except TaskRevokedError:
                states.append("REVOKED")
            except Exception as exc:
                states.append(f"FAILURE {type(exc).__name__}")
        outcome[run] = states
    newest = CALLS - 1
    expected = {run: ["REVOKED"] * newest + [f"SUCCESS {newest}"] for run in runs}
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert outcome == expected, tail
    assert {run: complete_lines(directory / f"calls-{run}") for run in runs} == {
        run: [str(newest)] for run in runs
    }
    assert [p.name for p in directory.glob("errback-*")] == []
