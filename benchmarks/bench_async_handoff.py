"""Async hand-off latency next to the sync one, on the same store, in one run.

A hand-off: a holder holds a fresh key; a waiter blocks on it (``wait=5``); the holder waits a
delay drawn uniformly from 5-20 ms (one seeded sequence for every contender), reads
``time.perf_counter()`` (t0) and leaves its block; the waiter reads ``time.perf_counter()`` as
soon as its block is entered (t1). Latency = t1 - t0. Both are in one process (one clock).

- ``sync``: holder = the main thread in ``with lease(...)``, waiter = a thread in ``with
  lease(..., wait=5)`` (the store's ``wait_for_release`` where it has one, else polling).
- ``async``: holder and waiter are two coroutines of one event loop in ``async with
  lease(...)``; the store is awaited through ``ThreadedAsyncStore`` (its calls on the loop's
  default executor; a release by one coroutine wakes the waiters of this process at once), or
  the native ``AsyncRedisLockStore`` when ``celery_lease.stores.redis_async`` exists.

Stores: memory, an SQLite file, and a throwaway Redis (``benchmarks/_redis_server.py``).
Rounds of ``PER_ROUND`` hand-offs per contender, the order rotated each round.

Run: ``python -m benchmarks.bench_async_handoff`` (``--rounds``, ``--per-round``, ``--json PATH``,
``--stores memory,sqlite`` for some rows only).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery_lease import LockStore, MemoryLockStore, SQLiteLockStore, lease, shutdown
from celery_lease._core.aio import ThreadedAsyncStore
from celery_lease.stores.base import AsyncLockStore

DELAY_MS = (5.0, 20.0)
WAIT_S = 5
TTL_S = 30
SEED = 20261203


def sync_handoff(store: LockStore, key: str, delay: float) -> float:
    entered = threading.Event()
    held_at: list[float] = []

    def waiter() -> None:
        entered.set()
        with lease(key, store=store, ttl=TTL_S, wait=WAIT_S):
            held_at.append(time.perf_counter())

    with lease(key, store=store, ttl=TTL_S):
        thread = threading.Thread(target=waiter)
        thread.start()
        entered.wait()
        time.sleep(delay)
        t0 = time.perf_counter()
    thread.join()
    return held_at[0] - t0


async def async_handoff(store: AsyncLockStore, key: str, delay: float) -> float:
    held_at: list[float] = []
    waiting = asyncio.Event()

    async def waiter() -> None:
        waiting.set()
        async with lease(key, store=store, ttl=TTL_S, wait=WAIT_S):
            held_at.append(time.perf_counter())

    async with lease(key, store=store, ttl=TTL_S):
        task = asyncio.create_task(waiter())
        await waiting.wait()
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
    await task
    return held_at[0] - t0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--stores",
        default="memory,sqlite,redis (adapter),redis (native)",
        help="comma-separated rows to run (default: all)",
    )
    args = parser.parse_args()

    from benchmarks._redis_server import redis_server
    from celery_lease.stores.redis import RedisLockStore

    tmp = Path(tempfile.mkdtemp(prefix="bench-async-handoff-"))
    sqlite = SQLiteLockStore(tmp / "leases.db")
    memory = MemoryLockStore()
    results: dict[str, dict[str, list[float]]] = {}
    try:
        with redis_server() as server:
            url = server.url
            redis_store = RedisLockStore(url)
            stores: list[tuple[str, LockStore, Callable[[], AsyncLockStore]]] = [
                ("memory", memory, lambda: ThreadedAsyncStore(memory)),
                ("sqlite", sqlite, lambda: ThreadedAsyncStore(sqlite)),
                ("redis (adapter)", redis_store, lambda: ThreadedAsyncStore(redis_store)),
            ]
            try:
                native = importlib.import_module("celery_lease.stores.redis_async")
            except ImportError:
                print("(celery_lease.stores.redis_async not found: no native Redis row)")
            else:
                stores.append(
                    (
                        "redis (native)",
                        redis_store,
                        lambda: native.AsyncRedisLockStore.from_url(url),
                    )
                )
            wanted = {name.strip() for name in args.stores.split(",")}
            stores = [row for row in stores if row[0] in wanted]
            rng = random.Random(SEED)
            delays = [rng.uniform(*DELAY_MS) / 1000 for _ in range(args.rounds * args.per_round)]
            serial = iter(range(10**9))
            for name, sync_store, make_async in stores:
                sync_lat: list[float] = []
                async_lat: list[float] = []

                async def run_async(
                    chunk: list[float],
                    out: list[float],
                    make: Callable[[], AsyncLockStore] = make_async,
                ) -> None:
                    astore = make()
                    try:
                        for delay in chunk:
                            out.append(await async_handoff(astore, f"h:{next(serial)}", delay))
                    finally:
                        if not isinstance(astore, ThreadedAsyncStore):
                            await astore.aclose()

                for r in range(args.rounds):
                    chunk = delays[r * args.per_round : (r + 1) * args.per_round]
                    order = ["sync", "async"] if r % 2 == 0 else ["async", "sync"]
                    for which in order:
                        if which == "sync":
                            for delay in chunk:
                                sync_lat.append(
                                    sync_handoff(sync_store, f"h:{next(serial)}", delay)
                                )
                        else:
                            asyncio.run(run_async(chunk, async_lat))
                results[name] = {"sync": sync_lat, "async": async_lat}
            redis_store.close()
    finally:
        sqlite.close()
        shutdown()

    print(
        f"\nHand-off latency, ms ({args.rounds} rounds x {args.per_round} per contender;"
        f" {platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})"
    )
    print(f"{'store':<18}{'mode':<7}{'p50':>9}{'p99':>9}{'mean':>9}   p50 async/sync")
    table: dict[str, Any] = {}
    for name, pair in results.items():
        p50s = {}
        for mode in ("sync", "async"):
            values = [v * 1000 for v in pair[mode]]
            p50s[mode] = pct(values, 0.5)
            table.setdefault(name, {})[mode] = {
                "p50_ms": pct(values, 0.5),
                "p99_ms": pct(values, 0.99),
                "mean_ms": statistics.fmean(values),
                "n": len(values),
            }
            ratio = f"{p50s['async'] / p50s['sync']:.2f}" if mode == "async" else ""
            print(
                f"{name:<18}{mode:<7}{pct(values, 0.5):>9.3f}{pct(values, 0.99):>9.3f}"
                f"{statistics.fmean(values):>9.3f}   {ratio}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
