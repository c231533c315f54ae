"""A solo worker's early-sent try and what Celery does between the receipt and the run (here a
``task_prerun`` receiver): a grant older than the renewer's first renewal point is not used, a
refusal is not final; the run tries afresh, as it does when nothing was sent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import task_prerun

from celery_lease import LockedTask, LockNotAcquiredError
from celery_lease.testing import FakeClock
from tests.unit._celery.test_early_acquire import POLL, TIMEOUT, RecordingStore


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    clock = FakeClock()
    store = RecordingStore(clock)
    app = Celery("prologue", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.lease_defer_release = False
    app.conf.broker_transport_options = {"polling_interval": POLL}
    seen: list[tuple[str, Any]] = []

    @app.task(base=LockedTask, lock_key="s:{a}", lock_ttl=30, shared=False)
    def slow(a: int) -> int:
        info = store.get("s:1")
        seen.append(("body", info.owner if info else None))
        return a

    @app.task(base=LockedTask, lock_key="f:{a}", lock_on_held="skip", shared=False)
    def freed(a: int) -> str:
        return "ran"

    def outlast_the_ttl(**_: Any) -> None:
        clock.advance(31.0)  # the sent try's key expired on the server; another takes it
        seen.append(("other", store.acquire("s:1", "other-worker", 60_000)))

    def free_the_key(**_: Any) -> None:
        store.release("f:1", "other-worker")  # the holder ends while Celery prepares the run

    task_prerun.connect(outlast_the_ttl, sender=slow, weak=False)
    task_prerun.connect(free_the_key, sender=freed, weak=False)
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=TIMEOUT):
            yield SimpleNamespace(store=store, slow=slow, freed=freed, seen=seen)
    finally:
        task_prerun.disconnect(outlast_the_ttl, sender=slow)
        task_prerun.disconnect(free_the_key, sender=freed)
        app.close()
        root.setLevel(level)
        root.handlers[:] = handlers


def test_a_grant_outlasted_by_the_prologue_is_not_used(env: SimpleNamespace) -> None:
    """The run's own try is refused (another holds the key now): no body runs under it."""
    env.store.take_events()
    with pytest.raises(LockNotAcquiredError):
        env.slow.delay(1).get(timeout=TIMEOUT, interval=POLL)
    assert env.seen[0][0] == "other" and env.seen[0][1] is not None
    assert not [entry for entry in env.seen if entry[0] == "body"], env.seen
    info = env.store.get("s:1")
    assert info is not None and info.owner == "other-worker"
    kinds = [event[0] for event in env.store.take_events()]
    assert kinds[:2] == ["sent", "acquire"] and "read" in kinds


def test_a_key_freed_before_the_run_is_taken_by_the_run(env: SimpleNamespace) -> None:
    """Refused at receipt (wait 0, on_held="skip"), free at the run: the run's try takes it."""
    assert env.store.acquire("f:1", "other-worker", 60_000) is not None
    env.store.take_events()
    assert env.freed.delay(1).get(timeout=TIMEOUT, interval=POLL) == "ran"
    kinds = [event[0] for event in env.store.take_events()]
    assert kinds.count("sent") == 1 and "read" in kinds
