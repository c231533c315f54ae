"""``async with lease(...)`` on the native async stores, one event loop, real servers.

Redis: a throwaway ``redis-server`` (``tests/fixtures_redis.py``); PostgreSQL: the session's
scratch database (``tests/fixtures_postgres.py``), each test on a table of its own. The stores
are ``celery_lease.stores.redis_async.AsyncRedisLockStore`` and
``celery_lease.stores.postgres_async.AsyncPostgresLockStore`` (when absent: a failure in CI, a
skip locally).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import celery_lease
from celery_lease import LockLostError, get_lock_token, lease
from celery_lease.dispatch import drain
from celery_lease.stores.base import AsyncLockStore, async_store_from_url
from tests.support import service_missing

T = TypeVar("T")
REAL_TIMEOUT = 30.0

Factory = Callable[[], AsyncLockStore]


def run(coro: Awaitable[T]) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(coro, REAL_TIMEOUT)

    return asyncio.run(guarded())


def _native(module: str, name: str) -> Any:
    """The native store class ``module.name``; absent: fails in CI, skips locally."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        service_missing(f"{module}.{name} ({exc})", "the async-stores change must be installed")


@pytest.fixture(params=["redis", "postgres"])
def make_store(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """A factory of native async stores on one server (call it inside the loop that uses it)."""
    if request.param == "redis":
        request.applymarker(pytest.mark.redis)
        cls = _native("celery_lease.stores.redis_async", "AsyncRedisLockStore")
        url = request.getfixturevalue("redis_url")
        yield lambda: cls.from_url(url)
    else:
        request.applymarker(pytest.mark.postgres)
        cls = _native("celery_lease.stores.postgres_async", "AsyncPostgresLockStore")
        dsn = request.getfixturevalue("pg_database_dsn")
        table = request.getfixturevalue("pg_table")
        yield lambda: cls(dsn, table=table, create_table=True)
    assert drain()
    celery_lease.shutdown()  # raises when a lease is still held


async def closing(store: AsyncLockStore, body: Callable[[AsyncLockStore], Awaitable[T]]) -> T:
    try:
        return await body(store)
    finally:
        await store.aclose()


class TestNativeStores:
    @pytest.mark.parametrize(
        ("scheme", "module", "name"),
        [
            pytest.param(
                "redis",
                "celery_lease.stores.redis_async",
                "AsyncRedisLockStore",
                marks=pytest.mark.redis,
            ),
            pytest.param(
                "postgres",
                "celery_lease.stores.postgres_async",
                "AsyncPostgresLockStore",
                marks=pytest.mark.postgres,
            ),
        ],
    )
    def test_url_gives_the_native_store(
        self, request: pytest.FixtureRequest, scheme: str, module: str, name: str
    ) -> None:
        """async_store_from_url() returns the native class for redis:// and postgresql://,
        whose sync twin is the sync store of the same URL; it works in a loop."""
        cls = _native(module, name)
        url = request.getfixturevalue("redis_url" if scheme == "redis" else "pg_database_dsn")

        async def main() -> None:
            store = async_store_from_url(url)
            try:
                assert type(store) is cls
                twin = "RedisLockStore" if scheme == "redis" else "PostgresLockStore"
                assert type(store.sync).__name__ == twin
                async with lease(f"native:url:{scheme}", store=store, ttl=30) as held:
                    assert held.store is store.sync
            finally:
                await store.aclose()

        run(main())
        with pytest.raises(celery_lease.LeaseConfigError, match="nosuch"):
            async_store_from_url("nosuch://x")

    def test_twenty_coroutines_never_overlap(self, make_store: Factory) -> None:
        """20 coroutines racing for one key in one loop hold it one at a time."""
        inside = 0
        tokens: list[int] = []

        async def body(store: AsyncLockStore) -> None:
            async def one() -> None:
                nonlocal inside
                async with lease("native:race", store=store, ttl=30, wait="60s"):
                    inside += 1
                    assert inside == 1, "two holders at once"
                    tokens.append(get_lock_token() or 0)
                    await asyncio.sleep(0)
                    inside -= 1

            await asyncio.gather(*(one() for _ in range(20)))

        run(closing(make_store(), body))
        assert len(tokens) == 20 and tokens == sorted(set(tokens))

    def test_blocked_loop_keeps_the_lease(self, make_store: Factory) -> None:
        """time.sleep(2 x ttl/3) in a coroutine: the sync twin renews it off the loop."""
        ttl = 0.9

        async def body(store: AsyncLockStore) -> None:
            async with lease("native:blocked", store=store, ttl=ttl) as held:
                time.sleep(2 * ttl / 3)  # the point of the test: the loop is blocked
                held.check()
                assert held.store is store.sync
            assert not held.lost

        run(closing(make_store(), body))

    def test_cancel_on_loss(self, make_store: Factory) -> None:
        """A lease taken away (released behind its back) cancels the body: LockLostError."""

        async def body(store: AsyncLockStore) -> str | None:
            loop = asyncio.get_running_loop()
            with pytest.raises(LockLostError):
                async with lease("native:lost", store=store, ttl=0.6, on_lost="cancel") as held:
                    # Another process's view: free the key behind the holder's back.
                    await store.release(held.key, held.owner)
                    await asyncio.Event().wait()  # until the next renewal is refused
            assert loop.is_running()
            return held.lost_reason

        assert run(closing(make_store(), body)) in ("taken", "released")

    def test_cancel_while_waiting_leaves_nothing_held(self, make_store: Factory) -> None:
        """Cancelling a waiter stops its wait; the holder keeps the key, nothing else is held."""

        async def body(store: AsyncLockStore) -> None:
            holding, done = asyncio.Event(), asyncio.Event()

            async def holder() -> None:
                async with lease("native:wait", store=store, ttl=30):
                    holding.set()
                    await done.wait()

            async def waiter() -> None:
                async with lease("native:wait", store=store, ttl=30, wait="1h"):
                    raise AssertionError("never acquired")

            held = asyncio.create_task(holder())
            await holding.wait()
            waiting = asyncio.create_task(waiter())
            for _ in range(10):  # let it reach its wait (between two tries will do as well)
                await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            done.set()
            await held
            async with lease("native:wait", store=store, ttl=30) as again:  # free: wait=0
                assert again.token > 0

        run(closing(make_store(), body))
        assert not [t for t in threading.enumerate() if t.name.startswith("asyncio_")]

    def test_in_a_loop_running_in_another_thread(self, make_store: Factory) -> None:
        """A server's loop running for ever on its own thread (requests scheduled into it with
        run_coroutine_threadsafe): the store is built in that loop and leases work there."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="server-loop")
        thread.start()

        async def build() -> AsyncLockStore:
            return make_store()

        async def request(store: AsyncLockStore, n: int) -> int:
            async with lease("native:served", store=store, ttl=30, wait="30s") as held:
                assert get_lock_token() == held.token
                await asyncio.sleep(0)
                return held.token

        try:
            store = asyncio.run_coroutine_threadsafe(build(), loop).result(REAL_TIMEOUT)
            futures = [asyncio.run_coroutine_threadsafe(request(store, n), loop) for n in range(3)]
            tokens = [f.result(REAL_TIMEOUT) for f in futures]
            assert len(set(tokens)) == 3
            asyncio.run_coroutine_threadsafe(store.aclose(), loop).result(REAL_TIMEOUT)
        finally:
            asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(
                REAL_TIMEOUT
            )
            loop.call_soon_threadsafe(loop.stop)
            thread.join(REAL_TIMEOUT)
            loop.close()
