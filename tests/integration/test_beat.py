"""Real ``celery beat`` (and ``celery worker -B``) processes with the leased scheduler.

Every beat schedules one entry every second onto a queue nobody consumes, on the shared Redis
(a unique queue and ``lease_key_prefix`` per test); each message carries the wall time it was
sent at (its argument) and its beat's fencing token (header ``lease_beat_token``). The tests
read the messages on the broker: one sender at a time, no tick sent twice (two sends less than
half an interval apart), and the take-over time after the active beat was killed, stopped or
shut down (printed: run with ``-s`` to see the figures).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from secrets import token_hex

import pytest
import redis

from celery_lease import LockStore, store_from_url
from celery_lease._core.owners import parse_owner
from celery_lease.beat import TOKEN_HEADER
from tests.faults.harness import wait_stopped
from tests.integration.workers import ROOT, stop_worker

pytestmark = [pytest.mark.worker, pytest.mark.slow]

BROKER = os.environ.get("CELERY_LEASE_BEAT_BROKER", "redis://127.0.0.1:6379/0")
APP = "tests.integration.beat_app:app"
TTL = 3.0
INTERVAL = 1.0
TIMEOUT = 60.0
POLL = 0.05
MARGIN = 2.0
"""Seconds of slack on a take-over bound, for process start-up and a loaded machine."""


@dataclass(frozen=True)
class Sent:
    token: int
    at: float


class Deployment:
    """Beats of one test: their store, queue, key prefix, processes and logs."""

    def __init__(
        self, store_url: str, directory: Path, app: str = APP, extra: dict[str, str] | None = None
    ) -> None:
        self.app = app
        self.extra = extra or {}
        self.store_url = store_url
        self.directory = directory
        self.prefix = f"beat-it-{token_hex(4)}:"
        self.queue = f"beat-it-{token_hex(4)}"
        self.key = self.prefix + "celery-beat:beat-it"
        self.redis = redis.Redis.from_url(BROKER)
        self.store: LockStore = store_from_url(store_url)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def environ(self) -> dict[str, str]:
        return {
            **os.environ,
            "BEAT_BROKER": BROKER,
            "BEAT_STORE": self.store_url,
            "BEAT_PREFIX": self.prefix,
            "BEAT_QUEUE": self.queue,
            "BEAT_TTL": str(TTL),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **self.extra,
        }

    def start(self, name: str, *command: str) -> subprocess.Popen[bytes]:
        with open(self.directory / f"{name}.log", "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", self.app, *command],
                cwd=self.directory, env=self.environ(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.processes[name] = process
        return process

    def beat(self, name: str) -> subprocess.Popen[bytes]:
        """``celery beat`` with a schedule file of its own."""
        return self.start(
            name, "beat", "-s", str(self.directory / f"schedule-{name}"), "--pidfile", "",
            "--loglevel", "INFO",
        )  # fmt: skip

    def worker_with_beat(self, name: str) -> subprocess.Popen[bytes]:
        """``celery worker -B`` consuming another queue, with a schedule file of its own."""
        return self.start(
            name, "worker", "-B", "-s", str(self.directory / f"schedule-{name}"),
            "-n", f"{name}@%h", "-P", "solo", "-Q", self.queue + "-work", "--loglevel", "INFO",
            "--without-mingle", "--without-gossip",
        )  # fmt: skip

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")

    def sent(self) -> list[Sent]:
        """Every tick on the queue, by the time it was sent (for an app that records its
        sends, what it recorded)."""
        if self.app != APP:
            recorded = [json.loads(raw) for raw in self.redis.lrange(self.queue + ":sent", 0, -1)]
            return sorted((Sent(int(token), float(at)) for at, token in recorded), key=_at)
        found = []
        for raw in self.redis.lrange(self.queue, 0, -1):
            message = json.loads(raw)
            body = message["body"]
            if message["properties"].get("body_encoding") == "base64":
                body = base64.b64decode(body)
            args = json.loads(body)[0]
            found.append(Sent(int(message["headers"][TOKEN_HEADER]), float(args[0])))
        return sorted(found, key=lambda sent: sent.at)

    def holder_pid(self) -> int | None:
        info = self.store.get(self.key)  # type: ignore[attr-defined]
        return None if info is None else parse_owner(info.owner).pid

    def wait(self, what: str, done: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                logs = {name: self.log(name)[-3000:] for name in self.processes}
                raise AssertionError(f"timed out waiting for {what}: {logs}")
            time.sleep(POLL)

    def wait_sends(self, count: int, token: int | None = None) -> list[Sent]:
        """Wait until ``count`` ticks (of ``token``, if given) are on the queue."""

        def mine() -> list[Sent]:
            return [s for s in self.sent() if token is None or s.token == token]

        timeout = TIMEOUT + count * INTERVAL
        self.wait(f"{count} sends of token {token}", lambda: len(mine()) >= count, timeout)
        return mine()

    def wait_new_token(self, old: int) -> Sent:
        """The first tick sent with a token above ``old``."""
        self.wait(f"a token above {old}", lambda: any(s.token > old for s in self.sent()))
        return next(s for s in self.sent() if s.token > old)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGCONT)
            stop_worker(process)
        self.redis.delete(self.queue, self.queue + ":sent")
        for info in self.store.list(self.prefix):  # type: ignore[attr-defined]
            self.store.release(info.key, info.owner)
        self.redis.close()


def _at(sent: Sent) -> float:
    return sent.at


def assert_no_tick_twice(sent: list[Sent]) -> None:
    """No two sends less than half an interval apart (a tick sent twice)."""
    gaps = [(a.at, b.at - a.at) for a, b in itertools.pairwise(sent)]
    assert all(gap >= INTERVAL / 2 for _, gap in gaps), gaps


def kill_and_measure(d: Deployment, pid: int, old: int, what: str) -> int:
    """SIGKILL ``pid`` (the holder of token ``old``); the standby must send within ttl + one
    interval, and three ticks after, with no tick twice. The new token."""
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    taken = d.wait_new_token(old)
    d.wait_sends(3, taken.token)
    report(what, taken.at - killed_at)
    assert taken.at - killed_at <= TTL + INTERVAL + MARGIN
    assert_no_tick_twice(d.sent())
    return taken.token


def report(what: str, seconds: float) -> None:
    print(f"\nbeat take-over ({what}): {seconds:.2f} s (ttl {TTL:g} s, interval {INTERVAL:g} s)")


@pytest.fixture
def redis_deployment(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(BROKER, tmp_path)
    try:
        deployment.redis.ping()
    except redis.ConnectionError as exc:
        pytest.skip(f"the shared Redis at {BROKER} does not answer: {exc}")
    yield deployment
    deployment.close()


@pytest.fixture
def pg_deployment(tmp_path: Path, pg_database_dsn: str) -> Iterator[Deployment]:
    deployment = Deployment(pg_database_dsn, tmp_path)
    yield deployment
    deployment.close()


def active(deployment: Deployment, names: list[str]) -> str:
    """The name of the process that holds the beat lease, once one does and has sent."""
    deployment.wait_sends(2)
    pid = deployment.holder_pid()
    for name in names:
        if deployment.processes[name].pid == pid:
            return name
    raise AssertionError(f"the beat lease is held by pid {pid}, none of {names}")


class TestRedisStore:
    def test_two_beats_one_sender_and_a_take_over_within_ttl_after_sigkill(
        self, redis_deployment: Deployment
    ) -> None:
        """Two beats: one token sends; SIGKILL the active, the standby sends within
        ttl + one interval, and no tick is sent twice."""
        d = redis_deployment
        d.beat("a"), d.beat("b")
        first = active(d, ["a", "b"])
        old = d.wait_sends(4)[0].token
        assert {s.token for s in d.sent()} == {old}, "more than one beat sent"
        listing = subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "lease", "list"],
            env=d.environ(), capture_output=True, text=True, timeout=TIMEOUT, check=True,
        ).stdout  # fmt: skip
        line = next(line for line in listing.splitlines() if d.key in line)
        assert str(d.processes[first].pid) in line and "celery beat" in line, listing
        kill_and_measure(d, d.processes[first].pid, old, "SIGKILL, Redis")

    def test_three_beats_send_each_tick_of_a_minute_once(
        self, redis_deployment: Deployment
    ) -> None:
        """Three beats on one schedule for a minute: one token, one message per tick."""
        d = redis_deployment
        for name in ("a", "b", "c"):
            d.beat(name)
        sent = d.wait_sends(60)
        assert len({s.token for s in sent}) == 1
        assert_no_tick_twice(sent)
        gaps = [b.at - a.at for a, b in itertools.pairwise(sent)]
        assert max(gaps) < 2 * INTERVAL, gaps  # none skipped while the holder ran
        print(f"\nbeat x3, a minute: {len(sent)} ticks, gaps {min(gaps):.3f} to {max(gaps):.3f} s")

    def test_a_clean_shutdown_hands_over_at_the_next_due_time(
        self, redis_deployment: Deployment
    ) -> None:
        """SIGTERM the active beat: it releases, and the standby sends the next tick one
        interval after the last one (not at once: that tick was sent)."""
        d = redis_deployment
        d.beat("a"), d.beat("b")
        first = active(d, ["a", "b"])
        old = d.wait_sends(3)[0].token
        d.processes[first].send_signal(signal.SIGTERM)
        taken = d.wait_new_token(old)
        d.wait_sends(2, taken.token)
        last_old = max(s.at for s in d.sent() if s.token == old)
        report("SIGTERM, Redis: gap after the last tick", taken.at - last_old)
        assert taken.at - last_old <= INTERVAL + MARGIN
        assert_no_tick_twice(d.sent())
        assert "releasing" in d.log(first)

    def test_a_stopped_beat_sends_none_of_the_ticks_it_missed(
        self, redis_deployment: Deployment
    ) -> None:
        """SIGSTOP the active beat past its ttl, then SIGCONT: the standby took over; the
        stopped one sends no tick as its own and stands by again."""
        d = redis_deployment
        d.beat("a"), d.beat("b")
        first = active(d, ["a", "b"])
        old = d.wait_sends(3)[0].token
        os.killpg(d.processes[first].pid, signal.SIGSTOP)
        wait_stopped(d.processes[first].pid)  # a thread in a system call stops when it returns
        stopped_at = time.time()
        taken = d.wait_new_token(old)
        report("SIGSTOP, Redis", taken.at - stopped_at)
        os.killpg(d.processes[first].pid, signal.SIGCONT)
        resumed = len(d.wait_sends(1, taken.token))
        d.wait_sends(resumed + 3, taken.token)
        late = [s for s in d.sent() if s.token == old and s.at > stopped_at]
        assert late == []
        assert_no_tick_twice(d.sent())
        assert d.processes[first].poll() is None
        d.wait("the stopped beat to report its loss", lambda: "standing by" in d.log(first))

    def test_three_workers_with_embedded_beat(self, redis_deployment: Deployment) -> None:
        """``celery worker -B`` x3: one embedded beat sends; SIGKILL it, another takes over."""
        d = redis_deployment
        names = ["w1", "w2", "w3"]
        for name in names:
            d.worker_with_beat(name)
        old = d.wait_sends(4)[0].token
        assert {s.token for s in d.sent()} == {old}
        pid = d.holder_pid()
        assert pid is not None
        # The embedded beat process, not its worker.
        kill_and_measure(d, pid, old, "SIGKILL of a worker's embedded beat, Redis")


@pytest.mark.postgres
class TestPostgresStore:
    def test_three_beats_two_take_overs(self, pg_deployment: Deployment) -> None:
        """Three beats on PostgreSQL: SIGKILL the active twice; each time one standby takes
        over within ttl + one interval, and no tick is sent twice."""
        d = pg_deployment
        names = ["a", "b", "c"]
        for name in names:
            d.beat(name)
        token = d.wait_sends(3)[0].token
        for round_ in (1, 2):
            victim = active(d, names)
            d.wait_sends(2, token)
            names.remove(victim)
            pid = d.processes[victim].pid
            token = kill_and_measure(d, pid, token, f"SIGKILL #{round_}, PostgreSQL")


def test_a_worker_s_warm_shutdown_hands_its_embedded_beat_over_at_once(
    redis_deployment: Deployment,
) -> None:
    """SIGTERM a ``worker -B`` whose beat holds the lease: its beat releases, and the other
    worker's beat sends the next tick at its due time."""
    d = redis_deployment
    for name in ("w1", "w2"):
        d.worker_with_beat(name)
    old = d.wait_sends(3)[0].token
    pid = d.holder_pid()
    holder = next(
        name
        for name, process in d.processes.items()
        if pid in (process.pid, *children(process.pid))
    )
    d.processes[holder].send_signal(signal.SIGTERM)
    taken = d.wait_new_token(old)
    last_old = max(s.at for s in d.sent() if s.token == old)
    report("worker SIGTERM, Redis: gap after the last tick", taken.at - last_old)
    assert taken.at - last_old <= INTERVAL + MARGIN
    assert_no_tick_twice(d.sent())


def test_a_beat_whose_loop_hangs_hands_the_lease_over(tmp_path: Path) -> None:
    """The holder's loop hangs in a send (its lease renewer, a thread of its own, still runs):
    the lease is released a ttl after the hung tick began, and the standby takes over."""
    d = Deployment(BROKER, tmp_path, extra={"BEAT_HANG_DIR": str(tmp_path)})
    try:
        d.beat("a"), d.beat("b")
        holder = active(d, ["a", "b"])
        old = d.sent()[-1].token
        hung_at = time.time()
        (tmp_path / f"hang-{d.processes[holder].pid}").touch()
        taken = d.wait_new_token(old)
        report("holder's loop hung, Redis", taken.at - hung_at)
        assert taken.at - hung_at <= TTL + INTERVAL + MARGIN
        d.wait_sends(3, taken.token)
        assert_no_tick_twice(d.sent())
    finally:
        d.close()


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (Linux ``/proc``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.postgres
def test_django_celery_beat_database_scheduler_wrapped(
    tmp_path: Path, pg_database_dsn: str
) -> None:
    """django-celery-beat's ``DatabaseScheduler`` under the leased scheduler, two beats on one
    database and the PostgreSQL store: one sender; SIGKILL it, the standby takes over within
    ttl + one interval and sends no tick twice."""
    import django_celery_beat  # noqa: F401  (the test extra installs it: no skip)

    extra = {
        "DJANGO_SETTINGS_MODULE": "tests.integration.beat_django_settings",
        "BEAT_DJANGO_DB": pg_database_dsn,
    }
    d = Deployment(pg_database_dsn, tmp_path, "tests.integration.beat_django_app:app", extra)
    try:
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
            env=d.environ(), check=True, timeout=TIMEOUT, cwd=tmp_path,
        )  # fmt: skip
        d.beat("a"), d.beat("b")
        first = active(d, ["a", "b"])
        old = d.wait_sends(3)[0].token
        assert {s.token for s in d.sent()} == {old}
        kill_and_measure(d, d.processes[first].pid, old, "SIGKILL, django-celery-beat on PG")
    finally:
        d.close()
