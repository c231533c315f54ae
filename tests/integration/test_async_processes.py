"""``async with lease(...)`` across processes: two spawned processes x 10 coroutines, one key.

Every holder raises a counter in shared memory (``multiprocessing.Value``) on entry and lowers it
on exit; a holder that finds it above 1 counts an overlap. Stores: an SQLite file and a real,
throwaway Redis, each through the thread adapter over the sync store, and Redis and PostgreSQL
through the native async stores (``celery_lease.stores.redis_async`` / ``postgres_async``).
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from tests.support import service_missing

PROCESSES = 2
COROUTINES = 10
JOIN_TIMEOUT = 120.0  # real seconds a child may take before the test fails

pytestmark = [pytest.mark.slow]


def _native(module: str, name: str) -> Any:
    """The native store class ``module.name``; absent: fails in CI, skips locally."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        service_missing(f"{module}.{name} ({exc})", "the async-stores change must be installed")


def _build(kind: str, target: str) -> Any:
    """The AsyncLockStore a child uses (built in the child, after spawn)."""
    from celery_lease._core.aio import ThreadedAsyncStore

    if kind == "sqlite":
        from celery_lease import SQLiteLockStore

        return ThreadedAsyncStore(SQLiteLockStore(target), close_store=True)
    if kind == "redis-threaded":
        from celery_lease import RedisLockStore

        return ThreadedAsyncStore(RedisLockStore(target), close_store=True)
    if kind == "redis-native":
        cls = importlib.import_module("celery_lease.stores.redis_async").AsyncRedisLockStore
        return cls.from_url(target)
    if kind == "postgres-native":
        cls = importlib.import_module("celery_lease.stores.postgres_async").AsyncPostgresLockStore
        return cls.from_url(target)
    raise AssertionError(kind)


async def _race(kind: str, target: str, counter: Any, overlaps: Any, holds: Any) -> None:
    from celery_lease import lease

    store = _build(kind, target)

    async def one() -> None:
        async with lease("async:race", store=store, ttl=30, wait="100s"):
            with counter.get_lock():
                counter.value += 1
                if counter.value != 1:
                    overlaps.value += 1
            await asyncio.sleep(0.002)  # hold it across loop turns and the other process' tries
            with counter.get_lock():
                counter.value -= 1
                holds.value += 1

    try:
        await asyncio.gather(*(one() for _ in range(COROUTINES)))
    finally:
        await store.aclose()


def _child(kind: str, target: str, start: Any, counter: Any, overlaps: Any, holds: Any) -> None:
    """Spawned: wait for the start signal, then race COROUTINES coroutines in one loop."""
    import celery_lease

    assert start.wait(JOIN_TIMEOUT)
    asyncio.run(_race(kind, target, counter, overlaps, holds))
    celery_lease.shutdown()  # raises if a lease were still held


def _race_in_processes(kind: str, target: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    counter, overlaps, holds = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", 0)
    children = [
        ctx.Process(target=_child, args=(kind, target, start, counter, overlaps, holds))
        for _ in range(PROCESSES)
    ]
    for child in children:
        child.start()
    start.set()
    for child in children:
        child.join(JOIN_TIMEOUT)
    for child in children:
        if child.is_alive():
            child.kill()
            child.join()
    assert [child.exitcode for child in children] == [0] * PROCESSES
    assert overlaps.value == 0, f"{overlaps.value} holds overlapped another"
    assert holds.value == PROCESSES * COROUTINES
    assert counter.value == 0


class TestTwoProcesses:
    def test_sqlite_file(self, tmp_path: Path) -> None:
        """Two processes racing on one SQLite file never hold the key at the same time."""
        _race_in_processes("sqlite", str(tmp_path / "leases.db"))

    @pytest.mark.redis
    def test_redis_through_the_thread_adapter(self, redis_url: str) -> None:
        """The same over a real Redis, through ThreadedAsyncStore(RedisLockStore)."""
        _race_in_processes("redis-threaded", redis_url)

    @pytest.mark.redis
    def test_redis_native(self, redis_url: str) -> None:
        """The same through the native AsyncRedisLockStore (redis.asyncio)."""
        _native("celery_lease.stores.redis_async", "AsyncRedisLockStore")
        _race_in_processes("redis-native", redis_url)

    @pytest.mark.postgres
    def test_postgres_native(self, pg_database_dsn: str) -> None:
        """The same through the native AsyncPostgresLockStore (psycopg's async connection)."""
        _native("celery_lease.stores.postgres_async", "AsyncPostgresLockStore")
        _race_in_processes("postgres-native", pg_database_dsn)
