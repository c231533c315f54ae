"""``python -m example_project demo``: the whole story on real processes, in under a minute.

It starts two prefork workers (``alpha`` and ``bravo``, one pool child each) and two beat
instances on an embedded broker (kombu's filesystem transport) with the SQLite lease store, all in
a temporary directory (``--redis URL``: broker and lease store on that Redis, under a key prefix
of this run), and then:

1. **Nightly report**: both beat instances send the report; it runs once, every duplicate is
   skipped, including those that arrive after it finished (the cooldown).
2. **Fencing**: ``alpha`` takes ``account:1`` and starts a slow update; a duplicate sent to
   ``bravo`` is rejected. ``alpha``'s pool child is frozen with ``SIGSTOP`` past its ttl: its
   lease expires, ``bravo`` applies another update with a higher token. ``alpha`` resumes
   (``SIGCONT``), learns that its lease was lost, and its stale write is rejected by the table.
3. **Hand-off**: two cache rebuilds at once; the second waits, then reuses the first one's work.

Every step is checked; the timeline comes from the workers' ``celery_lease`` signals, written as
JSON lines to a file (see :func:`example_project.app.record_event`). Every process and file it
made is removed at the end, also on failure and on Ctrl-C. Exit status: 0 when every step
happened, 1 when one did not (with the reason and the processes' last log lines), 2 for bad
arguments or an unreachable Redis, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = ["DemoFailed", "main", "run_demo"]

TTL = 2.0
"""Seconds: the lease ttl of the demo's tasks (renewed every ttl/3 while a task runs)."""

REPORT_EVERY = 2.0
"""Seconds between two sends of the "nightly" report by each beat instance."""

WORK_SECONDS = 5.0
"""Seconds of slow work in alpha's update between its read and its write (it is paused in it)."""

BUILD_SECONDS = 2.5
"""Seconds the first cache rebuild takes (the duplicate waits for it)."""

START_TIMEOUT = 60.0
"""Seconds the workers and beat get to start (a loaded CI machine is slow to import Celery)."""

STEP_TIMEOUT = 20.0
"""Seconds any one thing the story waits for may take before the demo gives up."""

STOP_TIMEOUT = 10.0
"""Seconds a process gets to stop after SIGTERM before its process group is killed."""

WORKERS = ("alpha", "bravo")
BEATS = ("beat-1", "beat-2")
PREFIX = "example_project.tasks."
REPORT, UPDATE, CACHE = (PREFIX + n for n in ("nightly_report", "update_balance", "rebuild_cache"))
ACCOUNT_KEY = "account:1"
REPORT_KEY = "nightly-report"
CACHE_KEY = "cache:prices"


class DemoFailed(Exception):
    """A step of the story did not happen; the message says which and what was seen."""


@dataclass
class Event:
    """One line of the events file (see :func:`example_project.app.record_event`)."""

    data: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name``, or ``default``."""
        return self.data.get(name, default)


@dataclass
class Process:
    """A process the demo started, in its own process group, logging to a file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of its log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Demo:
    """The state of one run: its directory, processes, events seen so far, and output."""

    redis_url: str | None
    out: TextIO
    root: Path = field(init=False)
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    processes: dict[str, Process] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    t0: float = field(default_factory=time.time)
    env: dict[str, str] = field(default_factory=dict)
    paused: set[int] = field(default_factory=set)
    lost_tokens: set[int] = field(default_factory=set)
    _offset: int = 0
    _partial: bytes = b""
    _client: Any = None
    _store: Any = None

    # Output ---------------------------------------------------------------------------------

    def say(self, who: str, text: str, at: float | None = None) -> None:
        """Print one timeline line: seconds since the start, who, what."""
        seconds = (time.time() if at is None else at) - self.t0
        self.out.write(f"{seconds:6.2f}s  {who:<7} {text}\n")
        self.out.flush()

    def heading(self, text: str) -> None:
        """Print a step's title."""
        self.out.write(f"\n== {text}\n")
        self.out.flush()

    # Set-up ----------------------------------------------------------------------------------

    @property
    def events_file(self) -> Path:
        """The JSON-lines file the workers write their lease events to."""
        return self.root / "events.jsonl"

    def prepare(self) -> None:
        """Create the directory, the environment of the processes, the database and the client."""
        self.root = Path(tempfile.mkdtemp(prefix="celery-lease-demo-"))
        (self.root / "logs").mkdir()
        package_parent = str(Path(__file__).resolve().parent.parent)
        pythonpath = os.environ.get("PYTHONPATH")
        self.env = {
            "EXAMPLE_DATA_DIR": str(self.root / "data"),
            "EXAMPLE_RESULT_BACKEND": f"file://{self.root / 'results'}",
            "EXAMPLE_DATABASE_URL": str(self.root / "accounts.sqlite3"),
            "EXAMPLE_LEASE_TTL": f"{TTL:g}s",
            "EXAMPLE_REPORT_EVERY": f"{REPORT_EVERY:g}",
            "EXAMPLE_EVENTS_FILE": str(self.events_file),
            "EXAMPLE_REMOTE_CONTROL": "0",
            "PYTHONPATH": package_parent + (os.pathsep + pythonpath if pythonpath else ""),
            "PYTHONUNBUFFERED": "1",
        }
        if self.redis_url is None:
            self.env["EXAMPLE_BROKER_URL"] = "filesystem://"
            self.env["EXAMPLE_LEASE_STORE"] = f"sqlite:///{self.root / 'leases.sqlite3'}"
        else:
            self.env["EXAMPLE_BROKER_URL"] = self.redis_url
            self.env["EXAMPLE_LEASE_STORE"] = self.redis_url
            self.env["EXAMPLE_KEY_PREFIX"] = f"celery-lease-demo-{self.run_id}:"
            # The demo's keys are its own and deleted at its end: a restart grace would only
            # hold it up on a Redis started moments ago.
            self.env["EXAMPLE_LEASE_RESTART_GRACE"] = "0"
        self.events_file.touch()

        with _environ(self.env):  # importing the app here must not touch the default data dir
            from example_project import db
            from example_project.app import create_app

            self._client = create_app(self.env, main="example_project_demo_client")
            self._store = _lease_store(self._client)
            db.init_db()
            db.create_account(1, 10_000)

    @property
    def store(self) -> Any:
        """The lease store the workers use (to watch a lease expire)."""
        return self._store

    def start(self) -> None:
        """Start both workers and both beat instances, and wait until they are ready."""
        broker = "filesystem:// (kombu)" if self.redis_url is None else _safe_url(self.redis_url)
        store = self.env["EXAMPLE_LEASE_STORE"]
        self.out.write(
            "celery-lease demo: 2 prefork workers (alpha, bravo; one pool child each) and 2 beat"
            f" instances\n  broker: {broker}\n  lease store: "
            f"{store if self.redis_url is None else _safe_url(store)}"
            f" (ttl {TTL:g}s, renewed every {TTL / 3:.2f}s)\n  directory: {self.root}\n"
        )
        self.heading("starting workers and beat")
        celery = [sys.executable, "-m", "celery", "-A", "example_project.app"]
        for name in WORKERS:
            self.spawn(
                name,
                [
                    *celery,
                    "worker",
                    "-n",
                    f"{name}@%h",
                    "-Q",
                    f"celery,{name}",
                    "-P",
                    "prefork",
                    "-c",
                    "1",
                    "-l",
                    "INFO",
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                ],
            )
        for name in BEATS:
            self.spawn(
                name,
                [
                    *celery,
                    "beat",
                    "-l",
                    "INFO",
                    "-s",
                    str(self.root / f"{name}-schedule"),
                    "--max-interval",
                    "1",
                ],
            )
        self.say(
            "demo",
            "started " + ", ".join(f"{n} (pid {p.popen.pid})" for n, p in self.processes.items()),
        )
        self.wait_for(
            lambda: (
                {e.node for e in self.find("worker_ready")} >= set(WORKERS)
                and {e.node for e in self.find("process_init")} >= set(WORKERS)
                and len(self.find("beat_ready")) >= len(BEATS)
            ),
            START_TIMEOUT,
            "the workers and beat instances to start",
        )

    def spawn(self, name: str, argv: Sequence[str]) -> None:
        """Start ``argv`` in a new session (its own process group) with output to a log file."""
        log = self.root / "logs" / f"{name}.log"
        with open(log, "wb") as handle:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.root,
                start_new_session=True,
            )
        self.processes[name] = Process(name, popen, log)

    # Events -----------------------------------------------------------------------------------

    def poll(self) -> None:
        """Read the new lines of the events file, print them, and check the processes live."""
        with open(self.events_file, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                event = Event(json.loads(line))
                self.events.append(event)
                self.show(event)
        for process in self.processes.values():
            code = process.popen.poll()
            if code is not None:
                raise DemoFailed(f"{process.name} exited unexpectedly (status {code})")

    def show(self, event: Event) -> None:
        """Print one event as a timeline line (task start/end bookkeeping is not shown)."""
        who = event.get("node") or f"pid {event.pid}"
        key = event.get("key", "")
        kind = event.kind
        if kind == "worker_ready":
            text = "worker ready"
        elif kind == "process_init":
            text = f"pool child started (pid {event.pid})"
        elif kind == "beat_ready":
            who = next((n for n, p in self.processes.items() if p.popen.pid == event.pid), "beat")
            text = f"beat started: sends the report every {REPORT_EVERY:g}s"
        elif kind == "acquired":
            text = f"acquired  {key:<15} token {event.token}"
            if event.waited:
                text += f"  (waited {event.wait_seconds:.2f}s for the previous holder)"
        elif kind == "rejected":
            text = f"rejected  {key:<15} held by another execution"
            text += {
                REPORT: " -> skipped (on_held='skip')",
                UPDATE: " -> fails with LockNotAcquiredError",
            }.get(event.task, "")
        elif kind == "lost":
            self.lost_tokens.add(event.token)
            text = f"LOST      {key:<15} token {event.token} ({event.reason})"
        elif kind == "released":
            text = f"released  {key:<15} token {event.token} after {event.held_seconds:.2f}s"
            if event.task == REPORT:
                text += " (kept taken for the 1h cooldown)"
            elif event.token in self.lost_tokens:
                text += " (nothing to free: it was lost)"
        elif kind == "succeeded":
            text = _describe_result(event.task, event.get("result"))
        elif kind == "failed":
            text = f"FAILED    {_short(event.task)}: {event.error}: {event.message}"
            if event.get("cause"):
                text += f"\n{'':17}caused by {event.cause}: {event.cause_message}"
        else:
            return
        self.say(who, text, at=event.t)

    def find(self, kind: str, **match: Any) -> list[Event]:
        """The events seen so far of ``kind`` whose fields equal ``match``."""
        return [
            e
            for e in self.events
            if e.kind == kind and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_for(self, condition: Callable[[], object], timeout: float, what: str) -> None:
        """Poll the events until ``condition()`` holds; :class:`DemoFailed` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if condition():
                return
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.05)

    def wait_event(
        self, kind: str, what: str, timeout: float = STEP_TIMEOUT, **match: Any
    ) -> Event:
        """The first event of ``kind`` matching ``match``, waiting for it if needed."""
        self.wait_for(lambda: self.find(kind, **match), timeout, what)
        return self.find(kind, **match)[0]

    # Tasks ------------------------------------------------------------------------------------

    def send(self, task: str, queue: str, **kwargs: Any) -> str:
        """Send ``task`` to a worker's own queue; returns the task id."""
        result = self._client.send_task(task, kwargs=kwargs, queue=queue)
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        self.say("demo", f"sent {_short(task)}({args}) to {queue}")
        return str(result.id)

    def outcome(self, task_id: str, what: str, timeout: float = STEP_TIMEOUT) -> tuple[str, Any]:
        """Wait for the task's final state in the result backend: (state, result or error)."""
        result = self._client.AsyncResult(task_id)
        self.wait_for(result.ready, timeout, what)
        self.poll()
        return str(result.state), result.result

    # Processes --------------------------------------------------------------------------------

    def pause(self, pid: int) -> None:
        """SIGSTOP a worker's pool child, at a moment it holds no write lock on the SQLite store.

        A child stopped inside its renewer's write transaction would block every other writer of
        the lease store until it resumes (a file lock cannot expire): resume it and try again.
        """
        for _ in range(20):
            os.kill(pid, signal.SIGSTOP)
            self.paused.add(pid)
            _wait_stopped(pid)
            if self._store_writable():
                return
            self.resume(pid)
            time.sleep(0.05)
        raise DemoFailed(f"could not pause pid {pid} outside a write to the lease store")

    def resume(self, pid: int) -> None:
        """SIGCONT a paused pool child."""
        os.kill(pid, signal.SIGCONT)
        self.paused.discard(pid)

    def _store_writable(self) -> bool:
        """Whether a write transaction on the SQLite lease store can start now (always on Redis)."""
        url = self.env.get("EXAMPLE_LEASE_STORE", "")
        if not url.startswith("sqlite:///"):
            return True
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=0.5, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()
        return True

    def stop(self, names: Sequence[str]) -> None:
        """Stop these processes: SIGCONT + SIGTERM to the group, then SIGKILL after a while."""
        procs = [self.processes.pop(n) for n in names if n in self.processes]
        for process in procs:
            for signum in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.popen.pid, signum)
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            # the group may still hold a pool child after its parent exited: kill what is left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait()

    def cleanup(self) -> None:
        """Stop every process, delete this run's Redis keys, remove the directory."""
        for pid in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused.clear()
        self.stop(list(self.processes))
        if self.redis_url is not None and self.env.get("EXAMPLE_KEY_PREFIX"):
            with contextlib.suppress(Exception):
                _delete_redis_keys(self.redis_url, self.env["EXAMPLE_KEY_PREFIX"])
        with contextlib.suppress(Exception):
            if self._store is not None and hasattr(self._store, "close"):
                self._store.close()
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._client.close()
        if hasattr(self, "root"):
            shutil.rmtree(self.root, ignore_errors=True)

    def purge_default_queue(self) -> int:
        """Drop the report messages still queued (the beat instances are stopped)."""
        with self._client.connection_for_write() as conn:
            return int(conn.default_channel.queue_purge("celery") or 0)

    # The story ------------------------------------------------------------------------------

    def step_report(self) -> None:
        """Two beat instances send the report: it runs once; a late duplicate is skipped too."""
        self.heading("1. nightly report: 2 beat instances send it; on_held='skip' + cooldown='1h'")
        self.wait_for(
            lambda: (
                self.find("acquired", key=REPORT_KEY)
                and len(self.find("finished", task=REPORT)) >= len(BEATS)
            ),
            STEP_TIMEOUT + REPORT_EVERY,
            "both beat instances' copies of the report to be handled",
        )
        self.stop(list(BEATS))
        self.say("demo", "stopped both beat instances")
        self.purge_default_queue()
        self.wait_for(self.quiet, STEP_TIMEOUT, "the workers to finish the queued report copies")
        released = self.find("released", key=REPORT_KEY)
        if not released:
            raise DemoFailed("the report's lease was never released")
        late_id = self.send(REPORT, "bravo")
        self.say(
            "demo", "(a copy that arrives after the report finished: a late beat, a redelivery)"
        )
        state, result = self.outcome(late_id, "the late copy of the report")
        runs = self.find("acquired", key=REPORT_KEY)
        skipped = self.find("rejected", key=REPORT_KEY)
        if len(runs) != 1:
            raise DemoFailed(f"the report ran {len(runs)} times, expected once")
        if not self.find("rejected", key=REPORT_KEY, task_id=late_id):
            raise DemoFailed("the late copy of the report was not turned away")
        if state != "REVOKED" or "skipped: " not in str(result):  # on_held="skip" on a worker
            raise DemoFailed(f"the skipped report ended {state} with {result!r}, not REVOKED")
        self.check(
            f"the report ran once; {len(skipped)} copies skipped (REVOKED 'skipped: ...'), the "
            "late one by the cooldown: a mutex alone would have run it again"
        )

    def quiet(self) -> bool:
        """Every task that started has finished, and none started in the last 0.7 s."""
        started = self.find("started")
        finished = {e.task_id for e in self.find("finished")}
        if any(e.task_id not in finished for e in started):
            return False
        return not started or time.time() - started[-1].t > 0.7

    def step_fencing(self) -> None:
        """A paused holder loses its lease to a higher token, and its stale write is rejected."""
        self.heading(
            f"2. fencing: a holder frozen past its ttl ({TTL:g}s) loses {ACCOUNT_KEY} and "
            "its stale write is rejected"
        )
        alpha_id = self.send(UPDATE, "alpha", account_id=1, amount=5_000, work_seconds=WORK_SECONDS)
        held = self.wait_event(
            "acquired", "alpha to take account:1", key=ACCOUNT_KEY, task_id=alpha_id
        )
        duplicate_id = self.send(UPDATE, "bravo", account_id=1, amount=5_000)
        self.wait_event(
            "rejected",
            "bravo to reject the duplicate update",
            timeout=WORK_SECONDS - 2.0,
            key=ACCOUNT_KEY,
            task_id=duplicate_id,
        )
        if self.find("finished", task_id=alpha_id):
            raise DemoFailed("alpha finished its update before it could be paused (too slow?)")
        self.pause(held.pid)
        paused_at = time.time()
        self.say(
            "demo",
            f"SIGSTOP alpha's pool child (pid {held.pid}): its body and its renewer are frozen",
        )
        self.wait_for(
            lambda: self.store.get(ACCOUNT_KEY) is None,
            TTL + STEP_TIMEOUT,
            "alpha's lease to expire in the store",
        )
        self.say(
            "demo",
            f"{ACCOUNT_KEY} expired in the store {time.time() - paused_at:.2f}s after the pause "
            "(nobody renewed it)",
        )
        state, error = self.outcome(duplicate_id, "the duplicate's result")
        if state != "FAILURE" or type(error).__name__ != "LockNotAcquiredError":
            raise DemoFailed(f"the duplicate update ended {state} ({error!r}), not rejected")

        takeover_id = self.send(UPDATE, "bravo", account_id=1, amount=2_500)
        takeover = self.wait_event(
            "acquired", "bravo to take account:1", key=ACCOUNT_KEY, task_id=takeover_id
        )
        state, result = self.outcome(takeover_id, "bravo's update")
        if state != "SUCCESS":
            raise DemoFailed(f"bravo's update ended {state}: {result!r}")
        if takeover.token <= held.token:
            raise DemoFailed(f"bravo's token {takeover.token} is not above alpha's {held.token}")
        self.check(f"bravo's token {takeover.token} > alpha's {held.token}")

        self.resume(held.pid)
        self.say(
            "demo",
            f"SIGCONT alpha's pool child (pid {held.pid}): it finishes its {WORK_SECONDS:g}s of"
            " slow work, then writes",
        )
        self.wait_event(
            "lost", "alpha to notice its lease was lost", key=ACCOUNT_KEY, token=held.token
        )
        state, error = self.outcome(alpha_id, "alpha's update")
        failed = self.find("failed", task_id=alpha_id)
        if state != "FAILURE" or not failed or failed[0].get("cause") != "StaleWriteError":
            raise DemoFailed(
                f"alpha's stale update ended {state} ({error!r}), not rejected by the fence"
            )
        self.check("alpha's stale write was rejected by the table; lock_lost was sent")
        account = self.account()
        if (account.balance, account.fence) != (12_500, takeover.token):
            raise DemoFailed(
                f"account 1 is {account}, expected balance 12500 fence {takeover.token}"
            )

    def step_handoff(self) -> None:
        """A second rebuild waits for the first, then reuses its result."""
        self.heading("3. hand-off: two cache rebuilds at once; wait='5s', request.lock_waited")
        first_id = self.send(CACHE, "alpha", name="prices", build_seconds=BUILD_SECONDS)
        self.wait_event("acquired", "alpha to start the rebuild", key=CACHE_KEY, task_id=first_id)
        second_id = self.send(CACHE, "bravo", name="prices", build_seconds=BUILD_SECONDS)
        first_state, first = self.outcome(first_id, "alpha's rebuild")
        second_state, second = self.outcome(second_id, "bravo's rebuild")
        waited = self.find("acquired", key=CACHE_KEY, task_id=second_id)
        if first_state != "SUCCESS" or not (isinstance(first, dict) and first.get("rebuilt")):
            raise DemoFailed(f"alpha's rebuild ended {first_state}: {first!r}")
        if not waited or not waited[0].waited:
            raise DemoFailed(
                "bravo did not have to wait: it took the message after alpha had finished "
                "(machine overloaded?)"
            )
        if second_state != "SUCCESS" or not isinstance(second, dict) or second.get("rebuilt"):
            raise DemoFailed(f"bravo's rebuild ended {second_state}: {second!r}, not reused")
        self.check("bravo waited for alpha's rebuild and reused it instead of rebuilding")

    def account(self) -> Any:
        """Account 1 as the table holds it now."""
        from example_project import db

        with _environ(self.env):
            return db.get_account(1)

    def check(self, text: str) -> None:
        """Print a step's verified outcome."""
        self.say("check", "ok: " + text)

    def final_rows(self) -> None:
        """Print the tables and the leases still held."""
        from example_project import db

        self.heading("final table rows")
        with _environ(self.env):
            for account in db.list_accounts():
                self.out.write(
                    f"  accounts  id={account.id} balance={account.balance} fence={account.fence}\n"
                )
            cached = db.read_cache("prices")
            if cached is not None:
                self.out.write(f"  cache     name=prices fence={cached[1]} value={cached[0]}\n")
            reports = db.read_reports()
            for report in reports:
                self.out.write(
                    f"  reports   id={report[0]} day={report[1]} accounts={report[2]} "
                    f"total={report[3]} fence={report[4]}\n"
                )
        for info in self.store.list(""):
            self.out.write(
                f"  lease     {info.key} token {info.token}, {info.expires_in:.0f}s left "
                "(the report's cooldown)\n"
            )
        if len(reports) != 1:
            raise DemoFailed(f"{len(reports)} report rows, expected exactly 1")

    def story(self) -> None:
        """Set up, run every step, show the tables."""
        self.prepare()
        self.start()
        self.step_report()
        self.step_fencing()
        self.step_handoff()
        self.final_rows()


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Wait until Linux reports ``pid`` stopped (signal delivery is asynchronous)."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return  # no /proc (not Linux), or the process is gone: nothing to wait for
        if state in ("T", "t"):
            return
        time.sleep(0.005)


def _lease_store(app: Any) -> Any:
    from celery_lease._celery.settings import get_store

    return get_store(app)


def _delete_redis_keys(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=prefix.replace("*", r"\*") + "*", count=500))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


def _safe_url(url: str) -> str:
    """``url`` without its password."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return url


def _short(task: str | None) -> str:
    return (task or "?").removeprefix(PREFIX)


def _describe_result(task: str | None, result: Any) -> str:
    if result is None:
        return f"done      {_short(task)}: SUCCESS, result None (its body did not run)"
    if not isinstance(result, dict):
        return f"succeeded {_short(task)}: {result!r}"
    if task == UPDATE:
        return (
            f"wrote     account {result['account_id']}: balance {result['balance']}, "
            f"fence {result['fence']}"
        )
    if task == REPORT:
        count = result["accounts"]
        plural = "" if count == 1 else "s"
        return f"report    {result['day']}: {count} account{plural}, total {result['total']}"
    if task == CACHE:
        if result.get("rebuilt"):
            return f"rebuilt   cache {result['name']} (token {result['built_by_token']})"
        return (
            f"reused    cache {result['name']}: the holder we waited for just rebuilt it "
            f"(token {result['built_by_token']})"
        )
    return f"succeeded {_short(task)}: {result!r}"


def _check_redis(url: str) -> str | None:
    """``None`` if ``url`` answers PING, else why not."""
    try:
        import redis
    except ImportError:
        return "--redis needs the redis extra: pip install 'celery-lease[redis]'"
    try:
        client = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError) as exc:
        return f"cannot reach Redis at {_safe_url(url)}: {exc}"
    return None


def run_demo(redis_url: str | None = None, out: TextIO | None = None) -> int:
    """Run the story; returns the exit status (0: every step happened; see the module docstring).

    Args:
        redis_url: run broker and lease store on this Redis instead of the embedded default.
        out: where the timeline goes (default: standard output).
    """
    out = sys.stdout if out is None else out
    if redis_url is not None:
        problem = _check_redis(redis_url)
        if problem is not None:
            print(f"demo: {problem}", file=sys.stderr)
            return 2
    demo = Demo(redis_url, out)
    previous = _on_sigterm_raise()
    try:
        demo.story()
    except DemoFailed as exc:
        out.flush()
        print(f"\ndemo FAILED: {exc}", file=sys.stderr)
        for process in demo.processes.values():
            print(
                f"\n--- last lines of {process.name}'s log ---\n{process.tail()}", file=sys.stderr
            )
        return 1
    except KeyboardInterrupt:
        print("\ndemo interrupted: cleaning up", file=sys.stderr)
        return 130
    finally:
        demo.cleanup()
        _restore_sigterm(previous)
    out.write(
        f"\ndemo OK in {time.monotonic() - demo.started:.1f}s: every step happened; "
        "all processes stopped and temporary files removed\n"
    )
    out.flush()
    return 0


def _on_sigterm_raise() -> Any:
    """Turn SIGTERM into KeyboardInterrupt (so the clean-up runs); returns the old handler."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    """The ``demo`` command's argument parser (also printed by ``python -m example_project -h``)."""
    parser = argparse.ArgumentParser(
        prog="python -m example_project demo",
        description="Two workers and beat on an embedded broker: a paused holder loses its "
        "lease to a higher token and its stale write is rejected.",
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        help="run the broker and the lease store on this Redis (keys under a prefix of this run, "
        "deleted at the end)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``demo`` command's arguments (``[--redis URL]``) -> :func:`run_demo`'s exit status."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    return run_demo(args.redis)
