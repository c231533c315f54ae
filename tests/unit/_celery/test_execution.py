"""The engine of LockedTask (:mod:`celery_lease._celery.execution`), run eagerly with ``apply()``.

Owner ids per execution, the key freed before the result is returned, an async store configured
for a task, and a loss recorded just before the body re-sends itself.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import LockedTask, MemoryLockStore
from celery_lease import signals as lease_signals
from celery_lease._core.dispatch import drain
from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS, parse_owner
from celery_lease._core.renewer import observe_renewals
from celery_lease.stores.threaded import ThreadedAsyncStore
from tests.unit.conftest import REAL_TIMEOUT


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("engine", broker="memory://", backend="cache+memory://", set_as_current=False)
    yield app
    from celery_lease._celery import settings as config

    config.reset(app)


class TestEngine:
    def test_a_loss_recorded_just_before_the_body_resends_itself_is_reported(
        self, app: Celery
    ) -> None:
        """The renewer records the loss ("taken"); before its listeners are dispatched, the
        body publishes a message with its own id (retry / apply_async(task_id=...)), which
        releases early. The loss happened before: lock_lost must still be sent."""
        store = MemoryLockStore()
        app.conf.lease_store = store
        recorded, published = threading.Event(), threading.Event()

        def between_record_and_notify(key: str, token: object, seconds: float, ok: object) -> None:
            if key == "resend" and ok is False:  # on the renewer: recorded, not yet notified
                recorded.set()
                published.wait(REAL_TIMEOUT)

        lost: list[dict[str, Any]] = []

        def on_lock_lost(sender: Any = None, **named: Any) -> None:
            lost.append(named)

        notified = threading.Event()

        @app.task(bind=True, base=LockedTask, lock_key="resend", lock_ttl="3s", shared=False)
        def body(self: Any) -> str:
            # Immediate listeners run once the dispatched ones (lock_lost's) were handed over.
            self.request.lease.add_loss_listener(lambda _: notified.set(), immediate=True)
            assert store.force_release("resend") is not None  # an operator, then:
            assert store.acquire("resend", "another-owner", 60_000) is not None
            assert recorded.wait(REAL_TIMEOUT)  # the renewal found it taken and recorded that
            try:
                self.apply_async(task_id=self.request.id, countdown=3600)  # re-sends itself
            finally:
                published.set()
            return "ran"

        forget = observe_renewals(between_record_and_notify)
        lease_signals.lock_lost.connect(on_lock_lost, weak=False)
        try:
            assert body.apply().get() == "ran"
            assert notified.wait(REAL_TIMEOUT)
            assert drain(REAL_TIMEOUT)
        finally:
            published.set()
            forget()
            lease_signals.lock_lost.disconnect(on_lock_lost)
        assert [named["reason"] for named in lost] == ["taken"]

    def test_an_async_store_configured_for_a_task_holds_the_key(self, app: Celery) -> None:
        memory = MemoryLockStore()
        app.conf.lease_store = ThreadedAsyncStore(memory)
        seen: list[tuple[object, object]] = []

        @app.task(bind=True, base=LockedTask, lock_key="async-k", shared=False)
        def body(self: Any) -> str:
            seen.append((self.request.lock_token, memory.get("async-k")))
            return "ran"

        with _ignore_runtime_warnings():
            body.apply()
        [(token, info)] = seen
        assert isinstance(token, int)
        assert info is not None

    @pytest.mark.parametrize("task_id", [uuid.UUID(int=7), "x" * 1001], ids=["uuid", "long"])
    def test_a_task_id_celery_accepts_never_fails_the_acquisition(
        self, app: Celery, task_id: object
    ) -> None:
        """The owner id only describes the holder: whatever id Celery runs a task with, the
        locked task runs as the plain one does."""
        app.conf.lease_store = MemoryLockStore()

        @app.task(shared=False)
        def plain() -> str:
            return "ran"

        @app.task(base=LockedTask, lock_key="tid", shared=False)
        def locked_body() -> str:
            return "ran"

        assert plain.apply(task_id=task_id).state == "SUCCESS"
        result = locked_body.apply(task_id=task_id)
        assert (result.state, result.result) == ("SUCCESS", "ran")

    def test_a_task_name_too_long_for_an_owner_id_is_cut_to_size(self, app: Celery) -> None:
        """Its owner id names as much of the task's name as fits; the task runs."""
        store = MemoryLockStore()
        app.conf.lease_store = store
        owners: list[str] = []
        name = "n" * (MAX_OWNER_FIELD_CHARS + 1)

        @app.task(name=name, bind=True, base=LockedTask, lock_key="long", shared=False)
        def body(self: Any) -> None:
            owners.append(self.request.lease.owner)

        body.apply()
        [owner] = owners
        assert parse_owner(owner).task == name[:MAX_OWNER_FIELD_CHARS]

    def test_every_execution_of_one_task_id_has_its_own_owner(self, app: Celery) -> None:
        """Owner ids name the task id, but two executions with the same id (a redelivery)
        still differ: one can never release the other's lease."""
        store = MemoryLockStore()
        app.conf.lease_store = store
        owners: list[str] = []

        @app.task(bind=True, base=LockedTask, lock_key="same", shared=False)
        def body(self: Any) -> None:
            owners.append(self.request.lease.owner)

        body.apply(task_id="one-id")
        body.apply(task_id="one-id")
        assert len(set(owners)) == 2
        assert [parse_owner(o).task_id for o in owners] == ["one-id", "one-id"]

    def test_the_key_is_free_before_apply_returns_the_result(self, app: Celery) -> None:
        store = MemoryLockStore()
        app.conf.lease_store = store
        seen: list[object] = []

        @app.task(base=LockedTask, lock_key="vis", shared=False)
        def body() -> str:
            seen.append(store.get("vis"))
            return "ran"

        result = body.apply()
        assert store.get("vis") is None
        assert result.get() == "ran" and seen[0] is not None


@contextlib.contextmanager
def _ignore_runtime_warnings() -> Iterator[None]:
    """Swallow "coroutine was never awaited" warnings (an async store's call left unawaited),
    so that the test fails on its assertions, not on the warning filter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


class TestTheStoresClock:
    """A task's lease runs on its store's clock only when that is a real clock."""

    def test_a_task_on_a_store_whose_clock_raises_runs(self) -> None:
        """Through the task path: the lease is taken and released, on the system clock."""

        class RaisingClock(MemoryLockStore):
            @property
            def clock(self) -> Any:
                raise RuntimeError("the clock is not configured")

        store = RaisingClock()
        app = Celery("raising-clock", broker="memory://", set_as_current=False)
        app.conf.task_always_eager = True
        app.conf.lease_store = store

        @app.task(base=LockedTask, lock_key="report", name="tests.clock_of.report")
        def report() -> int | None:
            return report.request.lock_token  # type: ignore[no-any-return]

        token = report.delay().get()
        assert token is not None and store.last_token("report") == token
        assert store.get("report") is None
