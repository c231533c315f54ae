"""Hand-off latency: a waiter blocked on a held key, from the holder's release call to the waiter's
acquisition, on one throwaway Redis.

Contenders, all on the same ``redis.Redis`` client (redis-py defaults; each thread takes its own
pooled connection):

- ``lease()``: the waiter blocks in ``with lease(key, store=RedisLockStore(client), ttl=30,
  wait=5)`` (BLPOP on the store's release signal); the holder holds with ``lease()`` too and
  releases by leaving its block;
- ``redis-py Lock``: ``client.lock(key, timeout=30, blocking_timeout=5).acquire()`` (polls every
  0.1 s, redis-py's default ``sleep``);
- ``python-redis-lock``: ``redis_lock.Lock(client, key, expire=30).acquire(timeout=5)`` (BLPOP on
  its signal list).

One hand-off, the same for every contender: the holder (the main thread) takes a fresh key; a
waiter thread starts, sets an event and calls the blocking acquire; the holder sees the event,
sleeps a delay drawn uniformly from 5-100 ms (the same seeded sequence for every contender, so the
waiter is blocked and the release lands at varied points of its waiting), reads
``time.perf_counter()`` (t0) and releases; the waiter reads ``time.perf_counter()`` as soon as it
holds the key (t1) and releases. Latency = t1 - t0. Holder and waiter are threads of one process
(so t0 and t1 come from one clock). Rounds of ``PER_ROUND`` hand-offs per contender, the order
rotated each round.

Run: ``python -m benchmarks.bench_handoff`` (``--json PATH`` also writes the results for
``benchmarks/plot.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis
import redis_lock

from benchmarks._redis_server import redis_server
from celery_lease import lease
from celery_lease.stores.redis import RedisLockStore

ROUNDS = 10
PER_ROUND = 25
DELAY_MS = (5.0, 100.0)
TTL_S = 30
WAIT_S = 5
SEED = 20240601

Release = Callable[[], None]
Hold = Callable[[str], Release]
"""Takes the key (it is free) and returns the function that releases it."""

Wait = Callable[[str, threading.Event], float]
"""Sets the event, blocks until it holds the key, releases; returns perf_counter() when it held."""


class Contender:
    def __init__(self, name: str, hold: Hold, wait: Wait) -> None:
        self.name = name
        self.hold = hold
        self.wait = wait
        self.latencies: list[float] = []
        self.release_calls: list[float] = []
        self.notes: list[Any] = []


def make_contenders(client: redis.Redis) -> list[Contender]:
    store = RedisLockStore(client)

    def lease_hold(key: str) -> Release:
        context = lease(key, store=store, ttl=TTL_S)
        context.__enter__()

        def release() -> None:
            context.__exit__(None, None, None)

        return release

    def lease_wait(key: str, ready: threading.Event) -> float:
        context = lease(key, store=store, ttl=TTL_S, wait=WAIT_S)
        ready.set()
        with context as held:
            acquired = time.perf_counter()
            lease_contender.notes.append(held.waited)
        return acquired

    def redis_py_hold(key: str) -> Release:
        lock = client.lock(key, timeout=TTL_S)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"{key} unexpectedly held")
        return lock.release

    def redis_py_wait(key: str, ready: threading.Event) -> float:
        lock = client.lock(key, timeout=TTL_S, blocking_timeout=WAIT_S)
        ready.set()
        if not lock.acquire():
            raise RuntimeError(f"redis-py Lock: {key} not acquired within {WAIT_S} s")
        acquired = time.perf_counter()
        lock.release()
        return acquired

    def prl_hold(key: str) -> Release:
        lock = redis_lock.Lock(client, key, expire=TTL_S)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"{key} unexpectedly held")
        return lock.release

    def prl_wait(key: str, ready: threading.Event) -> float:
        lock = redis_lock.Lock(client, key, expire=TTL_S)
        ready.set()
        if not lock.acquire(blocking=True, timeout=WAIT_S):
            raise RuntimeError(f"python-redis-lock: {key} not acquired within {WAIT_S} s")
        acquired = time.perf_counter()
        lock.release()
        return acquired

    lease_contender = Contender("lease() on RedisLockStore", lease_hold, lease_wait)
    return [
        lease_contender,
        Contender("redis-py Lock (polls 0.1 s)", redis_py_hold, redis_py_wait),
        Contender("python-redis-lock (BLPOP)", prl_hold, prl_wait),
    ]


def hand_off(contender: Contender, key: str, delay: float) -> None:
    release = contender.hold(key)
    ready = threading.Event()
    acquired: list[float] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            acquired.append(contender.wait(key, ready))
        except BaseException as exc:
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=waiter, name="waiter")
    thread.start()
    ready.wait()
    time.sleep(delay)
    released_at = time.perf_counter()
    release()
    release_done = time.perf_counter()
    thread.join(WAIT_S + 5)
    if errors:
        raise errors[0]
    if thread.is_alive() or not acquired:
        raise RuntimeError(f"{contender.name}: the waiter did not finish")
    if acquired[0] < released_at:
        raise RuntimeError(f"{contender.name}: the waiter acquired before the release")
    contender.latencies.append(acquired[0] - released_at)
    contender.release_calls.append(release_done - released_at)


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--per-round", type=int, default=PER_ROUND)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    total = args.rounds * args.per_round
    delays = [random.Random(SEED + i).uniform(*DELAY_MS) / 1000 for i in range(total)]
    with redis_server() as server:
        client = server.client()
        contenders = make_contenders(client)
        for contender in contenders:  # warm-up: connections, scripts, imports
            for i in range(3):
                hand_off(contender, f"warm:{contender.name}:{i}", 0.005)
            contender.latencies.clear()
            contender.release_calls.clear()
            contender.notes.clear()
        for index in range(args.rounds):
            shift = index % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                for j in range(args.per_round):
                    n = index * args.per_round + j
                    hand_off(contender, f"handoff:{contender.name}:{n}", delays[n])
        client.close()
    print(
        f"\nHand-off latency (release call start -> waiter holds the key), {total} hand-offs per "
        f"contender in {args.rounds} rounds, threads of one process; Python "
        f"{platform.python_version()}, redis-py {redis.__version__}, python-redis-lock "
        f"{redis_lock.__version__}"
    )
    header = (
        f"{'contender':<30} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'mean ms':>8} {'release ms':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for contender in contenders:
        values = sorted(contender.latencies)
        ms = [1000 * percentile(values, f) for f in (0.5, 0.9, 0.99)]
        release_ms = 1000 * statistics.median(contender.release_calls)
        rows.append(
            {
                "name": contender.name,
                "n": len(values),
                "p50_ms": ms[0],
                "p90_ms": ms[1],
                "p99_ms": ms[2],
                "max_ms": 1000 * values[-1],
                "mean_ms": 1000 * statistics.fmean(values),
                "release_ms": release_ms,
            }
        )
        print(
            f"{contender.name:<30} {len(values):>4} {ms[0]:>8.3f} {ms[1]:>8.3f} {ms[2]:>8.3f} "
            f"{1000 * values[-1]:>8.3f} {1000 * statistics.fmean(values):>8.3f} "
            f"{release_ms:>10.3f}"
        )
    print("p50/p90/p99: nearest rank; release ms: median duration of the holder's release call")
    waited = contenders[0].notes
    print(f"lease(): Lease.waited was True in {sum(waited)} of {len(waited)} hand-offs")
    if args.json:
        results = {
            "benchmark": "handoff",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {
                "python": platform.python_version(),
                "redis-py": redis.__version__,
                "python-redis-lock": redis_lock.__version__,
            },
            "params": {"rounds": args.rounds, "per_round": args.per_round},
            "contenders": rows,
            "lease_waited": {"true": sum(waited), "of": len(waited)},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
