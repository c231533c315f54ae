"""Unique and debounce under racing callers and late starts: never two bodies for one key.

In-process broker and result backend, MemoryLockStore on a FakeClock; a competing call is made at
a chosen store operation or publish (``hook_once``, a wrapped ``send_task``).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_lease import LockedTask
from celery_lease._celery import settings as config
from celery_lease._celery import unique as unique_module
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.testing import FakeClock
from tests.unit.conftest import Published, SpyStore
from tests.unit.unique_copies import define_task, deliver, hook_once, request_of


class TestSupersedingCallerFails:
    def test_a_failed_publish_does_not_revive_a_copy_superseded_again(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A waits; X supersedes A; while X's publish is on its way Y supersedes X; then X's
        publish fails. X no longer stands in for A, so A stays superseded: only Y runs."""
        task = define_task(app, "d.revive", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        real = app.send_task
        y: list[Any] = []

        def send(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("task_id") == "X":
                y.append(task.apply_async((1, 3), task_id="Y"))  # Y supersedes X meanwhile
                raise ConnectionError("broker down")
            return real(*args, **kwargs)

        monkeypatch.setattr(app, "send_task", send)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert [r.id for r in y] == ["Y"]
        assert published.ids == [a.id, "Y"]
        assert store.get(unique_module.superseded_key(a.id, "")) is not None, (
            "A's tombstone is gone: A runs beside Y"
        )
        holder = store.get("queued:k:1")
        assert holder is not None and parse_owner(holder.owner).task_id == y[0].id

    def test_a_caller_that_loses_the_tombstone_leaves_the_waiting_copy_alone(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B and C both supersede A; B writes A's tombstone first. C finds it B's: C is a
        duplicate of B and never touches A's queued lease; B publishes."""
        task = define_task(app, "d.tomb-race", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]
        c: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            "release",
            lambda key, owner: key == "queued:k:1" and owner == a_owner,
            lambda: c.append(task.apply_async((1, 3), task_id="C")),
        )
        b = task.apply_async((1, 2), task_id="B")
        assert [r.id for r in c] == ["B"], "C lost the tombstone to B: it is B's duplicate"
        assert b.id == "B"
        assert published.ids == [a.id, "B"]


class TestLateStart:
    def test_an_until_done_copy_starting_after_its_queue_ttl_takes_its_key_back(
        self, app: Celery, published: Published, clock: FakeClock
    ) -> None:
        """The copy's queued key expired while it waited in the queue. Once it starts it takes
        the key back: a call made while its body runs is its duplicate, not a second copy."""
        inner: list[str] = []

        @app.task(
            name="late.start",
            base=LockedTask,
            lock_key="k:{n}",
            lock_unique="until_done",
            lock_queue_ttl=10,
            shared=False,
            bind=True,
        )
        def body(self: Any, n: int) -> int:
            inner.append(self.delay(n).id)
            return n

        task = body._get_current_object()
        first = task.delay(1)
        clock.advance(10.5)  # the queued key expires before a worker starts the copy
        deliver(task, published.headers[0], deferred=False)
        assert inner == [first.id], "a call during the body was published as a second copy"
        assert published.ids == [first.id]


class TestWithdrawAfterFailedPublish:
    """X superseded the waiting copy A, X's publish failed, and X hands the key back to A while
    Y calls at a chosen step of that: whatever the step, exactly one copy stays to run."""

    def _supersede_and_fail(
        self, app: Celery, store: SpyStore, monkeypatch: pytest.MonkeyPatch, name: str
    ) -> tuple[Any, Any, str]:
        task = define_task(app, name, lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", refuse)
        return task, a, a_owner

    def test_a_call_taking_the_freed_key_keeps_the_waiting_copy_superseded(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Y lands right after X freed its own queued lease: Y takes the free key and is
        published; X cannot hand the key back, so A stays superseded."""
        real = app.send_task
        task, a, _ = self._supersede_and_fail(app, store, monkeypatch, "w.freed")
        y: list[Any] = []

        def call_y() -> None:
            monkeypatch.setattr(app, "send_task", real)
            y.append(task.apply_async((1, 3), task_id="Y"))

        hook_once(
            monkeypatch,
            store,
            "release",
            lambda key, owner: key == "queued:k:1" and parse_owner(owner).task_id == "X",
            call_y,
            after=True,
        )
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert [r.id for r in y] == ["Y"]
        assert published.ids == [a.id, "Y"]
        tomb = store.get(unique_module.superseded_key(a.id, ""))
        assert tomb is not None and parse_owner(tomb.owner).task_id == "X", "A runs beside Y"

    def test_a_call_landing_after_the_key_is_handed_back_is_the_waiting_copys_duplicate(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Y lands after X gave A its key back, before X removed A's tombstone: Y is A's
        duplicate (A runs once the tombstone is gone); nothing else is published."""
        task, a, a_owner = self._supersede_and_fail(app, store, monkeypatch, "w.handed")
        y: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            "acquire",
            lambda key, owner, ttl: key == "queued:k:1" and owner == a_owner,
            lambda: y.append(task.apply_async((1, 3), task_id="Y")),
            after=True,
        )
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert [r.id for r in y] == [a.id]
        assert published.ids == [a.id]
        assert store.get(unique_module.superseded_key(a.id, "")) is None
        holder = store.get("queued:k:1")
        assert holder is not None and holder.owner == a_owner

    def test_a_message_that_reached_the_broker_after_all_ends_without_its_body(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """X's publish raised but its message was taken: X handed the key back to A, and X's
        message, when it starts, ends superseded (REVOKED): A runs, X does not."""
        task = define_task(app, "w.taken", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        real = app.send_task

        def taken_then_fail(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            raise ConnectionError("connection lost after the broker took it")

        monkeypatch.setattr(app, "send_task", taken_then_fail)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert published.ids == [a.id, "X"]
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        x_request = request_of(published.headers[1])
        with pytest.raises(Ignore):
            unique_module.on_start(task, x_request, store, "k:1", settings, options, 30, 0)
        a_request = request_of(published.headers[0])
        hold = unique_module.on_start(task, a_request, store, "k:1", settings, options, 30, 0)
        assert hold is None  # A runs its body (no Ignore)


class TestUntilDoneDebounceStart:
    def test_a_call_racing_the_copys_start_is_not_enqueued_while_its_body_runs(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """N reads the waiting copy A's queued lease; A starts (run lease taken, queued lease
        freed); then N goes on superseding it. Either A ends superseded, or N is A's duplicate:
        never a second copy enqueued while A's body runs."""
        task = define_task(
            app, "d.start-race", lock_unique="until_done", lock_debounce=1, lock_ttl=30
        )
        a = task.delay(1, 1)
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        ran: list[bool] = []

        def start_a() -> None:
            store.acquire("k:1", make_owner(task=task.name, task_id=a.id), 30_000)
            try:
                unique_module.on_start(
                    task, request_of(published.headers[0]), store, "k:1", settings, options, 30, 0
                )
            except Ignore:
                ran.append(False)
            else:
                ran.append(True)

        hook_once(monkeypatch, store, "get", lambda key: key == "queued:k:1", start_a, after=True)
        n = task.apply_async((1, 2), task_id="N")
        assert ran == [True]
        assert n.id == a.id, "N was enqueued while A's body runs"
        assert published.ids == [a.id]
