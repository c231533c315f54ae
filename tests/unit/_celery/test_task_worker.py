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
from celery.exceptions import TaskRevokedError
from celery.signals import before_task_publish, task_failure

from celery_lease import (
    LockedTask,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    locked,
)
from celery_lease import signals as lease_signals

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

    @app.task(shared=False)
    @locked(key="busy", on_held="skip")
    def skipping_body() -> str:
        return "ran"

    @locked(key="busy", on_held="skip")
    def skipping_helper() -> str:
        return "ran"

    @app.task(shared=False)
    def calls_skipping_helper() -> list[str | None]:
        return [skipping_helper()]

    @app.task(base=LockedTask, lock_key="outer", shared=False)
    def locked_calls_skipping_helper() -> list[str | None]:
        return [skipping_helper()]

    @app.task(base=LockedTask, lock_key="t", lock_ttl="0.3s", lock_on_lost="revoke", shared=False)
    def revoked() -> str:
        inside.set()
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # bytecode runs between waits: the exception lands
            time.sleep(0.01)
        return "finished"

    # Early release (retry(throw=False) lets the body run on): what each attempt saw.
    copy_started, first_done = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def await_retry_stored(task: Any) -> None:
        """A retried copy waits until the attempt before it stored RETRY (celery/celery#6115)."""
        deadline = time.monotonic() + TIMEOUT
        while task.AsyncResult(task.request.id).state != "RETRY" and time.monotonic() < deadline:
            time.sleep(POLL)

    @app.task(bind=True, base=LockedTask, lock_key="early", max_retries=1, shared=False)
    def early(self: Any) -> str:
        if self.request.retries:
            seen["copy_token"] = self.request.lock_token
            copy_started.set()
            first_done.wait(TIMEOUT)
            return "copy"
        seen["first_token"] = self.request.lock_token
        self.retry(countdown=0, throw=False)
        seen["copy_ran"] = copy_started.wait(TIMEOUT)  # the retried copy holds the key now
        seen["lost"] = self.request.lock_lost
        try:
            self.request.lease.check()
        except LockLostError as exc:
            seen["check"] = exc.reason
        first_done.set()
        return "first"

    ran_on: list[str] = []

    @app.task(
        bind=True, base=LockedTask, lock_key="early-rv", lock_on_lost="revoke", max_retries=1,
        shared=False,
    )  # fmt: skip
    def early_revoke(self: Any, throw: bool) -> str:
        if self.request.retries:
            await_retry_stored(self)
            return "second"
        self.retry(countdown=0, throw=throw)
        ran_on.append(self.request.id)
        return "first"

    with start_worker(
        app, pool="threads", concurrency=3, perform_ping_check=False, shutdown_timeout=TIMEOUT
    ):
        yield SimpleNamespace(
            app=app,
            store=store,
            inside=inside,
            retrying=retrying,
            skipping=skipping,
            skipping_body=skipping_body,
            calls_skipping_helper=calls_skipping_helper,
            locked_calls_skipping_helper=locked_calls_skipping_helper,
            revoked=revoked,
            early=early,
            early_revoke=early_revoke,
            seen=seen,
            copy_started=copy_started,
            first_done=first_done,
            ran_on=ran_on,
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


def test_skip_ends_revoked_and_get_raises_at_once(env: SimpleNamespace) -> None:
    """on_held="skip" on a worker: the run is REVOKED 'skipped: ...' (not SUCCESS with None),
    AsyncResult.get() raises TaskRevokedError without blocking, lock_rejected is sent, and the
    key is left to its holder."""
    rejected: list[Any] = []

    def on_rejected(sender: Any = None, key: Any = None, task_id: Any = None, **_: Any) -> None:
        rejected.append((key, task_id))

    lease_signals.lock_rejected.connect(on_rejected, weak=False)
    assert env.store.acquire("busy", "other", 60_000) is not None
    try:
        result = env.skipping.delay()
        with pytest.raises(TaskRevokedError, match="skipped: 'busy' held"):
            result.get(timeout=TIMEOUT, interval=POLL)
    finally:
        lease_signals.lock_rejected.disconnect(on_rejected)
        env.store.release("busy", "other")
    assert result.state == "REVOKED"
    assert rejected == [("busy", result.id)]


def test_skipped_locked_body_is_revoked_too(env: SimpleNamespace) -> None:
    """@locked(on_held="skip") as a task's body: REVOKED like a LockedTask's skipped run."""
    assert env.store.acquire("busy", "other", 60_000) is not None
    try:
        result = env.skipping_body.delay()
        with pytest.raises(TaskRevokedError, match="skipped: 'busy' held"):
            result.get(timeout=TIMEOUT, interval=POLL)
    finally:
        env.store.release("busy", "other")


@pytest.mark.parametrize("task", ["calls_skipping_helper", "locked_calls_skipping_helper"])
def test_skipped_helper_inside_a_body_returns_none_and_the_task_succeeds(
    env: SimpleNamespace, task: str
) -> None:
    """A @locked(on_held="skip") helper called from a running task's body (plain or locked)
    returns None there: the task is not marked skipped, it goes on and succeeds."""
    assert env.store.acquire("busy", "other", 60_000) is not None
    try:
        result = getattr(env, task).delay()
        assert result.get(timeout=TIMEOUT, interval=POLL) == [None]
    finally:
        env.store.release("busy", "other")
    assert result.state == "SUCCESS"


def test_skip_called_directly_or_eagerly_returns_none(env: SimpleNamespace) -> None:
    """Outside a worker (a direct call, apply()) a skipped run still returns None."""
    assert env.store.acquire("busy", "other", 60_000) is not None
    try:
        assert env.skipping() is None
        eager = env.skipping.apply()
        assert eager.state == "SUCCESS" and eager.get() is None
    finally:
        env.store.release("busy", "other")


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


class TestEarlyRelease:
    """``retry(throw=False)`` publishes the retry and lets the body run on without its key."""

    def test_body_running_on_after_retry_sees_its_lease_released(
        self, env: SimpleNamespace
    ) -> None:
        """While the retried copy holds the key, the first body reads lock_lost True and
        check() raises LockLostError("released"); lock_released is sent once per token and
        lock_lost never."""
        sent: list[tuple[str, Any]] = []

        def on_signal(
            signal: Any = None, sender: Any = None, token: Any = None, **kwargs: Any
        ) -> None:
            # This module's worker is shared: a lease another test's task still holds (a 0.3 s
            # lease under on_lost="revoke") may send its own signals during this test.
            if getattr(sender, "name", None) == env.early.name:
                sent.append((signal.name, token))

        for name in ("lock_lost", "lock_released"):
            getattr(lease_signals, name).connect(on_signal, weak=False)
        try:
            env.early.delay()
            assert env.first_done.wait(TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while len(sent) < 2 and time.monotonic() < deadline:
                time.sleep(POLL)
        finally:
            for name in ("lock_lost", "lock_released"):
                getattr(lease_signals, name).disconnect(on_signal)
        seen = env.seen
        assert seen["copy_ran"], "the retried copy acquired the key while the first body ran"
        assert seen["copy_token"] > seen["first_token"]
        assert (seen["lost"], seen.get("check")) == (True, "released")
        assert sorted(sent) == sorted(
            [("lock_released", seen["first_token"]), ("lock_released", seen["copy_token"])]
        )

    @pytest.mark.parametrize("throw", [True, False])
    def test_revoke_stops_at_the_retry_and_ends_in_retry(
        self, env: SimpleNamespace, throw: bool
    ) -> None:
        """on_lost="revoke": after ``retry()`` (even with throw=False) the body does not run
        on; the attempt ends in RETRY, never FAILURE, and the retry succeeds."""
        failures: list[Any] = []

        def on_failure(task_id: Any = None, **kwargs: Any) -> None:
            failures.append(task_id)

        task_failure.connect(on_failure, weak=False)
        try:
            result = env.early_revoke.delay(throw)
            assert result.get(timeout=TIMEOUT, interval=POLL) == "second"
        finally:
            task_failure.disconnect(on_failure)
        assert result.id not in env.ran_on, "the body ran on without its lease"
        assert failures == []
