"""The SQLite store's acquire + release cycle against the minimal correct SQLite lock, in one run.

Every contender works on the same database file (its own table or its own keys), in WAL mode with
``synchronous=NORMAL`` (the store's settings) unless its name says otherwise:

- ``baseline``: the minimal correct lock on one connection, ``BEGIN IMMEDIATE; INSERT ... ON
  CONFLICT (key) DO UPDATE ... WHERE expired; COMMIT`` to acquire (``changes()`` says whether it
  took the key), ``DELETE ... WHERE key = ? AND owner = ?`` to release; no token, no boot id, no
  monotonic clock;
- ``baseline synchronous=FULL``: the same with an fsync of the WAL at every commit;
- ``SQLiteLockStore``: ``store.acquire()`` + ``store.release()`` (tokens, owner check, monotonic
  clock + boot id + wall column);
- ``SQLiteLockStore @REV`` (``--before REV``): the store as committed at git revision ``REV``,
  loaded from ``git show`` into a module of its own (the before/after comparison in one run);
- ``lease() on SQLiteLockStore``: ``with lease(key, store=store, ttl=30)`` (adds owner id, the
  ``Lease`` and renewer registration); ``lease() on MemoryLockStore`` shows that part alone.

Each cycle takes a key of its own (``--keys distinct``, as every task of
``bench_task_throughput`` does; the store keeps one row per key ever locked, the baseline deletes
its rows) or one key for every cycle (``--keys same``). Owner ids are fresh per cycle
(``secrets.token_hex(8)``). Each round runs every contender for ``--cycles`` cycles in an order
rotated by one each round; the table gives the median cycles/s over rounds, us per cycle, the
ratio to the baseline's median, the median of per-round ratios (``paired``), and per cycle the
SQL statements sent (``sqlite3`` trace callback, untimed pass) and, with ``--syscalls``, the
fsync/fdatasync, fcntl (file locks) and pwrite64 calls, counted by ``strace -f -c`` on a child
that runs the contender for N and for 2N cycles (the difference, divided by N).

``--processes 2`` runs each contender in two forked processes at once on one file (what
``-P prefork -c 2`` does to the store): combined cycles/s, and each cycle's latency (p50, p99,
max, and how many cycles took >= 1 ms: SQLite's own busy handler sleeps 1 ms at its first retry).

Run: ``python -m benchmarks.bench_sqlite_store [--rounds 9] [--cycles 2000]
[--keys distinct|same] [--processes 2] [--before REV] [--syscalls] [--profile] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import itertools
import json
import multiprocessing
import os
import platform
import pstats
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

from celery_lease import lease
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.sqlite import SQLiteLockStore

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 9
CYCLES = 2000
TTL_MS = 30_000
BASELINE = "baseline"

BASELINE_SCHEMA = """CREATE TABLE IF NOT EXISTS bench_baseline (
    key TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_ms INTEGER NOT NULL)"""
# ?1 key, ?2 owner, ?3 now (ms), ?4 expiry (ms): takes the key if free or expired.
BASELINE_ACQUIRE = """INSERT INTO bench_baseline (key, owner, expires_ms) VALUES (?1, ?2, ?4)
ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, expires_ms = excluded.expires_ms
WHERE expires_ms <= ?3"""
BASELINE_RELEASE = "DELETE FROM bench_baseline WHERE key = ? AND owner = ?"

Cycle = Callable[[int], None]
"""Runs ``n`` acquire + release cycles."""


def key_source(prefix: str, distinct: bool) -> Iterator[str]:
    """Keys for successive cycles: a new one per cycle, or always the same."""
    if not distinct:
        return itertools.repeat(prefix)
    return (f"{prefix}:{i}" for i in itertools.count())


def load_revision(rev: str) -> ModuleType:
    """``celery_lease/stores/sqlite.py`` as committed at ``rev``, imported as a module."""
    source = subprocess.run(
        ["git", "show", f"{rev}:celery_lease/stores/sqlite.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix="bench-sqlite-rev-"))
    path = folder / "sqlite_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"_sqlite_at_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Contenders:
    """The contenders on one database file, built (and connected) in the calling process."""

    def __init__(self, path: Path, distinct: bool, before: str | None) -> None:
        self.path = path
        self.distinct = distinct
        self.before = before
        self.cycles: dict[str, Cycle] = {}
        self.connections: dict[str, sqlite3.Connection] = {}
        self.stores: dict[str, Any] = {}
        self.prefix = f"p{os.getpid()}"
        self._build()

    def _baseline(self, name: str, synchronous: str) -> None:
        conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(BASELINE_SCHEMA)
        self.connections[name] = conn
        keys = key_source(f"{self.prefix}:{name}", self.distinct)
        execute = conn.execute

        def cycle(n: int) -> None:
            for key in itertools.islice(keys, n):
                owner = secrets.token_hex(8)
                now = round(time.time() * 1000)
                execute("BEGIN IMMEDIATE")
                taken = execute(BASELINE_ACQUIRE, (key, owner, now, now + TTL_MS)).rowcount
                execute("COMMIT")
                if taken != 1:
                    raise RuntimeError(f"{name}: key unexpectedly held")
                execute(BASELINE_RELEASE, (key, owner))

        self.cycles[name] = cycle

    def _store(self, name: str, store: Any) -> None:
        self.stores[name] = store
        keys = key_source(f"{self.prefix}:{name}", self.distinct)

        def cycle(n: int) -> None:
            for key in itertools.islice(keys, n):
                owner = secrets.token_hex(8)
                if store.acquire(key, owner, TTL_MS) is None:
                    raise RuntimeError(f"{name}: key unexpectedly held")
                store.release(key, owner)

        self.cycles[name] = cycle

    def _lease(self, name: str, store: Any) -> None:
        self.stores[name] = store
        keys = key_source(f"{self.prefix}:{name}", self.distinct)

        def cycle(n: int) -> None:
            for key in itertools.islice(keys, n):
                with lease(key, store=store, ttl=TTL_MS / 1000):
                    pass

        self.cycles[name] = cycle

    def _build(self) -> None:
        self._baseline(BASELINE, "NORMAL")
        self._baseline("baseline synchronous=FULL", "FULL")
        store = SQLiteLockStore(self.path)
        self._store("SQLiteLockStore", store)
        if self.before is not None:
            module = load_revision(self.before)
            self._store(f"SQLiteLockStore @{self.before}", module.SQLiteLockStore(self.path))
        self._lease("lease() on SQLiteLockStore", SQLiteLockStore(self.path))
        self._lease("lease() on MemoryLockStore", MemoryLockStore())

    def connection_of(self, name: str) -> sqlite3.Connection | None:
        """The sqlite3 connection a contender uses (opened by a first cycle), if any."""
        if name in self.connections:
            return self.connections[name]
        return getattr(self.stores.get(name), "_conn", None)

    def close(self) -> None:
        for conn in self.connections.values():
            conn.close()
        for store in self.stores.values():
            close = getattr(store, "close", None)
            if close is not None:
                close()


def statements_per_cycle(contenders: Contenders, name: str, n: int = 200) -> float | None:
    """SQL statements a contender sends per cycle (trace callback), or None if not traceable."""
    contenders.cycles[name](5)  # open the connection
    conn = contenders.connection_of(name)
    if conn is None:
        return None
    seen: list[str] = []
    conn.set_trace_callback(seen.append)
    try:
        contenders.cycles[name](n)
    finally:
        conn.set_trace_callback(None)
    return len(seen) / n


def measure(contenders: Contenders, rounds: int, cycles: int) -> dict[str, list[float]]:
    names = list(contenders.cycles)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: connections, statement caches, imports
        contenders.cycles[name](200)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            contenders.cycles[name](cycles)
            rates[name].append(cycles / (time.perf_counter() - started))
    return rates


# Two processes on one file -----------------------------------------------------------------------


def _child_cycles(
    path: Path,
    distinct: bool,
    before: str | None,
    name: str,
    cycles: int,
    barrier: Any,
    results: Any,
) -> None:
    contenders = Contenders(path, distinct, before)
    run = contenders.cycles[name]
    run(50)  # connect and warm up before the start line
    latencies: list[float] = []
    barrier.wait()
    started = time.perf_counter()
    for _ in range(cycles):
        t0 = time.perf_counter()
        run(1)
        latencies.append(time.perf_counter() - t0)
    results.put((started, time.perf_counter(), latencies))
    contenders.close()


def measure_processes(
    path: Path,
    distinct: bool,
    before: str | None,
    names: list[str],
    rounds: int,
    cycles: int,
    processes: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per contender: combined cycles/s per round, and every cycle's latency (seconds)."""
    ctx = multiprocessing.get_context("fork")
    rates: dict[str, list[float]] = {name: [] for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            barrier = ctx.Barrier(processes)
            results = ctx.Queue()
            children = [
                ctx.Process(
                    target=_child_cycles,
                    args=(path, distinct, before, name, cycles, barrier, results),
                )
                for _ in range(processes)
            ]
            for child in children:
                child.start()
            outcomes = [results.get(timeout=600) for _ in children]
            for child in children:
                child.join(60)
                if child.exitcode != 0:
                    raise RuntimeError(f"{name}: a child failed ({child.exitcode})")
            begin = min(o[0] for o in outcomes)
            end = max(o[1] for o in outcomes)
            rates[name].append(processes * cycles / (end - begin))
            for outcome in outcomes:
                latencies[name].extend(outcome[2])
    return rates, latencies


# System calls (strace) ---------------------------------------------------------------------------

_SYSCALLS = ("fsync", "fdatasync", "fcntl", "pwrite64")


def _strace_counts(
    name: str, cycles: int, folder: Path, keys: str, before: str | None
) -> dict[str, int]:
    out = folder / f"strace-{cycles}.txt"
    subprocess.run(
        [
            "strace",
            "-f",
            "-c",
            "-o",
            str(out),
            "-e",
            f"trace={','.join(_SYSCALLS)}",
            sys.executable,
            "-m",
            "benchmarks.bench_sqlite_store",
            "--run-one",
            name,
            "--cycles",
            str(cycles),
            "--keys",
            keys,
            "--file",
            str(folder / "s.db"),
            *(["--before", before] if before else []),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        fields = line.split()
        if fields and fields[-1] in _SYSCALLS:
            counts[fields[-1]] = int(fields[3])
    return counts


def syscalls_per_cycle(name: str, cycles: int, keys: str, before: str | None) -> dict[str, float]:
    """fsync/fdatasync/fcntl/pwrite64 per cycle: (calls for 2N cycles - calls for N) / N."""
    folder = Path(tempfile.mkdtemp(prefix="bench-sqlite-strace-"))
    try:
        small = _strace_counts(name, cycles, folder, keys, before)
        (folder / "s.db").unlink(missing_ok=True)
        for extra in ("-wal", "-shm"):
            (folder / f"s.db{extra}").unlink(missing_ok=True)
        large = _strace_counts(name, 2 * cycles, folder, keys, before)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {call: (large.get(call, 0) - small.get(call, 0)) / cycles for call in _SYSCALLS}


def run_one(name: str, cycles: int, distinct: bool, path: Path, before: str | None) -> None:
    """The child of :func:`syscalls_per_cycle`: warm up 100 cycles, then run ``cycles``."""
    contenders = Contenders(path, distinct, before)
    contenders.cycles[name](100)
    contenders.cycles[name](cycles)
    contenders.close()


# Output ------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_table(
    rates: dict[str, list[float]],
    statements: dict[str, float | None],
    syscalls: dict[str, dict[str, float]],
) -> list[dict[str, Any]]:
    base_rates = rates[BASELINE]
    base = statistics.median(base_rates)
    header = (
        f"{'contender':<34} {'median/s':>9} {'us/cycle':>9} {'x base':>7} {'paired':>7} "
        f"{'stmts':>6}"
    )
    if syscalls:
        header += f" {'fsync':>6} {'fcntl':>6} {'pwrite':>6}"
    print(header)
    print("-" * len(header))
    rows = []
    for name, values in rates.items():
        median = statistics.median(values)
        paired = statistics.median(v / b for v, b in zip(values, base_rates, strict=True))
        stmts = statements.get(name)
        line = (
            f"{name:<34} {median:>9.0f} {1e6 / median:>9.1f} {median / base:>7.3f} "
            f"{paired:>7.3f} {'-' if stmts is None else f'{stmts:.2f}':>6}"
        )
        counts = syscalls.get(name)
        if counts is not None:
            fsyncs = counts["fsync"] + counts["fdatasync"]
            line += f" {fsyncs:>6.3f} {counts['fcntl']:>6.2f} {counts['pwrite64']:>6.2f}"
        print(line)
        rows.append(
            {
                "name": name,
                "median_per_s": median,
                "us_per_cycle": 1e6 / median,
                "x_base": median / base,
                "paired": paired,
                "statements": stmts,
                "syscalls": counts,
                "per_round_per_s": values,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument("--keys", choices=("distinct", "same"), default="distinct")
    parser.add_argument("--processes", type=int, default=1, help="processes on one file")
    parser.add_argument("--before", metavar="REV", help="also run the store as of git REV")
    parser.add_argument("--syscalls", action="store_true", help="count syscalls with strace")
    parser.add_argument("--profile", action="store_true", help="cProfile the store and lease()")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--run-one", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--file", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    distinct = args.keys == "distinct"
    if args.run_one:
        run_one(args.run_one, args.cycles, distinct, Path(args.file), args.before)
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-sqlite-"))
    path = folder / "leases.db"
    try:
        contenders = Contenders(path, distinct, args.before)
        names = list(contenders.cycles)
        statements = {name: statements_per_cycle(contenders, name) for name in names}
        latencies: dict[str, list[float]] = {}
        if args.processes > 1:
            names = [n for n in names if "MemoryLockStore" not in n]
            contenders.close()
            rates, latencies = measure_processes(
                path, distinct, args.before, names, args.rounds, args.cycles, args.processes
            )
        else:
            rates = measure(contenders, args.rounds, args.cycles)
            if args.profile:
                for name in ("SQLiteLockStore", "lease() on SQLiteLockStore"):
                    profiler = cProfile.Profile()
                    profiler.runcall(contenders.cycles[name], args.cycles)
                    print(f"\ncProfile of {name}, {args.cycles} cycles (tottime, top 25):")
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            contenders.close()
        syscalls = {}
        if args.syscalls:
            if shutil.which("strace") is None:
                raise SystemExit("--syscalls needs strace on PATH")
            syscalls = {
                name: syscalls_per_cycle(name, 2000, args.keys, args.before) for name in rates
            }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"\nSQLite acquire + release, {args.rounds} rounds x {args.cycles} cycles, "
        f"{args.processes} process(es) on one file, {args.keys} keys, order rotated; "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, WAL, "
        f"synchronous=NORMAL unless named; load average {os.getloadavg()[0]:.2f}"
    )
    rows = print_table(rates, {n: statements[n] for n in rates}, syscalls)
    print("x base: median cycles/s / the baseline's median; paired: median over rounds of the")
    print("        contender's rate / the baseline's rate in the same round")
    print("stmts: SQL statements per cycle (sqlite3 trace callback, untimed pass)")
    if syscalls:
        print("fsync, fcntl, pwrite: system calls per cycle (strace -f -c, 4000 - 2000 cycles)")
    if latencies:
        print(f"\nPer-cycle latency with {args.processes} processes (all rounds):")
        header = f"{'contender':<34} {'p50 us':>8} {'p99 us':>8} {'max ms':>8} {'>=1ms':>7}"
        print(header)
        print("-" * len(header))
        for name, values in latencies.items():
            slow = sum(1 for v in values if v >= 0.001)
            print(
                f"{name:<34} {percentile(values, 0.5) * 1e6:>8.0f} "
                f"{percentile(values, 0.99) * 1e6:>8.0f} {max(values) * 1e3:>8.2f} "
                f"{slow / len(values):>6.2%}"
            )
        print(">=1ms: share of cycles that took 1 ms or more")
    if args.json:
        results = {
            "benchmark": "sqlite_store",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version},
            "params": {
                "rounds": args.rounds,
                "cycles": args.cycles,
                "keys": args.keys,
                "processes": args.processes,
                "before": args.before,
            },
            "baseline": BASELINE,
            "contenders": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
