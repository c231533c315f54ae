"""Hostile review of apply_unique's acquire_or_holder path: overrides of acquire are not
bypassed, the holder is decoded as the client encodes, races publish once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
import redis.backoff
import redis.retry
from celery import Celery

from celery_lease import AlreadyQueuedError, LockedTask
from celery_lease import unique as unique_module
from celery_lease.errors import StoreUnavailableError
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.fixtures_redis import RedisServer
from tests.unit.conftest import Published


def _app(store: Any) -> Celery:
    app = Celery("aoh-review", broker="memory://", backend="cache+memory://", set_as_current=False)
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
        characters gets that id (before this change the holder was read by get() through
        redis-py, which decodes with the client's encoding)."""
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
