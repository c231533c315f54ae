"""Where a solo worker's time goes per task: syscalls, wake-ups and CPU per thread, per contender.

One ``celery worker -P solo`` (Redis broker and result backend on one throwaway ``redis-server``,
locks on a second one, results ignored; the app of :mod:`benchmarks.bench_task_throughput`) runs
``--tasks`` tasks of each contender (plain, LockedTask on Redis, QueueOnce, Singleton), each task
on its own key, after a warm-up round of each. Per contender and task it reports:

- ``proc`` pass (nothing attached; ``--rounds`` rounds in rotated order, medians printed):
  per worker thread (by ``/proc/<pid>/task/<tid>/comm``), the CPU nanoseconds (``schedstat``'s
  run time, exact, not 10 ms ticks) and the voluntary and involuntary context switches
  (``status``); the same CPU for the two ``redis-server`` processes; and the lock server's
  commands (``INFO commandstats``). The worker is held stopped (SIGSTOP) while the client sends
  the round, then drains the backlog (``--live``: it runs meanwhile and waits for the client),
  so its voluntary switches are its own waits (for the lock server), not the client's pace;
- ``strace`` pass (``strace -f -qq -yy -o FILE -p <worker pid>``, attached for the round only):
  the syscalls per task by name and by thread, and the socket syscalls split by peer (lock
  server, broker), so round trips to the lock server can be counted (a write and the read that
  takes its reply). strace slows the worker: its counts matter, not its time;
- ``--perf DIR``: ``perf record -e cpu-clock -g`` on the worker for a round (``perf report
  --sort dso`` splits kernel from interpreter); ``--pyspy DIR``: ``py-spy record --nonblocking``
  collapsed stacks of a round (``PY_SPY`` names the binary);
- ``--callgrind``: the worker runs under ``valgrind --tool=callgrind`` and each contender's
  round prints the instructions per task it ran (all threads; kernel time not included):
  repeatable on a busy host, where the CPU figures are not (use ``--passes none``).

The client sends all of a round's tasks, then a plain end marker, and waits for the marker: the
marker's own cost is in every contender's figures alike (over ``--tasks`` tasks).

Run: ``python -m benchmarks.worker_cost [--tasks 1000] [--rounds 3] [--live]
[--contenders plain,LockedTask,...] [--passes proc,strace] [--perf DIR] [--pyspy DIR]
[--callgrind] [--json PATH]`` (Linux; strace, perf, py-spy, valgrind on PATH for their passes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_task_throughput import CONTENDERS, command_calls, make_app

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 900.0  # seconds: a worker under callgrind on a busy host starts slowly
ROUND_TIMEOUT = 900.0


def threads(pid: int) -> dict[int, dict[str, Any]]:
    """Per thread of ``pid``: its name, CPU ns (schedstat), voluntary/involuntary switches."""
    out: dict[int, dict[str, Any]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            with open(f"{base}/schedstat") as f:
                run_ns = int(f.read().split()[0])
            with open(f"{base}/status") as f:
                lines = f.read().splitlines()
            status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        except OSError:
            continue
        out[int(tid)] = {
            "comm": comm,
            "cpu_ns": run_ns,
            "vol": int(status["voluntary_ctxt_switches"]),
            "invol": int(status["nonvoluntary_ctxt_switches"]),
        }
    return out


def thread_delta(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]], count: int, main: int
) -> dict[str, dict[str, float]]:
    """Per thread name (``main`` for the worker's main thread), the per-task deltas."""
    out: dict[str, dict[str, float]] = {}
    for tid, now in after.items():
        was = before.get(tid, {"cpu_ns": 0, "vol": 0, "invol": 0})
        name = "main" if tid == main else now["comm"]
        row = out.setdefault(name, {"cpu_ns": 0.0, "vol": 0.0, "invol": 0.0, "threads": 0})
        for k in ("cpu_ns", "vol", "invol"):
            row[k] += (now[k] - was[k]) / count
        row["threads"] += 1
    for tid, was in before.items():  # threads that ended during the round
        if tid not in after:
            out.setdefault(f"{was['comm']} (ended)", {"cpu_ns": 0.0, "vol": 0.0, "invol": 0.0})
    return out


_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. )?([a-z_0-9]+)(\(| resumed>)")
_PEER = re.compile(r"TCP:\[[\d.]+:\d+->[\d.]+:(\d+)\]")


def parse_strace(path: Path, ports: dict[int, str]) -> dict[str, Any]:
    """Counts from an ``strace -f -yy`` log: by syscall, by (thread, syscall), by (syscall,
    peer) for sockets whose peer port is in ``ports``; a call split over two lines (unfinished,
    resumed) counts once."""
    by_call: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[tuple[int, str]] = collections.Counter()
    by_peer: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m is None or m.group(3) != "(":
            continue
        tid, call = int(m.group(1)), m.group(2)
        by_call[call] += 1
        by_thread[(tid, call)] += 1
        p = _PEER.search(line[:200])
        if p is not None:
            by_peer[(call, ports.get(int(p.group(1)), p.group(1)))] += 1
    return {"by_call": by_call, "by_thread": by_thread, "by_peer": by_peer}


class Bench:
    def __init__(self, options: argparse.Namespace, tmp: Path) -> None:
        self.options = options
        self.tmp = tmp
        self.key = 0

    def run_round(self, client: Any, name: str, count: int, stopped: int | None = None) -> float:
        """Send ``count`` tasks and the end marker, wait for the marker; seconds taken.
        ``stopped``: a worker pid held stopped (SIGSTOP) while the tasks are sent and let go
        after (the clock starts then): the worker drains a backlog and never waits for the
        client, so its switches are its own."""
        task = client.tasks[CONTENDERS[name]]
        if stopped is not None:
            os.kill(stopped, signal.SIGSTOP)
        started = time.perf_counter()
        try:
            for i in range(self.key, self.key + count):
                task.apply_async((i,))
            self.key += count
            marker = client.tasks["bench.done"].apply_async()
        finally:
            if stopped is not None:
                started = time.perf_counter()
                os.kill(stopped, signal.SIGCONT)
        marker.get(timeout=ROUND_TIMEOUT, interval=0.005)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="proc rounds (median printed)")
    parser.add_argument(
        "--live",
        dest="backlog",
        action="store_false",
        help="proc rounds: the worker runs while the client sends (default: it is stopped"
        " until all are sent, then drains the backlog)",
    )
    parser.add_argument(
        "--contenders", default="plain,LockedTask,QueueOnce,Singleton", help=", ".join(CONTENDERS)
    )
    parser.add_argument("--passes", default="proc,strace")
    parser.add_argument("--perf", metavar="DIR", help="perf record each contender's round here")
    parser.add_argument(
        "--pyspy", metavar="DIR", help="py-spy record (collapsed stacks) each round here"
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="run the worker under valgrind --tool=callgrind: instructions per task per"
        " contender (callgrind_control -e Ir before and after each round); use --passes none",
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--threads-detail", action="store_true", help="print per-thread rows")
    options = parser.parse_args()
    names = [n for n in options.contenders.split(",") if n]
    passes = [p for p in options.passes.split(",") if p]

    from benchmarks._redis_server import redis_server

    results: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="celery-lease-worker-cost-"))
    with redis_server() as locks, redis_server() as broker:
        env = {
            "BENCH_BROKER": broker.url,
            "BENCH_BACKEND": broker.url,
            "BENCH_LOCKS": locks.url,
            "BENCH_LEASE_STORE": locks.url,
            "BENCH_RESTART_GRACE": os.environ.get("BENCH_RESTART_GRACE", "0.001"),
        }
        ports = {locks.port: "lock", broker.port: "broker"}
        if "LockedTask-memory" in names:
            env["BENCH_MEMORY"] = "1"
        argv = [
            sys.executable, "-m", "celery", "-A", "benchmarks.bench_task_throughput:app",
            "worker", "-P", "solo", "--loglevel", "WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        if options.callgrind:
            argv = ["valgrind", "--tool=callgrind", "--vgdb=yes",
                    f"--callgrind-out-file={tmp}/callgrind.%p", *argv]  # fmt: skip
        log = open(tmp / "worker.log", "wb")  # noqa: SIM115
        worker = subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
            )}, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            client = make_app(env)
            client.tasks["bench.done"].apply_async().get(timeout=READY_TIMEOUT, interval=0.05)
            bench = Bench(options, tmp)
            lock_client = locks.client()
            for name in names:  # warm-up: imports, connections, script loads, threads
                bench.run_round(client, name, min(200, options.tasks))
            rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for round_no in range(options.rounds if "proc" in passes else 0):
                order = names[round_no % len(names) :] + names[: round_no % len(names)]
                for name in order:
                    rows[name].append(
                        proc_round(bench, client, name, worker.pid, locks, broker, lock_client)
                    )
            stop = worker.pid if options.backlog else None
            for name in names:
                row: dict[str, Any] = median_row(rows[name]) if rows[name] else {}
                if options.callgrind:
                    row["instructions"] = instructions(bench, client, name, worker.pid)
                    print(f"{name}: {row['instructions']:,.0f} instructions per task (callgrind)")
                if "strace" in passes:
                    out = tmp / f"strace-{name}.txt"
                    strace = subprocess.Popen(
                        ["strace", "-f", "-qq", "-yy", "-s", "0", "-o", str(out),
                         "-p", str(worker.pid)],
                        stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(1.0)  # attached to every thread (no synchronisation offered)
                    bench.run_round(client, name, options.tasks)
                    time.sleep(0.2)
                    strace.send_signal(signal.SIGINT)
                    strace.wait(30)
                    parsed = parse_strace(out, ports)
                    n = options.tasks
                    names_by_tid = {tid: t["comm"] for tid, t in threads(worker.pid).items()}
                    names_by_tid[worker.pid] = "main"
                    row["syscalls"] = {k: v / n for k, v in parsed["by_call"].most_common()}
                    per_thread: dict[str, dict[str, float]] = {}
                    for (tid, call), v in parsed["by_thread"].items():
                        tname = names_by_tid.get(tid, f"tid{tid}")
                        per_thread.setdefault(tname, {})
                        per_thread[tname][call] = per_thread[tname].get(call, 0) + v / n
                    row["syscalls_by_thread"] = per_thread
                    row["socket_by_peer"] = {
                        f"{call}@{peer}": v / n for (call, peer), v in parsed["by_peer"].items()
                    }
                if options.perf:
                    Path(options.perf).mkdir(parents=True, exist_ok=True)
                    data = Path(options.perf) / f"{name}.data"
                    perf = subprocess.Popen(
                        ["perf", "record", "-q", "-g",
                         *(["-e", os.environ["PERF_EVENT"], "-c", "1"] if "PERF_EVENT" in os.environ
                           else ["-e", "cpu-clock", "-F", "4000"]),
                         "-o", str(data), "-p", str(worker.pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(0.5)
                    bench.run_round(client, name, options.tasks, stop)
                    perf.send_signal(signal.SIGINT)
                    perf.wait(60)
                if options.pyspy:
                    Path(options.pyspy).mkdir(parents=True, exist_ok=True)
                    spy = subprocess.Popen(
                        [os.environ.get("PY_SPY", "py-spy"), "record", "--nonblocking",
                         "-r", "2000", "-f", "raw", "-o", str(Path(options.pyspy) / f"{name}.txt"),
                         "-p", str(worker.pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(1.0)
                    bench.run_round(client, name, options.tasks)
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
                results[name] = row
                print_row(name, row, options.threads_detail)
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
            log.close()
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=2, default=str) + "\n")


def _ir(pid: int) -> int:
    """Instructions the callgrind-run process ``pid`` ran so far, all threads summed."""
    out = subprocess.run(
        ["callgrind_control", "-e", "Ir", str(pid)], capture_output=True, text=True, check=True
    ).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if line.startswith("PID "):
            mine = line.startswith(f"PID {pid}:")
        elif mine and (m := re.match(r"\s*Th \d+\s+([\d,]+)", line)):
            total += int(m.group(1).replace(",", ""))
    assert total, out
    return total


def instructions(bench: Bench, client: Any, name: str, pid: int) -> float:
    """Instructions per task the worker (under callgrind) ran in a round of ``name``."""
    before = _ir(pid)
    bench.run_round(client, name, bench.options.tasks)
    return (_ir(pid) - before) / bench.options.tasks


def proc_round(
    bench: Bench, client: Any, name: str, pid: int, locks: Any, broker: Any, lock_client: Any
) -> dict[str, Any]:
    """One round of ``name`` measured from /proc (no tracer attached): per-task figures."""
    n = bench.options.tasks
    servers = (("lock", locks), ("broker", broker))
    t0 = threads(pid)
    s0 = {k: threads(p.process.pid) for k, p in servers}
    c0 = command_calls(lock_client)
    seconds = bench.run_round(client, name, n, pid if bench.options.backlog else None)
    t1 = threads(pid)
    s1 = {k: threads(p.process.pid) for k, p in servers}
    c1 = command_calls(lock_client)
    calls = {k: (v - c0.get(k, 0)) / n for k, v in c1.items() if v != c0.get(k, 0)}
    calls["info"] = calls.get("info", 0) - 1 / n
    return {
        "wall_us": seconds / n * 1e6,
        "threads": thread_delta(t0, t1, n, pid),
        "servers": {
            k: {
                "cpu_ns": (
                    sum(t["cpu_ns"] for t in s1[k].values())
                    - sum(t["cpu_ns"] for t in s0[k].values())
                )
                / n
            }
            for k in s0
        },
        "lock_cmds": {k: v for k, v in calls.items() if abs(v) > 1e-9},
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over rounds (per thread name: each figure's own median)."""
    med = statistics.median
    names = {t for r in rows for t in r["threads"]}
    zero = {"cpu_ns": 0.0, "vol": 0.0, "invol": 0.0}
    return {
        "rounds": len(rows),
        "wall_us": med(r["wall_us"] for r in rows),
        "worker_cpu_ns": med(sum(t["cpu_ns"] for t in r["threads"].values()) for r in rows),
        "worker_cpu_ns_rounds": [sum(t["cpu_ns"] for t in r["threads"].values()) for r in rows],
        "threads": {
            t: {k: med(r["threads"].get(t, zero)[k] for r in rows) for k in zero} for t in names
        },
        "servers": {
            k: {"cpu_ns": med(r["servers"][k]["cpu_ns"] for r in rows)} for k in rows[0]["servers"]
        },
        "lock_cmds": rows[-1]["lock_cmds"],
    }


def print_row(name: str, row: dict[str, Any], detail: bool) -> None:
    print(f"\n== {name}")
    if "threads" in row:
        rounds = ", ".join(f"{ns / 1000:.0f}" for ns in row["worker_cpu_ns_rounds"])
        print(
            f"wall {row['wall_us']:.0f} us/task; worker CPU {row['worker_cpu_ns'] / 1000:.1f}"
            f" us/task (median of {row['rounds']} rounds: {rounds})"
        )
        for tname, t in sorted(row["threads"].items(), key=lambda kv: -kv[1]["cpu_ns"]):
            if t["cpu_ns"] or t["vol"] or t["invol"] or detail:
                print(
                    f"  thread {tname:28s} cpu {t['cpu_ns'] / 1000:8.1f} us"
                    f"  vol {t['vol']:.3f}  invol {t['invol']:.3f}"
                )
        for k, s in row["servers"].items():
            print(f"  {k}-server cpu {s['cpu_ns'] / 1000:.1f} us/task")
        print("  lock cmds/task: " + ", ".join(f"{k} {v:.2f}" for k, v in row["lock_cmds"].items()))
    if "syscalls" in row:
        total = sum(row["syscalls"].values())
        print(f"  syscalls/task {total:.2f}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in row["syscalls"].items() if v >= 0.005
        ))  # fmt: skip
        for tname, calls in row["syscalls_by_thread"].items():
            print(f"    [{tname}] " + ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])
                if v >= 0.001
            ))  # fmt: skip
        print("  by peer: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(row["socket_by_peer"].items())
        ))  # fmt: skip


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
