"""Mutual-exclusion harness and the processes the fault tests drive.

Three parts, all reusable outside pytest (``benchmarks/exclusion_checker.py`` runs the checker):

- :class:`FencedResource`: a table that accepts a write only with a fencing token larger than
  every token it accepted before (``UPDATE ... SET fence = t WHERE fence < t``), in an SQLite file
  or a PostgreSQL database, logging every attempt (accepted or not) in commit order.
- The checker: K holders (processes, or threads for the memory store) x M acquisitions of a few
  hot keys, random hold times, random pauses (a real ``SIGSTOP`` of the whole process, longer than
  the ttl, placed between "the lease is still held" and the fenced write: the documented case
  that only fencing catches). Each holding records ``(key, token, acquired_at, confirmed_at)``,
  ``confirmed_at`` being the last moment its holder saw ``lease.lost`` false. :func:`check` then
  verifies that no two holdings of a key overlapped while both believed they held it, that tokens
  per key strictly increase in acquisition order, and that the resource accepted writes in token
  order only. Timestamps are ``CLOCK_MONOTONIC``: comparable across processes of one host.
  With a ``limit`` (``Plan.limit``, ``check(..., limit=)``) the holders take slots
  (``lease(key, limit=n)``): :func:`check` then counts the holders of a key that believed they
  held it at once (its peak, :attr:`Report.peaks`, a violation above the limit), requires the
  holdings of one slot never to overlap, requires a token to exceed every token of the key whose
  acquisition had returned before the later acquisition was asked for (``asked_at``), and fences
  each slot as its own resource (the slot's store key). Holders are processes
  (:func:`run_processes`), threads (:func:`run_threads`) or tasks on one event loop sharing an
  async store (:func:`run_async`, without pauses).
- :class:`Agent`: a holder process driven line by line over its stdin (``acquire``, ``check``,
  ``write``, ``release``), answering JSON lines (and reporting ``lost`` when its lease is lost),
  so a test can SIGKILL or SIGSTOP it at an exact point.

Run as ``python -m tests.faults.harness worker|agent ...`` (from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_lease import lease, store_from_url
from celery_lease._core.lease import Lease
from celery_lease.errors import LockLostError, LockNotAcquiredError, StoreUnavailableError
from celery_lease.stores.base import LockStore

__all__ = [
    "Agent",
    "FencedResource",
    "PausableStore",
    "Plan",
    "Report",
    "check",
    "concurrency_peak",
    "is_stopped",
    "make_celery_app",
    "now",
    "run_async",
    "run_processes",
    "run_threads",
    "wait_stopped",
]

ROOT = Path(__file__).resolve().parents[2]


def now() -> float:
    """``CLOCK_MONOTONIC`` seconds: comparable between processes of the same host."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# Fenced resource ------------------------------------------------------------------------------


class FencedResource:
    """A resource that accepts a write only with a token above every token it accepted.

    Args:
        spec: ``sqlite:////absolute/path.db`` (or a plain path) or a ``postgresql://`` DSN,
            optionally followed by ``#name``: the prefix of its two tables (default ``fenced``),
            so that several resources can share one database.
    """

    def __init__(self, spec: str) -> None:
        self.spec = spec
        spec, _, name = spec.partition("#")
        self._target = spec
        self.name = name or "fenced"
        if not self.name.isidentifier():
            raise ValueError(f"spec={self.spec!r}: the table prefix must be an identifier")
        self._lock = threading.Lock()
        self._postgres = spec.startswith(("postgresql://", "postgres://"))
        self._conn: Any = None
        self._pid = 0

    def _connect(self) -> Any:
        if self._conn is not None and self._pid == os.getpid():
            return self._conn
        self._pid = os.getpid()
        if self._postgres:
            import psycopg

            conn = psycopg.connect(self._target, autocommit=True)
            self._x(
                conn,
                "CREATE TABLE IF NOT EXISTS {n}_resource"
                " (key TEXT PRIMARY KEY, fence BIGINT NOT NULL, writer TEXT)",
            )
            self._x(
                conn,
                "CREATE TABLE IF NOT EXISTS {n}_writes (seq BIGSERIAL PRIMARY KEY,"
                " key TEXT NOT NULL, token BIGINT NOT NULL, accepted BOOLEAN NOT NULL,"
                " writer TEXT)",
            )
        else:
            path = self._target.removeprefix("sqlite:///")
            conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            # WAL is a property of the file, set once by prepare(); switching needs a lock the
            # busy timeout does not wait for, so holders must not all try it.
            if self._x(conn, "PRAGMA journal_mode").fetchone()[0] != "wal":
                self._x(conn, "PRAGMA journal_mode=WAL")
            self._x(
                conn,
                "CREATE TABLE IF NOT EXISTS {n}_resource"
                " (key TEXT PRIMARY KEY, fence INTEGER NOT NULL, writer TEXT)",
            )
            self._x(
                conn,
                "CREATE TABLE IF NOT EXISTS {n}_writes (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                " key TEXT NOT NULL, token INTEGER NOT NULL, accepted INTEGER NOT NULL,"
                " writer TEXT)",
            )
        self._conn = conn
        return conn

    def _x(self, conn: Any, text: str, params: Sequence[Any] = ()) -> Any:
        return conn.execute(text.replace("{n}", self.name), params)

    def write(self, key: str, token: int, writer: str) -> bool:
        """Write as ``writer`` with fencing ``token``; True when the resource accepted it."""
        with self._lock:
            conn = self._connect()
            if self._postgres:
                with conn.transaction():
                    self._x(
                        conn,
                        "INSERT INTO {n}_resource (key, fence) VALUES (%s, 0)"
                        " ON CONFLICT (key) DO NOTHING",
                        (key,),
                    )
                    accepted = (
                        self._x(
                            conn,
                            "UPDATE {n}_resource SET fence = %s, writer = %s"
                            " WHERE key = %s AND fence < %s",
                            (token, writer, key, token),
                        ).rowcount
                        == 1
                    )
                    self._x(
                        conn,
                        "INSERT INTO {n}_writes (key, token, accepted, writer)"
                        " VALUES (%s, %s, %s, %s)",
                        (key, token, accepted, writer),
                    )
                return accepted
            self._x(conn, "BEGIN IMMEDIATE")
            try:
                self._x(
                    conn, "INSERT OR IGNORE INTO {n}_resource (key, fence) VALUES (?, 0)", (key,)
                )
                accepted = (
                    self._x(
                        conn,
                        "UPDATE {n}_resource SET fence = ?, writer = ? WHERE key = ? AND fence < ?",
                        (token, writer, key, token),
                    ).rowcount
                    == 1
                )
                self._x(
                    conn,
                    "INSERT INTO {n}_writes (key, token, accepted, writer) VALUES (?, ?, ?, ?)",
                    (key, token, int(accepted), writer),
                )
            except BaseException:
                self._x(conn, "ROLLBACK")
                raise
            self._x(conn, "COMMIT")
            return accepted

    def log(self) -> list[tuple[str, int, bool, str]]:
        """Every write attempt in commit order: ``(key, token, accepted, writer)``."""
        with self._lock:
            rows = self._x(
                self._connect(), "SELECT key, token, accepted, writer FROM {n}_writes ORDER BY seq"
            ).fetchall()
        return [(k, int(t), bool(a), w) for k, t, a, w in rows]

    def prepare(self) -> None:
        """Create the tables (and switch SQLite to WAL) from one process, before the holders.

        Set-up is not safe to race: PostgreSQL's ``CREATE TABLE IF NOT EXISTS`` lets two sessions
        pass the check (the loser fails on the row type's unique index), and SQLite's switch to
        WAL fails with "database is locked" instead of waiting.
        """
        with self._lock:
            self._connect()
        self.close()

    def close(self) -> None:
        """Close this process's connection."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


# Holders --------------------------------------------------------------------------------------


class PausableStore:
    """Wraps a store so that one owner's renewals fail, as if its process were paused.

    For holders that are threads (the memory store): a real pause stops the renewer too, so the
    lease runs out in the store while the paused holder still believes it holds it.
    """

    def __init__(self, inner: LockStore) -> None:
        self.inner = inner
        self._paused: set[str] = set()

    def pause(self, owner: str) -> None:
        """Renewals of ``owner`` fail from now on."""
        self._paused.add(owner)

    def resume(self, owner: str) -> None:
        """Renewals of ``owner`` reach the store again."""
        self._paused.discard(owner)

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.inner.acquire(key, owner, ttl_ms)

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        return self.inner.acquire_slot(key, owner, ttl_ms, limit)  # type: ignore[attr-defined,no-any-return]

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if owner in self._paused:
            raise StoreUnavailableError(f"owner {owner} is paused")
        return self.inner.renew(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.inner.release(key, owner)


@dataclass
class Plan:
    """What one holder does: ``rounds`` acquisitions of random ``keys``."""

    keys: Sequence[str]
    rounds: int
    seed: int
    ttl: float = 1.0
    wait: float = 20.0
    hold_max: float = 0.03
    pause_prob: float = 0.0
    pause_for: float = 0.0
    limit: int = 1
    """Holders of a key at once: 1 is the single-holder lease, more takes slots."""


def hold_loop(
    store: LockStore,
    fence: FencedResource,
    name: str,
    plan: Plan,
    pause: Callable[[Lease], None],
    emit: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``plan`` as holder ``name``, emitting one record per acquisition."""
    rng = random.Random(plan.seed)
    for index in range(plan.rounds):
        key = rng.choice(plan.keys)
        rec: dict[str, Any] = {"holder": name, "round": index, "key": key}
        limit = {"limit": plan.limit} if plan.limit != 1 else {}
        try:
            rec["asked_at"] = now()
            with lease(key, store=store, ttl=plan.ttl, wait=plan.wait, **limit) as held:
                rec["acquired_at"] = rec["confirmed_at"] = now()
                rec["token"] = held.token
                if limit:
                    rec["slot"] = held.slot
                    rec["fence_key"] = held.store_key
                time.sleep(rng.uniform(0, plan.hold_max))
                checked = now()
                if not held.lost:  # check, then act: a pause in between is what fencing is for
                    rec["confirmed_at"] = checked
                    if rng.random() < plan.pause_prob:
                        rec["paused"] = True
                        pause(held)
                    rec["accepted"] = fence.write(rec.get("fence_key", key), held.token, name)
                time.sleep(rng.uniform(0, plan.hold_max))
                checked = now()
                if not held.lost:
                    rec["confirmed_at"] = checked
                    rec["confirmed_after_write"] = "accepted" in rec
                rec["lost"] = held.lost
        except LockNotAcquiredError:
            rec["timed_out"] = True
        except LockLostError:
            rec["lost"] = True
        emit(rec)


def _stop_self(seconds: float) -> Callable[[Lease], None]:
    def pause(held: Lease) -> None:
        # The parent reads this line, waits until this process is stopped, then sends SIGCONT.
        sys.stdout.write(f"PAUSE {seconds}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSTOP)

    return pause


def _worker_main(args: argparse.Namespace) -> None:
    store = store_from_url(args.store)
    fence = FencedResource(args.fence)
    plan = Plan(
        keys=args.keys.split(","),
        rounds=args.rounds,
        seed=args.seed,
        ttl=args.ttl,
        wait=args.wait,
        hold_max=args.hold_max,
        pause_prob=args.pause_prob,
        pause_for=args.pause_for,
        limit=args.limit,
    )

    def emit(rec: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()

    # Set up (imports, store, plan) before the start line: the holders begin together.
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    sys.stdin.readline()
    hold_loop(store, fence, args.name, plan, _stop_self(args.pause_for), emit)
    sys.stdout.write("DONE\n")
    sys.stdout.flush()


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP), from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except OSError:
        return False


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Return once process ``pid`` is stopped; raise AssertionError after ``timeout`` seconds."""
    deadline = now() + timeout
    while not is_stopped(pid):
        if now() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout} s")
        time.sleep(0.002)  # deadline polling of /proc, not a synchronisation by sleeping


def _resume_later(pid: int, seconds: float) -> None:
    try:
        wait_stopped(pid)
    except AssertionError:
        return
    time.sleep(seconds)  # the pause itself
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def run_processes(
    store_url: str,
    fence_spec: str,
    *,
    holders: int,
    plan: Plan,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``holders`` holder processes following ``plan`` (each with its own seed).

    The holders start their plans together: each says ``READY`` once set up, and all are told
    to go (a line on their stdin) once every one has. Pauses are real: the holder stops itself
    with SIGSTOP, this process sends SIGCONT after ``plan.pause_for`` seconds. Returns every
    record; raises if a holder fails or times out.
    """
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    errors = [tempfile.TemporaryFile("w+") for _ in range(holders)]  # noqa: SIM115 - closed below
    done: list[bool] = [False] * holders
    ready = threading.Semaphore(0)  # one release per holder set up (or ended before)
    started: list[bool] = [False] * holders

    def read(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        try:
            follow(i, proc)
        finally:
            if not started[i]:  # it ended before it was set up: nobody waits for it
                ready.release()

    def follow(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PAUSE "):
                threading.Thread(
                    target=_resume_later, args=(proc.pid, float(line.split()[1])), daemon=True
                ).start()
            elif line.startswith("READY"):
                started[i] = True
                ready.release()
            elif line.startswith("DONE"):
                done[i] = True
            elif line.strip():
                with lock:
                    records.append(json.loads(line))

    FencedResource(fence_spec).prepare()  # no set-up races between the holders
    try:
        for i in range(holders):
            command = [
                sys.executable, "-m", "tests.faults.harness", "worker",
                "--store", store_url, "--fence", fence_spec, "--name", f"p{i}",
                "--keys", ",".join(plan.keys), "--rounds", str(plan.rounds),
                "--seed", str(plan.seed * 1000 + i), "--ttl", str(plan.ttl),
                "--wait", str(plan.wait), "--hold-max", str(plan.hold_max),
                "--pause-prob", str(plan.pause_prob), "--pause-for", str(plan.pause_for),
                "--limit", str(plan.limit),
            ]  # fmt: skip
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors[i],
                text=True, cwd=ROOT, env=env,
            )  # fmt: skip
            procs.append(proc)
            reader = threading.Thread(target=read, args=(i, proc), daemon=True)
            reader.start()
            readers.append(reader)
        deadline = now() + timeout
        for _ in procs:
            if not ready.acquire(timeout=max(0.1, deadline - now())):
                break  # a holder failed to start: the waits below report it
        for proc in procs:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.write("GO\n")
                proc.stdin.close()
        for i, proc in enumerate(procs):
            try:
                proc.wait(max(0.1, deadline - now()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"holder p{i} did not finish within {timeout} s") from None
        for reader in readers:
            reader.join(5)
        for i, proc in enumerate(procs):
            if proc.returncode != 0 or not done[i]:
                errors[i].seek(0)
                raise RuntimeError(
                    f"holder p{i} exited with {proc.returncode}:\n{errors[i].read()[-4000:]}"
                )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        for f in errors:
            f.close()
    return records


def run_threads(
    store: LockStore, fence: FencedResource, *, holders: int, plan: Plan
) -> list[dict[str, Any]]:
    """Run ``holders`` holder threads in this process; pauses are simulated with
    :class:`PausableStore` (the holder's renewals fail while its thread sleeps)."""
    pausable = PausableStore(store)
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    failures: list[BaseException] = []

    def pause(held: Lease) -> None:
        pausable.pause(held.owner)
        try:
            time.sleep(plan.pause_for)
        finally:
            pausable.resume(held.owner)

    def emit(rec: dict[str, Any]) -> None:
        with lock:
            records.append(rec)

    def run(i: int) -> None:
        own = Plan(**{**plan.__dict__, "seed": plan.seed * 1000 + i})
        try:
            hold_loop(pausable, fence, f"t{i}", own, pause, emit)  # type: ignore[arg-type]
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(holders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return records


async def _async_hold_loop(
    store: Any, fence: FencedResource, name: str, plan: Plan, emit: Callable[[dict], None]
) -> None:
    """:func:`hold_loop` for an async store (``async with lease(...)``), without pauses."""
    rng = random.Random(plan.seed)
    for index in range(plan.rounds):
        key = rng.choice(plan.keys)
        rec: dict[str, Any] = {"holder": name, "round": index, "key": key}
        limit = {"limit": plan.limit} if plan.limit != 1 else {}
        try:
            rec["asked_at"] = now()
            async with lease(key, store=store, ttl=plan.ttl, wait=plan.wait, **limit) as held:
                rec["acquired_at"] = rec["confirmed_at"] = now()
                rec["token"] = held.token
                if limit:
                    rec["slot"] = held.slot
                    rec["fence_key"] = held.store_key
                await asyncio.sleep(rng.uniform(0, plan.hold_max))
                checked = now()
                if not held.lost:
                    rec["confirmed_at"] = checked
                    rec["accepted"] = fence.write(rec.get("fence_key", key), held.token, name)
                await asyncio.sleep(rng.uniform(0, plan.hold_max))
                checked = now()
                if not held.lost:
                    rec["confirmed_at"] = checked
                    rec["confirmed_after_write"] = "accepted" in rec
                rec["lost"] = held.lost
        except LockNotAcquiredError:
            rec["timed_out"] = True
        except LockLostError:
            rec["lost"] = True
        emit(rec)


def run_async(
    make_store: Callable[[], Any], fence: FencedResource, *, holders: int, plan: Plan
) -> list[dict[str, Any]]:
    """Run ``holders`` holder tasks on one event loop (a new one, in this thread), sharing the
    async store ``make_store()`` builds on that loop (closed at the end when it has
    ``aclose``). No pauses: a paused task would pause the loop and every holder with it."""
    records: list[dict[str, Any]] = []

    async def main() -> None:
        store = make_store()
        try:
            await asyncio.gather(*(
                _async_hold_loop(
                    store, fence, f"a{i}", Plan(**{**plan.__dict__, "seed": plan.seed * 1000 + i}),
                    records.append,
                )
                for i in range(holders)
            ))  # fmt: skip
        finally:
            close = getattr(store, "aclose", None)
            if close is not None:
                await close()

    asyncio.run(main())
    return records


# Checker --------------------------------------------------------------------------------------


@dataclass
class Report:
    """What :func:`check` found; :attr:`violations` is empty when exclusion held."""

    store: str
    acquisitions: int = 0
    overlaps: int = 0
    stale_accepted: int = 0
    stale_rejected: int = 0
    late_accepted: int = 0
    pauses: int = 0
    lost: int = 0
    timed_out: int = 0
    writes: int = 0
    violations: list[str] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    """Per key: the most holdings that believed they held it at one moment."""
    limits: dict[str, int] = field(default_factory=dict)
    """Per key: the limit its peak was checked against."""

    def summary(self) -> str:
        """One line: ``<store>: N acquisitions, 0 overlaps, 0 stale writes accepted (...)``,
        then each key's peak against its limit when a limit above 1 was checked."""
        line = (
            f"{self.store}: {self.acquisitions} acquisitions, {self.overlaps} overlaps, "
            f"{self.stale_accepted} stale writes accepted ({self.writes} fenced writes, "
            f"{self.stale_rejected} stale writes rejected by fencing, {self.late_accepted} late "
            f"writes accepted in token order, {self.pauses} pauses, {self.lost} leases lost, "
            f"{self.timed_out} waits timed out)"
        )
        if any(limit != 1 for limit in self.limits.values()):
            peaks = ", ".join(
                f"{key} {self.peaks[key]} of {self.limits[key]}" for key in sorted(self.peaks)
            )
            line += f"; peak holders per key: {peaks}"
        return line


Limit = int | Mapping[str, int]
"""What :func:`check` allows: one limit for every key, or a limit per key (absent keys: 1)."""


def concurrency_peak(
    spans: Iterable[tuple[float, float, str]],
) -> tuple[int, float, list[str]]:
    """The most ``(start, end, who)`` spans open at one moment: ``(peak, when, who)``.

    A span is open from ``start`` to ``end``; one that starts exactly when another ends does not
    overlap it (the end is counted first). A span of no length (``end <= start``: a holder that
    saw its lease lost at once) is open at its instant only, together with the spans that start
    then. ``(0, 0.0, [])`` for no spans.
    """
    events: list[tuple[float, int, int]] = []
    named = list(spans)
    for index, (start, end, _) in enumerate(named):
        # At equal times: ends (0), then starts (1), then the ends of spans of no length (2).
        events.append((start, 1, index))
        events.append((end, 2, index) if end <= start else (end, 0, index))
    open_now: set[int] = set()
    peak, when, who = 0, 0.0, []
    for at, kind, index in sorted(events):
        if kind == 1:
            open_now.add(index)
            if len(open_now) > peak:
                peak, when, who = len(open_now), at, sorted(named[i][2] for i in open_now)
        else:
            open_now.discard(index)
    return peak, when, who


def _holding(rec: dict[str, Any]) -> str:
    slot = f" slot {rec['slot']}" if rec.get("slot") is not None else ""
    return f"{rec['holder']} (token {rec['token']}{slot})"


def check(
    store: str,
    records: Iterable[dict[str, Any]],
    writes: Iterable[tuple[str, int, bool, str]],
    *,
    limit: Limit = 1,
) -> Report:
    """Verify mutual exclusion (at most ``limit`` holders of a key at once) and fencing over
    the holders' ``records`` and the resource log.

    A record is one holding: ``holder``, ``key``, ``token``, ``acquired_at`` (its acquisition
    had returned), ``confirmed_at`` (the last moment it saw its lease held), and optionally
    ``asked_at`` (before its acquisition was asked for; default ``acquired_at``), ``slot`` and
    ``fence_key`` (the key its fenced writes used; default ``key``).
    """
    report = Report(store)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        if rec.get("timed_out"):
            report.timed_out += 1
            continue
        report.acquisitions += 1
        report.pauses += bool(rec.get("paused"))
        report.lost += bool(rec.get("lost"))
        by_key[rec["key"]].append(rec)

    for key, recs in by_key.items():
        allowed = limit if isinstance(limit, int) else limit.get(key, 1)
        report.limits[key] = allowed
        recs.sort(key=lambda r: r["acquired_at"])
        tokens = [r["token"] for r in recs]
        if len(set(tokens)) != len(tokens):
            report.violations.append(f"{key}: a token was issued twice: {sorted(tokens)}")
        # A token exceeds every token of the key acquired before its acquisition was asked for.
        highest, done = None, 0
        for later in sorted(recs, key=lambda r: r.get("asked_at", r["acquired_at"])):
            asked = later.get("asked_at", later["acquired_at"])
            while done < len(recs) and recs[done]["acquired_at"] < asked:
                if highest is None or recs[done]["token"] > highest["token"]:
                    highest = recs[done]
                done += 1
            if highest is not None and later["token"] <= highest["token"]:
                report.violations.append(
                    f"{key}: token {later['token']} acquired after {highest['token']}"
                )
        # Belief intervals [acquired_at, confirmed_at]: at most `allowed` open at once.
        spans = [(r["acquired_at"], r["confirmed_at"], _holding(r)) for r in recs]
        peak, when, who = concurrency_peak(spans)
        report.peaks[key] = peak
        if peak > allowed:
            report.violations.append(
                f"{key}: {peak} holders believed they held it at {when:.4f} (limit {allowed}):"
                f" {', '.join(who)}"
            )
        for index, b in enumerate(recs):
            believing = sum(1 for a in recs[:index] if a["confirmed_at"] > b["acquired_at"])
            if believing >= allowed:  # b made one holder too many
                report.overlaps += 1
        # Holdings of one slot (or of the key, without slots) never overlap.
        by_slot: dict[object, list[dict[str, Any]]] = defaultdict(list)
        for rec in recs:
            by_slot[rec.get("slot")].append(rec)
        for slot, held in by_slot.items():
            if slot is None and allowed != 1:
                continue  # no slot recorded: only the count above applies
            for i, a in enumerate(held):
                for b in held[i + 1 :]:
                    if b["acquired_at"] >= a["confirmed_at"]:
                        continue
                    report.violations.append(
                        f"{key}: {_holding(b)} acquired at {b['acquired_at']:.4f} while"
                        f" {_holding(a)} still believed it held"
                        f" {'the key' if slot is None else f'slot {slot}'}"
                        f" until {a['confirmed_at']:.4f}"
                    )

    top: dict[str, int] = {}
    tokens_of = {
        (r.get("fence_key", r["key"]), r["token"]): r for recs in by_key.values() for r in recs
    }
    for key, token, accepted, writer in writes:
        report.writes += 1
        highest_token = top.get(key, 0)
        rec = tokens_of.get((key, token))
        if rec is None:
            report.violations.append(f"{key}: write with token {token} by {writer}: no holder")
        if token <= highest_token:
            if accepted:
                report.stale_accepted += 1
                report.violations.append(
                    f"{key}: stale write accepted: token {token} after token {highest_token}"
                )
            else:
                report.stale_rejected += 1
                if rec is not None and rec.get("confirmed_after_write"):
                    report.violations.append(
                        f"{key}: write of token {token} rejected while its holder believed it"
                        " held the key throughout"
                    )
        elif not accepted:
            report.violations.append(f"{key}: the resource rejected the newest token {token}")
        if accepted:
            top[key] = max(highest_token, token)
            if rec is not None and rec.get("paused"):
                report.late_accepted += 1
    return report


# Agent: a holder process driven over stdin ------------------------------------------------------


def _agent_main(args: argparse.Namespace) -> None:
    store = store_from_url(args.store)
    fence = FencedResource(args.fence) if args.fence else None
    held: dict[str, tuple[Any, Lease]] = {}
    out = threading.Lock()

    def emit(**event: Any) -> None:
        event.setdefault("at", now())
        with out:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    def on_lost(lost: Lease) -> None:
        emit(ev="lost", key=lost.key, token=lost.token, reason=lost.lost_reason)

    emit(ev="ready", pid=os.getpid())
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        command, rest = words[0], words[1:]
        started = now()
        try:
            if command == "quit":
                break
            if command == "acquire":
                key, ttl, wait = rest[0], float(rest[1]), float(rest[2])
                context = lease(key, store=store, ttl=ttl, wait=wait, on_lost=on_lost)
                got = context.__enter__()
                held[key] = (context, got)
                emit(ev="acquired", key=key, token=got.token, started=started)
            elif command == "check":
                got = held[rest[0]][1]
                emit(ev="check", key=got.key, lost=got.lost, reason=got.lost_reason)
            elif command == "write":
                got = held[rest[0]][1]
                assert fence is not None, "the agent was started without --fence"
                accepted = fence.write(got.key, got.token, f"agent-{os.getpid()}")
                emit(ev="write", key=got.key, token=got.token, accepted=accepted)
            elif command == "release":
                context, got = held.pop(rest[0])
                context.__exit__(None, None, None)
                emit(ev="released", key=got.key, lost=got.lost)
            else:
                emit(ev="error", command=command, type="UnknownCommand", message=line.strip())
        except Exception as exc:  # reported to the test
            emit(ev="error", command=command, type=type(exc).__name__, message=str(exc))


class Agent:
    """A holder process, driven by the test (see the module docstring).

    Args:
        store_url: the store URL the agent opens (``store_from_url``).
        fence: the :class:`FencedResource` spec for ``write``, if any.
        log: a file for the agent's stderr (its warnings), shown when it misbehaves.
    """

    def __init__(self, store_url: str, *, fence: str | None = None, log: Path | None = None):
        command = [sys.executable, "-m", "tests.faults.harness", "agent", "--store", store_url]
        if fence:
            command += ["--fence", fence]
        self._log_path = log
        self._log = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=ROOT,
        )
        self.pid = self.proc.pid
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_for(lambda e: e["ev"] == "ready", timeout=30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"ev": "exit", "at": now()})
            self._cond.notify_all()

    def wait_for(
        self, match: Callable[[dict[str, Any]], bool], *, timeout: float, since: int = 0
    ) -> dict[str, Any]:
        """The first event from index ``since`` on that ``match`` accepts, waiting up to
        ``timeout`` seconds; raises AssertionError (with the agent's log) when none comes."""
        deadline = now() + timeout
        with self._cond:
            while True:
                for event in self.events[since:]:
                    if match(event):
                        return event
                left = deadline - now()
                if left <= 0:
                    raise AssertionError(
                        f"agent {self.pid}: no matching event within {timeout} s; events: "
                        f"{self.events}\nlog:\n{self.log()}"
                    )
                self._cond.wait(left)

    def send(self, *words: object) -> int:
        """Send one command without waiting; returns the index its answer will be found from."""
        with self._cond:
            since = len(self.events)
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        return since

    def answer(self, since: int, *, timeout: float = 15.0) -> dict[str, Any]:
        """The answer to the command sent at ``since`` (the next event that is not ``lost``)."""
        return self.wait_for(lambda e: e["ev"] != "lost", timeout=timeout, since=since)

    def request(self, *words: object, timeout: float = 15.0) -> dict[str, Any]:
        """Send one command; return its answer."""
        return self.answer(self.send(*words), timeout=timeout)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the agent process."""
        os.kill(self.pid, signum)

    def log(self) -> str:
        """The agent's stderr so far."""
        return self._log_path.read_text() if self._log_path else ""

    def close(self) -> None:
        """Kill the agent (resumed first, in case it is stopped) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A Celery app for the worker fault test ---------------------------------------------------------

CELERY_TTL = 5.0
"""Seconds: ``lock_ttl`` of ``faults.exclusive``."""

CELERY_VISIBILITY = 3
"""Seconds before the Redis transport redelivers an unacknowledged message: longer than a
redelivered task waits for the lease plus its body (else it would be redelivered again), shorter
than the ttl (so that the redelivery usually arrives while the dead worker's lease still holds)."""


def _append_line(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def make_celery_app(broker: str, backend: str, store: str, directory: str) -> Any:
    """The app of ``celery -A tests.faults.harness:celery_app worker`` (from ``FAULTS_*``
    variables) and of the test process, which sends ``faults.exclusive``.

    ``faults.exclusive(run, hold)`` appends ``start`` and ``end`` records (JSON, with
    ``CLOCK_MONOTONIC`` times, pid, parent pid and token) to ``<directory>/<run>.bodies``. Its first
    execution of a run blocks (until the test kills its worker); later ones hold ``hold`` seconds.
    """
    from celery import Celery

    from celery_lease import LockedTask

    app = Celery("faults", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        lease_store=store,
        # A throwaway redis-server started by this session: no restart grace (see docs/stores.md).
        lease_restart_grace=0,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": CELERY_VISIBILITY,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
    )
    out = Path(directory)

    @app.task(
        name="faults.exclusive", base=LockedTask, bind=True, shared=False,
        lock_key="exclusive:{run}", lock_ttl=CELERY_TTL, lock_wait=4 * CELERY_TTL,
    )  # fmt: skip
    def exclusive(self: Any, run: str, hold: float) -> str:
        record = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "token": self.request.lock_token,
            "waited": self.request.lock_waited,
        }
        bodies = out / f"{run}.bodies"
        _append_line(bodies, json.dumps({**record, "event": "start", "at": now()}))
        try:
            fd = os.open(out / f"{run}.first", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            time.sleep(hold)
        else:
            os.close(fd)
            deadline = now() + 60
            while now() < deadline:  # the test SIGKILLs this worker meanwhile
                time.sleep(0.05)
        _append_line(bodies, json.dumps({**record, "event": "end", "at": now()}))
        return "done"

    return app


def __getattr__(name: str) -> Any:
    if name == "celery_app":  # built lazily: only ``celery -A`` in a worker needs it
        env = os.environ
        return make_celery_app(
            env["FAULTS_BROKER"], env["FAULTS_BACKEND"], env["FAULTS_STORE"], env["FAULTS_DIR"]
        )
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.faults.harness worker|agent``: the processes the tests start."""
    parser = argparse.ArgumentParser(prog="python -m tests.faults.harness")
    sub = parser.add_subparsers(dest="role", required=True)
    worker = sub.add_parser("worker", help="run a holder plan, printing one JSON record a line")
    worker.add_argument("--store", required=True)
    worker.add_argument("--fence", required=True)
    worker.add_argument("--name", required=True)
    worker.add_argument("--keys", required=True)
    worker.add_argument("--rounds", type=int, required=True)
    worker.add_argument("--seed", type=int, required=True)
    worker.add_argument("--ttl", type=float, default=1.0)
    worker.add_argument("--wait", type=float, default=20.0)
    worker.add_argument("--hold-max", type=float, default=0.03)
    worker.add_argument("--pause-prob", type=float, default=0.0)
    worker.add_argument("--pause-for", type=float, default=0.0)
    worker.add_argument("--limit", type=int, default=1)
    agent = sub.add_parser("agent", help="a holder driven over stdin")
    agent.add_argument("--store", required=True)
    agent.add_argument("--fence")
    args = parser.parse_args(argv)
    if args.role == "worker":
        _worker_main(args)
    else:
        _agent_main(args)


if __name__ == "__main__":
    main()
