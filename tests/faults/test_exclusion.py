"""The mutual-exclusion checker on every store: K holders x M acquisitions of hot keys."""

from __future__ import annotations

import itertools
import secrets
import threading

import pytest
from redis.cluster import RedisCluster

from celery_lease import async_store_from_url
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.redis import RedisLockStore
from tests.faults.harness import (
    FencedResource,
    Plan,
    Report,
    check,
    run_async,
    run_processes,
    run_threads,
)
from tests.fixtures_redis import RedisServer, SentinelGroup

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


# Slots: at most `limit` holders of a key at once -------------------------------------------------

SLOT_LIMIT = 3
SLOT_THREAD_PLAN = Plan(
    keys=["hot"], rounds=20, seed=13, ttl=0.3, hold_max=0.02, pause_prob=0.05, pause_for=0.4,
    limit=SLOT_LIMIT,
)  # fmt: skip
SLOT_PROCESS_PLAN = Plan(
    keys=["hot"], rounds=12, seed=13, ttl=1.0, hold_max=0.03, pause_prob=0.04, pause_for=1.3,
    limit=SLOT_LIMIT,
)  # fmt: skip


def _finish_slots(
    name: str, records: list, fence: str, reports: list[Report], expected: int
) -> Report:
    resource = FencedResource(fence)
    try:
        report = check(name, records, resource.log(), limit=SLOT_LIMIT)
    finally:
        resource.close()
    reports.append(report)
    print(report.summary())
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.acquisitions + report.timed_out == expected
    assert report.writes > 0
    # Six holders on three slots: the slots are full under this load, never over-full.
    assert report.peaks == {"hot": SLOT_LIMIT}, report.summary()
    assert len({r["slot"] for r in records if "slot" in r}) == SLOT_LIMIT
    return report


def test_slots_memory_store_threads(fence_sqlite: str, exclusion_reports: list[Report]) -> None:
    """Six threads on three slots of one key (memory store, simulated pauses): at most three
    believe they hold it at once, and three do; tokens rise across slots; fencing per slot."""
    records = run_threads(
        MemoryLockStore(), FencedResource(fence_sqlite), holders=6, plan=SLOT_THREAD_PLAN
    )
    _finish_slots("memory slots (6 threads)", records, fence_sqlite, exclusion_reports, 120)


def test_slots_redis_store_processes(own_redis, fence_sqlite: str, exclusion_reports) -> None:  # type: ignore[no-untyped-def]
    """Six processes on three slots of one key on Redis, real SIGSTOP pauses: peak three."""
    records = run_processes(own_redis.url, fence_sqlite, holders=6, plan=SLOT_PROCESS_PLAN)
    _finish_slots("redis slots (6 processes)", records, fence_sqlite, exclusion_reports, 72)


def test_slots_postgres_store_processes(
    pg_database_dsn: str, exclusion_reports: list[Report]
) -> None:
    """Six processes on three slots of one key on PostgreSQL, real SIGSTOP pauses: peak three."""
    fence = f"{pg_database_dsn}#fence_{secrets.token_hex(4)}"
    hot = f"hot-{secrets.token_hex(3)}"
    plan = Plan(**{**SLOT_PROCESS_PLAN.__dict__, "keys": [hot]})
    records = run_processes(pg_database_dsn, fence, holders=6, plan=plan)
    for rec in records:  # one scratch database per session: the key is unique, the check the same
        rec["key"] = "hot"
    _finish_slots("postgres slots (6 processes)", records, fence, exclusion_reports, 72)


def test_slots_sqlite_store_processes(
    sqlite_store_url: str, fence_sqlite: str, exclusion_reports: list[Report]
) -> None:
    """Six processes on three slots of one key in one SQLite file, real SIGSTOP pauses."""
    records = run_processes(sqlite_store_url, fence_sqlite, holders=6, plan=SLOT_PROCESS_PLAN)
    _finish_slots("sqlite slots (6 processes)", records, fence_sqlite, exclusion_reports, 72)


def test_slots_redis_cluster_threads(
    redis_cluster_server: RedisServer, redis_cluster_url: str, fence_sqlite: str,
    exclusion_reports: list[Report],
) -> None:  # fmt: skip
    """Six threads on three slots of one key on a Redis Cluster (simulated pauses)."""
    client = RedisCluster(host="127.0.0.1", port=redis_cluster_server.port)
    try:
        records = run_threads(
            RedisLockStore(client), FencedResource(fence_sqlite), holders=6,
            plan=SLOT_THREAD_PLAN,
        )  # fmt: skip
    finally:
        client.close()
    _finish_slots("redis cluster slots (6 threads)", records, fence_sqlite, exclusion_reports, 120)


ASYNC_SLOT_PLAN = Plan(keys=["hot"], rounds=15, seed=17, ttl=1.0, hold_max=0.02, limit=SLOT_LIMIT)


def test_slots_async_redis_store(
    own_redis, fence_sqlite: str, exclusion_reports: list[Report]
) -> None:  # type: ignore[no-untyped-def]
    """Six tasks on one event loop on three slots of one key (the native async Redis store)."""
    records = run_async(
        lambda: async_store_from_url(own_redis.url), FencedResource(fence_sqlite), holders=6,
        plan=ASYNC_SLOT_PLAN,
    )  # fmt: skip
    _finish_slots("async redis slots (6 tasks)", records, fence_sqlite, exclusion_reports, 90)


def test_slots_async_postgres_store(pg_database_dsn: str, exclusion_reports: list[Report]) -> None:
    """Six tasks on one event loop on three slots of one key (the native async PostgreSQL
    store)."""
    fence = f"{pg_database_dsn}#fence_{secrets.token_hex(4)}"
    hot = f"hot-{secrets.token_hex(3)}"
    plan = Plan(**{**ASYNC_SLOT_PLAN.__dict__, "keys": [hot]})
    FencedResource(fence).prepare()
    records = run_async(
        lambda: async_store_from_url(pg_database_dsn), FencedResource(fence), holders=6,
        plan=plan,
    )  # fmt: skip
    for rec in records:
        rec["key"] = "hot"
    _finish_slots("async postgres slots (6 tasks)", records, fence, exclusion_reports, 90)


def test_slots_redis_sentinel_processes(
    redis_sentinel: SentinelGroup, fence_sqlite: str, exclusion_reports: list[Report]
) -> None:
    """Six processes on three slots of one key through Redis Sentinel, real SIGSTOP pauses."""
    records = run_processes(redis_sentinel.url, fence_sqlite, holders=6, plan=SLOT_PROCESS_PLAN)
    _finish_slots("sentinel slots (6 processes)", records, fence_sqlite, exclusion_reports, 72)


class _OneSlotTooManyStore(MemoryLockStore):
    """A broken store whose slots admit one holder more than asked."""

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        return super().acquire_slot(key, owner, ttl_ms, limit + 1)


def test_checker_catches_a_store_admitting_one_holder_too_many(fence_sqlite: str) -> None:
    """Against slots that admit limit + 1 holders, under load, the checker reports the peak."""
    plan = Plan(keys=["hot"], rounds=15, seed=5, ttl=1.0, hold_max=0.02, limit=SLOT_LIMIT)
    records = run_threads(
        _OneSlotTooManyStore(), FencedResource(fence_sqlite), holders=8, plan=plan
    )
    resource = FencedResource(fence_sqlite)
    report = check("one too many", records, resource.log(), limit=SLOT_LIMIT)
    resource.close()
    assert report.peaks["hot"] == SLOT_LIMIT + 1
    assert report.overlaps > 0
    assert any("4 holders believed they held it" in v for v in report.violations)


def _holding(holder: str, token: int, start: float, end: float, **more: object) -> dict:
    return {
        "holder": holder, "key": "k", "token": token, "acquired_at": start, "confirmed_at": end,
        **more,
    }  # fmt: skip


class TestCheckerCountsHolders:
    def test_limit_plus_one_concurrent_holders_is_a_violation(self) -> None:
        """Four holdings of a limit-3 key open at once (each in its own slot): one violation
        naming the four, peak 4."""
        records = [
            _holding(f"h{i}", 10 + i, 1.0 + i / 10, 2.0, slot=i) for i in range(SLOT_LIMIT + 1)
        ]
        report = check("planted", records, [], limit=SLOT_LIMIT)
        assert report.peaks == {"k": 4}
        assert report.overlaps == 1
        assert len(report.violations) == 1
        assert report.violations[0].startswith("k: 4 holders believed they held it at 1.3000")
        assert all(f"h{i}" in report.violations[0] for i in range(4))

    def test_limit_concurrent_holders_is_no_violation(self) -> None:
        """Three holdings open at once on a limit-3 key, then a fourth after one ended: peak 3."""
        records = [_holding(f"h{i}", 10 + i, 1.0 + i / 10, 2.0, slot=i) for i in range(3)]
        records.append(_holding("h3", 20, 2.0, 2.5, slot=0))  # starts as slot 0's holder ends
        report = check("full", records, [], limit=SLOT_LIMIT)
        assert report.violations == []
        assert report.peaks == {"k": 3}
        assert "peak holders per key: k 3 of 3" in report.summary()

    def test_a_holding_of_no_length_ends_at_its_instant(self) -> None:
        """A holder that saw its lease lost as it acquired it (start == end) is counted at that
        instant only, not from then on: three later holdings are no violation."""
        records = [_holding("lost", 5, 1.0, 1.0, slot=0)]
        records += [_holding(f"h{i}", 10 + i, 2.0 + i / 10, 3.0, slot=i) for i in range(3)]
        report = check("instant", records, [], limit=SLOT_LIMIT)
        assert report.violations == []
        assert report.peaks == {"k": 3}

    def test_a_holding_of_no_length_counts_with_those_starting_then(self) -> None:
        """Three open holdings and a fourth of no length inside them: four at that instant."""
        records = [_holding(f"h{i}", 10 + i, 1.0, 3.0, slot=i) for i in range(3)]
        records.append(_holding("blink", 20, 2.0, 2.0, slot=3))
        report = check("instant", records, [], limit=SLOT_LIMIT)
        assert report.peaks == {"k": 4}
        assert len(report.violations) == 1

    def test_two_holdings_of_one_slot_overlapping_is_a_violation(self) -> None:
        """Under the limit, but two holders in slot 1 at once: a violation of that slot."""
        records = [
            _holding("a", 10, 1.0, 2.0, slot=1),
            _holding("b", 11, 1.5, 2.5, slot=1),
        ]
        report = check("slot", records, [], limit=SLOT_LIMIT)
        assert report.peaks == {"k": 2}
        assert report.violations == [
            "k: b (token 11 slot 1) acquired at 1.5000 while a (token 10 slot 1) still believed"
            " it held slot 1 until 2.0000"
        ]

    def test_a_token_below_one_acquired_before_it_was_asked_for_is_a_violation(self) -> None:
        """b asked after a's acquisition returned, in another slot, yet got a lower token."""
        records = [
            _holding("a", 20, 1.0, 3.0, slot=0, asked_at=0.9),
            _holding("b", 15, 1.6, 2.0, slot=1, asked_at=1.5),
        ]
        report = check("tokens", records, [], limit=SLOT_LIMIT)
        assert report.violations == ["k: token 15 acquired after 20"]

    def test_tokens_of_acquisitions_asked_for_at_once_may_come_in_any_order(self) -> None:
        """Both asked before either acquisition returned: either may have the higher token."""
        records = [
            _holding("a", 20, 1.0, 3.0, slot=0, asked_at=0.5),
            _holding("b", 15, 1.1, 2.0, slot=1, asked_at=0.6),
        ]
        assert check("tokens", records, [], limit=SLOT_LIMIT).violations == []

    def test_per_key_limits(self) -> None:
        """A mapping gives each key its own limit; a key it does not name has limit 1."""
        records = [
            _holding("a", 1, 1.0, 2.0, slot=0),
            _holding("b", 2, 1.1, 2.0, slot=1),
            {**_holding("c", 3, 1.0, 2.0), "key": "other"},
            {**_holding("d", 4, 1.5, 2.0), "key": "other"},
        ]
        report = check("per key", records, [], limit={"k": 2})
        assert report.peaks == {"k": 2, "other": 2}
        assert report.limits == {"k": 2, "other": 1}
        assert [v.split(":")[0] for v in report.violations] == ["other", "other"]

    def test_a_single_holder_key_still_reports_each_overlap(self) -> None:
        """Without a limit two overlapping holdings are a violation, as before slots."""
        records = [_holding("a", 5, 1.0, 2.0), _holding("b", 7, 1.5, 2.5)]
        report = check("one", records, [])
        assert report.overlaps == 1
        assert report.peaks == {"k": 2}
        assert len(report.violations) == 2  # the count above 1, and the pair that overlapped
