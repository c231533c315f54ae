"""Requests a solo worker sends nothing early for: a task whose own ``before_start`` or
``__call__`` may end the request without its run taking the try (and without ``task_failure``
or ``task_revoked`` giving it up), and a redelivered message (which Celery may skip without a
signal). The key is left free when such a request ends."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_postrun

from celery_lease import LockedTask
from celery_lease._celery import early_acquire, pool
from tests.unit._celery.test_early_acquire import POLL, TIMEOUT, RecordingStore


class CallsThrough:
    """A mixin whose ``__call__`` runs inside LockedTask's (after it in the MRO)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)  # type: ignore[misc]


def _raising_before_start(exc: BaseException) -> type:
    class Raising(LockedTask):  # type: ignore[misc]
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            raise exc

    return Raising


class Cached(LockedTask):  # type: ignore[misc]
    """Answers 0 from a cache without running the locked body."""

    def __call__(self, a: int) -> Any:
        if a == 0:
            return "cached"
        return super().__call__(a)


class Inner(LockedTask, CallsThrough):  # type: ignore[misc]
    pass


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    store = RecordingStore()
    app = Celery("hooks", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.lease_defer_release = False
    app.conf.broker_transport_options = {"polling_interval": POLL}
    ended: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def event_of(task_id: str) -> threading.Event:
        with lock:
            return ended.setdefault(task_id, threading.Event())

    def on_postrun(task_id: Any = None, **_: Any) -> None:
        event_of(task_id).set()

    @app.task(base=_raising_before_start(Ignore()), lock_key="i:{a}", shared=False)
    def ignored(a: int) -> int:
        return a

    rejecting = _raising_before_start(Reject("no", requeue=False))

    @app.task(base=rejecting, lock_key="j:{a}", shared=False)
    def rejected(a: int) -> int:
        return a

    @app.task(base=_raising_before_start(Retry("later")), lock_key="r:{a}", shared=False)
    def retried(a: int) -> int:
        return a

    @app.task(base=Cached, lock_key="c:{a}", shared=False)
    def cached(a: int) -> Any:
        return a

    @app.task(base=LockedTask, shared=False)
    def default_key(a: int) -> int:
        return a

    @app.task(base=Inner, lock_key="m:{a}", shared=False)
    def inner(a: int) -> int:
        return a

    tasks = {
        "ignored": ignored,
        "rejected": rejected,
        "retried": retried,
        "cached": cached,
        "default_key": default_key,
        "inner": inner,
    }
    task_postrun.connect(on_postrun, weak=False)
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=TIMEOUT):
            yield SimpleNamespace(store=store, tasks=tasks, event_of=event_of)
    finally:
        task_postrun.disconnect(on_postrun)
        app.close()
        root.setLevel(level)
        root.handlers[:] = handlers


def _run_to_end(env: SimpleNamespace, name: str, a: int) -> list[str]:
    env.store.take_events()
    result = env.tasks[name].delay(a)
    assert env.event_of(result.id).wait(TIMEOUT), "the task's trace never ended"
    return [event[0] for event in env.store.take_events()]


@pytest.mark.parametrize(
    ("name", "key"),
    [("ignored", "i:1"), ("rejected", "j:1"), ("retried", "r:1")],
    ids=["Ignore", "Reject", "Retry"],
)
def test_a_before_start_ending_the_request_leaves_the_key_free(
    env: SimpleNamespace, name: str, key: str
) -> None:
    kinds = _run_to_end(env, name, 1)
    assert env.store.get(key) is None, f"held after the task ended; events {kinds}"
    assert "sent" not in kinds


def test_a_call_that_never_reaches_the_lock_leaves_the_key_free(env: SimpleNamespace) -> None:
    kinds = _run_to_end(env, "cached", 0)
    assert env.store.get("c:0") is None, f"held after the task ended; events {kinds}"
    assert "sent" not in kinds


def test_a_call_mixin_run_inside_the_lock_still_sends_early(env: SimpleNamespace) -> None:
    kinds = _run_to_end(env, "inner", 2)
    assert kinds.count("sent") == 1 and "acquire" not in kinds, kinds
    assert env.store.get("m:2") is None


def test_the_default_key_is_taken_by_its_run(env: SimpleNamespace) -> None:
    """The receipt's digest (args a list) equals the run's (args a tuple): one acquire."""
    kinds = _run_to_end(env, "default_key", 3)
    assert kinds.count("sent") == 1 and "acquire" not in kinds, kinds


def test_a_redelivered_message_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("hooks-redelivered", set_as_current=False)
    app.conf.lease_store = store = RecordingStore()
    label = pool.pool_label()
    pool.set_pool_label("solo")
    try:

        @app.task(base=LockedTask, lock_key="d:{a}", shared=False)
        def body(a: int) -> int:
            return a

        request = SimpleNamespace(
            task=body, id="id-1", eta=None, args=[1], kwargs={}, delivery_info={"redelivered": True}
        )
        early_acquire.on_task_received(request=request)
        request.delivery_info = {"redelivered": False}
        request.id = "id-2"
        early_acquire.on_task_received(request=request)
    finally:
        early_acquire.give_up()
        pool.set_pool_label(label)
        app.close()
    assert [event[0] for event in store.events] == ["sent", "read", "release"]
