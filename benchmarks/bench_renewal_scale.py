"""Renewal at scale: 10,000 leases held at once in one process, then python-redis-lock with 1,000.

Part 1, celery-lease: ``N_LEASES`` leases entered with ``lease(key, store=RedisLockStore(url),
ttl=TTL_S)``, held ``HOLD_TTLS`` ttls after the last one is acquired, then released (last in,
first out). Each lease is entered and exited in its own ``contextvars.Context``, as independent
holders are (threads, greenlets, asyncio tasks); ``--nested`` enters them all in the main thread's
one context instead, nested like an ``ExitStack`` (each lease then sees all the others on its
context's stack of held leases). Reported:

- threads: ``threading.active_count()`` while all are held, minus before the first;
- sweeps: the store's ``renew_many`` is wrapped (an instance attribute) to time each call and
  count its items, and the renewer's ``_sweep`` likewise to time whole sweeps and count the round
  trips the renewer thread sends during each (redis-py's ``send_packed_command`` is counted per
  thread; one pipeline is one send). Figures cover the hold phase (every lease already held);
  sweeps that ran while leases were still being acquired are counted separately;
- one synthetic ``renew_many`` of all N leases at once from the main thread (a worst-case sweep);
- memory, in a separate first pass: ``tracemalloc`` traced memory after acquiring N leases minus
  before, per lease (it includes the bench's own list of contexts). That pass uses a 60 s ttl
  so no renewal runs while tracemalloc slows every allocation; the renewal pass runs without
  tracemalloc;
- leases lost: ``on_lost`` calls, plus, at the end, each lease key's owner read back from Redis;
- Redis EVALSHA calls seen by the server (``INFO commandstats``) during the hold phase.

Part 2, python-redis-lock: ``N_PRL`` locks ``redis_lock.Lock(client, key, expire=3,
auto_renewal=True)`` acquired at once on one ``redis.Redis`` client with its default connection
pool, held ``HOLD_TTLS`` ttls; reported: threads, renewal threads that died with an error, locks
whose key no longer holds their id at the end, connections the pool opened.

Run: ``python -m benchmarks.bench_renewal_scale`` (``--json PATH`` also writes the results for
``benchmarks/plot.py``).
"""

from __future__ import annotations

import argparse
import contextvars
import gc
import json
import logging
import platform
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis
import redis_lock

from benchmarks._redis_server import command_calls, count_round_trips, redis_server
from celery_lease import Lease, lease
from celery_lease._core.renewer import get_renewer
from celery_lease.stores.redis import RedisLockStore

N_LEASES = 10_000
N_PRL = 1_000
TTL_S = 3
HOLD_TTLS = 3
RENEWER_THREAD = "celery-lease-renewer"


class Sweep:
    __slots__ = ("items", "phase", "renew_seconds", "round_trips", "seconds")

    def __init__(self) -> None:
        self.items = 0
        self.renew_seconds = 0.0
        self.round_trips = 0
        self.seconds = 0.0
        self.phase = "acquiring"


def summary(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return "-"
    return (
        f"median {statistics.median(values) * scale:.{digits}f}, "
        f"max {max(values) * scale:.{digits}f}"
    )


def histogram(values: Sequence[int]) -> str:
    """``"1 x38, 3 x1"``: each distinct value and how many times it occurs."""
    return ", ".join(f"{v} x{values.count(v)}" for v in sorted(set(values))) or "-"


def enter(
    entered: list[tuple[contextvars.Context | None, Any]], context: Any, nested: bool
) -> Lease:
    """Enter ``context`` in a fresh ``contextvars.Context`` (or, nested, in the current one)."""
    scope = None if nested else contextvars.Context()
    held: Lease = context.__enter__() if scope is None else scope.run(context.__enter__)
    entered.append((scope, context))
    return held


def exit_all(entered: list[tuple[contextvars.Context | None, Any]]) -> None:
    """Exit every entered lease, last in first out, each in the context it was entered in."""
    for scope, context in reversed(entered):
        if scope is None:
            context.__exit__(None, None, None)
        else:
            scope.run(context.__exit__, None, None, None)
    entered.clear()


def memory_per_lease(store: RedisLockStore, n: int, nested: bool) -> float:
    """Bytes traced per held lease: ``n`` leases (ttl 60 s, so no renewal runs meanwhile)."""
    entered: list[tuple[contextvars.Context | None, Any]] = []
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            enter(entered, lease(f"memory:{i}", store=store, ttl=60), nested)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        exit_all(entered)
    return (after - before) / n


def bench_celery_lease(
    url: str, n: int, nested: bool
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The printed rows, and the same measurements as numbers (for ``--json``)."""
    store = RedisLockStore(url)
    gc.collect()
    threads_before = threading.active_count()  # before either pass starts the renewer
    memory = memory_per_lease(store, n, nested)
    client = store.client
    renewer = get_renewer(None, store)
    sweeps: list[Sweep] = []
    phase = "acquiring"
    current: list[Sweep] = []

    original_renew_many = store.renew_many
    original_sweep = renewer._sweep

    def timed_renew_many(items: Sequence[tuple[str, str, int]]) -> list[bool]:
        started = time.perf_counter()
        try:
            return original_renew_many(items)
        finally:
            if current:
                current[-1].items += len(items)
                current[-1].renew_seconds += time.perf_counter() - started

    def timed_sweep() -> None:
        sweep = Sweep()
        sweep.phase = phase
        current.append(sweep)
        before = counts[RENEWER_THREAD]
        started = time.perf_counter()
        try:
            original_sweep()
        finally:
            sweep.seconds = time.perf_counter() - started
            sweep.round_trips = counts[RENEWER_THREAD] - before
            current.pop()
            if sweep.round_trips:
                sweeps.append(sweep)

    store.renew_many = timed_renew_many  # type: ignore[method-assign]
    renewer._sweep = timed_sweep  # type: ignore[method-assign]
    lost: list[Lease] = []
    held: list[Lease] = []
    entered: list[tuple[contextvars.Context | None, Any]] = []
    with count_round_trips() as counts:
        started = time.perf_counter()
        try:
            for i in range(n):
                context = lease(f"scale:{i}", store=store, ttl=TTL_S, on_lost=lost.append)
                held.append(enter(entered, context, nested))
            acquire_seconds = time.perf_counter() - started
            threads_held = threading.active_count()
            thread_names = sorted(t.name for t in threading.enumerate())
            stats_before = command_calls(client)
            sweeps_before = renewer.sweeps
            phase = "holding"
            time.sleep(HOLD_TTLS * TTL_S)
            phase = "after"
            stats_after = command_calls(client)
            hold_sweeps = renewer.sweeps - sweeps_before
            batch = [(h.key, h.owner, TTL_S * 1000) for h in held]
            started = time.perf_counter()
            batch_ok = sum(original_renew_many(batch))
            batch_seconds = time.perf_counter() - started
            pipe = client.pipeline(transaction=False)
            for h in held:
                pipe.hget(store.lease_key(h.key), "owner")
            owners = pipe.execute()
            still_owned = sum(
                1
                for h, o in zip(held, owners, strict=True)
                if o is not None and o.decode() == h.owner
            )
            flagged_lost = sum(1 for h in held if h.lost)
            pool = client.connection_pool
            pool_connections = len(pool._available_connections) + len(pool._in_use_connections)
        finally:
            started = time.perf_counter()
            exit_all(entered)
    release_seconds = time.perf_counter() - started
    thread = renewer.thread
    if thread is not None:  # it exits on its next wake-up, within ttl/3, once no lease is left
        thread.join(TTL_S)
    store.close()

    hold = [s for s in sweeps if s.phase == "holding"]
    early = [s for s in sweeps if s.phase == "acquiring"]
    evalsha = stats_after.get("evalsha", 0) - stats_before.get("evalsha", 0)
    renewed = sum(s.items for s in hold)
    numbers = {
        "leases": n,
        "nested": nested,
        "ttl_s": TTL_S,
        "hold_s": HOLD_TTLS * TTL_S,
        "acquire_all_s": acquire_seconds,
        "release_all_s": release_seconds,
        "threads_delta": threads_held - threads_before,
        "hold_sweeps": hold_sweeps,
        "hold_phase_sweeps": [
            {
                "leases": s.items,
                "renew_many_ms": s.renew_seconds * 1000,
                "sweep_ms": s.seconds * 1000,
                "round_trips": s.round_trips,
            }
            for s in hold
        ],
        "sweeps_while_acquiring": len(early),
        "renewals_sent": renewed,
        "evalsha_at_server": evalsha,
        "synthetic_renew_many_ms": batch_seconds * 1000,
        "synthetic_renewed": batch_ok,
        "memory_per_lease_bytes": memory,
        "lost_on_lost": len(lost),
        "lost_flagged": flagged_lost,
        "still_owned": still_owned,
        "pool_connections": pool_connections,
    }
    return [
        (
            "leases held at once",
            f"{n}, " + ("nested in one context" if nested else "one context each"),
        ),
        ("ttl / renewal every", f"{TTL_S} s / {TTL_S / 3:g} s"),
        ("acquire all / release all", f"{acquire_seconds:.2f} s / {release_seconds:.2f} s"),
        (
            "threads (active_count delta)",
            f"+{threads_held - threads_before} ({', '.join(thread_names)})",
        ),
        ("hold phase", f"{HOLD_TTLS * TTL_S} s, {hold_sweeps} sweeps (Renewer.sweeps)"),
        ("  leases per sweep", summary([s.items for s in hold], digits=0)),
        ("  renew_many time per sweep, ms", summary([s.renew_seconds for s in hold], 1000, 1)),
        ("  whole sweep time, ms", summary([s.seconds for s in hold], 1000, 1)),
        ("  round trips per sweep", histogram([s.round_trips for s in hold])),
        ("  renewals sent / EVALSHA at server", f"{renewed} / {evalsha}"),
        (
            "sweeps while acquiring",
            f"{len(early)}; leases per sweep {summary([s.items for s in early], digits=0)}; "
            f"ms {summary([s.seconds for s in early], 1000, 1)}; "
            f"round trips {histogram([s.round_trips for s in early])}",
        ),
        (
            f"one renew_many of all {n} (synthetic)",
            f"{batch_seconds * 1000:.1f} ms, {batch_ok} renewed",
        ),
        ("memory per held lease", f"{memory:.0f} B (tracemalloc pass)"),
        ("leases lost (on_lost / .lost)", f"{len(lost)} / {flagged_lost}"),
        ("lease keys still owned at the end", f"{still_owned} of {n}"),
        ("Redis connections in the pool", f"{pool_connections}"),
    ], numbers


def bench_python_redis_lock(
    server_client: Callable[[], redis.Redis], n: int
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The printed rows, and the same measurements as numbers (for ``--json``)."""
    client = server_client()
    died: list[str] = []
    previous_hook = threading.excepthook

    def hook(args: Any) -> None:
        died.append(type(args.exc_value).__name__)

    threading.excepthook = hook
    try:
        gc.collect()
        threads_before = threading.active_count()
        locks = []
        started = time.perf_counter()
        for i in range(n):
            lock = redis_lock.Lock(client, f"prl:{i}", expire=TTL_S, auto_renewal=True)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"prl:{i} unexpectedly held")
            locks.append(lock)
        acquire_seconds = time.perf_counter() - started
        threads_held = threading.active_count()
        time.sleep(HOLD_TTLS * TTL_S)
        threads_end = threading.active_count()
        pipe = client.pipeline(transaction=False)
        for lock in locks:
            pipe.get(lock._name)
        values = pipe.execute()
        still_owned = sum(
            1
            for lock, v in zip(locks, values, strict=True)
            if v is not None and v.decode() == lock.id
        )
        pool = client.connection_pool
        connections = len(pool._available_connections) + len(pool._in_use_connections)
        release_errors = 0
        for lock in locks:
            try:
                lock.release()
            except redis_lock.NotAcquired:
                release_errors += 1
    finally:
        threading.excepthook = previous_hook
        client.close()
    kinds = ", ".join(f"{k} x{died.count(k)}" for k in sorted(set(died))) or "none"
    numbers = {
        "locks": n,
        "expire_s": TTL_S,
        "hold_s": HOLD_TTLS * TTL_S,
        "acquire_all_s": acquire_seconds,
        "threads_delta": threads_held - threads_before,
        "threads_alive_at_end": threads_end - threads_before,
        "renewal_threads_died": len(died),
        "died_with": {k: died.count(k) for k in sorted(set(died))},
        "lost": n - still_owned,
        "release_not_acquired": release_errors,
        "pool_connections": connections,
    }
    return [
        ("locks held at once", f"{n}"),
        ("expire / renewal every", f"{TTL_S} s / {TTL_S * 2 / 3:g} s (auto_renewal)"),
        ("acquire all", f"{acquire_seconds:.2f} s"),
        ("threads (active_count delta)", f"+{threads_held - threads_before}"),
        ("threads still alive at the end", f"+{threads_end - threads_before}"),
        ("renewal threads that died", f"{len(died)} ({kinds})"),
        ("locks lost (key no longer holds id)", f"{n - still_owned} of {n}"),
        ("release() raising NotAcquired", f"{release_errors}"),
        ("Redis connections in the pool", f"{connections}"),
    ], numbers


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=N_LEASES)
    parser.add_argument("--prl-locks", type=int, default=N_PRL)
    parser.add_argument("--nested", action="store_true", help="all leases in one context")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    # Each loss is counted through on_lost; the renewer's per-lease warning would flood stderr.
    logging.getLogger("celery_lease").setLevel(logging.ERROR)
    with redis_server() as server:
        ours, our_numbers = bench_celery_lease(server.url, args.leases, args.nested)
        theirs, their_numbers = (
            bench_python_redis_lock(server.client, args.prl_locks) if args.prl_locks else ([], {})
        )
    versions = (
        f"Python {platform.python_version()}, redis-py {redis.__version__}, "
        f"python-redis-lock {redis_lock.__version__}"
    )
    print_table(f"celery-lease: lease() on RedisLockStore ({versions})", ours)
    if theirs:
        print_table("python-redis-lock, auto_renewal=True, default connection pool", theirs)
    if args.json:
        results = {
            "benchmark": "renewal_scale",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {
                "python": platform.python_version(),
                "redis-py": redis.__version__,
                "python-redis-lock": redis_lock.__version__,
            },
            "params": {"leases": args.leases, "prl_locks": args.prl_locks, "nested": args.nested},
            "celery_lease": {**our_numbers, "table": dict(ours)},
            "python_redis_lock": {**their_numbers, "table": dict(theirs)} if theirs else None,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
