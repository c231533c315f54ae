"""Our Python per task: a LockedTask traced as the worker traces it, against the plain task.

No broker and no worker process: each task is run by Celery's own tracer (``build_tracer``, as
``fast_trace_task`` calls it in a worker, with the worker's stack protection installed), so the
difference between the two is what celery-lease adds in the worker's thread, per task. The lock
store is chosen with ``--store``:

- ``null`` (default): a store whose calls do nothing (a counter for the token): our Python only;
- ``memory``: :class:`~celery_lease.MemoryLockStore`;
- ``redis``: :class:`~celery_lease.stores.redis.RedisLockStore` on a throwaway redis-server
  (the round trips included);
- ``sqlite``: :class:`~celery_lease.stores.sqlite.SQLiteLockStore` on a file in a temporary
  folder (the embedded default's store).

The process passes for a solo worker's (the pool label the worker's start-up check sets), so a
release takes the path it takes there: sent without waiting for the reply when the result is
ignored (the default), answered before the result is stored with ``--results`` (the task stores
its result; the app has no backend, so storing it costs Celery next to nothing).

Interleaved, paired blocks (the protocol of ``benchmarks.paired_stats``): each of ``--rounds``
rounds runs one block of ``--tasks`` executions of each task, in an order drawn afresh every
round from ``--seed`` (printed; drawn when not given), so a drift of the machine hits both
alike. Printed: the median us per task of each over the rounds, the us LockedTask adds per task
(its block's us per task less plain's in the same round) and its speed as a fraction of plain's
(plain's us per task over LockedTask's in the same round), each as the median over rounds with a
95% bootstrap interval of that median (``[low, high]``).
``--early``: each LockedTask execution is preceded by what a solo worker does when its message
arrives (``early_acquire.on_task_received``, which sends the acquire on a store that can:
Redis), so the figures include the receipt's work and the run reads the reply sent there.
``--profile`` runs ``--tasks`` LockedTask executions under cProfile instead and prints the top
functions by own time and by cumulative time. ``--only plain|LockedTask --count N`` warms both
up, runs ``N`` executions of one, untimed, and exits: the loop ``benchmarks.callgrind_task`` runs
under ``valgrind --tool=callgrind`` to count instructions per task.

Run: ``python -m benchmarks.bench_task_overhead [--store null|memory|redis|sqlite] [--tasks 2000]
[--rounds 60] [--seed S] [--profile] [--results] [--early] [--only plain|LockedTask --count N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import pstats
import random
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from celery import Celery
from celery.app.trace import build_tracer, setup_worker_optimizations

from benchmarks import paired_stats
from celery_lease import LockedTask, LockStore, MemoryLockStore


class NullStore:
    """A store that takes no time: every acquire succeeds with the next token."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return next(self._tokens)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        return [True] * len(items)

    def release(self, key: str, owner: str) -> None:
        return None


@contextlib.contextmanager
def make_store(kind: str) -> Iterator[LockStore]:
    if kind == "null":
        yield NullStore()
    elif kind == "memory":
        yield MemoryLockStore()
    elif kind == "redis":
        from benchmarks._redis_server import redis_server
        from celery_lease.stores.redis import RedisLockStore

        with redis_server() as server:
            yield RedisLockStore(server.url)
    elif kind == "sqlite":
        import tempfile

        from celery_lease.stores.sqlite import SQLiteLockStore

        with tempfile.TemporaryDirectory() as folder:
            yield SQLiteLockStore(f"{folder}/leases.sqlite3")
    else:
        raise SystemExit(f"--store={kind!r}: use null, memory, redis or sqlite")


def make_tracers(
    store: LockStore, results: bool = False, early: bool = False
) -> dict[str, Callable[[int], Any]]:
    """``{name: run_one(i)}``: one traced execution of the plain / locked task per call;
    ``results``: the tasks store their results (else ``task_ignore_result``); ``early``: each
    LockedTask execution is received first as a solo worker receives it (see ``--early``)."""
    from celery_lease._celery import early_acquire, pool

    pool.set_pool_label("solo")  # as the start-up check of a solo worker does
    app = Celery("overhead", broker="memory://", set_as_current=False)
    app.conf.update(task_ignore_result=not results, lease_store=store)

    @app.task(name="o.plain", shared=False)
    def plain(i: int) -> None:
        return None

    @app.task(name="o.locked", base=LockedTask, lock_key="o:{i}", shared=False)
    def locked_task(i: int) -> None:
        return None

    setup_worker_optimizations(app, hostname="bench@host")
    tracers: dict[str, Callable[[int], Any]] = {}
    for name, task in (("plain", plain), ("LockedTask", locked_task)):
        trace = build_tracer(task.name, task, app.loader, "bench@host", app=app)

        receive = early and name == "LockedTask"

        def run_one(i: int, trace: Any = trace, task: Any = task, receive: bool = receive) -> Any:
            task_id = str(uuid.uuid4())
            if receive:  # what task_received carries, as far as the receiver reads it
                early_acquire.on_task_received(
                    request=types.SimpleNamespace(
                        task=app.tasks[task.name],  # the task itself, as a worker's request has
                        id=task_id,
                        eta=None,
                        args=[i],
                        kwargs={},
                        delivery_info={"exchange": "", "routing_key": "celery"},
                        hostname="bench@host",
                    )
                )
            request = {
                "id": task_id,
                "task": task.name,
                "args": (i,),
                "kwargs": {},
                "delivery_info": {"exchange": "", "routing_key": "celery"},
                "hostname": "bench@host",
                "is_eager": False,
            }
            return trace(task_id, (i,), {}, request)

        tracers[name] = run_one
    return tracers


def measure(run_one: Callable[[int], Any], first: int, count: int) -> float:
    """Microseconds per task for ``count`` executions on keys ``first..``."""
    started = time.perf_counter()
    for i in range(first, first + count):
        run_one(i)
    return (time.perf_counter() - started) / count * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="null", choices=("null", "memory", "redis", "sqlite"))
    parser.add_argument(
        "--tasks",
        type=int,
        default=2000,
        help="executions per block (one block of each task per round; default %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=60, help="default %(default)s")
    parser.add_argument(
        "--seed", help="seed of the block orders and the bootstrap (default: drawn, printed)"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile LockedTask instead")
    parser.add_argument("--top", type=int, default=30, help="rows of the profile to print")
    parser.add_argument(
        "--results", action="store_true", help="the tasks store their results (no backend)"
    )
    parser.add_argument(
        "--only",
        choices=("plain", "LockedTask"),
        help="run --count executions of this contender, untimed, and exit (for callgrind)",
    )
    parser.add_argument("--count", type=int, default=0, help="executions with --only")
    parser.add_argument(
        "--early", action="store_true", help="receive each LockedTask first (early acquire)"
    )
    options = parser.parse_args(argv)
    if options.count < 0:
        parser.error(f"--count={options.count}: use 0 or more")
    with make_store(options.store) as store:
        tracers = make_tracers(store, options.results, options.early)
        for name in tracers:  # warm up (caches, key functions, the renewer thread)
            measure(tracers[name], 0, 200)
        if options.only:
            run_one = tracers[options.only]
            for i in range(10_000_000, 10_000_000 + options.count):
                run_one(i)
            return
        if options.profile:
            profile = cProfile.Profile()
            profile.enable()
            measure(tracers["LockedTask"], 10_000_000, options.tasks)
            profile.disable()
            stats = pstats.Stats(profile, stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(options.top)
            stats.sort_stats("cumulative").print_stats(options.top)
            return
        seed = options.seed or str(random.SystemRandom().randrange(10**6))
        orders = paired_stats.block_orders(list(tracers), options.rounds, random.Random(seed))
        us: dict[str, list[float]] = {name: [] for name in tracers}
        key = 1_000_000
        for order in orders:
            for name in order:
                us[name].append(measure(tracers[name], key, options.tasks))
                key += options.tasks
    print(report(us, options.store, options.tasks, seed))


def report(us: dict[str, list[float]], store: str, tasks: int, seed: str) -> str:
    """The printed summary of ``us`` (``{"plain": [...], "LockedTask": [...]}``, us per task
    of each round's block): medians over rounds with 95% bootstrap intervals."""
    each = {name: paired_stats.estimate(values, f"{seed}:{name}") for name, values in us.items()}
    added = paired_stats.estimate(
        paired_stats.paired_differences(us, "plain")["LockedTask"], f"{seed}:added"
    )
    speed = {name: [1.0 / v for v in values] for name, values in us.items()}
    ratio = paired_stats.estimate(
        paired_stats.paired_ratios(speed, "plain")["LockedTask"], f"{seed}:ratio"
    )
    rounds = len(us["plain"])
    return "\n".join(
        [
            f"Traced in-process, store={store}, {rounds} rounds of one {tasks}-task block each,"
            f" shuffled order (seed {seed}); median over rounds [95% interval]",
            f"  plain       {each['plain'].text(1)} us/task",
            f"  LockedTask  {each['LockedTask'].text(1)} us/task",
            f"  added       {added.text(1)} us/task (LockedTask less plain, same round)",
            f"  ratio       {ratio.text(2, 'x')} plain (plain's time over LockedTask's, same"
            " round)",
        ]
    )


if __name__ == "__main__":
    main()
