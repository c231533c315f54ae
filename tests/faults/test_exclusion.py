"""The mutual-exclusion checker on every store: K holders x M acquisitions of hot keys."""

from __future__ import annotations

import itertools
import secrets
import threading

import pytest

from celery_lease.stores.memory import MemoryLockStore
from tests.faults.harness import FencedResource, Plan, Report, check, run_processes, run_threads

pytestmark = pytest.mark.slow

PROCESS_PLAN = Plan(
    keys=["hot-a", "hot-b"], rounds=12, seed=11, ttl=1.0, hold_max=0.03,
    pause_prob=0.06, pause_for=1.3,
)  # fmt: skip
THREAD_PLAN = Plan(
    keys=["hot-a", "hot-b"], rounds=25, seed=11, ttl=0.3, hold_max=0.02,
    pause_prob=0.08, pause_for=0.4,
)  # fmt: skip


def _finish(name: str, records: list, fence: str, reports: list[Report], expected: int) -> Report:
    resource = FencedResource(fence)
    try:
        report = check(name, records, resource.log())
    finally:
        resource.close()
    reports.append(report)
    print(report.summary())
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.acquisitions + report.timed_out == expected
    assert report.writes > 0
    return report


def test_memory_store_threads(fence_sqlite: str, exclusion_reports: list[Report]) -> None:
    """Four threads on one memory store, with simulated pauses: no overlap, no stale write."""
    records = run_threads(
        MemoryLockStore(), FencedResource(fence_sqlite), holders=4, plan=THREAD_PLAN
    )
    _finish("memory (4 threads)", records, fence_sqlite, exclusion_reports, 100)


def test_sqlite_store_processes(
    sqlite_store_url: str, fence_sqlite: str, exclusion_reports: list[Report]
) -> None:
    """Four processes on one SQLite file, real SIGSTOP pauses: no overlap, no stale write."""
    records = run_processes(sqlite_store_url, fence_sqlite, holders=4, plan=PROCESS_PLAN)
    _finish("sqlite (4 processes)", records, fence_sqlite, exclusion_reports, 48)


def test_redis_store_processes(own_redis, fence_sqlite: str, exclusion_reports) -> None:  # type: ignore[no-untyped-def]
    """Four processes on one Redis, real SIGSTOP pauses: no overlap, no stale write."""
    records = run_processes(own_redis.url, fence_sqlite, holders=4, plan=PROCESS_PLAN)
    _finish("redis (4 processes)", records, fence_sqlite, exclusion_reports, 48)


def test_postgres_store_processes(pg_database_dsn: str, exclusion_reports: list[Report]) -> None:
    """Four processes on one PostgreSQL table, real SIGSTOP pauses: no overlap, no stale write."""
    fence = f"{pg_database_dsn}#fence_{secrets.token_hex(4)}"
    plan = Plan(
        **{**PROCESS_PLAN.__dict__, "keys": [f"hot-{secrets.token_hex(3)}-{k}" for k in "ab"]}
    )
    records = run_processes(pg_database_dsn, fence, holders=4, plan=plan)
    _finish("postgres (4 processes)", records, fence, exclusion_reports, 48)


class _NoExclusionStore:
    """A broken store that grants every acquire: the checker must notice."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        with self._lock:
            return next(self._tokens)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    def release(self, key: str, owner: str) -> None:
        return None


def test_checker_catches_a_store_without_exclusion(fence_sqlite: str) -> None:
    """Against a store that grants every acquire, the checker reports overlaps."""
    plan = Plan(keys=["hot"], rounds=10, seed=3, ttl=1.0, hold_max=0.02)
    records = run_threads(_NoExclusionStore(), FencedResource(fence_sqlite), holders=4, plan=plan)  # type: ignore[arg-type]
    resource = FencedResource(fence_sqlite)
    report = check("broken", records, resource.log())
    resource.close()
    assert report.overlaps > 0
    assert report.violations


def test_checker_catches_a_stale_write_accepted() -> None:
    """A resource log that accepted a lower token after a higher one is a violation."""
    records = [
        {"holder": "a", "key": "k", "token": 5, "acquired_at": 1.0, "confirmed_at": 1.1},
        {"holder": "b", "key": "k", "token": 7, "acquired_at": 2.0, "confirmed_at": 2.1},
    ]
    report = check("log", records, [("k", 7, True, "b"), ("k", 5, True, "a")])
    assert report.stale_accepted == 1
    assert report.overlaps == 0
    assert report.violations == ["k: stale write accepted: token 5 after token 7"]
