"""Review attacks on the native async stores against real servers (reviewer RA).

Redis: the session's throwaway ``redis-server`` (``tests/fixtures_redis.py``), each test on a
prefix of its own; PostgreSQL: the session's scratch database, a table per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from celery_lease import lease
from celery_lease.dispatch import drain
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.fixtures_redis import RedisServer

T = TypeVar("T")
REAL_TIMEOUT = 30.0


def run(coro: Awaitable[T]) -> T:
    """``asyncio.run`` with a real-time guard: a hang fails the test, it never blocks it."""

    async def guarded() -> T:
        return await asyncio.wait_for(coro, REAL_TIMEOUT)

    return asyncio.run(guarded())


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Yield to the loop until ``predicate()`` (run off the loop) holds; fail after a while."""
    deadline = time.monotonic() + REAL_TIMEOUT
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def blocked_clients(server: RedisServer) -> int:
    client = server.client()
    try:
        return int(client.info("clients")["blocked_clients"])
    finally:
        client.close()


async def use_once(store: Any, key: str) -> int:
    owner = f"owner-{uuid.uuid4().hex}"
    token = await store.acquire(key, owner, 30_000)
    assert token is not None
    await store.release(key, owner)
    return int(token)


@pytest.fixture(params=["redis", "postgres"])
def make_store(request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A factory of native async stores (Redis on a prefix, PostgreSQL on a table of its own)."""
    if request.param == "redis":
        request.applymarker(pytest.mark.redis)
        url: str = request.getfixturevalue("redis_url")
        prefix = f"ra-{uuid.uuid4().hex[:8]}:"
        return lambda: AsyncRedisLockStore(url, prefix=prefix)
    request.applymarker(pytest.mark.postgres)
    dsn: str = request.getfixturevalue("pg_database_dsn")
    table: str = request.getfixturevalue("pg_table")
    return lambda: AsyncPostgresLockStore(dsn, table=table)


async def wait_once(store: Any, key: str) -> bool:
    """Hold ``key``, wait for its release while another coroutine releases it."""
    owner = f"owner-{uuid.uuid4().hex}"
    assert await store.acquire(key, owner, 30_000) is not None
    waiting = asyncio.create_task(store.wait_for_release(key, 0.5))
    await asyncio.sleep(0)
    await store.release(key, owner)
    return bool(await waiting)


class TestOneStorePerLoop:
    @pytest.mark.parametrize("use", [use_once, wait_once], ids=["acquire", "wait"])
    def test_a_second_event_loop_gets_a_clear_error(
        self, make_store: Callable[[], Any], use: Callable[[Any, str], Awaitable[object]]
    ) -> None:
        """Used again under a new ``asyncio.run`` (the first loop is closed): an error that
        says what is wrong (one store per loop), not "Event loop is closed" or "bound to a
        different event loop" from deep inside the driver."""
        store = make_store()
        try:
            run(use(store, "k"))  # and no aclose(): its connections stay with the dead loop
            with pytest.raises(RuntimeError) as info:
                run(use(store, "k"))
            assert "another event loop" in str(info.value)
        finally:
            store.sync.close()
            with warnings.catch_warnings():  # the dead loop's connections are finalized here,
                warnings.simplefilter("ignore", ResourceWarning)  # not inside a later import
                gc.collect()

    @pytest.mark.redis
    def test_after_aclose_another_loop_may_use_the_store(self, redis_url: str) -> None:
        """``aclose()`` in the first loop frees the store's connections: a later loop may use
        the same store (its sync twin is the caller's here)."""
        prefix = f"ra-{uuid.uuid4().hex[:8]}:"
        twin = RedisLockStore(redis_url, prefix=prefix)
        store = AsyncRedisLockStore(redis_url, sync=twin)

        async def use_and_close() -> int:
            try:
                return await use_once(store, "k")
            finally:
                await store.aclose()

        try:
            first = run(use_and_close())
            assert run(use_and_close()) > first
        finally:
            twin.close()

    def test_two_loops_at_once_fail_fast_instead_of_hanging(
        self, make_store: Callable[[], Any]
    ) -> None:
        """A loop in another thread holds the store's connections; a call from this thread's
        loop raises at once: it neither hangs nor talks over the other loop's connection."""
        store = make_store()
        bound = threading.Event()
        done = threading.Event()
        first: list[object] = []

        async def owner_loop() -> None:
            try:
                first.append(await use_once(store, "k"))
                bound.set()
                await asyncio.to_thread(done.wait, REAL_TIMEOUT)  # the loop stays alive
                first.append(await use_once(store, "k"))  # still works in its own loop
            finally:
                await store.aclose()

        thread = threading.Thread(target=lambda: asyncio.run(owner_loop()), daemon=True)
        thread.start()
        try:
            assert bound.wait(REAL_TIMEOUT)
            with pytest.raises(RuntimeError) as info:
                run(use_once(store, "k"))
            assert "another event loop" in str(info.value)
        finally:
            done.set()
            thread.join(REAL_TIMEOUT)
        assert not thread.is_alive() and len(first) == 2


@pytest.mark.redis
def test_a_cancelled_blpop_leaves_no_reply_on_a_pooled_connection(
    redis_server: RedisServer, redis_url: str
) -> None:
    """A waiter cancelled inside BLPOP, then a release signals the key: the next commands on
    the store's pool get their own replies (no stale BLPOP answer read as a token)."""
    store = AsyncRedisLockStore(redis_url, prefix=f"ra-{uuid.uuid4().hex[:8]}:")
    before = blocked_clients(redis_server)

    async def main() -> None:
        try:
            assert await store.acquire("k", "a", 30_000) is not None
            waiter = asyncio.create_task(store.wait_for_release("k", REAL_TIMEOUT))
            await until(lambda: blocked_clients(redis_server) > before, "the BLPOP")
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
            await store.release("k", "a")  # pushes a signal nobody is waiting for now
            token = await store.acquire("k2", "b", 30_000)
            assert isinstance(token, int)
            assert await store.renew("k2", "b", 30_000) is True
            assert await store.renew("k2", "someone-else", 30_000) is False
            await store.release("k2", "b")
        finally:
            await store.aclose()

    run(main())


@pytest.mark.postgres
def test_postgres_cancelled_waiter_then_holder_cancelled_leaves_nothing(
    pg_database_dsn: str, pg_table: str
) -> None:
    """A waiter and then the holder are cancelled (TaskGroup style): the key ends free and the
    listener keeps serving a later waiter."""
    store = AsyncPostgresLockStore(pg_database_dsn, table=pg_table)

    async def holder(entered: asyncio.Event) -> None:
        async with lease("k", store=store, ttl=30):
            entered.set()
            await asyncio.Event().wait()

    async def waiter() -> None:
        async with lease("k", store=store, ttl=30, wait=REAL_TIMEOUT):
            raise AssertionError("never acquired while the holder holds it")

    async def main() -> None:
        try:
            entered = asyncio.Event()
            held = asyncio.create_task(holder(entered))
            await entered.wait()
            waiting = asyncio.create_task(waiter())
            await until(lambda: store.waiting() >= 1, "the waiter")
            waiting.cancel()
            held.cancel()
            for task in (waiting, held):
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert await asyncio.to_thread(drain)
            info = store.sync.get("k")  # type: ignore[attr-defined]
            assert info is None
            async with lease("k", store=store, ttl=30) as again:
                assert again.token > 0
        finally:
            await store.aclose()

    run(main())


def test_store_closed_at_shutdown_before_a_holder_is_cancelled(
    make_store: Callable[[], Any],
) -> None:
    """The FastAPI-style shutdown: ``main`` closes the store in its ``finally``, then
    ``asyncio.run`` cancels a request task still holding a lease. The key is freed (the
    dispatcher's second release), not left held until its ttl runs out."""
    store = make_store()
    key = f"k-{uuid.uuid4().hex[:8]}"

    async def request(entered: asyncio.Event) -> None:
        async with lease(key, store=store, ttl=30):
            entered.set()
            await asyncio.Event().wait()

    async def main() -> None:
        entered = asyncio.Event()
        try:
            asyncio.get_running_loop().create_task(request(entered))  # still running at the end
            await entered.wait()
        finally:
            await store.aclose()

    with warnings.catch_warnings():  # a Redis release after aclose() opens a connection that
        warnings.simplefilter("ignore", ResourceWarning)  # dies with the loop: finalized here
        asyncio.run(main())
        gc.collect()
    assert drain()
    fresh = make_store()  # the same server and prefix or table
    try:
        assert fresh.sync.get(key) is None  # type: ignore[attr-defined]
    finally:
        fresh.sync.close()  # type: ignore[attr-defined]
