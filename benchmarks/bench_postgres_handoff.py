"""Hand-off latency of the PostgreSQL store: from ``release`` to the waiter's successful acquire.

A holder takes a key; a waiter tries, fails and blocks in ``wait_for_release``; the holder
releases after a short hold, and the waiter, woken by ``NOTIFY``, acquires. The latency is the
time from the start of the holder's ``release`` to the return of the waiter's winning
``acquire`` (``time.perf_counter``, system-wide monotonic on Linux, so comparable across
processes). Measured in two set-ups:

- ``threads``: holder and waiter are threads of one process sharing one store (one listener);
- ``processes``: the waiter is another process with its own store, as Celery prefork workers are.

Runs in a scratch database ``celery_lease_bench_<pid>_<hex>`` on the server given by ``--dsn``
(default: the local server), dropped at the end. Usage::

    python benchmarks/bench_postgres_handoff.py [--handoffs 300] [--dsn postgresql://...]

``--json PATH`` also writes the results for ``benchmarks/plot.py``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import secrets
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from celery_lease.stores.postgres import PostgresLockStore

TTL_MS = 30_000
HOLD = (0.001, 0.004)  # seconds the holder keeps the key once the waiter is blocked


def _waiter_loop(
    store: PostgresLockStore, key: str, rounds: int, go: Any, ready: Any, done: Any
) -> None:
    """Per round: once told to go, fail to acquire, say so, wait, acquire, release, report."""
    owner = f"waiter-{os.getpid()}-{threading.get_ident()}"
    for _ in range(rounds):
        go.get(timeout=30)
        announced = False
        while True:
            token = store.acquire(key, owner, TTL_MS)
            if token is not None:
                acquired_at = time.perf_counter()
                store.release(key, owner)
                done.put(acquired_at)
                break
            if not announced:
                ready.put(True)
                announced = True
            store.wait_for_release(key, 1.0)


def _waiter_process(
    dsn: str, table: str, key: str, rounds: int, go: Any, ready: Any, done: Any
) -> None:
    store = PostgresLockStore(dsn, table=table)
    try:
        store.wait_for_release("warm-up", 0.2)  # start the listener before the first round
        ready.put(True)
        _waiter_loop(store, key, rounds, go, ready, done)
    finally:
        store.close()


def _hold_and_release(
    store: PostgresLockStore, key: str, rounds: int, go: Any, ready: Any, done: Any
) -> list[float]:
    """Per round: take the key, let the waiter block on it, release, collect the latency."""
    latencies = []
    for _ in range(rounds):
        assert store.acquire(key, "holder", TTL_MS) is not None  # the waiter released it
        go.put(True)
        ready.get(timeout=10)  # the waiter failed to acquire and is about to wait
        time.sleep(random.uniform(*HOLD))
        released_at = time.perf_counter()
        store.release(key, "holder")
        latencies.append(done.get(timeout=10) - released_at)
    return latencies


def run_threads(dsn: str, rounds: int) -> list[float]:
    """Holder and waiter as two threads sharing one store (and its one listener)."""
    import queue

    store = PostgresLockStore(dsn, table="bench_threads")
    go: queue.Queue[bool] = queue.Queue()
    ready: queue.Queue[bool] = queue.Queue()
    done: queue.Queue[float] = queue.Queue()
    try:
        store.wait_for_release("warm-up", 0.2)  # start the listener before the first round
        waiter = threading.Thread(
            target=_waiter_loop, args=(store, "k", rounds, go, ready, done), daemon=True
        )
        waiter.start()
        latencies = _hold_and_release(store, "k", rounds, go, ready, done)
        waiter.join(10)
        return latencies
    finally:
        store.close()


def run_processes(dsn: str, rounds: int) -> list[float]:
    """The waiter in a child process with its own store, as prefork workers are."""
    ctx = multiprocessing.get_context("spawn")
    go, ready, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    store = PostgresLockStore(dsn, table="bench_processes")
    try:
        child = ctx.Process(
            target=_waiter_process, args=(dsn, "bench_processes", "k", rounds, go, ready, done)
        )
        child.start()
        ready.get(timeout=30)  # the child's listener is up
        latencies = _hold_and_release(store, "k", rounds, go, ready, done)
        child.join(10)
        return latencies
    finally:
        store.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _with_dbname(dsn: str, dbname: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--handoffs", type=int, default=300, help="hand-offs per set-up (300)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    name = f"celery_lease_bench_{os.getpid()}_{secrets.token_hex(4)}"
    ident = sql.Identifier(name)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    try:
        dsn = _with_dbname(args.dsn, name)
        rows = []
        for label, run in (("threads", run_threads), ("processes", run_processes)):
            ms = [x * 1000 for x in run(dsn, args.handoffs)]
            rows.append(
                (
                    label,
                    len(ms),
                    statistics.median(ms),
                    _percentile(ms, 0.99),
                    max(ms),
                    statistics.fmean(ms),
                )
            )
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
    print("PostgreSQL hand-off latency: release -> waiter's acquire returns (ms)")
    print(f"{'set-up':<10} {'n':>5} {'p50':>8} {'p99':>8} {'max':>8} {'mean':>8}")
    for label, n, p50, p99, top, mean in rows:
        print(f"{label:<10} {n:>5} {p50:>8.2f} {p99:>8.2f} {top:>8.2f} {mean:>8.2f}")
    if args.json:
        results = {
            "benchmark": "postgres_handoff",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "psycopg": psycopg.__version__},
            "params": {"handoffs": args.handoffs},
            "setups": [
                dict(zip(("name", "n", "p50_ms", "p99_ms", "max_ms", "mean_ms"), row, strict=True))
                for row in rows
            ],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
