"""``async with lease(...)`` on the native async stores, one event loop, real servers.

Redis: a throwaway ``redis-server`` (``tests/fixtures_redis.py``); PostgreSQL: the session's
scratch database (``tests/fixtures_postgres.py``), each test on a table of its own. The stores
are ``celery_lease.stores.redis_async.AsyncRedisLockStore`` and
``celery_lease.stores.postgres_async.AsyncPostgresLockStore`` (when absent: a failure in CI, a
skip locally).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import celery_lease
from celery_lease import LockLostError, get_lock_token, lease
from celery_lease._core.dispatch import drain
from celery_lease.stores import async_store_from_url
from celery_lease.stores.base import AsyncLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.fixtures_redis import RedisServer, blocked_clients
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


# One store per event loop; cancelled waiters and holders; a store closed at shutdown ------------


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Yield to the loop until ``predicate()`` (run off the loop) holds; fail after a while."""
    deadline = time.monotonic() + REAL_TIMEOUT
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def use_once(store: Any, key: str) -> int:
    owner = f"owner-{uuid.uuid4().hex}"
    token = await store.acquire(key, owner, 30_000)
    assert token is not None
    await store.release(key, owner)
    return int(token)


@pytest.fixture(params=["redis", "postgres"])
def make_own_store(request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A factory of native async stores on keys of the test's own (Redis: a prefix of its own;
    PostgreSQL: a table of its own), left to the test to close."""
    if request.param == "redis":
        request.applymarker(pytest.mark.redis)
        url: str = request.getfixturevalue("redis_url")
        prefix = f"own-{uuid.uuid4().hex[:8]}:"
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
        self, make_own_store: Callable[[], Any], use: Callable[[Any, str], Awaitable[object]]
    ) -> None:
        """Used again under a new ``asyncio.run`` (the first loop is closed): an error that
        says what is wrong (one store per loop), not "Event loop is closed" or "bound to a
        different event loop" from deep inside the driver."""
        store = make_own_store()
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
        prefix = f"own-{uuid.uuid4().hex[:8]}:"
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
        self, make_own_store: Callable[[], Any]
    ) -> None:
        """A loop in another thread holds the store's connections; a call from this thread's
        loop raises at once: it neither hangs nor talks over the other loop's connection."""
        store = make_own_store()
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
    store = AsyncRedisLockStore(redis_url, prefix=f"own-{uuid.uuid4().hex[:8]}:")
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
    make_own_store: Callable[[], Any],
) -> None:
    """The FastAPI-style shutdown: ``main`` closes the store in its ``finally``, then
    ``asyncio.run`` cancels a request task still holding a lease. The key is freed (the
    dispatcher's second release), not left held until its ttl runs out."""
    store = make_own_store()
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
    fresh = make_own_store()  # the same server and prefix or table
    try:
        assert fresh.sync.get(key) is None  # type: ignore[attr-defined]
    finally:
        fresh.sync.close()  # type: ignore[attr-defined]
