"""Task throughput on one real worker: plain task vs LockedTask vs celery-once vs celery-singleton.

Scenarios (``--brokers`` x ``--pools``):

- ``redis``: a throwaway ``redis-server`` is the broker and result backend; a second throwaway
  ``redis-server`` holds every contender's locks, so its ``INFO commandstats`` counts lock
  commands alone and the first one's counts the broker's;
- ``embedded``: the default a user gets without a server, as ``example_project`` runs it: kombu's
  filesystem broker (the multi-process-safe transport of ``example_project.transport``), the
  ``file://`` result backend and LockedTask on the SQLite store; celery-once and celery-singleton
  need Redis, so they lock on the throwaway lock ``redis-server`` (marked "Redis locks").

Timing on the embedded broker (``--embedded-timing``): ``staged`` (default) writes each round's
messages into a staging folder first, untimed, and starts the clock when they are renamed into
the broker's folder, so the round times the worker draining a backlog of ``--tasks`` messages.
``live`` times from the first ``apply_async`` as on Redis; there the client is the bottleneck:
kombu's filesystem ``_put`` costs 2-3 ms a message here, more than a plain task takes to run,
and the worker idles in its 10 ms poll sleeps. In ``staged`` mode celery-once and
celery-singleton take their lock in the untimed staging pass (they lock at enqueue time), so
on the embedded broker only their unlock is timed: compare LockedTask with plain there.

Results (``--results``): ``off`` runs every task with ``task_ignore_result=True``; ``on`` stores
each task's result in the scenario's result backend (on Redis: the broker's ``redis-server``, as
``backend=redis://``; embedded: ``file://``). With results on, LockedTask's release goes out
without waiting and its reply is read just before the key-value backend writes the result
(``celery_lease._celery.result_write``), so the key is free before the result is visible: the
comparison is the one a user with a result backend sees.

Pools: ``solo`` (``-P solo``) and ``prefork`` (``-P prefork -c 2``). One worker per scenario runs
all the tasks; each round sends ``--tasks`` tasks of each contender, every task on its own key
(distinct arguments), in an order rotated by one each round, and times from the first
``apply_async`` until a plain end marker queued after them has run (under prefork the marker can
finish while the other child still runs the round's last task: at most one task of error).
Round 0 warms up and is dropped.

Printed per contender: the median over rounds of tasks/s, its ratio to the plain task's median,
the median of the per-round ratios, the microseconds it adds per task (1/median - 1/plain's
median), and the server commands per task (``INFO commandstats`` delta per contender round,
divided by its tasks, the ``INFO`` calls themselves left out) on the lock server and the broker.
A second table breaks a task's time down by process: the CPU microseconds (user + system, from
``/proc``, 10 ms ticks over the round) that the worker (with its pool children), the client (this
process), the broker and the lock server spent per task, and the worker's wall time per task
(1/median rate) less its CPU: the time it waited (for the lock server, the broker, a core).

Run: ``python -m benchmarks.bench_task_throughput [--tasks 2000 --rounds 7]
[--brokers redis,embedded] [--pools solo,prefork] [--results off,on]
[--contenders plain,LockedTask,...] [--json PATH] [--profile DIR] [--spin-us N] [--quick]``
(``--quick``: the Redis broker, both pools, results off and on, 400 tasks x 3 rounds, about two
minutes; options given explicitly win over its presets;
``--spin-us`` sets the Redis fast path's poll before a
blocking read in the workers, ``celery_lease.stores._redis_fast.SPIN_SECONDS``, 0 turns it off;
``--json`` writes the results for ``benchmarks/plot.py``; ``--profile`` runs each
worker's main process under cProfile and writes ``DIR/<broker>-<pool>.prof``: with ``--pools solo``
that is where the tasks run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if os.environ.get("BENCH_NO_HIREDIS"):  # --no-hiredis: redis-py's pure-Python reply parser
    sys.modules["hiredis"] = None  # type: ignore[assignment]  # makes `import hiredis` fail

import celery  # after the hiredis switch, which must precede redis-py's import
import redis
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_lease import LockedTask, MemoryLockStore

ROOT = Path(__file__).resolve().parents[1]
# Seconds of the lock store's restart grace (--restart-grace): short enough for a server started
# a moment ago, yet non-zero, so the acquire runs the default's script path (INFO server and the
# store's marker on each acquire of a free key).
RESTART_GRACE = 0.001
READY_TIMEOUT = 60.0  # seconds for the worker to run the first end marker
ROUND_TIMEOUT = 600.0  # seconds for one contender round's end marker
TRANSPORT = "example_project.transport:FilesystemTransport"


def make_app(env: dict[str, str]) -> Celery:
    """The benchmark app, from the ``BENCH_*`` variables (the worker builds it from its env).

    ``BENCH_BROKER``: a Redis URL, or ``filesystem:<folder>``; ``BENCH_BACKEND``: the result
    backend URL; ``BENCH_LOCKS``: the Redis URL the anchors lock on; ``BENCH_LEASE_STORE``: the
    LockedTask store URL; ``BENCH_RESULTS``: ``1`` stores every task's result (else ignored).
    """
    broker = env["BENCH_BROKER"]
    locks = env["BENCH_LOCKS"]
    app = Celery("bench", backend=env["BENCH_BACKEND"], set_as_current=False)
    app.conf.update(
        task_ignore_result=env.get("BENCH_RESULTS") != "1",
        worker_prefetch_multiplier=16,
        broker_connection_retry_on_startup=True,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": locks}},
        singleton_backend_url=locks,
        lease_store=env["BENCH_LEASE_STORE"],
        # The Redis store's restart grace (default: on, as long as the default ttl) refuses
        # free keys for that long after a server starts; see --restart-grace.
        lease_restart_grace=float(env.get("BENCH_RESTART_GRACE", RESTART_GRACE)),
    )
    if broker.startswith("filesystem:"):
        folder = broker.removeprefix("filesystem:")
        app.conf.update(
            broker_url="filesystem://",
            broker_transport=TRANSPORT,
            broker_transport_options={
                "data_folder_in": folder,
                # BENCH_STAGE: the client writes its messages there (see one_round).
                "data_folder_out": env.get("BENCH_STAGE") or folder,
                "processed_folder": folder + "-processed",
                "control_folder": folder + "-control",
                "store_processed": False,
                "polling_interval": 0.01,
            },
        )
    else:
        app.conf.broker_url = broker

    @app.task(name="bench.plain", shared=False)
    def plain(i: int) -> None:
        return None

    @app.task(name="bench.locked", base=LockedTask, lock_key="bench:{i}", shared=False)
    def locked_task(i: int) -> None:
        return None

    if env.get("BENCH_MEMORY"):
        # Only with --contenders LockedTask-memory (solo: a prefork worker refuses a
        # process-local store): the engine's Python alone, on a MemoryLockStore of the worker
        # process, to tell our Python from the store's cost.
        @app.task(
            name="bench.locked_memory",
            base=LockedTask,
            lock_key="bench:{i}",
            lock_store=MemoryLockStore(),
            shared=False,
        )
        def locked_memory(i: int) -> None:
            return None

    @app.task(name="bench.once", base=QueueOnce, shared=False)
    def once(i: int) -> None:
        return None

    @app.task(name="bench.singleton", base=Singleton, shared=False)
    def singleton(i: int) -> None:
        return None

    @app.task(name="bench.done", ignore_result=False, shared=False)
    def done() -> str:
        return "done"

    if env.get("BENCH_SPIN_US"):  # --spin-us: the Redis fast path's poll before a blocking read
        from celery_lease.stores import _redis_fast

        _redis_fast.SPIN_SECONDS = float(env["BENCH_SPIN_US"]) / 1e6
    if env.get("BENCH_PROFILE"):
        _profile_worker(env["BENCH_PROFILE"])
    if env.get("BENCH_RELEASES"):
        _count_release_paths(env["BENCH_RELEASES"])
    return app


_release_paths = {"unanswered": 0, "answered": 0}


def _count_release_paths(folder: str) -> None:
    """Count, in each worker process, LockedTask releases sent without waiting for the reply
    (the engine's ``_release`` let the context defer) and those answered before it returned,
    i.e. before the task's result is stored; each process writes ``folder/<pid>.json`` when it
    shuts down (prefork children too). Costs one wrapper call per LockedTask release."""
    from celery.signals import worker_process_shutdown, worker_shutdown

    from celery_lease._celery import execution

    release = execution._release

    def counting_release(run: Any, request: Any, context: Any, settings: Any) -> None:
        release(run, request, context, settings)
        _release_paths["unanswered" if context.defer_release else "answered"] += 1

    execution._release = counting_release

    def write(**_: Any) -> None:
        Path(folder, f"{os.getpid()}.json").write_text(json.dumps(_release_paths))

    worker_shutdown.connect(write, weak=False)
    worker_process_shutdown.connect(write, weak=False)


def read_release_paths(folder: Path) -> dict[str, int]:
    """The counts every worker process of a scenario wrote (see ``_count_release_paths``)."""
    total = {"unanswered": 0, "answered": 0}
    for path in folder.glob("*.json"):
        for k, n in json.loads(path.read_text()).items():
            total[k] = total.get(k, 0) + n
    return total


def _profile_worker(path: str) -> None:
    """Run the worker's main process under cProfile (``--profile``; the solo pool runs the
    tasks there) and write the stats to ``path`` when the worker shuts down."""
    import cProfile

    from celery.signals import worker_ready, worker_shutdown

    profile = cProfile.Profile()

    @worker_ready.connect(weak=False)
    def start(**_: Any) -> None:
        profile.enable()

    @worker_shutdown.connect(weak=False)
    def stop(**_: Any) -> None:
        profile.disable()
        profile.dump_stats(path)


if os.environ.get("BENCH_BROKER"):
    app = make_app(dict(os.environ))

CONTENDERS = {
    "plain": "bench.plain",
    "LockedTask": "bench.locked",
    "QueueOnce": "bench.once",
    "Singleton": "bench.singleton",
    "LockedTask-memory": "bench.locked_memory",
}
DEFAULT_CONTENDERS = ("plain", "LockedTask", "QueueOnce", "Singleton")

POOLS = {"solo": ["-P", "solo"], "prefork": ["-P", "prefork", "-c", "2"]}

# Option values when not given: the full run, and --quick's (about two minutes here).
FULL = {
    "tasks": 2000,
    "rounds": 7,
    "brokers": "redis,embedded",
    "pools": "solo,prefork",
    "results": "off,on",
}
QUICK = {**FULL, "tasks": 400, "rounds": 3, "brokers": "redis"}


@dataclass
class Scenario:
    """One broker and pool: where the worker runs and what counts commands."""

    broker: str
    pool: str
    results: bool  # results stored in the result backend (else task_ignore_result)
    env: dict[str, str]
    lock_server: redis.Redis
    broker_server: redis.Redis | None
    directory: Path
    rates: dict[str, list[float]] = field(default_factory=dict)
    lock_cmds: dict[str, list[float]] = field(default_factory=dict)
    broker_cmds: dict[str, list[float]] = field(default_factory=dict)
    lock_mix: dict[str, dict[str, float]] = field(default_factory=dict)  # last round's, per task
    # CPU seconds per task, per round, of each process that takes part (see _cpu_seconds).
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)  # role -> pid ("worker" set at start)
    broker_mix: dict[str, dict[str, float]] = field(default_factory=dict)
    # LockedTask releases by path, counted in the worker processes (see _count_release_paths).
    release_paths: dict[str, int] = field(default_factory=dict)

    @property
    def title(self) -> str:
        where = "Redis broker" if self.broker == "redis" else "embedded default"
        pool = "1 solo worker" if self.pool == "solo" else "1 prefork worker -c 2"
        backend = "results stored" if self.results else "results ignored"
        return f"{pool}, {where}, {backend}"

    @property
    def slug(self) -> str:
        """``<broker>-<pool>-<results|noresults>``: file names of the scenario's logs."""
        return f"{self.broker}-{self.pool}-{'results' if self.results else 'noresults'}"

    def label(self, name: str) -> str:
        if self.broker == "embedded" and name == "LockedTask":
            return "LockedTask (SQLite store)"
        if self.broker == "embedded" and name in ("QueueOnce", "Singleton"):
            return f"{name} (Redis locks)"
        return name


def _command_calls(client: redis.Redis | None) -> dict[str, int]:
    """``{command: calls}`` the server ran so far (commands inside scripts included; the
    ``INFO`` that asks is not counted yet: a server counts a command after it ran)."""
    if client is None:
        return {}
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) that ``pid`` and its live children used so far (Linux
    ``/proc``; 0.0 where there is none): for prefork, the pool children do the tasks' work."""
    total = 0.0
    pids = [pid]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids.extend(int(c) for c in f.read().split())
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


def _cpu_seconds(scenario: Scenario) -> dict[str, float]:
    """CPU seconds so far of each role: worker (with its pool children), client (this
    process), broker and lock server (the throwaway ``redis-server`` processes)."""
    out = {role: _process_cpu(pid) for role, pid in scenario.pids.items()}
    out["client"] = time.process_time()
    return out


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two :func:`_command_calls`, less the first one's own ``INFO``
    (``INFO`` inside the acquire script, the restart grace's, stays counted)."""
    calls = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    if before:
        calls["info"] = calls.get("info", 0) - 1
        if not calls["info"]:
            del calls["info"]
    return calls


def one_round(
    client: Celery, scenario: Scenario, name: str, first: int, count: int, stager: Celery | None
) -> float:
    """Run ``count`` tasks of contender ``name`` on keys ``first..``; record its figures.

    With ``stager`` (the embedded broker, ``--embedded-timing staged``) the tasks are written
    into a staging folder first, untimed, and the clock starts when they are moved into the
    broker's folder (one rename each): the round then times the worker draining a backlog of
    ``count`` messages, not the client writing them (2-3 ms per message on this broker, slower
    than a plain task runs, so the live timing measures the client).
    """
    done = client.tasks["bench.done"]
    locks_before = _command_calls(scenario.lock_server)
    broker_before = _command_calls(scenario.broker_server)
    cpu_before = _cpu_seconds(scenario)
    if stager is not None:
        task = stager.tasks[CONTENDERS[name]]
        for i in range(first, first + count):
            task.apply_async((i,))
        stage = Path(scenario.env["BENCH_STAGE"])
        inbox = Path(scenario.env["BENCH_BROKER"].removeprefix("filesystem:"))
        started = time.perf_counter()
        for message in sorted(os.listdir(stage)):  # names start with the send time: in order
            if message.endswith(".msg"):
                os.rename(stage / message, inbox / message)
    else:
        task = client.tasks[CONTENDERS[name]]
        started = time.perf_counter()
        for i in range(first, first + count):
            task.apply_async((i,))
    done.apply_async().get(timeout=ROUND_TIMEOUT, interval=0.005)
    rate = count / (time.perf_counter() - started)
    cpu_after = _cpu_seconds(scenario)
    cpu = scenario.cpu.setdefault(name, {})
    for role, seconds in cpu_after.items():
        cpu.setdefault(role, []).append((seconds - cpu_before[role]) / count)
    # The end marker's own commands are in the delta: the same for every contender.
    locks = _delta(locks_before, _command_calls(scenario.lock_server))
    scenario.lock_cmds.setdefault(name, []).append(sum(locks.values()) / count)
    scenario.lock_mix[name] = {k: n / count for k, n in sorted(locks.items())}
    if scenario.broker_server is not None:
        calls = _delta(broker_before, _command_calls(scenario.broker_server))
        scenario.broker_cmds.setdefault(name, []).append(sum(calls.values()) / count)
        scenario.broker_mix[name] = {k: n / count for k, n in sorted(calls.items())}
    return rate


@contextlib.contextmanager
def worker(scenario: Scenario) -> Iterator[None]:
    """A ``celery worker`` for the scenario, stopped (TERM, then KILL) when the block exits."""
    log = scenario.directory / f"worker-{scenario.slug}.log"
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "benchmarks.bench_task_throughput:app",
        "worker",
        *POOLS[scenario.pool],
        "--loglevel",
        "WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={
                **os.environ,
                **{k: v for k, v in scenario.env.items() if k != "BENCH_STAGE"},
                "PYTHONPATH": str(ROOT),
            },
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    scenario.pids["worker"] = process.pid
    try:
        yield
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


def run_scenario(
    scenario: Scenario, names: list[str], tasks: int, rounds: int, staged: bool = False
) -> None:
    """Start the worker and run the rounds (rotated order) of the scenario's contenders."""
    with worker(scenario):
        client = make_app({k: v for k, v in scenario.env.items() if k != "BENCH_STAGE"})
        stager = make_app(scenario.env) if staged else None
        client.tasks["bench.done"].apply_async().get(timeout=READY_TIMEOUT, interval=0.05)
        scenario.rates = {n: [] for n in names}
        key = 0
        for round_no in range(rounds + 1):  # round 0 warms up and is dropped
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for name in order:
                rate = one_round(client, scenario, name, key, tasks, stager)
                key += tasks
                if round_no:
                    scenario.rates[name].append(rate)
                else:  # warm-up: drop its command counts and CPU figures too
                    scenario.lock_cmds[name].pop()
                    for per_role in scenario.cpu[name].values():
                        per_role.pop()
                    if scenario.broker_server is not None:
                        scenario.broker_cmds[name].pop()
        client.close()
        if stager is not None:
            stager.close()


def report(scenario: Scenario, names: list[str], tasks: int, rounds: int) -> list[dict[str, Any]]:
    """Print the scenario's table; return its JSON rows."""
    plain = statistics.median(scenario.rates["plain"])
    print(
        f"\nTask throughput, {scenario.title} ({platform.python_version()}, {tasks} tasks x"
        f" {rounds} rounds per contender, distinct keys)\n"
    )
    print(
        "| contender | median tasks/s | ratio of medians | median per-round ratio"
        " | added us/task | lock-server cmds/task | broker cmds/task | all cmds/task |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in names:
        rates = scenario.rates[name]
        ratios = [r / p for r, p in zip(rates, scenario.rates["plain"], strict=True)]
        median = statistics.median(rates)
        added = 1e6 / median - 1e6 / plain
        lock_cmds = statistics.median(scenario.lock_cmds[name])
        broker = scenario.broker_cmds.get(name)
        broker_cmds = statistics.median(broker) if broker else None
        label = scenario.label(name)
        if scenario.broker == "embedded" and name == "LockedTask":
            lock_text = "SQLite"
        else:
            lock_text = f"{lock_cmds:.1f}"
        all_text = "-" if broker_cmds is None else f"{lock_cmds + broker_cmds:.1f}"
        print(
            f"| {label} | {median:,.0f} | {median / plain:.2f}x | {statistics.median(ratios):.2f}x"
            f" | {added:,.0f} | {lock_text} |"
            f" {'-' if broker_cmds is None else f'{broker_cmds:.1f}'} | {all_text} |"
        )
        rows.append(
            {
                "name": label,
                "median_per_s": median,
                "ratio": median / plain,
                "paired_ratio": statistics.median(ratios),
                "added_us_per_task": added,
                "lock_server_cmds_per_task": lock_cmds,
                "broker_cmds_per_task": broker_cmds,
                "per_round_per_s": rates,
                "lock_server_commands": scenario.lock_mix.get(name, {}),
                "broker_commands": scenario.broker_mix.get(name, {}),
            }
        )
    roles = [
        r
        for r in ("worker", "client", "broker", "lock server")
        if r in scenario.pids or r == "client"
    ]
    print(
        "\nCPU us per task (median over rounds; user + system) of each process, and the worker's"
        " wall time per task (1/median rate) that its CPU leaves unexplained (waiting):\n"
    )
    print("| contender | " + " | ".join(roles) + " | all | worker wall | worker waiting |")
    print("|---|" + "---:|" * (len(roles) + 3))
    for name in names:
        per_role = {r: statistics.median(scenario.cpu[name][r]) * 1e6 for r in roles}
        wall = 1e6 / statistics.median(scenario.rates[name])
        cells = " | ".join(f"{per_role[r]:,.0f}" for r in roles)
        print(
            f"| {scenario.label(name)} | {cells} | {sum(per_role.values()):,.0f} | {wall:,.0f}"
            f" | {wall - per_role['worker']:,.0f} |"
        )
        rows[names.index(name)]["cpu_us_per_task"] = per_role
    print("\nCommands per task in the last round (lock server; broker), inner script calls too:")
    for name in names:
        mix = ", ".join(f"{k} {v:.2f}" for k, v in scenario.lock_mix.get(name, {}).items())
        broker_mix = ", ".join(f"{k} {v:.2f}" for k, v in scenario.broker_mix.get(name, {}).items())
        print(f"- {scenario.label(name)}: {mix or '-'}; {broker_mix or '-'}")
    paths = scenario.release_paths
    print(
        f"\nLockedTask releases in the worker (all rounds, warm-up included):"
        f" {paths.get('unanswered', 0):,} sent without waiting for the reply,"
        f" {paths.get('answered', 0):,} answered before the task returned (and before its"
        " result, if any, was stored)"
    )
    return rows


@contextlib.contextmanager
def servers(brokers: list[str]) -> Iterator[tuple[Any, Any]]:
    """The lock server, and the broker server when the Redis broker is measured."""
    from benchmarks._redis_server import redis_server

    with redis_server() as locks, contextlib.ExitStack() as stack:
        broker = stack.enter_context(redis_server()) if "redis" in brokers else None
        yield locks, broker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tasks", type=int, help="tasks per contender per round (default 2000; --quick: 400)"
    )
    parser.add_argument("--rounds", type=int, help="timed rounds (default 7; --quick: 3)")
    parser.add_argument("--brokers", help="redis, embedded or both (default both; --quick: redis)")
    parser.add_argument("--pools", help="solo, prefork or both (default both)")
    parser.add_argument(
        "--results",
        help="off (task_ignore_result), on (a result backend stores every result) or both"
        " (default off,on)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="presets for a run of about two minutes: --brokers redis --pools solo,prefork"
        " --results off,on --tasks 400 --rounds 3 (explicit options win)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, of {', '.join(CONTENDERS)}; plain always runs",
    )
    parser.add_argument(
        "--no-hiredis",
        action="store_true",
        help="client and workers use redis-py's Python parser (hiredis is installed)",
    )
    parser.add_argument(
        "--embedded-timing",
        choices=("staged", "live"),
        default="staged",
        help="embedded broker: time the worker draining a staged backlog (default), or from"
        " the first apply_async as on Redis",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="cProfile each worker's main process (use --pools solo); stats in DIR/<broker>.prof",
    )
    parser.add_argument(
        "--restart-grace",
        type=float,
        default=RESTART_GRACE,
        help="the Redis lock store's restart grace in seconds (default %(default)s: the default"
        " script path, with no refusal on the fresh throwaway server; 0 turns it off)",
    )
    parser.add_argument(
        "--spin-us",
        type=float,
        help="the workers' Redis fast-path poll before a blocking read, in us (0: off;"
        " default: the library's SPIN_SECONDS)",
    )
    options = parser.parse_args()
    presets = QUICK if options.quick else FULL
    for name, value in presets.items():
        if getattr(options, name) is None:
            setattr(options, name, value)
    if options.restart_grace < 0:
        parser.error(f"--restart-grace={options.restart_grace}: use 0 (off) or more seconds")
    if options.tasks < 1 or options.rounds < 1:
        parser.error(f"--tasks={options.tasks} --rounds={options.rounds}: both must be >= 1")
    os.environ["BENCH_RESTART_GRACE"] = str(options.restart_grace)  # the workers inherit it
    if options.spin_us is not None:
        os.environ["BENCH_SPIN_US"] = str(options.spin_us)  # the workers inherit it
    if options.no_hiredis and not os.environ.get("BENCH_NO_HIREDIS"):
        # The switch must be in place before redis-py is imported: run again with it set.
        env = {**os.environ, "BENCH_NO_HIREDIS": "1"}
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.bench_task_throughput", *sys.argv[1:]],
            env,
        )
    brokers = [b for b in options.brokers.split(",") if b]
    pools = [p for p in options.pools.split(",") if p]
    results_modes = [r for r in options.results.split(",") if r]
    for value, allowed, what in (
        (brokers, ("redis", "embedded"), "--brokers"),
        (pools, POOLS, "--pools"),
        (results_modes, ("off", "on"), "--results"),
    ):
        bad = [v for v in value if v not in allowed]
        if bad or not value:
            parser.error(f"{what}={','.join(value)!r}: use {', '.join(allowed)} (comma-separated)")
    names = ["plain", *(n for n in options.contenders.split(",") if n and n != "plain")]
    bad_names = [n for n in names if n not in CONTENDERS]
    if bad_names:
        parser.error(f"--contenders: {', '.join(bad_names)}: use {', '.join(CONTENDERS)}")
    if "LockedTask-memory" in names and pools != ["solo"]:
        parser.error("--contenders LockedTask-memory needs --pools solo (a process-local store)")
    load = os.getloadavg()
    scenarios_out: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="celery-lease-throughput-"))
    try:
        with servers(brokers) as (locks, broker_server):
            for broker, pool, results in (
                (b, p, r == "on") for b in brokers for p in pools for r in results_modes
            ):
                directory = tmp / f"{broker}-{pool}-{'results' if results else 'noresults'}"
                directory.mkdir()
                locks.client().flushall()  # our own throwaway server: a clean slate per run
                if broker == "redis":
                    assert broker_server is not None
                    broker_server.client().flushall()
                    env = {
                        "BENCH_BROKER": broker_server.url,
                        "BENCH_BACKEND": broker_server.url,
                        "BENCH_LOCKS": locks.url,
                        "BENCH_LEASE_STORE": locks.url,
                    }
                    broker_client = broker_server.client()
                else:
                    (directory / "broker").mkdir()
                    (directory / "stage").mkdir()
                    (directory / "results").mkdir()
                    env = {
                        "BENCH_BROKER": f"filesystem:{directory / 'broker'}",
                        "BENCH_BACKEND": f"file://{directory / 'results'}",
                        "BENCH_LOCKS": locks.url,
                        "BENCH_LEASE_STORE": f"sqlite:///{directory / 'leases.sqlite3'}",
                    }
                    if options.embedded_timing == "staged":
                        env["BENCH_STAGE"] = str(directory / "stage")
                    broker_client = None
                if "LockedTask-memory" in names:
                    env["BENCH_MEMORY"] = "1"
                if results:
                    env["BENCH_RESULTS"] = "1"
                (directory / "releases").mkdir()
                env["BENCH_RELEASES"] = str(directory / "releases")
                scenario = Scenario(
                    broker, pool, results, env, locks.client(), broker_client, directory
                )
                if options.profile:
                    Path(options.profile).mkdir(parents=True, exist_ok=True)
                    env["BENCH_PROFILE"] = str(Path(options.profile) / f"{scenario.slug}.prof")
                scenario.pids["lock server"] = locks.process.pid
                if broker_server is not None and broker == "redis":
                    scenario.pids["broker"] = broker_server.process.pid
                run_scenario(scenario, names, options.tasks, options.rounds, "BENCH_STAGE" in env)
                scenario.release_paths = read_release_paths(directory / "releases")
                rows = report(scenario, names, options.tasks, options.rounds)
                scenarios_out.append(
                    {
                        "name": scenario.title,
                        "broker": broker,
                        "pool": pool,
                        "results": results,
                        "release_paths": scenario.release_paths,
                        "contenders": rows,
                    }
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    after = os.getloadavg()
    print(
        f"\nload average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f},"
        f" after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f} ({os.cpu_count()} CPUs)"
    )
    if options.json:
        results = {
            "benchmark": "task_throughput",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "celery": celery.__version__},
            "params": {
                "tasks": options.tasks,
                "rounds": options.rounds,
                "quick": options.quick,
                "restart_grace": options.restart_grace,
            },
            "baseline": "plain",
            # The first scenario's rows, as earlier versions wrote them (plot.py reads both).
            "contenders": scenarios_out[0]["contenders"],
            "scenarios": scenarios_out,
            "load_average": {"before": list(load), "after": list(after)},
        }
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
