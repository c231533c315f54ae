"""LockedTask on one in-process worker (``celery.contrib.testing.worker``, threads pool)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import before_task_publish

from celery_lease import LockedTask, LockLostError, LockNotAcquiredError, MemoryLockStore

TIMEOUT = 10.0
POLL = 0.01  # seconds between result polls


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    """One app, store and threads-pool worker shared by this module's tests."""
    store = MemoryLockStore()
    app = Celery("w", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.broker_transport_options = {"polling_interval": POLL}
    inside = threading.Event()

    @app.task(bind=True, base=LockedTask, lock_key="acct:{a}", max_retries=2, shared=False)
    def retrying(self: Any, a: int) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return int(self.request.retries)

    @app.task(base=LockedTask, lock_key="busy", lock_on_held="skip", shared=False)
    def skipping() -> str:
        return "ran"

    @app.task(base=LockedTask, lock_key="t", lock_ttl="0.3s", lock_on_lost="revoke", shared=False)
    def revoked() -> str:
        inside.set()
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # bytecode runs between waits: the exception lands
            time.sleep(0.01)
        return "finished"

    with start_worker(
        app, pool="threads", concurrency=3, perform_ping_check=False, shutdown_timeout=TIMEOUT
    ):
        yield SimpleNamespace(
            app=app,
            store=store,
            inside=inside,
            retrying=retrying,
            skipping=skipping,
            revoked=revoked,
        )
    app.close()


def test_retry_releases_before_the_retry_is_published(env: SimpleNamespace) -> None:
    """When retry() publishes, the task's own lease is already released; the retry succeeds."""
    at_publish: list[object] = []

    def check(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if headers and headers.get("retries"):
            at_publish.append(env.store.get("acct:1"))

    before_task_publish.connect(check, weak=False)
    try:
        assert env.retrying.delay(1).get(timeout=TIMEOUT, interval=POLL) == 1
    finally:
        before_task_publish.disconnect(check)
    assert at_publish == [None]


def test_skip_ends_in_success_none(env: SimpleNamespace) -> None:
    """on_held="skip" on a worker: AsyncResult.get() returns None at once, state SUCCESS."""
    assert env.store.acquire("busy", "other", 60_000) is not None
    result = env.skipping.delay()
    assert result.get(timeout=TIMEOUT, interval=POLL) is None
    assert result.state == "SUCCESS"


def test_threads_pool_excludes_and_revokes(env: SimpleNamespace) -> None:
    """Under the threads pool, a duplicate is rejected while one body runs; a loss revokes it."""
    first = env.revoked.delay()
    assert env.inside.wait(TIMEOUT)
    second = env.revoked.delay()
    with pytest.raises(LockNotAcquiredError):
        second.get(timeout=TIMEOUT, interval=POLL)
    env.store.force_release("t")
    with pytest.raises(LockLostError):
        first.get(timeout=TIMEOUT, interval=POLL)
    assert first.state == "FAILURE"
