"""What a slot costs: ``limit=4`` against a single-holder lease, on the store and end to end.

Two parts (``--parts store,tasks``), each on the stores of ``--stores`` (``redis``: a throwaway
``redis-server``; ``postgres``: a scratch database ``celery_lease_bench_<pid>_<hex>`` on
``--dsn``, dropped at the end; ``memory``: in-process, for a check of the script itself).

**store**: uncontended cycles per second, every contender on its own key, in rounds whose order
rotates by one each round:

- ``acquire + release``: ``store.acquire`` + ``store.release`` of a key (the baseline);
- ``acquire_slot(4) + release``: ``store.acquire_slot(key, owner, ttl, 4)`` + ``store.release``
  of the slot's store key, the other slots free;
- ``acquire_slot(4), 3 held``: the same with three slots of the key held by other owners for
  the whole run, so the acquire counts three live slots and takes the fourth;
- ``lease()`` and ``lease(limit=4)``: ``with lease(key, store=store, ttl=30[, limit=4])``.

Printed: the median over rounds of cycles/s, its ratio to the baseline's median, the median of
the per-round ratios (``paired``: less sensitive to load that drifts over the run), the
microseconds a cycle costs more than the baseline, and, on Redis, the requests sent per cycle
(counted in a separate, untimed pass) and the server's own microseconds per call (``INFO
commandstats`` over 2,000 calls on fresh keys, untimed: far less sensitive to a busy host).

**tasks**: the end-to-end task rate on one real worker (``celery worker -P threads -c 4`` of
this module's app, the throwaway Redis as broker and result backend, the lock store as in
``--stores``), all calls of a round on ONE key:

- ``limit=1``: ``lock_limit=1`` (today's lease; the calls take turns);
- ``limit=4``: ``lock_limit=4`` (four bodies at once: the four threads can all run);
- ``plain``: no lock (what four threads do without one).

Every body runs ``--body-ms`` of ``time.sleep`` (the I/O of the call the limit protects, such
as a partner's API) and then counts itself on the broker's Redis; a round is timed from its
first ``apply_async`` until the last body counted itself (the client waits with ``BLPOP``).
Rounds of ``--tasks`` calls per contender, order rotated, a warm-up round dropped. Printed:
tasks/s (median), and the ratios ``limit=4 / limit=1`` and ``limit=4 / plain`` (of the medians,
and paired per round).

Run: ``python -m benchmarks.bench_slots [--quick] [--parts store,tasks] [--stores redis,postgres]
[--rounds N --cycles N --pg-cycles N --tasks N --body-ms MS] [--json PATH]``. The default run
takes about a minute and a half here; ``--quick`` about half of that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery

from celery_lease import LockedTask, lease, store_from_url
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.slots import slot_key

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 4
TTL_MS = 30_000
READY_TIMEOUT = 60.0  # seconds for the worker to answer its first task
ROUND_TIMEOUT = 300.0  # seconds for one round of tasks
BASELINE = "acquire + release"

Cycle = Callable[[int], None]
"""Runs ``n`` acquire + release cycles."""


# Part 1: the store cycle -----------------------------------------------------------------------


def store_contenders(store: Any) -> tuple[dict[str, Cycle], Callable[[], None]]:
    """The contenders on ``store`` and a function that releases the slots held for the run."""
    prefix = f"bench:{uuid.uuid4().hex[:8]}"

    def single(n: int) -> None:
        key = f"{prefix}:single"
        for _ in range(n):
            owner = secrets.token_hex(8)
            if store.acquire(key, owner, TTL_MS) is None:
                raise RuntimeError("acquire: key unexpectedly held")
            store.release(key, owner)

    def slot_cycles(key: str) -> Cycle:
        def run(n: int) -> None:
            for _ in range(n):
                owner = secrets.token_hex(8)
                got = store.acquire_slot(key, owner, TTL_MS, LIMIT)
                if got is None:
                    raise RuntimeError(f"acquire_slot: {key} unexpectedly full")
                store.release(slot_key(key, got[0]), owner)

        return run

    crowded = f"{prefix}:crowded"
    others = [f"other-{i}" for i in range(LIMIT - 1)]
    held = [store.acquire_slot(crowded, owner, 3_600_000, LIMIT) for owner in others]
    if any(got is None for got in held):
        raise RuntimeError(f"could not hold {LIMIT - 1} slots of {crowded}")

    def release_held() -> None:
        for owner, got in zip(others, held, strict=True):
            assert got is not None
            store.release(slot_key(crowded, got[0]), owner)

    def via_lease(n: int) -> None:
        key = f"{prefix}:lease"
        for _ in range(n):
            with lease(key, store=store, ttl=TTL_MS / 1000):
                pass

    def via_lease_limit(n: int) -> None:
        key = f"{prefix}:lease-limit"
        for _ in range(n):
            with lease(key, store=store, ttl=TTL_MS / 1000, limit=LIMIT):
                pass

    contenders = {
        BASELINE: single,
        f"acquire_slot({LIMIT}) + release": slot_cycles(f"{prefix}:slots"),
        f"acquire_slot({LIMIT}), {LIMIT - 1} held": slot_cycles(crowded),
        "lease()": via_lease,
        f"lease(limit={LIMIT})": via_lease_limit,
    }
    return contenders, release_held


def measure(contenders: dict[str, Cycle], rounds: int, cycles: int) -> dict[str, list[float]]:
    """Cycles/s of every contender per round; the order rotates by one each round."""
    names = list(contenders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: connections, scripts, statements, imports
        contenders[name](max(20, cycles // 10))
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            contenders[name](cycles)
            rates[name].append(cycles / (time.perf_counter() - started))
    return rates


def round_trips(contenders: dict[str, Cycle], n: int = 100) -> dict[str, float]:
    """Requests redis-py (or the store's own connection) sent per cycle, untimed."""
    from benchmarks._redis_server import count_round_trips

    trips = {}
    for name, run in contenders.items():
        run(5)
        with count_round_trips() as counts:
            run(n)
        trips[name] = sum(counts.values()) / n
    return trips


def server_us(store: Any, client: redis.Redis, n: int = 2000) -> dict[str, float]:
    """Redis's own microseconds (``INFO commandstats``) per call, untimed: an acquire and a
    slot acquire of a key never used before (a new key each call), a slot acquire of a key
    whose other three slots are held, and the releases.

    Every command the server ran during ``n`` calls counts (``INFO`` and ``CONFIG`` left out).
    """
    prefix = f"bench-server:{uuid.uuid4().hex[:8]}"
    held = f"{prefix}:crowded"
    for i in range(LIMIT - 1):
        store.acquire_slot(held, f"other-{i}", 3_600_000, LIMIT)
    steps: dict[str, Callable[[int], object]] = {
        "acquire, new key": lambda i: store.acquire(f"{prefix}:a{i}", "o", TTL_MS),
        f"acquire_slot({LIMIT}), new key": lambda i: store.acquire_slot(
            f"{prefix}:s{i}", "o", TTL_MS, LIMIT
        ),
        f"acquire_slot({LIMIT}), {LIMIT - 1} held": lambda i: store.release(
            slot_key(held, store.acquire_slot(held, f"o{i}", TTL_MS, LIMIT)[0]), f"o{i}"
        ),
        "release": lambda i: store.release(f"{prefix}:a{i}", "o"),
        "release of a slot": lambda i: store.release(slot_key(f"{prefix}:s{i}", 0), "o"),
    }
    results = {}
    for name, call in steps.items():
        call(-1)  # scripts loaded, connection open
        client.config_resetstat()
        for i in range(n):
            call(i)
        stats = client.info("commandstats")
        usec = sum(
            float(v["usec"])
            for k, v in stats.items()
            if k not in ("cmdstat_info", "cmdstat_config")
        )
        results[name] = usec / n
    # The crowded row also released (one more script call): take the release's cost off.
    results[f"acquire_slot({LIMIT}), {LIMIT - 1} held"] -= results["release of a slot"]
    return results


def store_table(label: str, rates: dict[str, list[float]], trips: dict[str, float]) -> list[dict]:
    """Print one store's table; its JSON rows."""
    base_rates = rates[BASELINE]
    base = statistics.median(base_rates)
    header = (
        f"{'contender':<28} {'median/s':>9} {'min/s':>8} {'max/s':>8} {'x base':>7} "
        f"{'paired':>7} {'+us':>7} {'RTs':>5}"
    )
    print(f"\n{label}")
    print(header)
    print("-" * len(header))
    rows = []
    for name, values in rates.items():
        median = statistics.median(values)
        paired = statistics.median(v / b for v, b in zip(values, base_rates, strict=True))
        added = (1 / median - 1 / base) * 1e6
        rt = f"{trips[name]:>5.2f}" if name in trips else f"{'-':>5}"
        print(
            f"{name:<28} {median:>9.0f} {min(values):>8.0f} {max(values):>8.0f} "
            f"{median / base:>7.3f} {paired:>7.3f} {added:>7.1f} {rt}"
        )
        rows.append({
            "name": name, "median_per_s": median, "x_base": median / base, "paired": paired,
            "added_us": added, "round_trips": trips.get(name), "per_round_per_s": values,
        })  # fmt: skip
    lease_rates, limit_rates = rates["lease()"], rates[f"lease(limit={LIMIT})"]
    ratio = statistics.median(limit_rates) / statistics.median(lease_rates)
    paired = statistics.median(a / b for a, b in zip(limit_rates, lease_rates, strict=True))
    print(f"lease(limit={LIMIT}) / lease(): {ratio:.3f} (paired {paired:.3f})")
    return rows


@contextlib.contextmanager
def scratch_database(dsn: str) -> Iterator[str]:
    """A database created on ``dsn``'s server for the block, dropped (``FORCE``) after it."""
    import psycopg
    from psycopg import sql

    name = f"celery_lease_bench_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def run_store_part(kind: str, url: str, rounds: int, cycles: int) -> dict[str, Any]:
    store: Any = MemoryLockStore() if kind == "memory" else store_from_url(url)
    contenders, release_held = store_contenders(store)
    try:
        trips = round_trips(contenders) if kind == "redis" else {}
        rates = measure(contenders, rounds, cycles)
        server = server_us(store, redis.Redis.from_url(url)) if kind == "redis" else {}
    finally:
        release_held()
        close = getattr(store, "close", None)
        if close is not None:
            close()
    label = (
        f"Store cycle on {kind}: uncontended acquire + release, {rounds} rounds x {cycles} "
        f"cycles per contender, order rotated (Python {platform.python_version()})"
    )
    rows = store_table(label, rates, trips)
    if server:
        print("server-side us per call (INFO commandstats, untimed pass):")
        for name, value in server.items():
            print(f"  {name:<30} {value:8.2f}")
    return {"contenders": rows, "server_us_per_call": server}


# Part 2: tasks on a real worker ----------------------------------------------------------------


def make_app(broker: str, store: str, body_ms: float) -> Celery:
    """The worker's app (from ``BENCH_*`` variables) and the client's alike."""
    app = Celery("bench_slots", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(
        lease_store=store,
        lease_restart_grace=0,  # a throwaway server of this run
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
    )
    counters: dict[int, redis.Redis] = {}

    def finish(run: str, total: int) -> None:
        client = counters.get(os.getpid())
        if client is None:
            client = counters[os.getpid()] = redis.Redis.from_url(broker)
        if client.incr(f"count:{run}") == total:
            client.rpush(f"finished:{run}", "1")

    def work() -> None:
        time.sleep(body_ms / 1000)  # the body's own I/O: the workload, not a synchronisation

    @app.task(name="bench.plain", shared=False)
    def plain(run: str, total: int) -> None:
        work()
        finish(run, total)

    @app.task(
        name="bench.limit1", base=LockedTask, shared=False, lock_key="bench:{run}",
        lock_limit=1, lock_wait=ROUND_TIMEOUT,
    )  # fmt: skip
    def limit1(run: str, total: int) -> None:
        work()
        finish(run, total)

    @app.task(
        name="bench.limit4", base=LockedTask, shared=False, lock_key="bench:{run}",
        lock_limit=LIMIT, lock_wait=ROUND_TIMEOUT,
    )  # fmt: skip
    def limit4(run: str, total: int) -> None:
        work()
        finish(run, total)

    @app.task(name="bench.ping", shared=False, ignore_result=False)
    def ping() -> str:
        return "pong"

    return app


TASKS = {"limit=1": "bench.limit1", f"limit={LIMIT}": "bench.limit4", "plain": "bench.plain"}

if os.environ.get("BENCH_BROKER"):
    app = make_app(
        os.environ["BENCH_BROKER"], os.environ["BENCH_STORE"], float(os.environ["BENCH_BODY_MS"])
    )


@contextlib.contextmanager
def worker(broker: str, store: str, body_ms: float, log: Path) -> Iterator[subprocess.Popen]:
    """``celery -A benchmarks.bench_slots:app worker -P threads -c 4`` for the block."""
    env = {
        **os.environ, "BENCH_BROKER": broker, "BENCH_STORE": store,
        "BENCH_BODY_MS": str(body_ms), "PYTHONPATH": str(ROOT),
    }  # fmt: skip
    argv = [
        sys.executable, "-m", "celery", "-A", "benchmarks.bench_slots:app", "worker",
        "-P", "threads", "-c", str(LIMIT), "--loglevel", "WARNING",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    except BaseException:
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def task_round(client: Celery, counters: redis.Redis, name: str, tasks: int) -> float:
    """Tasks/s of one round of ``tasks`` calls of contender ``name`` on one fresh key."""
    run = uuid.uuid4().hex[:12]
    task = client.tasks[TASKS[name]]
    started = time.perf_counter()
    for _ in range(tasks):
        task.apply_async((run, tasks))
    if counters.blpop([f"finished:{run}"], timeout=ROUND_TIMEOUT) is None:
        raise RuntimeError(f"{name}: round {run} did not finish in {ROUND_TIMEOUT} s")
    return tasks / (time.perf_counter() - started)


def run_task_part(
    kind: str, broker: str, store: str, tasks: int, rounds: int, body_ms: float, log: Path
) -> dict[str, Any]:
    names = list(TASKS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    client = make_app(broker, store, body_ms)
    counters = redis.Redis.from_url(broker)
    with worker(broker, store, body_ms, log):
        client.tasks["bench.ping"].apply_async().get(timeout=READY_TIMEOUT, interval=0.05)
        for index in range(rounds + 1):  # round 0 warms up and is dropped
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                rate = task_round(client, counters, name, tasks)
                if index:
                    rates[name].append(rate)
    client.close()
    counters.close()
    one, four = rates["limit=1"], rates[f"limit={LIMIT}"]
    ratio = statistics.median(four) / statistics.median(one)
    paired = statistics.median(a / b for a, b in zip(four, one, strict=True))
    print(
        f"\nTasks on one key, lock store {kind}: celery worker -P threads -c {LIMIT}, "
        f"{tasks} calls x {rounds} rounds per contender, body {body_ms:g} ms, order rotated"
    )
    header = f"{'contender':<10} {'median tasks/s':>15} {'min':>8} {'max':>8}"
    print(header)
    print("-" * len(header))
    for name, values in rates.items():
        print(
            f"{name:<10} {statistics.median(values):>15.1f} {min(values):>8.1f} {max(values):>8.1f}"
        )
    plain = rates["plain"]
    of_plain = statistics.median(four) / statistics.median(plain)
    of_plain_paired = statistics.median(a / b for a, b in zip(four, plain, strict=True))
    print(f"limit={LIMIT} / limit=1: {ratio:.2f}x (paired {paired:.2f}x)")
    print(f"limit={LIMIT} / plain:   {of_plain:.2f}x (paired {of_plain_paired:.2f}x)")
    return {
        "store": kind, "rates": rates, "ratio": ratio, "paired": paired,
        "x_plain": of_plain, "x_plain_paired": of_plain_paired,
    }  # fmt: skip


# Main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="store,tasks")
    parser.add_argument("--stores", default="redis,postgres", help="redis, postgres, memory")
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls (~45 s)")
    parser.add_argument("--rounds", type=int, help="store rounds (default 7, quick 5)")
    parser.add_argument("--cycles", type=int, help="cycles per round, redis (1000, quick 500)")
    parser.add_argument("--pg-cycles", type=int, help="cycles per round, postgres (150, quick 60)")
    parser.add_argument("--tasks", type=int, help="calls per task round (120, quick 60)")
    parser.add_argument("--task-rounds", type=int, help="task rounds (5, quick 3)")
    parser.add_argument("--body-ms", type=float, default=5.0, help="each body's sleep (5 ms)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    quick = args.quick
    rounds = args.rounds or (5 if quick else 7)
    cycles = args.cycles or (500 if quick else 1000)
    pg_cycles = args.pg_cycles or (60 if quick else 150)
    tasks = args.tasks or (60 if quick else 120)
    task_rounds = args.task_rounds or (3 if quick else 5)
    parts = args.parts.split(",")
    kinds = args.stores.split(",")
    results: dict[str, Any] = {
        "benchmark": "slots",
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "redis-py": redis.__version__},
        "params": {
            "limit": LIMIT, "rounds": rounds, "cycles": cycles, "pg_cycles": pg_cycles,
            "tasks": tasks, "task_rounds": task_rounds, "body_ms": args.body_ms,
        },
        "store": {},
        "tasks": {},
    }  # fmt: skip
    from benchmarks._redis_server import redis_server

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(redis_server())
        base = f"redis://127.0.0.1:{server.port}"
        urls = {"redis": f"{base}/1", "memory": "memory://"}
        if "postgres" in kinds:
            urls["postgres"] = stack.enter_context(scratch_database(args.dsn))
        if "store" in parts:
            for kind in kinds:
                n = pg_cycles if kind == "postgres" else cycles
                results["store"][kind] = run_store_part(kind, urls[kind], rounds, n)
        if "tasks" in parts:
            for kind in kinds:
                if kind == "memory":
                    continue  # a worker's store must be shared with nobody: nothing to compare
                log = server.directory / f"worker-{kind}.log"
                results["tasks"][kind] = run_task_part(
                    kind, f"{base}/0", urls[kind], tasks, task_rounds, args.body_ms, log
                )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
