"""Unique at enqueue: ``lock_unique="until_done"`` vs celery-once ``QueueOnce`` vs celery-singleton
``Singleton``, in one run, on the same throwaway servers.

Two throwaway ``redis-server``: one is the broker and result backend, the other holds every
contender's locks. Measured, for each contender (a ``plain`` task without a lock is the
baseline; ``LockedTask`` without ``lock_unique`` shows what the run lease alone costs):

- **enqueue, new key** (no worker running): ``apply_async`` calls, each on its own key (lock +
  publish), in calls/s;
- **enqueue, duplicate**: calls on one key already queued (nothing is published: ``QueueOnce``
  raises ``AlreadyQueued``, counted as a call; the two others return the holder's
  ``AsyncResult``), in calls/s;
- **end to end**: a ``-P solo`` worker; tasks on distinct keys, timed from the first
  ``apply_async`` of a chunk until a plain end marker queued after it has run, in tasks/s;
- **requests per call**: redis-py requests (broker and locks) per new-key call, in an untimed
  pass (``count_round_trips``).

The machine is shared and its load moves, so the contenders take turns in chunks of
``--chunk`` calls (250 tasks end to end), in an order rotated every chunk, and a round's rate is
its calls over the sum of its chunks' times. Printed: the median over ``--rounds`` rounds (round 0
warms up and is dropped) and the median of the per-round ratios to ``QueueOnce`` and
``Singleton`` (``x once``, ``x single``; new-key calls, duplicate calls, end to end), which load
affects least.

Run: ``python -m benchmarks.bench_unique [--calls 2000 --tasks 1000 --rounds 5] [--json PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import celery
from celery import Celery
from celery_once import AlreadyQueued, QueueOnce
from celery_singleton import Singleton

from celery_lease import LockedTask

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 60.0  # seconds for the worker to run the first end marker
ROUND_TIMEOUT = 600.0  # seconds for one round's end marker

CONTENDERS = {
    "plain": "bu.plain",
    "LockedTask": "bu.locked",
    "until_done": "bu.unique",
    "QueueOnce": "bu.once",
    "Singleton": "bu.singleton",
}


def make_app(env: dict[str, str]) -> Celery:
    """The benchmark app from ``BENCH_BROKER`` (also the result backend) and ``BENCH_LOCKS``."""
    locks = env["BENCH_LOCKS"]
    app = Celery(
        "bu", broker=env["BENCH_BROKER"], backend=env["BENCH_BROKER"], set_as_current=False
    )
    app.conf.update(
        task_ignore_result=True,
        worker_prefetch_multiplier=16,
        broker_connection_retry_on_startup=True,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": locks}},
        singleton_backend_url=locks,
        lease_store=locks,
    )

    @app.task(name="bu.plain", shared=False)
    def plain(i: int) -> None:
        return None

    @app.task(name="bu.locked", base=LockedTask, lock_key="bu:{i}", shared=False)
    def locked(i: int) -> None:
        return None

    @app.task(
        name="bu.unique", base=LockedTask, lock_key="bu:{i}", lock_unique="until_done",
        shared=False,
    )  # fmt: skip
    def unique(i: int) -> None:
        return None

    @app.task(name="bu.once", base=QueueOnce, shared=False)
    def once(i: int) -> None:
        return None

    @app.task(name="bu.singleton", base=Singleton, shared=False)
    def singleton(i: int) -> None:
        return None

    @app.task(name="bu.done", ignore_result=False, shared=False)
    def done() -> str:
        return "done"

    return app


if os.environ.get("BENCH_BROKER"):
    app = make_app(dict(os.environ))


def _call(task: Any, i: int) -> None:
    with contextlib.suppress(AlreadyQueued):  # QueueOnce's duplicate: counted as a call
        task.apply_async((i,))


def enqueue_chunk(client: Celery, name: str, first: int, count: int, duplicate: bool) -> float:
    """Seconds for ``count`` apply_async of ``name``: keys ``first..``, or key 0 (queued)."""
    task = client.tasks[CONTENDERS[name]]
    started = time.perf_counter()
    for i in range(first, first + count):
        _call(task, 0 if duplicate else i)
    return time.perf_counter() - started


def e2e_chunk(client: Celery, name: str, first: int, count: int) -> float:
    """Seconds for ``count`` tasks on keys ``first..`` through the running solo worker, until
    an end marker queued after them has run."""
    task = client.tasks[CONTENDERS[name]]
    started = time.perf_counter()
    for i in range(first, first + count):
        task.apply_async((i,))
    client.tasks["bu.done"].apply_async().get(timeout=ROUND_TIMEOUT, interval=0.002)
    return time.perf_counter() - started


def round_trips(client: Celery, name: str, first: int, count: int) -> float:
    """Requests sent (broker and locks) per new-key call, in an untimed pass."""
    from benchmarks._redis_server import count_round_trips

    task = client.tasks[CONTENDERS[name]]
    with count_round_trips() as counts:
        for i in range(first, first + count):
            _call(task, i)
    return sum(counts.values()) / count


@contextlib.contextmanager
def worker(env: dict[str, str], directory: Path) -> Iterator[None]:
    """A ``celery worker -P solo`` on the benchmark app, stopped when the block exits."""
    log = directory / "worker.log"
    argv = [
        sys.executable, "-m", "celery", "-A", "benchmarks.bench_unique:app", "worker",
        "-P", "solo", "--loglevel", "WARNING",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
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


def _rotated(names: list[str], by: int) -> list[str]:
    return names[by % len(names) :] + names[: by % len(names)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="enqueue calls per round")
    parser.add_argument("--tasks", type=int, default=1000, help="end-to-end tasks per round")
    parser.add_argument("--chunk", type=int, default=100, help="calls per interleaved chunk")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    options = parser.parse_args()
    from benchmarks._redis_server import redis_server

    names = list(CONTENDERS)
    phases = ("new", "duplicate", "e2e")
    rates: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names} for p in phases}
    trips: dict[str, float] = {}
    chunk = options.chunk
    with redis_server() as broker, redis_server() as locks:
        env = {"BENCH_BROKER": broker.url, "BENCH_LOCKS": locks.url}
        broker_client, lock_client = broker.client(), locks.client()
        client = make_app(env)

        def clean() -> None:
            broker_client.flushdb()
            lock_client.flushdb()

        key = 10**7
        for name in names:
            clean()
            trips[name] = round_trips(client, name, key, 200)
            key += 200
        # Enqueue: the contenders take turns, chunk by chunk, so load on the machine falls on
        # all alike; a round's rate is its calls over the sum of its chunks' times.
        for round_no in range(options.rounds + 1):  # round 0 warms up and is dropped
            for duplicate in (False, True):
                clean()
                spent = dict.fromkeys(names, 0.0)
                if duplicate:
                    for name in names:
                        _call(client.tasks[CONTENDERS[name]], 0)
                for step in range(options.calls // chunk):
                    for name in _rotated(names, step):
                        spent[name] += enqueue_chunk(client, name, key, chunk, duplicate)
                        key += chunk
                if round_no:
                    phase = "duplicate" if duplicate else "new"
                    for name in names:
                        rates[phase][name].append(options.calls / spent[name])
        clean()
        directory = Path(os.environ.get("TMPDIR", "/tmp"))
        with worker(env, directory):
            client.tasks["bu.done"].apply_async().get(timeout=READY_TIMEOUT, interval=0.05)
            e2e_chunk_size = max(chunk, 250)
            for round_no in range(options.rounds + 1):
                spent = dict.fromkeys(names, 0.0)
                for step in range(max(1, options.tasks // e2e_chunk_size)):
                    for name in _rotated(names, step + round_no):
                        spent[name] += e2e_chunk(client, name, key, e2e_chunk_size)
                        key += e2e_chunk_size
                if round_no:
                    done = max(1, options.tasks // e2e_chunk_size) * e2e_chunk_size
                    for name in names:
                        rates["e2e"][name].append(done / spent[name])
        client.close()

    def paired(phase: str, name: str, other: str) -> float:
        return statistics.median(
            a / b for a, b in zip(rates[phase][name], rates[phase][other], strict=True)
        )

    rows = []
    print(
        f"\nunique at enqueue: {options.calls} calls and {options.tasks} tasks per round,"
        f" {options.rounds} rounds, contenders interleaved in chunks; medians over rounds;"
        " end to end on 1 solo worker; Redis broker, Redis locks (two servers)"
    )
    print(
        f"{'contender':<12}{'new calls/s':>13}{'dup calls/s':>13}{'e2e tasks/s':>13}"
        f"{'reqs/call':>11}{'new x once':>12}{'new x single':>14}{'dup x once':>12}"
        f"{'dup x single':>14}{'e2e x once':>12}{'e2e x single':>14}"
    )
    for name in names:
        row = {
            "contender": name,
            "enqueue_new_calls_per_s": statistics.median(rates["new"][name]),
            "enqueue_duplicate_calls_per_s": statistics.median(rates["duplicate"][name]),
            "e2e_tasks_per_s": statistics.median(rates["e2e"][name]),
            "requests_per_call": trips[name],
            "new_vs_QueueOnce": paired("new", name, "QueueOnce"),
            "new_vs_Singleton": paired("new", name, "Singleton"),
            "duplicate_vs_QueueOnce": paired("duplicate", name, "QueueOnce"),
            "duplicate_vs_Singleton": paired("duplicate", name, "Singleton"),
            "e2e_vs_QueueOnce": paired("e2e", name, "QueueOnce"),
            "e2e_vs_Singleton": paired("e2e", name, "Singleton"),
        }
        rows.append(row)
        print(
            f"{name:<12}{row['enqueue_new_calls_per_s']:>13.0f}"
            f"{row['enqueue_duplicate_calls_per_s']:>13.0f}{row['e2e_tasks_per_s']:>13.0f}"
            f"{row['requests_per_call']:>11.1f}{row['new_vs_QueueOnce']:>12.2f}"
            f"{row['new_vs_Singleton']:>14.2f}{row['duplicate_vs_QueueOnce']:>12.2f}"
            f"{row['duplicate_vs_Singleton']:>14.2f}{row['e2e_vs_QueueOnce']:>12.2f}"
            f"{row['e2e_vs_Singleton']:>14.2f}"
        )
    print(f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if options.json:
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(
            json.dumps(
                {
                    "benchmark": "unique",
                    "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "versions": {
                        "python": platform.python_version(),
                        "celery": celery.__version__,
                    },
                    "params": vars(options),
                    "contenders": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
