"""Task throughput on one real worker: plain task vs LockedTask vs celery-once vs celery-singleton.

Scenarios (``--brokers`` x ``--pools``):

- ``redis``: a throwaway ``redis-server`` is the broker and result backend; a second throwaway
  ``redis-server`` holds every contender's locks, so its ``INFO commandstats`` counts lock
  commands alone and the first one's counts the broker's;
- ``embedded``: the default a user gets without a server, as ``example_project`` runs it: kombu's
  filesystem broker (the multi-process-safe transport of ``example_project.transport``), the
  ``file://`` result backend and LockedTask on the SQLite store; celery-once and celery-singleton
  need Redis, so they lock on the throwaway lock ``redis-server`` (marked "Redis locks").

Timing on the embedded broker (``--embedded-timing``): ``staged`` (default) writes each block's
messages into a staging folder first, untimed, and starts the clock when they are renamed into
the broker's folder, so the block times the worker draining a backlog of ``--tasks`` messages.
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
all the tasks, every task on its own key (distinct arguments).

Protocol: interleaved, paired blocks (``benchmarks.paired_stats``). After a warm-up block of
each contender (dropped) and five blocks of no tasks (the end marker alone: its round trip is
the fixed cost each block's time carries, printed as a share of a plain block), the scenario
runs ``--rounds`` rounds; a round runs one block of ``--tasks`` tasks of every contender, in an
order shuffled afresh each round by a ``random.Random`` seeded from ``--seed`` (printed; drawn
when not given; the orders go into the JSON). A block is timed from its first ``apply_async``
until a plain end marker queued after its tasks has run (under prefork the marker can finish
while the other child still runs the block's last task: at most one task of error). Short
blocks (100 tasks, 70-200 ms here) in a shuffled order mean a slow drift of the machine
(another process, a core's clock) hits every contender alike, and no contender always follows
the same one. A contender's paired ratio in a round is its block's tasks/s over the plain
block's of the same round.

Printed per scenario and contender: the median over rounds of its tasks/s, the ratio of that
median to plain's, the **paired ratio** (median over rounds of the same-round ratios) with its
95% percentile-bootstrap interval (2000 resamples of the rounds, seeded from ``--seed``), the
microseconds it adds per task (1/median - 1/plain's median), and the server commands per task
(``INFO commandstats`` delta per block, divided by its tasks, the ``INFO`` calls themselves left
out, the end marker's own commands in: the same for every contender) on the lock server and the
broker. Then LockedTask's **verdict** against each anchor (QueueOnce, Singleton), head to head:
LockedTask's block tasks/s over the anchor's in the same round, median over rounds with its 95%
interval: ``ahead`` when the interval lies wholly above 1, ``behind`` when wholly below 1,
``level`` otherwise (``too few rounds`` under 5 rounds); next to it both paired ratios to plain.
A last table sums the scenarios up.

A second table breaks a task's time down by process (medians over blocks, per task): the CPU
microseconds that the worker (with its pool children), the client (this process), the broker
and the lock server spent; the worker's wall time (1/median rate) less its CPU (the time it
waited: for the lock server, the broker, a core); the worker's ``queued`` microseconds, runnable
but without a core (other processes held both: near 0 on a quiet machine, so a large figure
flags a disturbed run); and each process's voluntary context switches (a thread blocked: a
read, a lock, a sleep). CPU is on-CPU time, user + system, as the columns always meant, now read
from each thread's ``/proc/<pid>/task/<tid>/schedstat`` in nanoseconds (earlier versions read
``/proc/<pid>/stat``'s 10 ms ticks, too coarse for a short block), summed over the process's
threads and its live children's; ``queued`` is the same file's run-queue time; switches come
from the threads' ``status`` (``voluntary_ctxt_switches``).

Run: ``python -m benchmarks.bench_task_throughput [--tasks 100 --rounds 80] [--seed S]
[--brokers redis,embedded] [--pools solo,prefork] [--results off,on]
[--contenders plain,LockedTask,...] [--json PATH] [--profile DIR] [--spin-us N]
[--quick | --report]``
(``--report``: the figures to report, the Redis broker, both pools, results off and on, 100
tasks x 80 rounds, 3-4 minutes here; ``--quick``: the same with 15 rounds, about a
minute; the defaults add the embedded broker, about 12 minutes; options given explicitly win
over either's presets; ``--spin-us`` sets the Redis fast path's poll before a blocking read in
the workers, ``celery_lease.stores._redis_fast.SPIN_SECONDS``, 0 turns it off;
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
import random
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

from benchmarks import paired_stats
from celery_lease import LockedTask, MemoryLockStore

ROOT = Path(__file__).resolve().parents[1]
# Seconds of the lock store's restart grace (--restart-grace): short enough for a server started
# a moment ago, yet non-zero, so the acquire runs the default's script path (INFO server and the
# store's marker on each acquire of a free key).
RESTART_GRACE = 0.001
READY_TIMEOUT = 60.0  # seconds for the worker to run the first end marker
ROUND_TIMEOUT = 600.0  # seconds for one block's end marker
EMPTY_BLOCKS = 5  # blocks of no tasks timed after the warm-up (the end marker's fixed cost)
ANCHORS = ("QueueOnce", "Singleton")  # what LockedTask is judged against
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
                # BENCH_STAGE: the client writes its messages there (see one_block).
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

    class AcquiredAtRun(LockedTask):  # type: ignore[misc]
        """A LockedTask whose acquire is sent when it runs, never at receipt: a class with a
        ``before_start`` of its own is not sent early (``_celery.early_acquire``)."""

        abstract = True

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            return None

    @app.task(name="bench.locked_at_run", base=AcquiredAtRun, lock_key="bench:{i}", shared=False)
    def locked_at_run(i: int) -> None:
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
    # The engine on a MemoryLockStore of the worker: LockedTask less the Redis store's cost.
    "LockedTask-memory": "bench.locked_memory",
    # The same as LockedTask, its acquire sent when the task runs (what a prefork child does):
    # measures what the solo worker's early acquire buys.
    "LockedTask-at-run": "bench.locked_at_run",
}
DEFAULT_CONTENDERS = ("plain", "LockedTask", "QueueOnce", "Singleton")

POOLS = {"solo": ["-P", "solo"], "prefork": ["-P", "prefork", "-c", "2"]}

# Option values when not given: the full run, --quick's (about a minute here) and
# --report's (the Redis broker's four scenarios, 3-4 minutes here).
FULL = {
    "tasks": 100,
    "rounds": 80,
    "brokers": "redis,embedded",
    "pools": "solo,prefork",
    "results": "off,on",
}
QUICK = {**FULL, "rounds": 15, "brokers": "redis"}
REPORT = {**FULL, "brokers": "redis"}


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
    # CPU seconds per task, per round, of each process that takes part (see _process_usage).
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # Seconds per task, per round, each process was runnable but had no core (_process_usage).
    queued: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # Voluntary context switches per task, per round, of each process (see _process_usage).
    switches: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)  # the timed rounds' block orders
    empty_block_s: float = 0.0  # median seconds of a block of no tasks (the end marker alone)
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


def command_calls(client: redis.Redis | None) -> dict[str, int]:
    """``{command: calls}`` the server ran so far (commands inside scripts included; the
    ``INFO`` that asks is not counted yet: a server counts a command after it ran)."""
    if client is None:
        return {}
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _threads(pid: int, children: bool) -> list[str]:
    """``/proc/<pid>/task/<tid>`` of every thread of ``pid`` and, with ``children``, of its
    live child processes (the prefork pool's children do the tasks' work)."""
    pids = [pid]
    if children:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    pids.extend(int(c) for c in f.read().split())
    folders = []
    for p in pids:
        with contextlib.suppress(OSError):
            folders.extend(f"/proc/{p}/task/{tid}" for tid in os.listdir(f"/proc/{p}/task"))
    return folders


@dataclass(frozen=True)
class Usage:
    """What a process (its threads, with or without its children's) used so far."""

    cpu_s: float  # on-CPU seconds, user + system
    queued_s: float  # seconds runnable but waiting for a core (another process had it)
    switches: int  # voluntary context switches (a thread blocked: a read, a lock, a sleep)


def _process_times(pid: int, children: bool = True) -> Usage:
    """What ``pid``'s threads (and, with ``children``, its live children's) used so far: the
    first two fields of each thread's ``/proc/<pid>/task/<tid>/schedstat`` (on-CPU and
    run-queue nanoseconds, where ``/proc/<pid>/stat`` counts 10 ms ticks) and the
    ``voluntary_ctxt_switches`` of its ``status``. Linux only (zeros elsewhere); a thread that
    exits between two readings takes its time with it (the worker's threads live as long as
    it does)."""
    cpu_ns = queued_ns = switches = 0
    for folder in _threads(pid, children):
        try:
            with open(f"{folder}/schedstat") as f:
                on_cpu, waited = (int(v) for v in f.read().split()[:2])
            with open(f"{folder}/status") as f:
                blocked = next(
                    int(line.split()[1])
                    for line in f
                    if line.startswith("voluntary_ctxt_switches:")
                )
        except (OSError, ValueError, StopIteration):
            continue  # the thread exited, or a kernel without the field
        cpu_ns += on_cpu
        queued_ns += waited
        switches += blocked
    return Usage(cpu_ns / 1e9, queued_ns / 1e9, switches)


def _process_usage(scenario: Scenario) -> dict[str, Usage]:
    """What each role used so far: worker (with its pool children), client (this process
    without its children: the worker and the servers are them), broker and lock server (the
    throwaway ``redis-server`` processes)."""
    out = {role: _process_times(pid) for role, pid in scenario.pids.items()}
    out["client"] = _process_times(os.getpid(), children=False)
    return out


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two :func:`command_calls`, less the first one's own ``INFO``
    (``INFO`` inside the acquire script, the restart grace's, stays counted)."""
    calls = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    if before:
        calls["info"] = calls.get("info", 0) - 1
        if not calls["info"]:
            del calls["info"]
    return calls


def one_block(
    client: Celery, scenario: Scenario, name: str, first: int, count: int, stager: Celery | None
) -> float:
    """Run a block of ``count`` tasks of contender ``name`` on keys ``first..``; record its
    figures (commands, CPU, switches per task) and return its tasks/s.

    The block is timed from the first ``apply_async`` until a plain end marker queued after the
    tasks has run and its result was read. With ``stager`` (the embedded broker,
    ``--embedded-timing staged``) the tasks are written into a staging folder first, untimed,
    and the clock starts when they are moved into the broker's folder (one rename each): the
    block then times the worker draining a backlog of ``count`` messages, not the client
    writing them (2-3 ms per message on this broker, slower than a plain task runs, so the live
    timing measures the client).
    """
    done = client.tasks["bench.done"]
    locks_before = command_calls(scenario.lock_server)
    broker_before = command_calls(scenario.broker_server)
    usage_before = _process_usage(scenario)
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
    usage_after = _process_usage(scenario)
    cpu = scenario.cpu.setdefault(name, {})
    queued = scenario.queued.setdefault(name, {})
    switches = scenario.switches.setdefault(name, {})
    for role, after in usage_after.items():
        before = usage_before[role]
        cpu.setdefault(role, []).append((after.cpu_s - before.cpu_s) / count)
        queued.setdefault(role, []).append((after.queued_s - before.queued_s) / count)
        switches.setdefault(role, []).append((after.switches - before.switches) / count)
    # The end marker's own commands are in the delta: the same for every contender.
    locks = _delta(locks_before, command_calls(scenario.lock_server))
    scenario.lock_cmds.setdefault(name, []).append(sum(locks.values()) / count)
    scenario.lock_mix[name] = {k: n / count for k, n in sorted(locks.items())}
    if scenario.broker_server is not None:
        calls = _delta(broker_before, command_calls(scenario.broker_server))
        scenario.broker_cmds.setdefault(name, []).append(sum(calls.values()) / count)
        scenario.broker_mix[name] = {k: n / count for k, n in sorted(calls.items())}
    return rate


def _drop_last_block(scenario: Scenario, name: str) -> None:
    """Forget the figures :func:`one_block` recorded for ``name``'s last block (warm-up)."""
    scenario.lock_cmds[name].pop()
    for per_role in (
        *scenario.cpu[name].values(),
        *scenario.queued[name].values(),
        *scenario.switches[name].values(),
    ):
        per_role.pop()
    if scenario.broker_server is not None:
        scenario.broker_cmds[name].pop()


def empty_block_seconds(client: Celery, blocks: int = EMPTY_BLOCKS) -> float:
    """Median seconds of ``blocks`` blocks of no tasks: the end marker's round trip alone,
    the fixed cost every block's time carries (the same for every contender)."""
    done = client.tasks["bench.done"]
    times = []
    for _ in range(blocks):
        started = time.perf_counter()
        done.apply_async().get(timeout=ROUND_TIMEOUT, interval=0.005)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


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
    scenario: Scenario,
    names: list[str],
    tasks: int,
    rounds: int,
    rng: random.Random,
    staged: bool = False,
) -> None:
    """Start the worker; run a warm-up round (dropped), then ``rounds`` rounds of one block of
    ``tasks`` tasks per contender each, in an order ``rng`` shuffles afresh every round."""
    with worker(scenario):
        client = make_app({k: v for k, v in scenario.env.items() if k != "BENCH_STAGE"})
        stager = make_app(scenario.env) if staged else None
        client.tasks["bench.done"].apply_async().get(timeout=READY_TIMEOUT, interval=0.05)
        scenario.rates = {n: [] for n in names}
        key = 0
        for name in names:  # warm-up: its rates, command counts and CPU figures are dropped
            one_block(client, scenario, name, key, tasks, stager)
            _drop_last_block(scenario, name)
            key += tasks
        scenario.empty_block_s = empty_block_seconds(client)
        scenario.orders = paired_stats.block_orders(names, rounds, rng)
        for order in scenario.orders:
            for name in order:
                scenario.rates[name].append(one_block(client, scenario, name, key, tasks, stager))
                key += tasks
        client.close()
        if stager is not None:
            stager.close()


def judge(
    scenario: Scenario, names: list[str], ratios: dict[str, paired_stats.Estimate], seed: str
) -> dict[str, dict[str, Any]]:
    """Print and return LockedTask's verdict against each anchor that ran (the rule of
    ``benchmarks.paired_stats``), with LockedTask over the anchor in the same round."""
    verdicts: dict[str, dict[str, Any]] = {}
    if "LockedTask" not in names:
        return verdicts
    ours = ratios["LockedTask"]
    for anchor in (a for a in ANCHORS if a in names):
        theirs = ratios[anchor]
        direct = paired_stats.paired_ratios(scenario.rates, anchor)["LockedTask"]
        head_to_head = paired_stats.estimate(direct, f"{seed}:{scenario.slug}:LockedTask/{anchor}")
        said = paired_stats.verdict(head_to_head)
        print(
            f"- LockedTask / {scenario.label(anchor)} in the same round:"
            f" {head_to_head.text(suffix='x')}: **{said}** (paired ratios to plain:"
            f" LockedTask {ours.text(suffix='x')}, {anchor} {theirs.text(suffix='x')})"
        )
        verdicts[anchor] = {
            "verdict": said,
            "locked_over_anchor": head_to_head.median,
            "locked_over_anchor_interval": [head_to_head.low, head_to_head.high],
        }
    return verdicts


def report(
    scenario: Scenario, names: list[str], tasks: int, rounds: int, seed: str
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Print the scenario's tables; return its JSON rows and LockedTask's verdicts."""
    plain = statistics.median(scenario.rates["plain"])
    block_ms = 1e3 * tasks / plain
    print(
        f"\nTask throughput, {scenario.title} ({platform.python_version()}, {rounds} rounds of"
        f" one {tasks}-task block per contender, shuffled order, distinct keys; end marker alone"
        f" {scenario.empty_block_s * 1e3:.1f} ms = {scenario.empty_block_s * 1e3 / block_ms:.1%}"
        " of a plain block)\n"
    )
    print(
        "| contender | median tasks/s | ratio of medians | paired ratio [95% interval]"
        " | added us/task | lock-server cmds/task | broker cmds/task | all cmds/task |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    paired = paired_stats.paired_ratios(scenario.rates, "plain")
    ratios = {
        name: paired_stats.estimate(paired[name], f"{seed}:{scenario.slug}:{name}")
        for name in names
    }
    for name in names:
        rates = scenario.rates[name]
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
            f"| {label} | {median:,.0f} | {median / plain:.2f}x | {ratios[name].text(suffix='x')}"
            f" | {added:,.0f} | {lock_text} |"
            f" {'-' if broker_cmds is None else f'{broker_cmds:.1f}'} | {all_text} |"
        )
        rows.append(
            {
                "name": label,
                "median_per_s": median,
                "ratio": median / plain,
                "paired_ratio": ratios[name].median,
                "paired_ratio_interval": [ratios[name].low, ratios[name].high],
                "added_us_per_task": added,
                "lock_server_cmds_per_task": lock_cmds,
                "broker_cmds_per_task": broker_cmds,
                "per_round_per_s": rates,
                "lock_server_commands": scenario.lock_mix.get(name, {}),
                "broker_commands": scenario.broker_mix.get(name, {}),
            }
        )
    print()
    verdicts = judge(scenario, names, ratios, seed)
    roles = [
        r
        for r in ("worker", "client", "broker", "lock server")
        if r in scenario.pids or r == "client"
    ]
    print(
        "\nCPU us per task (median over blocks; on-CPU time, user + system, from each thread's"
        " /proc schedstat) of each process; the worker's wall time per task (1/median rate),"
        " the part of it its CPU leaves unexplained (waiting) and the us per task its threads"
        " were runnable without a core (queued: other processes had both); voluntary context"
        " switches per task of each process:\n"
    )
    print(
        "| contender | "
        + " | ".join(roles)
        + " | all | worker wall | worker waiting | worker queued | "
        + " | ".join(f"{r} switches" for r in roles)
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(roles) + 4))
    for name in names:
        per_role = {r: statistics.median(scenario.cpu[name][r]) * 1e6 for r in roles}
        queued = statistics.median(scenario.queued[name]["worker"]) * 1e6
        switched = {r: statistics.median(scenario.switches[name][r]) for r in roles}
        wall = 1e6 / statistics.median(scenario.rates[name])
        cells = " | ".join(f"{per_role[r]:,.0f}" for r in roles)
        switch_cells = " | ".join(f"{switched[r]:.2f}" for r in roles)
        print(
            f"| {scenario.label(name)} | {cells} | {sum(per_role.values()):,.0f} | {wall:,.0f}"
            f" | {wall - per_role['worker']:,.0f} | {queued:,.0f} | {switch_cells} |"
        )
        row = rows[names.index(name)]
        row["cpu_us_per_task"] = per_role
        row["worker_queued_us_per_task"] = queued
        row["voluntary_switches_per_task"] = switched
    print("\nCommands per task in the last block (lock server; broker), inner script calls too:")
    for name in names:
        mix = ", ".join(f"{k} {v:.2f}" for k, v in scenario.lock_mix.get(name, {}).items())
        broker_mix = ", ".join(f"{k} {v:.2f}" for k, v in scenario.broker_mix.get(name, {}).items())
        print(f"- {scenario.label(name)}: {mix or '-'}; {broker_mix or '-'}")
    paths = scenario.release_paths
    print(
        f"\nLockedTask releases in the worker (all blocks, warm-up included):"
        f" {paths.get('unanswered', 0):,} sent without waiting for the reply,"
        f" {paths.get('answered', 0):,} answered before the task returned (and before its"
        " result, if any, was stored)"
    )
    return rows, verdicts


def summarise(scenarios: list[dict[str, Any]], seed: str) -> None:
    """One line per scenario: the paired ratios with their intervals and LockedTask's
    verdicts against the anchors (the rule of ``benchmarks.paired_stats``)."""
    if not any(s["verdicts"] for s in scenarios):
        return
    print(f"\nSummary (seed {seed}): paired ratio to plain, median [95% interval] over rounds\n")
    anchors = [a for a in ANCHORS if any(a in s["verdicts"] for s in scenarios)]
    print(
        "| scenario | LockedTask | "
        + " | ".join(anchors)
        + " | "
        + " | ".join(f"vs {a}" for a in anchors)
        + " |"
    )
    print("|---|" + "---:|" * (1 + 2 * len(anchors)))
    for s in scenarios:
        by_name = {c["name"].split(" (")[0]: c for c in s["contenders"]}
        cells = []
        for name in ("LockedTask", *anchors):
            c = by_name.get(name)
            cells.append(
                "-"
                if c is None
                else f"{c['paired_ratio']:.2f}x [{c['paired_ratio_interval'][0]:.2f},"
                f" {c['paired_ratio_interval'][1]:.2f}]"
            )
        cells += [s["verdicts"].get(a, {}).get("verdict", "-") for a in anchors]
        print(f"| {s['name']} | " + " | ".join(cells) + " |")
    took = ", ".join(f"{s['wall_s']:.0f} s" for s in scenarios)
    print(f"\nWall time per scenario (worker start and warm-up included): {took}")


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
        "--tasks", type=int, help="tasks per block: per contender per round (default 100)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="timed rounds, one block per contender each (default 80; --quick: 15)",
    )
    parser.add_argument(
        "--seed",
        help="seed of the rounds' block orders and of the bootstrap (default: drawn, printed)",
    )
    parser.add_argument("--brokers", help="redis, embedded or both (default both; --quick: redis)")
    parser.add_argument("--pools", help="solo, prefork or both (default both)")
    parser.add_argument(
        "--results",
        help="off (task_ignore_result), on (a result backend stores every result) or both"
        " (default off,on)",
    )
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument(
        "--quick",
        action="store_true",
        help="presets for a run of about a minute: --brokers redis --pools"
        " solo,prefork --results off,on --tasks 100 --rounds 15 (explicit options win)",
    )
    presets.add_argument(
        "--report",
        action="store_true",
        help="presets of the figures to report, 3-4 minutes: --brokers redis --pools"
        " solo,prefork --results off,on --tasks 100 --rounds 80 (explicit options win)",
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
    preset = REPORT if options.report else QUICK if options.quick else FULL
    for name, value in preset.items():
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
    seed = options.seed or str(random.SystemRandom().randrange(10**6))
    print(f"seed {seed} (--seed {seed} repeats the block orders and the intervals)")
    rng = random.Random(seed)
    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        print("no /proc/<pid>/schedstat here: the CPU, queued and switch columns read 0")
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
                began = time.monotonic()
                run_scenario(
                    scenario, names, options.tasks, options.rounds, rng, "BENCH_STAGE" in env
                )
                wall_s = time.monotonic() - began
                scenario.release_paths = read_release_paths(directory / "releases")
                rows, verdicts = report(scenario, names, options.tasks, options.rounds, seed)
                scenarios_out.append(
                    {
                        "name": scenario.title,
                        "broker": broker,
                        "pool": pool,
                        "results": results,
                        "release_paths": scenario.release_paths,
                        "contenders": rows,
                        "verdicts": verdicts,
                        "block_orders": scenario.orders,
                        "empty_block_s": scenario.empty_block_s,
                        "wall_s": wall_s,
                    }
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    after = os.getloadavg()
    summarise(scenarios_out, seed)
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
                "report": options.report,
                "seed": seed,
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
