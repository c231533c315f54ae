"""Task throughput on one real worker: plain task vs LockedTask vs celery-once vs celery-singleton.

One throwaway ``redis-server`` is the broker, the result backend (for the end marker only) and
every contender's lock store. One ``celery worker -P solo`` runs all four tasks; each round
sends ``TASKS`` tasks of each contender, every task on its own key (distinct arguments), in an
order rotated by one each round, and times from the first ``apply_async`` until a plain end
marker queued after them has run (solo runs them in order). Reported: the median over rounds of
tasks/s, its ratio to the plain task's median, the median of the per-round ratios, and the
microseconds each contender adds per task (1/median - 1/plain's median).

- ``plain``: ``@app.task`` (no lock);
- ``LockedTask``: ``base=LockedTask, lock_key="bench:{i}"``, store = the broker's Redis;
- ``QueueOnce``: celery-once, locks at enqueue, unlocks in ``after_return``;
- ``Singleton``: celery-singleton, locks at enqueue, unlocks when the task ends.

Run: ``python -m benchmarks.bench_task_throughput [--tasks 300 --rounds 5]`` (``--json PATH``
also writes the results for ``benchmarks/plot.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import celery
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_lease import LockedTask

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 30.0  # seconds for the worker to log "ready."


def make_app(url: str) -> Celery:
    """The benchmark app; the worker builds it from ``BENCH_REDIS_URL``."""
    app = Celery("bench", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        worker_prefetch_multiplier=16,
        broker_connection_retry_on_startup=True,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url}},
        singleton_backend_url=url,
    )

    @app.task(name="bench.plain", shared=False)
    def plain(i: int) -> None:
        return None

    @app.task(name="bench.locked", base=LockedTask, lock_key="bench:{i}", shared=False)
    def locked_task(i: int) -> None:
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

    return app


if os.environ.get("BENCH_REDIS_URL"):
    app = make_app(os.environ["BENCH_REDIS_URL"])

CONTENDERS = {
    "plain": "bench.plain",
    "LockedTask": "bench.locked",
    "QueueOnce": "bench.once",
    "Singleton": "bench.singleton",
}


def one_round(client: Celery, task_name: str, first: int, count: int) -> float:
    """Tasks/s for ``count`` tasks of ``task_name`` on keys ``first..first+count-1``."""
    task = client.tasks[task_name]
    done = client.tasks["bench.done"]
    started = time.perf_counter()
    for i in range(first, first + count):
        task.apply_async((i,))
    done.apply_async().get(timeout=120, interval=0.005)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=300, help="tasks per contender per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    options = parser.parse_args()

    from benchmarks._redis_server import redis_server

    with redis_server() as server:
        url = server.url
        log = server.directory / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "benchmarks.bench_task_throughput:app",
                    "worker",
                    "-P",
                    "solo",
                    "--loglevel",
                    "WARNING",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
                cwd=ROOT,
                env={**os.environ, "BENCH_REDIS_URL": url, "PYTHONPATH": str(ROOT)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            client = make_app(url)
            client.tasks["bench.done"].apply_async().get(timeout=READY_TIMEOUT, interval=0.05)
            names = list(CONTENDERS)
            rates: dict[str, list[float]] = {n: [] for n in names}
            key = 0
            for round_no in range(options.rounds + 1):  # round 0 warms up and is dropped
                order = names[round_no % len(names) :] + names[: round_no % len(names)]
                for name in order:
                    rate = one_round(client, CONTENDERS[name], key, options.tasks)
                    key += options.tasks
                    if round_no:
                        rates[name].append(rate)
        finally:
            worker.terminate()
            worker.wait(30)

    plain = statistics.median(rates["plain"])
    print(
        f"Task throughput, 1 solo worker, Redis broker ({platform.python_version()},"
        f" {options.tasks} tasks x {options.rounds} rounds per contender, distinct keys)\n"
    )
    print(
        "| contender | median tasks/s | ratio of medians | median per-round ratio | added us/task |"
    )
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name in names:
        ratios = [r / p for r, p in zip(rates[name], rates["plain"], strict=True)]
        median = statistics.median(rates[name])
        added = 1e6 / median - 1e6 / plain
        print(
            f"| {name} | {median:,.0f} | {median / plain:.2f}x | {statistics.median(ratios):.2f}x"
            f" | {added:,.0f} |"
        )
        rows.append(
            {
                "name": name,
                "median_per_s": median,
                "ratio": median / plain,
                "paired_ratio": statistics.median(ratios),
                "added_us_per_task": added,
                "per_round_per_s": rates[name],
            }
        )
    if options.json:
        results = {
            "benchmark": "task_throughput",
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "celery": celery.__version__},
            "params": {"tasks": options.tasks, "rounds": options.rounds},
            "baseline": "plain",
            "contenders": rows,
        }
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
