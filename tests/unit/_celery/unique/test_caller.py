"""Unique at enqueue, the caller's side: in-process broker, MemoryLockStore, FakeClock."""

from __future__ import annotations

import json
import pickle
import threading
from typing import Any

import pytest
import redis
import redis.backoff
import redis.retry
from celery import Celery

from celery_lease import AlreadyQueuedError, LeaseConfigError, LockedTask, locked
from celery_lease._celery import unique as unique_module
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.errors import LockNotAcquiredError, RestartGraceError, StoreUnavailableError
from celery_lease.signals import lock_duplicate
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.sqlite import SQLiteLockStore
from celery_lease.testing import FakeClock
from tests.fixtures_redis import RedisServer
from tests.unit.conftest import Published, SpyStore
from tests.unit.unique_copies import define_task, hook_once


def define(app: Celery, name: str, **options: Any) -> Any:
    @app.task(name=name, base=LockedTask, lock_key="k:{n}", shared=False, **options)
    def body(n: int, extra: int = 0) -> int:
        return n + extra

    return body


UNIQUES = ["while_queued", "until_done"]


class TestOneCopy:
    @pytest.mark.parametrize("unique", UNIQUES)
    def test_a_second_call_publishes_nothing_and_gets_the_first_id(
        self, app: Celery, published: Published, unique: str
    ) -> None:
        """Two delay() with one key: one message, the same task id for both callers."""
        task = define(app, f"t.two.{unique}", lock_unique=unique)
        first = task.delay(7)
        second = task.delay(7)
        assert second.id == first.id
        assert published.ids == [first.id]

    @pytest.mark.parametrize("unique", UNIQUES)
    def test_fifty_threads_publish_one_message(
        self, app: Celery, published: Published, unique: str
    ) -> None:
        """50 concurrent delay() calls from threads: exactly one message, one id for all."""
        task = define(app, f"t.fifty.{unique}", lock_unique=unique)
        assert task.name  # evaluate the task proxy here, as importing a tasks module does
        start = threading.Barrier(50)
        ids: list[str] = []
        guard = threading.Lock()

        def call() -> None:
            start.wait()
            result = task.delay(3)
            with guard:
                ids.append(result.id)

        threads = [threading.Thread(target=call) for _ in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(ids) == 50
        assert set(ids) == set(published.ids)
        assert len(published.ids) == 1

    @pytest.mark.parametrize("unique", UNIQUES)
    def test_a_duplicate_costs_one_store_call_when_the_store_names_the_holder(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch,
        unique: str,
    ) -> None:  # fmt: skip
        """A store that names the holder of a refused key (acquire_or_holder) answers a
        duplicate in one call, not an acquire and then a get (two round trips on Redis)."""
        task = define(app, f"t.one-call.{unique}", lock_unique=unique)
        first = task.delay(4)
        calls: list[str] = []
        for name in ("acquire", "acquire_or_holder", "get", "renew", "release"):
            real = getattr(SpyStore, name)

            def spy(self: SpyStore, *args: Any, _real: Any = real, _name: str = name) -> Any:
                calls.append(_name)
                return _real(self, *args)

            monkeypatch.setattr(SpyStore, name, spy)  # on the class: see _uses_acquire_or_holder
        assert task.delay(4).id == first.id
        assert calls == ["acquire_or_holder"]
        assert published.ids == [first.id]

    def test_other_keys_are_independent(self, app: Celery, published: Published) -> None:
        """Different keys each get their own copy."""
        task = define(app, "t.keys", lock_unique="until_done")
        assert task.delay(1).id != task.delay(2).id
        assert len(published.ids) == 2

    def test_the_message_carries_the_queued_lease(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """The header names the queued key and an owner that identifies the task id."""
        task = define(app, "t.header", lock_unique="while_queued")
        result = task.delay(5)
        qkey, owner = published.headers[0][unique_common.HEADER]
        assert qkey == "queued:k:5"
        assert parse_owner(owner).task_id == result.id
        info = store.get(qkey)
        assert info is not None and info.owner == owner

    def test_a_task_without_unique_touches_no_store(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """Without lock_unique, apply_async is Celery's: no store call at enqueue."""
        task = define(app, "t.plain")
        task.delay(1)
        task.delay(1)
        assert len(published.ids) == 2
        assert store.list() == []

    def test_eager_mode_deduplicates_nothing(self, app: Celery, store: SpyStore) -> None:
        """task_always_eager runs each call inline; the run lease is all there is."""
        app.conf.task_always_eager = True
        task = define(app, "t.eager", lock_unique="until_done")
        assert task.delay(1).get() == 1
        assert task.delay(1).get() == 1
        assert store.list() == []


class TestDuplicates:
    def test_raise_gives_the_holder(self, app: Celery, published: Published) -> None:
        """on_duplicate="raise": AlreadyQueuedError with the key and the holder's task id."""
        task = define(app, "t.raise", lock_unique="while_queued", lock_on_duplicate="raise")
        first = task.delay(4)
        with pytest.raises(AlreadyQueuedError) as caught:
            task.delay(4)
        assert caught.value.key == "k:4"
        assert caught.value.task_id == first.id
        assert isinstance(caught.value, LockNotAcquiredError)
        assert len(published.ids) == 1

    def test_the_error_survives_pickle_and_json(self) -> None:
        """Rebuilt as cls(*args) (json backend) and by pickle, with key and task_id."""
        error = AlreadyQueuedError("k:1", "abc")
        again = pickle.loads(pickle.dumps(error))
        rebuilt = AlreadyQueuedError(*json.loads(json.dumps(error.args)))
        for copy in (again, rebuilt):
            assert (copy.key, copy.task_id, copy.reason) == ("k:1", "abc", "queued")
            assert str(copy) == str(error)

    def test_lock_duplicate_is_sent_in_the_caller(self, app: Celery) -> None:
        """lock_duplicate(key, task_id, existing_task_id), from the calling thread."""
        task = define(app, "t.signal", lock_unique="until_done")
        seen: list[dict[str, Any]] = []

        def receiver(sender: Any, **named: Any) -> None:
            seen.append({**named, "thread": threading.get_ident()})

        lock_duplicate.connect(receiver)
        try:
            first = task.delay(9)
            task.apply_async((9,), task_id="second-id")
        finally:
            lock_duplicate.disconnect(receiver)
        assert len(seen) == 1
        assert seen[0]["key"] == "k:9"
        assert seen[0]["task_id"] == "second-id"
        assert seen[0]["existing_task_id"] == first.id
        assert seen[0]["thread"] == threading.get_ident()

    @pytest.mark.parametrize("callback", ["link", "link_error"])
    def test_a_duplicate_with_callbacks_raises(
        self, app: Celery, published: Published, callback: str
    ) -> None:
        """Callbacks are never dropped silently: a duplicate carrying them raises."""
        task = define(app, f"t.canvas.{callback}", lock_unique="while_queued")
        other = define(app, f"t.canvas.other.{callback}")
        first = task.apply_async((2,), **{callback: other.s()})
        assert published.ids == [first.id]
        with pytest.raises(AlreadyQueuedError) as caught:
            task.apply_async((2,), **{callback: other.s()})
        assert caught.value.task_id == first.id

    def test_a_chain_behind_a_duplicate_raises(self, app: Celery, published: Published) -> None:
        """A chain whose first step is a duplicate raises instead of losing its next steps."""
        task = define(app, "t.chain", lock_unique="until_done")
        other = define(app, "t.chain.next")
        task.delay(6)
        with pytest.raises(AlreadyQueuedError):
            (task.s(6) | other.s()).apply_async()
        assert len(published.ids) == 1


class TestUntilDone:
    def test_a_running_debounced_copy_is_the_existing_one(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """until_done with debounce: the run key held by a copy makes a call a duplicate (a
        debounced copy frees its queued key when it starts, so the run key tells)."""
        task = define(app, "t.running", lock_unique="until_done", lock_debounce=1)
        store.acquire("k:8", make_owner(task="t.running", task_id="running-id"), 60_000)
        assert task.delay(8).id == "running-id"
        assert published.ids == []
        assert store.get("queued:k:8") is None  # the queued lease taken to look was given back

    def test_while_queued_lets_one_wait_beside_the_running_one(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """while_queued: a running copy does not stop one copy from waiting."""
        task = define(app, "t.beside", lock_unique="while_queued")
        store.acquire("k:8", make_owner(task="t.beside", task_id="running-id"), 60_000)
        result = task.delay(8)
        assert published.ids == [result.id] and result.id != "running-id"

    def test_a_run_key_held_outside_a_task_is_not_a_copy(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """A lease without a task id (lease() in a script) is no copy to return: publish."""
        task = define(app, "t.script", lock_unique="until_done", lock_debounce=1)
        store.acquire("k:8", make_owner(label="script"), 60_000)  # run key, no task id
        result = task.delay(8)
        assert published.ids == [result.id]


class TestFreedKey:
    def test_a_failed_publish_frees_the_key(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The broker refuses the message: the error propagates and the key is free at once."""
        task = define(app, "t.broker-down", lock_unique="until_done")

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        with monkeypatch.context() as patch:
            patch.setattr(app, "send_task", refuse)
            with pytest.raises(ConnectionError):
                task.delay(1)
        assert store.get("queued:k:1") is None
        result = task.delay(1)
        assert published.ids == [result.id]

    def test_queue_ttl_frees_an_unstarted_copy(
        self, app: Celery, published: Published, clock: FakeClock
    ) -> None:
        """A copy that never starts holds its key for queue_ttl, then the next call publishes."""
        task = define(app, "t.ttl", lock_unique="until_done", lock_queue_ttl=10)
        first = task.delay(1)
        clock.advance(9.9)
        assert task.delay(1).id == first.id
        clock.advance(0.2)
        second = task.delay(1)
        assert second.id != first.id
        assert published.ids == [first.id, second.id]

    def test_queue_ttl_counts_from_the_eta(
        self, app: Celery, published: Published, clock: FakeClock
    ) -> None:
        """With a countdown, the key is held for countdown + queue_ttl."""
        task = define(app, "t.eta", lock_unique="while_queued", lock_queue_ttl=10)
        first = task.apply_async((1,), countdown=100)
        clock.advance(109.9)
        assert task.delay(1).id == first.id
        clock.advance(0.2)
        assert task.delay(1).id != first.id

    def test_the_app_setting_is_the_default_queue_ttl(
        self, app: Celery, published: Published, clock: FakeClock
    ) -> None:
        """lease_default_queue_ttl applies to tasks that set no queue_ttl."""
        app.conf.lease_default_queue_ttl = "5s"
        task = define(app, "t.default-ttl", lock_unique="while_queued")
        first = task.delay(1)
        clock.advance(5.1)
        assert task.delay(1).id != first.id


class TestRetries:
    def test_a_running_copy_resending_its_id_is_not_a_duplicate(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """retry(): the running copy publishes its own id under its own queued lease."""
        task = define(app, "t.retry", lock_unique="until_done")
        first = task.delay(1)
        task.push_request(id=first.id, called_directly=False)
        try:
            again = task.apply_async((1,), task_id=first.id, countdown=1)
        finally:
            task.pop_request()
        assert again.id == first.id
        assert published.ids == [first.id, first.id]
        assert (
            published.headers[1][unique_common.HEADER]
            == (published.headers[0][unique_common.HEADER])
        )
        assert parse_owner(store.get("queued:k:1").owner).task_id == first.id  # type: ignore[union-attr]


class TestDebounce:
    def test_the_newest_call_supersedes_the_waiting_copy(
        self, app: Celery, published: Published, store: SpyStore, clock: FakeClock
    ) -> None:
        """Each call publishes with the countdown; the waiting one gets a tombstone."""
        task = define(app, "t.debounce", lock_unique="while_queued", lock_debounce=1)
        results = []
        for extra in range(5):
            results.append(task.delay(1, extra))
            clock.advance(0.1)
        assert published.ids == [r.id for r in results]
        holder = store.get("queued:k:1")
        assert holder is not None and parse_owner(holder.owner).task_id == results[-1].id
        for old in results[:-1]:
            tomb = store.get(unique_common.superseded_key(old.id, ""))
            assert tomb is not None
        assert store.get(unique_common.superseded_key(results[-1].id, "")) is None

    def test_debounce_max_caps_the_delay(
        self, app: Celery, published: Published, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The eta is never pushed past debounce_max after the first call of the chain."""
        countdowns: list[float] = []
        task = define(
            app, "t.cap", lock_unique="while_queued", lock_debounce=1, lock_debounce_max=3
        )
        real = task.publish_copy

        def spy(*args: Any, **kwargs: Any) -> Any:
            countdowns.append(kwargs["countdown"])
            return real(*args, **kwargs)

        monkeypatch.setattr(task, "publish_copy", spy)
        for _ in range(6):
            task.delay(1)
            clock.advance(0.5)
        assert countdowns[:4] == [1, 1, 1, 1]
        assert countdowns[4] == pytest.approx(1.0)  # at 2.0 s: eta 3.0 s, the cap
        assert countdowns[5] == pytest.approx(0.5)  # at 2.5 s: capped to 3.0 s

    def test_a_failed_superseding_publish_leaves_the_waiting_copy_to_run(
        self, app: Celery, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The newest call fails to publish: the waiting copy gets its queued key back and its
        tombstone is removed."""
        task = define(app, "t.debounce-fail", lock_unique="while_queued", lock_debounce=1)
        first = task.delay(1)
        first_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", refuse)
        with pytest.raises(ConnectionError):
            task.delay(1)
        assert store.get(unique_common.superseded_key(first.id, "")) is None
        holder = store.get("queued:k:1")
        assert holder is not None and holder.owner == first_owner  # the waiting copy's again


class TestBadInput:
    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"lock_unique": "always"}, r"lock_unique of task .*'always'.*'while_queued'"),
            (
                {"lock_unique": "until_done", "lock_on_duplicate": "ignore"},
                r"lock_on_duplicate of task .*'ignore'.*'existing', 'raise'",
            ),
            ({"lock_unique": "until_done", "lock_queue_ttl": 0}, r"lock_queue_ttl.*> 0"),
            ({"lock_unique": "until_done", "lock_queue_ttl": -1}, r"lock_queue_ttl.*> 0"),
            ({"lock_debounce": 1}, r"lock_debounce of task .*needs lock_unique"),
            ({"lock_queue_ttl": 5}, r"lock_queue_ttl of task .*needs lock_unique"),
            (
                {
                    "lock_key": "k:{n}",
                    "lock_unique": "while_queued",
                    "lock_debounce": 2,
                    "lock_debounce_max": 1,
                },
                r"lock_debounce_max.*shorter than",
            ),
        ],
    )
    def test_bad_options_fail_at_definition(
        self, app: Celery, options: dict[str, Any], message: str
    ) -> None:
        """A bad value fails when the task is defined, naming the option and what is allowed."""
        app.finalize()  # tasks are created when defined (not at the first use of their proxy)
        with pytest.raises(LeaseConfigError, match=message):

            @app.task(name="t.bad", base=LockedTask, shared=False, **options)
            def body(n: int) -> None: ...

    def test_debounce_needs_a_key(self, app: Celery) -> None:
        """debounce without lock_key: no way to say what supersedes what."""
        app.finalize()
        with pytest.raises(LeaseConfigError, match=r"lock_debounce.*needs a unique key"):

            @app.task(
                name="t.nokey", base=LockedTask, shared=False, lock_unique="until_done",
                lock_debounce=1,
            )  # fmt: skip
            def body(n: int) -> None: ...

    def test_locked_refuses_unique(self) -> None:
        """@locked cannot reach apply_async: it says so instead of not de-duplicating."""
        with pytest.raises(LeaseConfigError, match=r"unique='until_done'.*base=LockedTask"):

            @locked(key="x", unique="until_done")
            def body() -> None: ...

    def test_locked_validates_the_new_keywords(self) -> None:
        """@locked names the keyword in its error like every other option."""
        with pytest.raises(LeaseConfigError, match=r"on_duplicate of @locked .*'never'"):

            @locked(key="x", unique="until_done", on_duplicate="never")  # type: ignore[arg-type]
            def body() -> None: ...


class TestBeat:
    def test_two_schedulers_send_one_message_per_tick(
        self, app: Celery, published: Published
    ) -> None:
        """Two beat schedulers firing the same entry at once: one message, one task id."""
        from datetime import timedelta

        from celery.beat import ScheduleEntry, Scheduler

        task = define(app, "t.beat", lock_unique="until_done")
        assert task.name
        entry = ScheduleEntry(
            name="nightly", task="t.beat", schedule=timedelta(days=1), args=(1,), app=app
        )
        schedulers = [Scheduler(app, lazy=True) for _ in range(2)]
        start = threading.Barrier(2)
        ids: list[str] = []

        def tick(scheduler: Scheduler) -> None:
            start.wait()
            ids.append(scheduler.apply_async(entry).id)

        threads = [threading.Thread(target=tick, args=(s,)) for s in schedulers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(ids) == 2 and len(set(ids)) == 1
        assert published.ids == ids[:1]


# One copy per call, whatever the store does in between -----------------------------------------


class TestReusedTaskId:
    @pytest.mark.parametrize("unique", ["while_queued", "until_done"])
    def test_two_calls_with_one_explicit_task_id_publish_one_message(
        self, app: Celery, published: Published, unique: str
    ) -> None:
        """apply_async(task_id=X) twice in the same millisecond: the second is a duplicate,
        not the holder again (the queued owner must be unique per call)."""
        task = define_task(app, f"r.same-id.{unique}", lock_unique=unique)
        first = task.apply_async((1,), task_id="fixed-id")
        second = task.apply_async((1,), task_id="fixed-id")
        assert first.id == second.id == "fixed-id"
        assert len(published.ids) == 1


class TestSupersedeRace:
    def test_losing_the_race_to_supersede_leaves_one_copy_to_run(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B supersedes A; C takes the key between B's release of A and B's acquire. A's lease
        is gone, so A must stay superseded: only C may run (never A beside C)."""
        task = define_task(app, "r.race", lock_unique="while_queued", lock_debounce=1)
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
        a_runs = store.get(unique_common.superseded_key(a.id, "")) is None
        assert not a_runs, "A has no lease and no tombstone: it runs beside C"

    def test_a_store_error_while_superseding_keeps_the_waiting_copy(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The store fails when B takes the key after releasing A's: B's caller gets the error,
        and A is not left superseded with nothing replacing it (it runs, as after a failed
        publish)."""
        task = define_task(app, "r.store-error", lock_unique="while_queued", lock_debounce=1)
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
        assert store.get(unique_common.superseded_key(a.id, "")) is None


class TestStoreDown:
    def test_a_store_error_at_enqueue_raises_and_publishes_nothing(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The store is down when the queued lease is taken: the caller gets the error (never
        a silent publish without the lease, never a silent success)."""
        task = define_task(app, "r.store-down", lock_unique="until_done")

        def down(*args: Any) -> Any:
            raise StoreUnavailableError("injected")

        monkeypatch.setattr(store, "acquire", down)
        monkeypatch.setattr(store, "acquire_or_holder", down)  # the call a duplicate check makes
        with pytest.raises(StoreUnavailableError):
            task.delay(1)
        assert published.ids == []


# The duplicate check's acquire_or_holder ---------------------------------------------------------


def _app(store: Any) -> Celery:
    app = Celery(
        "acquire-or-holder", broker="memory://", backend="cache+memory://", set_as_current=False
    )
    app.conf.update(lease_store=store, broker_connection_retry_on_startup=False)
    return app


def _define(app: Celery, name: str, **options: Any) -> Any:
    @app.task(name=name, base=LockedTask, lock_key="k:{n}", shared=False, **options)
    def body(n: int) -> int:
        return n

    return body


class _DownOnAcquire(MemoryLockStore):
    """A fault-injection store: every acquire fails (the store is 'down')."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        raise StoreUnavailableError("injected: store down")


def _assert_delay_fails_unpublished(store: Any, name: str, seen: Published) -> None:
    """delay() of a while_queued task on ``store`` raises the store's error, publishing nothing."""
    app = _app(store)
    task = _define(app, name, lock_unique="while_queued")
    try:
        with pytest.raises(StoreUnavailableError):
            task.delay(1)
        assert seen.ids == []
    finally:
        app.close()


class TestOverridesOfAcquire:
    def test_a_subclass_overriding_acquire_is_not_bypassed(self, published: Published) -> None:
        """A MemoryLockStore subclass whose acquire fails: delay() must raise, not publish
        behind the override's back (acquire_or_holder, inherited, skips it)."""
        _assert_delay_fails_unpublished(_DownOnAcquire(), "aoh.subclass-down", published)

    def test_a_delegating_wrapper_overriding_acquire_is_not_bypassed(
        self, published: Published
    ) -> None:
        """The tests' own wrapper pattern (``__getattr__`` to the inner store, ``acquire``
        overridden): the wrapper's acquire must be the one that decides."""

        class Wrapper:
            def __init__(self, inner: Any) -> None:
                self.inner = inner
                self.acquires = 0

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                self.acquires += 1
                raise StoreUnavailableError("injected")

            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                return self.inner.renew(key, owner, ttl_ms)  # type: ignore[no-any-return]

            def release(self, key: str, owner: str) -> None:
                self.inner.release(key, owner)

        _assert_delay_fails_unpublished(Wrapper(MemoryLockStore()), "aoh.wrapper-down", published)

    def test_the_class_cache_does_not_outlive_the_inner_store(
        self, published: Published, tmp_path: Any
    ) -> None:
        """One wrapper class around different stores: a wrapper of a store without
        acquire_or_holder must not be sent down that path because an earlier instance of the
        same class had one (AttributeError from delay())."""

        class Wrapper:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        first = _app(Wrapper(MemoryLockStore()))
        second = _app(Wrapper(SQLiteLockStore(str(tmp_path / "s.db"))))
        try:
            a = _define(first, "aoh.cache-a", lock_unique="while_queued")
            b = _define(second, "aoh.cache-b", lock_unique="while_queued")
            assert a.delay(1).id == a.delay(1).id
            one = b.delay(1)
            assert b.delay(1).id == one.id
        finally:
            first.close()
            second.close()


def _latin1_store(server: RedisServer) -> RedisLockStore:
    client = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        socket_timeout=5.0,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        encoding="latin-1",
        decode_responses=True,
    )
    return RedisLockStore(client)


@pytest.mark.redis
class TestRedisUnique:
    def test_duplicate_gets_the_holders_id_with_a_latin1_decoding_client(
        self, redis_server: RedisServer, redis_url: str, published: Published
    ) -> None:
        """decode_responses=True, encoding='latin-1' (supported: 'a caller's client with
        decode_responses=True is fine'): a duplicate of a copy whose id has non-ASCII
        characters gets that id (the holder is decoded with the client's encoding, as the
        client encoded it)."""
        store = _latin1_store(redis_server)
        app = _app(store)
        task = _define(app, "aoh.latin1", lock_unique="while_queued")
        try:
            first = task.apply_async((1,), task_id="tâche-Ã©-1")
            assert task.delay(1).id == first.id
            assert published.ids == [first.id]
        finally:
            app.close()
            store.client.close()

    def test_fifty_threads_publish_once_and_all_get_its_id(
        self, redis_url: str, published: Published
    ) -> None:
        store = RedisLockStore(redis_url)
        app = _app(store)
        task = _define(app, "aoh.race", lock_unique="while_queued")
        barrier = threading.Barrier(50)
        ids: list[str] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def run() -> None:
            barrier.wait()
            try:
                got = task.delay(7).id
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return
            with lock:
                ids.append(got)

        threads = [threading.Thread(target=run) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            assert errors == []
            assert len(published.ids) == 1
            assert set(ids) == set(published.ids)
        finally:
            app.close()
            store.close()

    def test_holder_that_is_not_a_queued_owner_raises(
        self, redis_url: str, published: Published
    ) -> None:
        """The queued key held by a foreign owner ('!12', no task id): AlreadyQueuedError, no
        publish, the foreign lease untouched."""
        store = RedisLockStore(redis_url)
        app = _app(store)
        task = _define(app, "aoh.foreign", lock_unique="while_queued")
        try:
            qkey = unique_module.queued_key("k:1", "")
            token = store.acquire(qkey, "!12", 60_000)
            assert token is not None
            with pytest.raises(AlreadyQueuedError):
                task.delay(1)
            assert published.ids == []
            info = store.get(qkey)
            assert info is not None and (info.owner, info.token) == ("!12", token)
        finally:
            app.close()
            store.close()

    def test_a_restart_grace_raises_its_own_error_even_with_on_duplicate_existing(
        self, redis_server_factory: Any, published: Published
    ) -> None:
        """A server in its restart grace refuses the free queued key: the call raises
        RestartGraceError (nothing holds the key, nothing was published), not an
        AlreadyQueuedError that a caller catching duplicates would take for a queued copy."""
        server = redis_server_factory()  # started moments ago, no marker: an hour's grace is on
        store = RedisLockStore(server.url, restart_grace=3600)
        app = _app(store)
        task = _define(app, "aoh.grace", lock_unique="while_queued", lock_on_duplicate="existing")
        try:
            with pytest.raises(RestartGraceError, match="restart grace"):
                task.delay(1)
            assert published.ids == []
            assert store.get(unique_module.queued_key("k:1", "")) is None
        finally:
            app.close()
            store.close()
