"""Review of unique at enqueue (issue 9): attacks on the caller's side and on the hand-over.

Each test forces one interleaving with a store wrapper that runs a competing call at a chosen
store operation (no sleeps, FakeClock), and checks a property of issue 9.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.exceptions import Ignore

from celery_lease import LockedTask, config
from celery_lease import unique as unique_module
from celery_lease.errors import StoreUnavailableError
from celery_lease.owners import make_owner, parse_owner, queued_owner
from celery_lease.testing import FakeClock
from tests.unit.conftest import Published, SpyStore

Hook = Callable[[], None]


def define(app: Celery, name: str, **options: Any) -> Any:
    @app.task(name=name, base=LockedTask, lock_key="k:{n}", shared=False, **options)
    def body(n: int, extra: int = 0) -> int:
        return n + extra

    return body._get_current_object()  # the Task itself: the worker's hooks get no proxy


def hook_once(
    monkeypatch: pytest.MonkeyPatch,
    store: SpyStore,
    op: str,
    when: Callable[..., bool],
    hook: Hook,
    *,
    after: bool = False,
) -> list[bool]:
    """Run ``hook`` once, before (or after) the first ``store.<op>(...)`` that ``when`` accepts."""
    real = getattr(store, op)
    fired: list[bool] = []

    def wrapper(*args: Any) -> Any:
        go = not fired and when(*args)
        if go:
            fired.append(True)
            if not after:
                hook()
        result = real(*args)
        if go and after:
            hook()
        return result

    monkeypatch.setattr(store, op, wrapper)
    return fired


def request_of(message_headers: dict[str, Any]) -> Context:
    """The worker's request of a published copy (its headers as attributes, as Celery does)."""
    return Context(
        id=message_headers["id"],
        is_eager=False,
        called_directly=False,
        **{unique_module.HEADER: message_headers[unique_module.HEADER]},
    )


class TestReusedTaskId:
    @pytest.mark.parametrize("unique", ["while_queued", "until_done"])
    def test_two_calls_with_one_explicit_task_id_publish_one_message(
        self, app: Celery, published: Published, unique: str
    ) -> None:
        """apply_async(task_id=X) twice in the same millisecond: the second is a duplicate,
        not the holder again (the queued owner must be unique per call)."""
        task = define(app, f"r.same-id.{unique}", lock_unique=unique)
        first = task.apply_async((1,), task_id="fixed-id")
        second = task.apply_async((1,), task_id="fixed-id")
        assert first.id == second.id == "fixed-id"
        assert len(published.ids) == 1


class TestForgedHeader:
    def test_a_revoked_copy_frees_only_a_queued_key(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """task_revoked with a header naming a key outside the queued namespace frees nothing,
        even when that key's owner happens to carry the same text."""
        task = define(app, "r.forged", lock_unique="while_queued")
        owner = queued_owner(task.name, "victim-id", 1)
        store.acquire("k:other", owner, 60_000)  # some lease that is not a queued lease
        request = SimpleNamespace(id="victim-id", **{unique_module.HEADER: ["k:other", owner]})
        unique_module._on_revoked(sender=task, request=request)
        assert store.get("k:other") is not None

    def test_a_header_naming_another_copy_is_not_trusted(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """A message carrying another copy's [queued key, owner] frees nothing when it starts."""
        task = define(app, "r.forged-start", lock_unique="while_queued")
        victim = task.delay(1)
        settings = config.get_settings(app)
        forged = SimpleNamespace(
            id="attacker-id",
            is_eager=False,
            **{unique_module.HEADER: published.headers[0][unique_module.HEADER]},
        )
        unique = type(task)._lock_options.unique
        assert unique_module.on_start(task, forged, store, "k:1", settings, unique, 30, 0) is None
        unique_module.on_rejected(forged, store, "k:1", settings)
        unique_module._on_revoked(sender=task, request=forged)
        info = store.get("queued:k:1")
        assert info is not None and parse_owner(info.owner).task_id == victim.id


class TestDebounceHandOver:
    @pytest.mark.parametrize(
        ("op", "after"), [("get", False), ("get", True), ("release", False), ("release", True)]
    )
    def test_a_superseded_copy_never_runs_its_body(
        self,
        app: Celery,
        published: Published,
        store: SpyStore,
        monkeypatch: pytest.MonkeyPatch,
        op: str,
        after: bool,
    ) -> None:
        """A newer call landing at any point of the waiting copy's start: either the copy ends
        (Ignore) or it was not superseded (no tombstone names it)."""
        task = define(app, f"r.handover.{op}.{after}", lock_unique="while_queued", lock_debounce=1)
        first = task.delay(1, 0)
        request = request_of(published.headers[0])
        newer: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            op,
            lambda *a: True,
            lambda: newer.append(task.delay(1, 5)),
            after=after,
        )
        unique = type(task)._lock_options.unique
        settings = config.get_settings(app)
        try:
            unique_module.on_start(task, request, store, "k:1", settings, unique, 30, 0)
        except Ignore:
            ran = False
        else:
            ran = True
        assert newer, "the competing call was made"
        superseded = store.get(unique_module.superseded_key(first.id, "")) is not None
        assert not (ran and superseded), "the superseded copy went on to run its body"


class TestSupersedeRace:
    def test_losing_the_race_to_supersede_leaves_one_copy_to_run(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B supersedes A; C takes the key between B's release of A and B's acquire. A's lease
        is gone, so A must stay superseded: only C may run (never A beside C)."""
        task = define(app, "r.race", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]
        c: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            "release",
            lambda key, owner: key == "queued:k:1" and owner == a_owner,
            lambda: c.append(task.delay(1, 3)),
            after=True,
        )
        b = task.delay(1, 2)
        assert c and b.id == c[0].id  # B is a duplicate of the winner
        assert published.ids == [a.id, c[0].id]
        a_runs = store.get(unique_module.superseded_key(a.id, "")) is None
        assert not a_runs, "A has no lease and no tombstone: it runs beside C"

    def test_a_store_error_while_superseding_keeps_the_waiting_copy(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The store fails when B takes the key after releasing A's: B's caller gets the error,
        and A is not left superseded with nothing replacing it (it runs, as after a failed
        publish)."""
        task = define(app, "r.store-error", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        real = store.acquire
        calls: list[str] = []

        def acquire(key: str, owner: str, ttl_ms: int) -> int | None:
            calls.append(key)
            if key == "queued:k:1" and calls.count(key) == 2:  # B's take-over, after the release
                raise StoreUnavailableError("injected")
            return real(key, owner, ttl_ms)

        monkeypatch.setattr(store, "acquire", acquire)
        with pytest.raises(StoreUnavailableError):
            task.delay(1, 2)
        assert published.ids == [a.id]
        assert store.get(unique_module.superseded_key(a.id, "")) is None


class TestFakeClockAroundQueueTtl:
    def test_a_copy_starting_after_its_queue_ttl_frees_nothing_of_the_next(
        self, app: Celery, published: Published, store: SpyStore, clock: FakeClock
    ) -> None:
        """A's queued lease expired, B took the key; A starting late releases only its own."""
        task = define(app, "r.late", lock_unique="while_queued", lock_queue_ttl=10)
        a = task.delay(1)
        clock.advance(10.1)
        b = task.delay(1)
        assert b.id != a.id
        unique = type(task)._lock_options.unique
        settings = config.get_settings(app)
        unique_module.on_start(
            task, request_of(published.headers[0]), store, "k:1", settings, unique, 30, 0
        )
        info = store.get("queued:k:1")
        assert info is not None and parse_owner(info.owner).task_id == b.id
        assert task.delay(1).id == b.id


class TestRedelivery:
    def test_a_redelivered_copy_meeting_its_own_run_lease_keeps_the_queued_key(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """acks_late redelivery of a running until_done copy: the run lease is its own, so it
        is turned away without freeing the queued key the running body keeps."""
        task = define(app, "r.redelivered", lock_unique="until_done")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)  # running
        settings = config.get_settings(app)
        unique_module.on_rejected(request_of(published.headers[0]), store, "k:1", settings)
        assert task.delay(1).id == first.id
        assert published.ids == [first.id]

    def test_a_second_delivery_of_the_running_copy_is_resent_and_stores_nothing(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """With the engine's arguments, a delivery meeting its own running copy's run lease is
        re-sent with the same id, ``lease_deferred`` and a countdown of the run ttl, then ends
        with Ignore: nothing stored under the id, the queued key kept."""
        task = define(app, "r.deferred", lock_unique="until_done")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)  # running
        request = request_of(published.headers[0])
        request.args, request.kwargs = [1], {}
        settings = config.get_settings(app)
        with pytest.raises(Ignore):
            unique_module.on_rejected(request, store, "k:1", settings, task=task, ttl=5.0)
        assert published.ids == [first.id, first.id]
        again = published.headers[1]
        assert again[unique_module.DEFERRED] == 1  # re-sent once so far
        assert again[unique_module.HEADER] == published.headers[0][unique_module.HEADER]
        assert again["eta"] is not None and again["expires"] is None
        assert task.AsyncResult(first.id).state == "PENDING"
        assert store.get("queued:k:1") is not None

    def test_a_deferred_delivery_of_a_finished_copy_ends_before_its_body(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """A deferred delivery that finds its copy's result ready raises Ignore at start."""
        task = define(app, "r.deferred-done", lock_unique="until_done")
        first = task.delay(1)
        task.backend.mark_as_done(first.id, 1)
        request = request_of(published.headers[0])
        setattr(request, unique_module.DEFERRED, 1)  # re-sent once
        settings = config.get_settings(app)
        unique = type(task)._lock_options.unique
        with pytest.raises(Ignore, match="finished"):
            unique_module.on_start(task, request, store, "k:1", settings, unique, 30, 0)
        assert task.AsyncResult(first.id).get() == 1

    def test_a_copy_turned_away_by_another_copy_frees_its_queued_key(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """The run lease is another copy's: the rejected copy frees its own queued key."""
        task = define(app, "r.rejected", lock_unique="while_queued")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id="other-id"), 60_000)
        settings = config.get_settings(app)
        unique_module.on_rejected(request_of(published.headers[0]), store, "k:1", settings)
        assert store.get("queued:k:1") is None
        assert task.delay(1).id != first.id


class TestStoreDown:
    def test_a_store_error_at_enqueue_raises_and_publishes_nothing(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The store is down when the queued lease is taken: the caller gets the error (never
        a silent publish without the lease, never a silent success)."""
        task = define(app, "r.store-down", lock_unique="until_done")

        def down(*args: Any) -> Any:
            raise StoreUnavailableError("injected")

        monkeypatch.setattr(store, "acquire", down)
        monkeypatch.setattr(store, "acquire_or_holder", down)  # the call a duplicate check makes
        with pytest.raises(StoreUnavailableError):
            task.delay(1)
        assert published.ids == []


class TestFailedPublishSeenByDuplicates:
    def test_a_duplicate_of_a_copy_whose_publish_failed_does_not_wait_forever(
        self, app: Celery, published: Published, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B calls while A is publishing and gets A's id; A's publish then fails: B's result
        ends FAILURE (its get() raises) instead of staying PENDING for ever."""
        task = define(app, "r.dup-of-failed", lock_unique="until_done")
        seen: list[Any] = []

        def refuse(*args: Any, **kwargs: Any) -> Any:
            seen.append(task.delay(1))  # B, during A's publish
            raise ConnectionError("broker down")

        with monkeypatch.context() as patch:
            patch.setattr(app, "send_task", refuse)
            with pytest.raises(ConnectionError):
                task.delay(1)
        assert seen and published.ids == []
        assert seen[0].state == "FAILURE"
        with pytest.raises(ConnectionError):
            seen[0].get(timeout=5, propagate=True)
