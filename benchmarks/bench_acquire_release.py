"""Uncontended acquire + release cycles per second on one throwaway Redis, interleaved.

Contenders, all on the same ``redis.Redis`` client (redis-py defaults), each on its own key:

- ``baseline``: ``SET key owner NX PX ttl`` + a Lua compare-and-delete (EVALSHA): 2 round trips;
- ``baseline, raw connection``: the same two commands, pre-packed, over the store's own
  dedicated connection (``celery_lease.stores._redis_fast.FastConnection``) instead of redis-py:
  what the wire and the server cost without any client library, for comparison with the store;
- ``RedisLockStore``: ``store.acquire()`` + ``store.release()``;
- ``lease()``: ``with lease(key, store=store, ttl=30)``, which adds renewer registration;
- ``redis-py Lock``: ``with client.lock(key, timeout=30)``;
- ``python-redis-lock``: ``with redis_lock.Lock(client, key, expire=30)``.

The baseline and the store draw a fresh owner id per cycle (``secrets.token_hex(8)``) as every
real acquisition must; ``lease()`` and the two libraries make their own ids. Each round runs every
contender for ``CYCLES`` cycles, in an order rotated by one each round; the table gives the
median over rounds of cycles/s, the ratio of that median to the baseline's, the median of the
per-round ratios (less sensitive to load that drifts over the run), and the round trips per
cycle (requests redis-py sent, counted in a separate, untimed pass).

Run: ``python -m benchmarks.bench_acquire_release`` (``--profile`` adds a cProfile of the
store and lease() contenders; ``--json PATH`` also writes the results for ``benchmarks/plot.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import secrets
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import redis
import redis_lock

from benchmarks._redis_server import count_round_trips, redis_server
from celery_lease import lease
from celery_lease.stores._redis_fast import FastConnection, pack_head
from celery_lease.stores.redis import RedisLockStore

ROUNDS = 15
CYCLES = 2000
TTL_MS = 30_000

# KEYS[1] the lock key. ARGV[1] the owner. Deletes the key if it holds the owner; 1 if deleted.
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

Cycle = Callable[[int], None]
"""Runs ``n`` acquire + release cycles."""


def make_contenders(client: redis.Redis) -> dict[str, Cycle]:
    store = RedisLockStore(client)
    cad_sha = client.script_load(COMPARE_AND_DELETE)

    def baseline(n: int) -> None:
        key = "bench:baseline"
        for _ in range(n):
            owner = secrets.token_hex(8)
            if not client.set(key, owner, nx=True, px=TTL_MS):
                raise RuntimeError("baseline: key unexpectedly held")
            client.evalsha(cad_sha, 1, key, owner)

    raw = FastConnection(client.connection_pool)
    cad_head = pack_head(cad_sha, 1, 1)
    raw_key = b"bench:raw-baseline"
    set_head = b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$16\r\n" % (len(raw_key), raw_key)
    set_tail = b"\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(TTL_MS)), TTL_MS)
    cad_key = b"$%d\r\n%s\r\n$16\r\n" % (len(raw_key), raw_key)

    def raw_baseline(n: int) -> None:
        for _ in range(n):
            owner = secrets.token_hex(8).encode()
            if raw.call(set_head + owner + set_tail) is None:
                raise RuntimeError("raw baseline: key unexpectedly held")
            raw.call(cad_head + cad_key + owner + b"\r\n")

    def via_store(n: int) -> None:
        key = "bench:store"
        for _ in range(n):
            owner = secrets.token_hex(8)
            if store.acquire(key, owner, TTL_MS) is None:
                raise RuntimeError("store: key unexpectedly held")
            store.release(key, owner)

    def via_lease(n: int) -> None:
        key = "bench:lease"
        for _ in range(n):
            with lease(key, store=store, ttl=TTL_MS / 1000):
                pass

    def redis_py_lock(n: int) -> None:
        key = "bench:redis-py"
        for _ in range(n):
            with client.lock(key, timeout=TTL_MS / 1000):
                pass

    def python_redis_lock(n: int) -> None:
        key = "bench:python-redis-lock"
        for _ in range(n):
            with redis_lock.Lock(client, key, expire=TTL_MS // 1000):
                pass

    return {
        "baseline SET NX PX + Lua CAD": baseline,
        "baseline, raw connection": raw_baseline,
        "RedisLockStore acquire+release": via_store,
        "lease() on RedisLockStore": via_lease,
        "redis-py Lock": redis_py_lock,
        "python-redis-lock": python_redis_lock,
    }


def round_trips_per_cycle(run: Cycle, n: int = 200) -> float:
    run(10)  # open the connection and load scripts outside the count
    with count_round_trips() as counts:
        run(n)
    return sum(counts.values()) / n


def server_us_per_call(client: redis.Redis, n: int = 5000) -> dict[str, float]:
    """Server-side ``usec_per_call`` (``INFO commandstats``) of each command alone, untimed."""
    store = RedisLockStore(client)
    cad_sha = client.script_load(COMPARE_AND_DELETE)
    owners = [secrets.token_hex(8) for _ in range(n)]
    keys = [f"bench:server:{i}" for i in range(n)]
    steps: list[tuple[str, str, Callable[[str, str], object]]] = [
        ("SET NX PX", "set", lambda k, o: client.set(k + ":b", o, nx=True, px=TTL_MS)),
        ("CAD (EVALSHA)", "evalsha", lambda k, o: client.evalsha(cad_sha, 1, k + ":b", o)),
        ("store ACQUIRE (EVALSHA)", "evalsha", lambda k, o: store.acquire(k, o, TTL_MS)),
        ("store RENEW (EVALSHA)", "evalsha", lambda k, o: store.renew(k, o, TTL_MS)),
        ("store RELEASE (EVALSHA)", "evalsha", lambda k, o: store.release(k, o)),
    ]
    results: dict[str, float] = {}
    for name, command, call in steps:
        call("bench:server:warm", "w")
        client.config_resetstat()
        for key, owner in zip(keys, owners, strict=True):
            call(key, owner)
        stats = client.info("commandstats")[f"cmdstat_{command}"]
        results[name] = float(stats["usec"]) / int(stats["calls"])
    return results


def measure(contenders: dict[str, Cycle], rounds: int, cycles: int) -> dict[str, list[float]]:
    names = list(contenders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: connections, script cache, imports
        contenders[name](200)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            contenders[name](cycles)
            rates[name].append(cycles / (time.perf_counter() - started))
    return rates


def profile(contenders: dict[str, Cycle], cycles: int) -> None:
    for name in ("RedisLockStore acquire+release", "lease() on RedisLockStore"):
        profiler = cProfile.Profile()
        profiler.runcall(contenders[name], cycles)
        print(f"\ncProfile of {name}, {cycles} cycles (tottime, top 25):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument("--profile", action="store_true", help="cProfile store and lease()")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    with redis_server() as server:
        client = server.client()
        contenders = make_contenders(client)
        trips = {name: round_trips_per_cycle(run) for name, run in contenders.items()}
        server_us = server_us_per_call(client)
        rates = measure(contenders, args.rounds, args.cycles)
        if args.profile:
            profile(contenders, args.cycles)
        client.close()
    print(
        f"\nUncontended acquire + release, {args.rounds} rounds x {args.cycles} cycles, order "
        f"rotated; Python {platform.python_version()}, redis-py {redis.__version__}, "
        f"python-redis-lock {redis_lock.__version__}"
    )
    base = statistics.median(rates["baseline SET NX PX + Lua CAD"])
    base_rates = rates["baseline SET NX PX + Lua CAD"]
    header = (
        f"{'contender':<32} {'median/s':>9} {'min/s':>8} {'max/s':>8} {'x base':>7} "
        f"{'paired':>7} {'RTs':>5}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name, values in rates.items():
        median = statistics.median(values)
        paired = statistics.median(v / b for v, b in zip(values, base_rates, strict=True))
        print(
            f"{name:<32} {median:>9.0f} {min(values):>8.0f} {max(values):>8.0f} "
            f"{median / base:>7.3f} {paired:>7.3f} {trips[name]:>5.2f}"
        )
        rows.append(
            {
                "name": name,
                "median_per_s": median,
                "min_per_s": min(values),
                "max_per_s": max(values),
                "x_base": median / base,
                "paired": paired,
                "round_trips": trips[name],
                "per_round_per_s": values,
            }
        )
    print("x base: median cycles/s / the baseline's median; paired: median over rounds of the")
    print("        contender's rate / the baseline's rate in the same round")
    print("RTs: round trips per cycle (requests sent, counted in an untimed pass)")
    print("server-side us per call (INFO commandstats, each command alone, untimed pass):")
    for name, value in server_us.items():
        print(f"  {name:<26} {value:6.2f}")
    if args.json:
        results = {
            "benchmark": "acquire_release",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {
                "python": platform.python_version(),
                "redis-py": redis.__version__,
                "python-redis-lock": redis_lock.__version__,
            },
            "params": {"rounds": args.rounds, "cycles": args.cycles},
            "baseline": "baseline SET NX PX + Lua CAD",
            "contenders": rows,
            "server_us_per_call": server_us,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
