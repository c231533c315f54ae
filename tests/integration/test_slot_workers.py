"""Tasks with ``lock_limit`` on real ``celery worker`` processes: at most ``limit`` bodies of a
key at once, on the Redis and the PostgreSQL store.

The worker runs the app below (``-A`` this module, configured from ``SL_*`` environment
variables) on a throwaway ``redis-server`` (broker, results, and the counters the bodies meet
on); its lock store is that Redis or a scratch PostgreSQL database. Every body appends
``start`` and ``end`` records (``CLOCK_MONOTONIC`` times, token, slot, pid) to a file, and a
``task_prerun`` receiver appends ``asked`` (before the lease is asked for); the test turns them
into holdings for the exclusion checker (:func:`tests.faults.harness.check` with the limit),
which counts the bodies of a key that ran at once and checks the tokens.

Bodies meet in batches instead of sleeping: the ``n``-th body of a key to enter belongs to batch
``(n - 1) // batch`` and waits (``BLPOP``) until its whole batch has entered; the body that
completes the batch wakes it. A batch of ``limit`` bodies is therefore inside at once (the peak
reaches the limit), and no batch can wait on a slot held by an earlier one (an earlier batch is
complete, so its bodies are leaving).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import WorkerLostError
from celery.signals import task_prerun

from celery_lease import LockedTask, store_from_url
from celery_lease.stores.slots import slot_key
from tests.faults.harness import check, now
from tests.fixtures_redis import RedisServer
from tests.integration.workers import CeleryWorker
from tests.support import complete_lines

pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.redis]

READY_TIMEOUT = 60.0  # seconds for a worker to log "ready." on a loaded machine
TIMEOUT = 30.0  # seconds a test waits for its results
WAIT = 25.0  # seconds a body waits for its batch, a call for a slot
LIMIT = 3
FREED_BOUND = 1.0  # seconds: a killed child's slot (ttl 30 s) is freed by the main process
POLL = 0.02


# The app the worker runs -----------------------------------------------------------------------

_counters: redis.Redis | None = None
_counters_pid = 0


def _redis(url: str) -> redis.Redis:
    """This process's client of the counters' Redis (a pool child makes its own)."""
    global _counters, _counters_pid
    if _counters is None or _counters_pid != os.getpid():
        _counters, _counters_pid = redis.Redis.from_url(url), os.getpid()
    return _counters


def _record(directory: Path, **event: Any) -> None:
    """Append one JSON line to the worker's event file (one ``write``: lines never interleave)."""
    line = json.dumps({**event, "at": now(), "pid": os.getpid()}) + "\n"
    fd = os.open(directory / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _meet(counters: redis.Redis, key: str, total: int, batch: int) -> None:
    """Wait until every body of this body's batch of ``key`` has entered (see the module)."""
    entered = int(counters.incr(f"entered:{key}"))
    index = (entered - 1) // batch
    size = min(batch, total - index * batch)
    gate = f"go:{key}:{index}"
    if entered == index * batch + size:  # this body completes its batch: open its gate
        counters.rpush(gate, *["go"] * size)
    if counters.blpop([gate], timeout=WAIT) is None:
        raise RuntimeError(f"{key}: batch {index} never filled ({entered} of {total} entered)")


def make_app(broker: str, store: str, counters_url: str, directory: str, queue: str) -> Celery:
    """The test app: the worker (from the environment) and the test process build it alike."""
    app = Celery("sl", broker=broker, backend=broker, set_as_current=False)
    out = Path(directory)
    app.conf.update(
        lease_store=store,
        # A throwaway redis-server started by this session: no restart grace (see docs/stores.md).
        lease_restart_grace=0,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
    )

    def body(task: Any, total: int, batch: int) -> str:
        request = task.request
        _record(
            out, id=request.id, event="start", key=request.lock_key,
            token=request.lock_token, slot=request.lock_slot,
        )  # fmt: skip
        _meet(_redis(counters_url), request.lock_key, total, batch)
        _record(out, id=request.id, event="end")
        return "done"

    @app.task(
        name="sl.work", base=LockedTask, bind=True, shared=False, lock_key="sl:{run}",
        lock_limit=LIMIT, lock_ttl="30s", lock_wait=WAIT,
    )  # fmt: skip
    def work(self: Any, run: str, total: int, batch: int) -> str:
        """One of ``total`` calls of ``run``, meeting the others in batches of ``batch``."""
        return body(self, total, batch)

    @app.task(
        name="sl.victim", base=LockedTask, bind=True, shared=False, lock_key="sl:{run}",
        lock_limit=LIMIT, lock_ttl="30s", lock_wait=WAIT,
    )  # fmt: skip
    def victim(self: Any, run: str) -> None:
        """Hold a slot of ``run``'s key until the test kills this process."""
        request = self.request
        _record(
            out, id=request.id, event="start", key=request.lock_key,
            token=request.lock_token, slot=request.lock_slot,
        )  # fmt: skip
        _redis(counters_url).blpop([f"never:{run}"], timeout=WAIT)

    @app.task(
        name="sl.per_account", base=LockedTask, bind=True, shared=False,
        lock_key="acct:{run}:{account_id}",
        lock_limit=lambda account_id, **_: 3 if account_id == "premium" else 1,
        lock_ttl="30s", lock_wait=WAIT,
    )  # fmt: skip
    def per_account(self: Any, account_id: str, *, run: str, total: int, batch: int) -> str:
        """A call for ``account_id``: premium accounts run three at once, others one."""
        return body(self, total, batch)

    def asked(sender: Any = None, task_id: str = "", **_: Any) -> None:
        """Before the lease is asked for: the earliest moment of the acquisition."""
        if sender is not None and sender.name.startswith("sl."):
            _record(out, id=task_id, event="asked")

    task_prerun.connect(asked, weak=False)
    return app


if os.environ.get("SL_BROKER"):
    app = make_app(
        os.environ["SL_BROKER"], os.environ["SL_STORE"], os.environ["SL_COUNTERS"],
        os.environ["SL_DIR"], os.environ["SL_QUEUE"],
    )  # fmt: skip


# The harness -----------------------------------------------------------------------------------


@dataclass
class Worker:
    """A running worker of this module's app, a client app like it, and its lock store."""

    name: str
    app: Celery
    store: Any  # a store with SupportsInspection's get()
    counters: redis.Redis
    directory: Path
    started: CeleryWorker

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.started.text().splitlines()[-lines:])

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in complete_lines(self.directory / "events.jsonl")]

    def started_bodies(self, ids: set[str], count: int) -> list[dict[str, Any]]:
        """Wait until ``count`` of the calls ``ids`` have started their body; their starts."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            starts = [e for e in self.events() if e["event"] == "start" and e["id"] in ids]
            if len(starts) >= count:
                return starts
            assert self.started.process.poll() is None, f"worker exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{len(starts)} of {count} started:\n{self.tail()}"
            time.sleep(POLL)

    def holdings(self, ids: set[str], ended: dict[str, float] | None = None) -> list[dict]:
        """The checker's records of the calls ``ids``: one holding per body, from its start to
        its end (or to the time in ``ended``), asked for at its ``task_prerun``."""
        by_id: dict[str, dict[str, Any]] = {}
        for event in self.events():
            if event["id"] in ids:
                by_id.setdefault(event["id"], {})[event["event"]] = event
        records = []
        for task_id, seen in by_id.items():
            start = seen["start"]
            end = (ended or {}).get(task_id, seen.get("end", {}).get("at"))
            assert end is not None, f"{task_id}: no end recorded: {seen}"
            records.append({
                "holder": f"{task_id[:8]}@{start['pid']}", "key": start["key"],
                "token": start["token"], "slot": start["slot"], "asked_at": seen["asked"]["at"],
                "acquired_at": start["at"], "confirmed_at": end,
            })  # fmt: skip
        return records

    def results(self, calls: list[Any]) -> list[Any]:
        """Every call's result, within one overall deadline."""
        deadline = time.monotonic() + TIMEOUT
        try:
            return [c.get(timeout=max(0.1, deadline - time.monotonic())) for c in calls]
        except Exception as exc:
            raise AssertionError(f"{exc!r}; log:\n{self.tail()}") from exc


def run_id() -> str:
    return "r" + uuid.uuid4().hex[:10]


def _start(
    name: str, pool: str, concurrency: int, store: str, server: RedisServer, db: int, tmp: Path
) -> Iterator[Worker]:
    base = f"redis://127.0.0.1:{server.port}"
    broker, counters_url = f"{base}/{db}", f"{base}/13"
    queue = f"sl-{name}-{uuid.uuid4().hex[:6]}"
    env = {
        "SL_BROKER": broker, "SL_STORE": store, "SL_COUNTERS": counters_url,
        "SL_DIR": str(tmp), "SL_QUEUE": queue,
    }  # fmt: skip
    started = CeleryWorker(
        f"{__name__}:app", tmp / "worker.log", pool=pool, concurrency=concurrency,
        name=f"{queue}", env=env,
    )  # fmt: skip
    client = make_app(broker, store, counters_url, str(tmp), queue)
    counters = redis.Redis.from_url(counters_url)
    try:
        started.wait_ready(READY_TIMEOUT)
        yield Worker(name, client, store_from_url(store), counters, tmp, started)
    finally:
        started.stop()
        client.close()
        counters.close()


STORES = ["redis", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="module", params=STORES)
def threads_worker(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    """A threads worker (-c 10) whose lock store is the throwaway Redis or PostgreSQL."""
    kind: str = request.param
    if kind == "redis":
        store, db = f"redis://127.0.0.1:{redis_server.port}/10", 10
    else:
        store, db = request.getfixturevalue("pg_database_dsn"), 11
    tmp = tmp_path_factory.mktemp(f"slots-threads-{kind}")
    yield from _start(kind, "threads", 10, store, redis_server, db, tmp)


@pytest.fixture(scope="module", params=STORES)
def prefork_worker(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    """A prefork worker (-c 4) whose lock store is the throwaway Redis or PostgreSQL."""
    kind: str = request.param
    if kind == "redis":
        store, db = f"redis://127.0.0.1:{redis_server.port}/12", 12
    else:
        store, db = request.getfixturevalue("pg_database_dsn"), 14
    tmp = tmp_path_factory.mktemp(f"slots-prefork-{kind}")
    yield from _start(f"prefork-{kind}", "prefork", 4, store, redis_server, db, tmp)


def _checked(records: list[dict], limit: int | dict[str, int]) -> dict[str, int]:
    """Run the exclusion checker over ``records``: no violation; the peak per key."""
    report = check("worker", records, [], limit=limit)
    assert report.violations == [], "\n".join(report.violations[:20])
    return report.peaks


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


# The tests -------------------------------------------------------------------------------------


class TestLimitOnThreads:
    def test_thirty_calls_run_three_at_once_never_four(self, threads_worker: Worker) -> None:
        """30 calls of one key with lock_limit=3 on 10 threads: all done, at most three bodies
        at once, and three at once (the peak is the limit), in the slots 0, 1 and 2."""
        run, total = run_id(), 30
        calls = [threads_worker.app.send_task("sl.work", (run, total, LIMIT)) for _ in range(total)]
        assert threads_worker.results(calls) == ["done"] * total
        records = threads_worker.holdings({c.id for c in calls})
        assert len(records) == total
        assert _checked(records, LIMIT) == {f"sl:{run}": LIMIT}
        assert {r["slot"] for r in records} == set(range(LIMIT))

    def test_a_callable_limit_is_each_keys_own(self, threads_worker: Worker) -> None:
        """lock_limit=lambda account_id: 3 if premium else 1: calls of both accounts at once on
        10 threads; the premium key runs three bodies at once, the other one, never more."""
        run = run_id()
        task = threads_worker.app.tasks["sl.per_account"]
        premium = [
            task.apply_async(("premium",), {"run": run, "total": 9, "batch": 3}) for _ in range(9)
        ]
        basic = [
            task.apply_async(("basic",), {"run": run, "total": 4, "batch": 1}) for _ in range(4)
        ]
        calls = [c for pair in zip(premium, basic, strict=False) for c in pair] + premium[4:]
        assert threads_worker.results(calls) == ["done"] * len(calls)
        records = threads_worker.holdings({c.id for c in calls})
        limits = {f"acct:{run}:premium": 3, f"acct:{run}:basic": 1}
        assert _checked(records, limits) == limits
        assert {r["slot"] for r in records if r["key"].endswith(":basic")} == {0}

    def test_every_token_exceeds_all_earlier_tokens_of_the_key_across_slots(
        self, threads_worker: Worker
    ) -> None:
        """A body's token is larger than the token of every body of the key that had started
        before this call asked for its slot, whichever slot either held."""
        run, total = run_id(), 15
        calls = [threads_worker.app.send_task("sl.work", (run, total, LIMIT)) for _ in range(total)]
        assert threads_worker.results(calls) == ["done"] * total
        records = threads_worker.holdings({c.id for c in calls})
        tokens = [r["token"] for r in records]
        assert len(set(tokens)) == total and min(tokens) > 0
        across_slots = 0
        for later in records:
            for earlier in records:
                if earlier["acquired_at"] < later["asked_at"]:
                    assert later["token"] > earlier["token"], (earlier, later)
                    across_slots += earlier["slot"] != later["slot"]
        assert across_slots > 0  # the order held between different slots, not only within one


class TestKilledChildOnPrefork:
    def test_its_slot_is_freed_at_once_and_the_other_calls_complete(
        self, prefork_worker: Worker
    ) -> None:
        """prefork -c 4, lock_limit=3: a child SIGKILLed while holding a slot; the worker's main
        process frees that slot within a second (its ttl is 30 s), and twelve more calls all
        complete, never more than three bodies at once (three while the victim still held)."""
        worker, run, total = prefork_worker, run_id(), 12
        victim = worker.app.send_task("sl.victim", (run,))
        (start,) = worker.started_bodies({victim.id}, 1)
        held = worker.store.get(slot_key(f"sl:{run}", start["slot"]))
        assert held is not None and held.token == start["token"]
        # Batches of two: the victim's slot plus two is the limit until it dies.
        calls = [worker.app.send_task("sl.work", (run, total, LIMIT - 1)) for _ in range(total)]
        worker.started_bodies({c.id for c in calls}, LIMIT - 1)
        os.kill(start["pid"], signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT
        while not _dead(start["pid"]):
            assert time.monotonic() < deadline, f"{start['pid']} still alive"
            time.sleep(0.002)
        killed_at = now()
        while True:
            now_held = worker.store.get(slot_key(f"sl:{run}", start["slot"]))
            if now_held is None or now_held.owner != held.owner:
                break
            assert now() - killed_at < FREED_BOUND, f"slot still held; log:\n{worker.tail()}"
            time.sleep(POLL)
        with pytest.raises(WorkerLostError):
            victim.get(timeout=TIMEOUT)
        assert worker.results(calls) == ["done"] * total
        records = worker.holdings({victim.id} | {c.id for c in calls}, {victim.id: killed_at})
        assert _checked(records, LIMIT) == {f"sl:{run}": LIMIT}
