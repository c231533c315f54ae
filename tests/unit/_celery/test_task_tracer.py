"""LockedTask as a ``celery worker`` runs it: Celery's tracer with a delivered message's request,
with the worker's stack protection installed, beside the same calls made eagerly.

Forged lock headers, a body publishing its own task id, mixins on both sides of LockedTask,
recursion and direct calls of other locked tasks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from billiard.einfo import ExceptionInfo
from celery import Celery, Task

from celery_lease import LockedTask, MemoryLockStore, current_lease, get_lock_token


@pytest.fixture
def store() -> MemoryLockStore:
    return MemoryLockStore()


@pytest.fixture
def app(store: MemoryLockStore) -> Iterator[Celery]:
    app = Celery("tracer", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.task_eager_propagates = False
    yield app
    app.close()


@pytest.fixture
def protected_call(app: Celery) -> Iterator[None]:
    """Celery's worker stack protection (``BaseTask.__call__`` -> ``__protected_call__``), as a
    ``celery worker`` process installs it; undone at teardown."""
    from celery import Task
    from celery.app import trace

    original = Task.__call__
    trace._install_stack_protection()
    assert Task.__call__ is not original
    try:
        yield
    finally:
        trace.reset_worker_optimizations(app)
        assert Task.__call__ is original


FORGED = {
    "_lease_run": True,
    "lock_token": 10**30,
    "lock_key": "forged",
    "lock_waited": True,
    "lease": "forged",
    "lock_lost": True,
}


class TestForgedHeaders:
    """Message headers named like the lock attributes (including the private ``_lease_run``)
    become request attributes on a worker: none of them may reach the body."""

    @pytest.mark.parametrize("mixin", [False, True])
    def test_worker_tracer_with_stack_protection(
        self, app: Celery, protected_call: None, mixin: bool
    ) -> None:
        import uuid

        from celery import Task
        from celery.app.trace import build_tracer

        class Opener(Task):  # type: ignore[misc]
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return super().__call__(*args, **kwargs)

        class WithMixin(LockedTask, Opener):
            pass

        def report(self: Any) -> dict[str, Any]:
            req = self.request
            return {
                "key": req.lock_key,
                "token": req.lock_token,
                "waited": req.lock_waited,
                "lease_token": getattr(req.lease, "token", req.lease),
                "lost": req.lock_lost,
                "ambient": get_lock_token(),
                "depth": len(self.request_stack.stack),
                "id": req.id,
            }

        base = WithMixin if mixin else LockedTask

        @app.task(bind=True, base=base, lock_key="fk", shared=False)
        def task(self: Any) -> dict[str, Any]:
            return report(self)

        app.finalize()
        seen = []
        for headers in ({}, FORGED):
            task_id = str(uuid.uuid4())
            tracer = build_tracer(task.name, task, app=app, eager=False, propagate=True)
            request = {"id": task_id, "task": task.name, "delivery_info": {}, **headers}
            seen.append(tracer(task_id, (), {}, request).retval)
            assert seen[-1]["id"] == task_id
        plain, forged = seen
        assert forged["key"] == "fk" and forged["waited"] is False and forged["lost"] is False
        assert forged["token"] == forged["lease_token"] == forged["ambient"] != 10**30
        assert forged["depth"] == plain["depth"], "the forged header changed the request stack"


def trace(app: Celery, task: Any, *args: Any, **headers: Any) -> Any:
    """Run ``task`` as a worker's tracer does (not eager: ``retry()`` publishes, to the memory
    broker, unconsumed); returns what the body returned, or the exception that ended it."""
    import uuid

    from celery.app.trace import build_tracer

    app.finalize()
    task_id = str(uuid.uuid4())
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    request = {"id": task_id, "task": task.name, "delivery_info": {}, **headers}
    retval = tracer(task_id, args, {}, request).retval
    if isinstance(retval, ExceptionInfo):
        exc = retval.exception
        return getattr(exc, "exc", exc)  # unwrap ExceptionWithTraceback
    return retval


@pytest.fixture
def released(app: Celery) -> Iterator[list[tuple[str, Any]]]:
    """``(signal name, token)`` of every lock_released and lock_lost sent during the test."""
    from celery_lease import signals as lease_signals

    sent: list[tuple[str, Any]] = []

    def receiver(signal: Any = None, token: Any = None, **kwargs: Any) -> None:
        sent.append((signal.name, token))

    for name in ("lock_released", "lock_lost"):
        getattr(lease_signals, name).connect(receiver, weak=False)
    yield sent
    for name in ("lock_released", "lock_lost"):
        getattr(lease_signals, name).disconnect(receiver)


class TestPublishingOwnId:
    """The early release on ``before_task_publish`` with the execution's own id."""

    def test_task_protocol_1_releases_too(self, app: Celery, store: MemoryLockStore) -> None:
        """With ``task_protocol = 1`` the id is in the body, not the headers: the lease is
        still released before the message goes out."""
        app.conf.task_protocol = 1

        @app.task(bind=True, base=LockedTask, lock_key="p1", shared=False)
        def task(self: Any) -> list[Any]:
            self.apply_async(task_id=self.request.id)
            return [store.get("p1") is None, self.request.lock_lost]

        assert list(task.apply().get()) == [True, True]

    @pytest.mark.parametrize("throw", [True, False])
    def test_retry_whose_publish_fails(
        self,
        app: Celery,
        store: MemoryLockStore,
        released: list[tuple[str, Any]],
        monkeypatch: pytest.MonkeyPatch,
        throw: bool,
    ) -> None:
        """Broker down at the retry: the lease was released at ``before_task_publish``; the
        body is told (``Reject`` from ``retry()``, even with throw=False, and lock_lost), the
        lease is released once and lock_released sent once, no lock_lost."""
        import kombu.messaging
        from celery.exceptions import Reject

        def broker_down(*args: Any, **kwargs: Any) -> None:
            raise ConnectionError("broker down")

        monkeypatch.setattr(kombu.messaging.Producer, "publish", broker_down)
        seen: list[Any] = []

        @app.task(bind=True, base=LockedTask, lock_key="pf", max_retries=3, shared=False)
        def task(self: Any) -> str:
            try:
                self.retry(countdown=0, throw=throw)
            except Reject:
                seen.append((self.request.lock_lost, store.get("pf"), self.request.lease.token))
                raise
            return "ran on"

        result = trace(app, task)
        assert isinstance(result, Reject), result
        assert len(seen) == 1 and seen[0][:2] == (True, None)
        assert released == [("lock_released", seen[0][2])]
        assert store.get("pf") is None

    def test_own_id_twice_eta_retry_releases_once(
        self, app: Celery, store: MemoryLockStore, released: list[tuple[str, Any]]
    ) -> None:
        """A body publishing its own id twice, then retrying with ``eta``: one release, one
        lock_released, the key free from the first publish on, the attempt ends in RETRY."""
        import datetime

        from celery.exceptions import Retry

        seen: list[Any] = []

        @app.task(bind=True, base=LockedTask, lock_key="twice", max_retries=3, shared=False)
        def task(self: Any) -> None:
            self.apply_async(task_id=self.request.id)
            seen.append(store.get("twice"))
            assert store.acquire("twice", "someone-else", 60_000) is not None
            self.apply_async(task_id=self.request.id)
            eta = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
            raise self.retry(eta=eta)

        result = trace(app, task)
        assert isinstance(result, Retry), result
        assert seen == [None]
        assert [name for name, _ in released] == ["lock_released"]
        after = store.get("twice")
        assert after is not None and after.owner == "someone-else", "the other holder kept it"

    def test_other_ids_release_nothing(
        self, app: Celery, store: MemoryLockStore, released: list[tuple[str, Any]]
    ) -> None:
        """A group, a chain and another task published from the body carry other ids: the
        lease stays held until the body ends."""
        from celery import chain, group

        @app.task(shared=False)
        def other(n: int) -> int:
            return n

        @app.task(bind=True, base=LockedTask, lock_key="others", shared=False)
        def task(self: Any) -> list[Any]:
            group(other.s(1), other.s(2)).apply_async()
            chain(other.s(1), other.s(2)).apply_async()
            other.apply_async((3,))
            held = store.get("others")
            return [held is not None and held.token == self.request.lock_token,
                    self.request.lock_lost]  # fmt: skip

        assert list(trace(app, task)) == [True, False]
        assert [name for name, _ in released] == ["lock_released"]

    def test_replace_with_itself_releases_once(
        self, app: Celery, store: MemoryLockStore, released: list[tuple[str, Any]]
    ) -> None:
        """``replace()`` freezes the replacement with the task's own id: released at the
        publish, once; the attempt ends IGNORED; the key is free for the replacement."""
        from celery.exceptions import Ignore

        @app.task(bind=True, base=LockedTask, lock_key="rep", shared=False)
        def task(self: Any, n: int) -> None:
            raise self.replace(self.s(n + 1))

        result = trace(app, task, 1)
        assert isinstance(result, Ignore), result
        assert [name for name, _ in released] == ["lock_released"]
        assert store.get("rep") is None


class _OpenA(Task):  # type: ignore[misc]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _opened.append(("A", current_lease() is not None))
        return super().__call__(*args, **kwargs)


class _OpenB(Task):  # type: ignore[misc]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _opened.append(("B", current_lease() is not None))
        return super().__call__(*args, **kwargs)


class _BothSides(_OpenA, LockedTask, _OpenB):
    """Mixins before and after LockedTask in the class order."""


_opened: list[tuple[str, bool]] = []


def _run_as(mode: str, app: Celery, task: Any, *args: Any) -> Any:
    if mode == "apply":
        return task.apply(args).get()
    return trace(app, task, *args)


@pytest.mark.parametrize("mode", ["apply", "worker"])
class TestCallPaths:
    """Mixins on both sides, recursion and direct calls of other locked tasks, eagerly and as
    a ``celery worker`` runs them (stack protection installed)."""

    @pytest.fixture(autouse=True)
    def _mode(self, request: pytest.FixtureRequest, mode: str) -> None:
        if mode == "worker":
            request.getfixturevalue("protected_call")

    def test_mixins_on_both_sides_run_once_each(self, app: Celery, mode: str) -> None:
        @app.task(bind=True, base=_BothSides, lock_key="both:{n}", shared=False)
        def task(self: Any, n: int) -> list[Any]:
            req = self.request
            return [req.lock_key, req.lock_token == get_lock_token() == req.lease.token]

        _opened.clear()
        assert list(_run_as(mode, app, task, 1)) == ["both:1", True]
        assert _opened == [("A", False), ("B", True)]

    @pytest.mark.parametrize("base", [LockedTask, _BothSides])
    def test_recursion_and_direct_calls(
        self, app: Celery, store: MemoryLockStore, mode: str, base: type
    ) -> None:
        """``task(n)`` calls itself directly down to 0 and another locked task on the way:
        every level sees its own key and token (equal to ``get_lock_token()``), before and
        after the call below it; nothing is left held."""

        @app.task(bind=True, base=base, lock_key="other:{n}", shared=False)
        def other(self: Any, n: int) -> Any:
            return [self.request.lock_key, self.request.lock_token == get_lock_token()]

        @app.task(bind=True, base=base, lock_key="rec:{n}", shared=False)
        def task(self: Any, n: int) -> list[Any]:
            req = self.request
            mine = [req.lock_key, req.lock_token]
            assert mine[1] == get_lock_token()
            below = task(n - 1) if n else other(n)
            assert [req.lock_key, req.lock_token] == mine, "the call below changed the request"
            assert [self.request.lock_key, self.request.lock_token] == mine
            assert get_lock_token() == mine[1]
            return [mine[0], *list(below)] if n else [mine[0], below]

        _opened.clear()
        result = _run_as(mode, app, task, 2)
        assert not isinstance(result, BaseException), result
        assert result[:3] == ["rec:2", "rec:1", "rec:0"]
        assert list(result[3]) == ["other:0", True]
        for key in ("rec:2", "rec:1", "rec:0", "other:0"):
            assert store.get(key) is None, key
        assert current_lease() is None


def test_on_held_retry_leaves_the_holder_alone(
    app: Celery, store: MemoryLockStore, released: list[tuple[str, Any]]
) -> None:
    """on_held="retry" on a worker: the retry is published (RETRY), the other holder's lease
    is untouched (nothing of ours was held, nothing is released or reported)."""
    from celery.exceptions import Retry

    from celery_lease import LockNotAcquiredError

    @app.task(base=LockedTask, lock_key="held", lock_on_held="retry", shared=False)
    def task() -> None: ...

    assert store.acquire("held", "someone-else", 60_000) is not None
    before = store.get("held")
    result = trace(app, task)
    assert isinstance(result, Retry) and isinstance(result.exc, LockNotAcquiredError), result
    assert store.get("held") is not None and store.get("held").token == before.token  # type: ignore[union-attr]
    assert released == []


class _Broken(Task):  # type: ignore[misc]
    """A mixin whose ``__call__`` raises before it calls ``super().__call__()`` (no push)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the mixin failed before the body")


class _LockedBroken(LockedTask, _Broken):
    pass


@pytest.mark.parametrize("mode", ["apply", "worker"])
def test_mixin_raising_before_the_push(
    app: Celery, store: MemoryLockStore, request: pytest.FixtureRequest, mode: str
) -> None:
    """The mixin under the lease raises before any request is pushed: the lease is released,
    the error is the mixin's, and the next execution finds the request stack clean."""
    if mode == "worker":
        request.getfixturevalue("protected_call")

    @app.task(bind=True, base=_LockedBroken, lock_key="broken", shared=False)
    def task(self: Any) -> None: ...

    result = task.apply() if mode == "apply" else trace(app, task)
    error = result.result if mode == "apply" else result
    assert isinstance(error, RuntimeError) and "mixin failed" in str(error)
    assert store.get("broken") is None and current_lease() is None
    assert len(task.request_stack.stack) == 0
