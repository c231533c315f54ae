"""Would an asynchronous release shorten the task's critical path? Three ways, interleaved.

The task-throughput benchmark puts two round trips on a locked task's critical path: the
acquire before the body and the release after it. This one measures what taking the release off
that path would save, before anybody builds it into the engine. Each cycle is what a worker does
per task: ``store.acquire()``, then ``--work-us`` microseconds of Python (standing in for
Celery's own per-task work, which holds the GIL) and one ``PING`` on a second client (standing
in for the broker I/O), then the release, done one of three ways:

- ``sync``: ``store.release()`` on the calling thread (what celery-lease does);
- ``thread``: the release call handed to a helper thread (``deque`` + ``Condition``), as the
  issue's stretch goal suggests ("release handed to the renewer thread");
- ``send-only``: the calling thread sends the release script on a pooled connection and hands
  the connection to the helper thread, which reads the reply and returns the connection; the
  release reaches the server before the caller goes on, so ordering is kept.

Every run waits for the helper thread to drain before its clock stops. Reported per way: median
microseconds per cycle over the rounds, and the median per-round ratio to ``sync`` (below 1.0 =
faster than the synchronous release).

Run: ``python -m benchmarks.bench_release_offload [--rounds 15 --cycles 2000 --work-us 0 500]``.
"""

from __future__ import annotations

import argparse
import collections
import platform
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from benchmarks._redis_server import redis_server
from celery_lease.stores.redis import RELEASE_SCRIPT, SIGNAL_TTL_MS, RedisLockStore

ROUNDS = 15
CYCLES = 2000
TTL_MS = 30_000


class Helper:
    """One daemon thread that runs queued callables in order; ``drain()`` waits for the queue."""

    def __init__(self) -> None:
        self._queue: collections.deque[Callable[[], Any]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> None:
        with self._cond:
            self._queue.append(fn)
            self._busy += 1
            self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                fn = self._queue.popleft()
            fn()
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()


def spin(microseconds: float) -> None:
    """Busy Python for ``microseconds`` (holds the GIL, like Celery's own per-task code)."""
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        pass


def make_ways(store: RedisLockStore, broker: redis.Redis, work_us: float) -> dict[str, Any]:
    client = store.client
    assert isinstance(client, redis.Redis)
    pool = client.connection_pool
    helper = Helper()
    release_sha = client.script_load(RELEASE_SCRIPT)

    def task(key: str, owner: str) -> None:
        if store.acquire(key, owner, TTL_MS) is None:
            raise RuntimeError(f"{key} was held")
        spin(work_us)
        broker.ping()

    def sync(n: int) -> None:
        for _ in range(n):
            key, owner = "sync:" + secrets.token_hex(6), secrets.token_hex(8)
            task(key, owner)
            store.release(key, owner)

    def thread(n: int) -> None:
        for _ in range(n):
            key, owner = "thread:" + secrets.token_hex(6), secrets.token_hex(8)
            task(key, owner)
            helper.submit(lambda key=key, owner=owner: store.release(key, owner))
        helper.drain()

    def send_only(n: int) -> None:
        for _ in range(n):
            key, owner = "send:" + secrets.token_hex(6), secrets.token_hex(8)
            task(key, owner)
            conn = pool.get_connection()
            conn.send_command(
                "EVALSHA",
                release_sha,
                2,
                store.lease_key(key),
                store.signal_key(key),
                owner,
                SIGNAL_TTL_MS,
            )

            def finish(conn: Any = conn) -> None:
                try:
                    conn.read_response()
                finally:
                    pool.release(conn)

            helper.submit(finish)
        helper.drain()

    return {"sync": sync, "thread": thread, "send-only": send_only}


def measure(ways: dict[str, Any], rounds: int, cycles: int) -> dict[str, list[float]]:
    names = list(ways)
    per_cycle: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        ways[name](200)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            ways[name](cycles)
            per_cycle[name].append((time.perf_counter() - started) / cycles * 1e6)
    return per_cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument(
        "--work-us",
        type=float,
        nargs="+",
        default=[0.0, 500.0],
        help="microseconds of busy Python per cycle; one table per value (default: 0 500)",
    )
    args = parser.parse_args()
    print(
        f"Release on the critical path vs off it; {args.rounds} rounds x {args.cycles} cycles, "
        f"order rotated; Python {platform.python_version()}, redis-py {redis.__version__}"
    )
    with redis_server() as server:
        store = RedisLockStore(server.url)
        broker = server.client()
        for work_us in args.work_us:
            per_cycle = measure(make_ways(store, broker, work_us), args.rounds, args.cycles)
            base = per_cycle["sync"]
            print(f"\nwork per cycle: {work_us:.0f} us of Python + 1 PING")
            header = f"{'release':<12} {'median us/cycle':>16} {'min':>8} {'max':>8} {'x sync':>7}"
            print(header)
            print("-" * len(header))
            for name, values in per_cycle.items():
                ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
                print(
                    f"{name:<12} {statistics.median(values):>16.1f} {min(values):>8.1f} "
                    f"{max(values):>8.1f} {ratio:>7.3f}"
                )
        store.close()
        broker.close()
    print("x sync: median over rounds of (time per cycle / sync's time per cycle in that round)")


if __name__ == "__main__":
    main()
