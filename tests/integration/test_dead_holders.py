"""Dead holders freed at once: a prefork child that dies running a task loses its keys at once.

Real ``celery worker -P prefork`` processes on a throwaway ``redis-server`` broker (the event-loop
pool, as in production), with the lock store in that Redis or in an SQLite file. The worker runs
the app defined at the bottom of this module (``-A tests.integration.test_dead_holders:app``,
configured from ``DH_*`` environment variables), so the test and the worker build it alike.

Each test synchronises on marker files the task bodies write and on the store itself: the 1 s
bound after a ``SIGKILL`` is the requirement, so that test polls the store against a deadline and
asserts on what it measured.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseInfo, LockedTask, SupportsInspection, lease, store_from_url
from celery_lease._core.keys import make_key_function
from celery_lease._core.owners import parse_owner
from celery_lease.signals import lock_released
from tests.support import complete_lines

TTL = "30s"
READY_TIMEOUT = 60.0  # seconds for a worker to log "ready." on a loaded machine
TIMEOUT = 30.0  # seconds a test waits for a marker file or a result
FREED_BOUND = 3.0  # seconds: generous (the requirement is 1 s, the figure is ~0.05 s; ttl 30 s)
REDELIVERY_BOUND = 3.0  # seconds from the release to the redelivered attempt, generous
POLL = 0.005  # seconds between store reads while measuring
WAIT = 60.0  # seconds a body waits for the test at most

pytestmark = [pytest.mark.worker, pytest.mark.slow]


# The app the workers run -----------------------------------------------------------------------


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def _first_attempt(out: Path, run: str, token: int | None) -> bool:
    """Record an attempt of ``run`` (pid, token, time); True for the first one."""
    attempts = out / f"attempts-{run}"
    first = not attempts.exists()
    _append(attempts, json.dumps([os.getpid(), token, time.time()]))
    return first


def _wait_for_the_kill() -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _pid_exists(pid: int) -> bool:
    """True while ``pid`` is a process (running or a zombie nobody has waited for yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RecordingStore:
    """The worker's lock store, recording what the worker's main process does with it.

    ``release`` calls made on behalf of another process (the dead child) are written to
    ``releases-<key>`` with whether that process still existed at the call (it must not: it is
    reaped first). ``list``, in the main process, lets an "intruder" take a key right after the
    store listed it (when the test wrote ``intrude-<key>``): the worker then releases an owner
    that no longer holds the key, which must leave the intruder's lease alone.
    """

    def __init__(self, inner: Any, directory: Path) -> None:
        self.inner = inner
        self.directory = directory

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.inner.acquire(key, owner, ttl_ms)  # type: ignore[no-any-return]

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self.inner.renew(key, owner, ttl_ms)  # type: ignore[no-any-return]

    def release(self, key: str, owner: str) -> None:
        pid = parse_owner(owner).pid
        if pid is not None and pid != os.getpid():
            alive = _pid_exists(pid)
            line = {"owner_pid": pid, "alive": alive, "by": os.getpid(), "at": time.time()}
            self.inner.release(key, owner)
            _append(self.directory / f"releases-{_safe(key)}", json.dumps(line))
            return
        self.inner.release(key, owner)

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        infos: list[LeaseInfo] = self.inner.list(prefix)
        for info in infos:
            marker = self.directory / f"intrude-{_safe(info.key)}"
            if marker.exists() and not (self.directory / f"intruded-{_safe(info.key)}").exists():
                self.inner.force_release(info.key)
                token = self.inner.acquire(info.key, INTRUDER, 30_000)
                _append(self.directory / f"intruded-{_safe(info.key)}", json.dumps(token))
        return infos


INTRUDER = "elsewhere/1/00000000000000ff;l=intruder"


def _safe(key: str) -> str:
    return key.replace(":", "-")


def make_app(broker: str, store: str, directory: str, queue: str) -> Celery:
    """The test app: the worker (from the environment) and the test process build it alike."""
    app = Celery("dh", broker=broker, backend=broker, set_as_current=False)
    out = Path(directory)
    app.conf.update(
        lease_store=RecordingStore(store_from_url(store), out),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,  # one queue per worker: no message outlives its test
    )

    @app.task(
        shared=False, name="dh.hold", bind=True, base=LockedTask, lock_key="dh:{run}", lock_ttl=TTL
    )
    def hold(self: Any, run: str) -> list[Any]:
        """First attempt: say so, then wait for the test (to be killed); later ones: return."""
        if _first_attempt(out, run, self.request.lock_token):
            _wait_for_the_kill()
        return [os.getpid(), self.request.lock_token]

    @app.task(
        shared=False,
        name="dh.limited",
        base=LockedTask,
        lock_key="dh:{run}",
        lock_ttl=TTL,
        time_limit=1.5,
    )
    def limited(run: str) -> None:
        """Hold the key past the hard time limit, deaf to the pool's SIGTERM (as a body stuck in
        C code is): the pool SIGKILLs the child 0.1 s later, before it can release anything."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _first_attempt(out, run, None)
        _wait_for_the_kill()

    @app.task(shared=False, name="dh.manual")
    def manual(run: str) -> None:
        """A lease() inside a plain task body (no LockedTask): its owner names the task too."""
        with lease(f"dh:{run}", store=store_from_url(store), ttl=TTL):
            if _first_attempt(out, run, None):
                _wait_for_the_kill()

    @app.task(
        shared=False,
        name="dh.cool",
        base=LockedTask,
        lock_key="dh:{run}",
        lock_ttl=TTL,
        lock_cooldown="120s",
    )
    def cool(run: str) -> int:
        """Succeed at once; the key stays taken for the cooldown, owned by this child."""
        return os.getpid()

    @app.task(shared=False, name="dh.pid")
    def pid() -> int:
        return os.getpid()

    return app


def _record_release(sender: Any = None, **named: Any) -> None:
    """In the worker: write every ``lock_released`` sent with a reason (a dead holder's)."""
    directory = os.environ.get("DH_DIR")
    if directory and named.get("reason"):
        sent = {k: v for k, v in named.items() if k != "signal"}
        sent["at"] = time.time()
        _append(Path(directory) / f"released-{_safe(str(named['key']))}", json.dumps(sent))


if os.environ.get("DH_BROKER"):  # the worker: a receiver here would reach every test's tasks
    lock_released.connect(_record_release, weak=False)
    app = make_app(
        os.environ["DH_BROKER"],
        os.environ["DH_STORE"],
        os.environ["DH_DIR"],
        os.environ["DH_QUEUE"],
    )


# The harness -----------------------------------------------------------------------------------


@dataclass
class Worker:
    """A running prefork worker, a client app like it, and a client of its lock store."""

    app: Celery
    store: Any
    directory: Path
    process: subprocess.Popen[bytes]
    log: Path
    node: str

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for(self, name: str, lines: int = 1) -> list[Any]:
        """Wait (polling) until marker file ``name`` has ``lines`` lines; return them, parsed."""
        path = self.directory / name
        deadline = time.monotonic() + TIMEOUT
        while True:
            rows = [json.loads(x) for x in complete_lines(path) if x]
            if len(rows) >= lines:
                return rows
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited ({self.process.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not written within {TIMEOUT}s; log:\n{self.tail()}")
            time.sleep(0.02)

    def wait_free(self, key: str, timeout: float) -> float | None:
        """Poll the store until ``key`` is free: seconds it took, or None if still held."""
        start = time.monotonic()
        while self.store.get(key) is not None:
            if time.monotonic() - start > timeout:
                return None
            time.sleep(POLL)
        return time.monotonic() - start


def run_worker(
    request: pytest.FixtureRequest,
    directory: Path,
    store_kind: str,
    pool: str = "prefork",
    concurrency: int = 1,
    db: int = 3,
) -> Iterator[Worker]:
    """A worker of this module's app on the session's throwaway redis-server."""
    from tests.fixtures_redis import RedisServer
    from tests.integration.workers import start_worker, stop_worker

    server: RedisServer = request.getfixturevalue("redis_server")
    broker = f"redis://127.0.0.1:{server.port}/{db}"
    store = broker if store_kind == "redis" else f"sqlite:///{directory / 'leases.db'}"
    name = f"dh{uuid.uuid4().hex[:6]}"
    env = {"DH_BROKER": broker, "DH_STORE": store, "DH_DIR": str(directory), "DH_QUEUE": name}
    client = make_app(broker, store, str(directory), name)
    process, log = start_worker(
        "tests.integration.test_dead_holders:app",
        name,
        pool,
        concurrency,
        env,
        directory,
        READY_TIMEOUT,
    )
    lock_store = store_from_url(store)
    assert isinstance(lock_store, SupportsInspection)
    try:
        yield Worker(client, lock_store, directory, process, log, f"{name}@{os.uname().nodename}")
    finally:
        stop_worker(process)
        client.close()


@pytest.fixture(params=["redis", "sqlite"])
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Worker]:
    """A prefork worker (-c 1), lock store in the broker's Redis or in an SQLite file."""
    yield from run_worker(request, tmp_path, request.param)


def new_run() -> str:
    """A fresh run id: the ``{run}`` of the tasks' key ``dh:{run}`` and of the marker files.

    It starts with a letter: a str of decimal digits alone is keyed ``~str.<digits>`` by a key
    template (see :mod:`celery_lease._core.keys`), so a bare ``uuid4().hex[:10]`` that happened
    to be all decimal (about 1 in 110) made the task lock ``dh:~str.<run>`` while the test read
    ``dh:<run>``, free.
    """
    return "r" + uuid.uuid4().hex[:10]


def held(worker: Worker, key: str) -> LeaseInfo:
    """The live lease on ``key``; else fail, naming the leases the store does hold."""
    info = worker.store.get(key)
    if info is None:
        try:
            leases: object = worker.store.list()
        except Exception as exc:  # the message must come out whatever the store does
            leases = exc
        raise AssertionError(f"{key} not held; the store holds {leases!r}; log:\n{worker.tail()}")
    return info


def assert_reaped(pid: int) -> None:
    """``pid`` no longer exists: not running, not a zombie (its parent waited for it)."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# The tests -------------------------------------------------------------------------------------


def released_after_reaping(worker: Worker, run: str, child: int) -> dict[str, Any]:
    """The worker's release on behalf of dead ``child``: made once ``child`` no longer existed."""
    (call,) = worker.wait_for(f"releases-dh-{run}")
    assert call["owner_pid"] == child
    assert call["alive"] is False, "released while the child still existed (not reaped yet)"
    assert call["by"] == worker.process.pid  # the worker's main process
    return call  # type: ignore[no-any-return]


class TestHarness:
    def test_the_key_a_task_locks_for_a_run_is_the_key_the_tests_read(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every locked task of the app locks ``dh:{run}`` exactly, for any run id the harness
        makes. A str of decimal digits alone is keyed ``~str.<digits>`` (so that it differs from
        the int; see :mod:`celery_lease._core.keys`): a run id of ten hex digits that were all
        decimal
        (about 1 in 110) made the task lock ``dh:~str.<run>`` while the test read ``dh:<run>``,
        found it free, and failed with "dh:<run> not held". The uuid is forced to that case."""
        monkeypatch.setattr(
            uuid, "uuid4", lambda: uuid.UUID("65097822-4700-4000-8000-000000000000")
        )
        app = make_app("memory://", "memory://", str(tmp_path), "q")
        run = new_run()
        # Shared tasks that other test modules of this process defined join every app as it is
        # finalized (Celery 5.4 lists them here): the harness's own are named dh.*.
        locked = [
            task
            for task in app.tasks.values()
            if isinstance(task, LockedTask) and task.name.startswith("dh.")
        ]
        assert {task.name for task in locked} == {"dh.hold", "dh.limited", "dh.cool"}
        for task in locked:
            key = make_key_function(
                type(task)._lock_options.key, inspect.signature(task.run), task=task.name
            )
            assert key((), {"run": run}) == f"dh:{run}", task.name


class TestSigkill:
    def test_key_is_free_within_a_second_and_the_requeued_task_runs_at_once(self, worker: Worker):
        """SIGKILL of the child holding a 30 s lease: the key is free at once (<= 1 s is the
        requirement; the figure is printed), released owner-checked after the child was reaped,
        and the acks_late redelivery takes it at once (a higher token)."""
        run = new_run()
        key = f"dh:{run}"
        result = worker.app.send_task("dh.hold", kwargs={"run": run})
        ((child, token, _),) = worker.wait_for(f"attempts-{run}")
        info = held(worker, key)
        assert info.token == token and 25 < info.expires_in <= 30
        os.kill(child, signal.SIGKILL)
        killed_wall, killed = time.time(), time.monotonic()
        freed = worker.wait_free(key, timeout=TIMEOUT)
        measured = time.monotonic() - killed
        print(f"\nkey free {measured * 1000:.1f} ms after SIGKILL (store: {worker.store!r})")
        assert freed is not None, f"key still held {TIMEOUT}s after SIGKILL; log:\n{worker.tail()}"
        assert measured <= FREED_BOUND, f"freed after {measured:.3f}s; log:\n{worker.tail()}"

        call = released_after_reaping(worker, run, child)
        (released,) = worker.wait_for(f"released-dh-{run}")
        assert released["reason"] == "holder_died"
        assert (released["pid"], released["token"]) == (child, token)
        assert released["exitcode"] == -signal.SIGKILL  # billiard waited for it: reaped
        assert released["task_id"] == result.id

        # acks_late + task_reject_on_worker_lost: the message comes back and takes the key.
        second_pid, second_token = result.get(timeout=TIMEOUT)
        assert second_pid != child
        assert second_token > token
        attempts = worker.wait_for(f"attempts-{run}", lines=2)
        redelivered = attempts[1][2] - killed_wall
        print(f"redelivered attempt started {redelivered * 1000:.1f} ms after the SIGKILL")
        assert call["at"] <= attempts[1][2], "the redelivery ran before the release"
        assert redelivered <= FREED_BOUND + REDELIVERY_BOUND, worker.tail()
        assert "holding 'dh:" in worker.log.read_text()

    def test_a_lease_taken_inside_a_plain_task_body_is_freed_too(self, worker: Worker):
        """``lease()`` in a task body names its task (ambient holder), so it is freed as well."""
        run = new_run()
        key = f"dh:{run}"
        result = worker.app.send_task("dh.manual", kwargs={"run": run})
        ((child, _, _),) = worker.wait_for(f"attempts-{run}")
        info = held(worker, key)
        assert f";i={result.id};" in info.owner and ";t=dh.manual;" in info.owner
        os.kill(child, signal.SIGKILL)
        assert worker.wait_free(key, timeout=TIMEOUT) is not None, worker.tail()
        (released,) = worker.wait_for(f"released-dh-{run}")
        assert (released["pid"], released["task_id"]) == (child, result.id)
        result.get(timeout=TIMEOUT)  # the redelivery finishes: nothing left for the next test


class TestHardTimeLimit:
    def test_key_is_freed_after_the_child_is_killed_by_its_hard_time_limit(self, worker: Worker):
        """A hard time limit kills the child; its 30 s lease is released once it is reaped."""
        run = new_run()
        key = f"dh:{run}"
        worker.app.send_task("dh.limited", kwargs={"run": run})
        ((child, _, started),) = worker.wait_for(f"attempts-{run}")
        held(worker, key)
        assert worker.wait_free(key, timeout=TIMEOUT) is not None, worker.tail()
        freed_after = time.time() - started
        print(f"\nkey free {freed_after:.3f}s after the body started (hard time limit 1.5 s)")
        assert freed_after < 20, "freed by its ttl, not by the worker"
        released_after_reaping(worker, run, child)
        (released,) = worker.wait_for(f"released-dh-{run}")
        assert released["reason"] == "holder_died" and released["pid"] == child
        assert released["exitcode"] is not None
        assert_reaped(child)


class TestOwnerChecked:
    def test_a_key_taken_by_another_owner_after_the_listing_is_not_released(self, worker: Worker):
        """Another process takes the key between the worker's ``list()`` and its ``release()``
        (forced by the store wrapper): the owner-checked release leaves that lease alone."""
        run = new_run()
        key = f"dh:{run}"
        (worker.directory / f"intrude-dh-{run}").write_text("")
        worker.app.send_task("dh.hold", kwargs={"run": run})
        ((child, token, _),) = worker.wait_for(f"attempts-{run}")
        os.kill(child, signal.SIGKILL)
        released_after_reaping(worker, run, child)  # the worker did try, with the dead owner
        (intruder_token,) = worker.wait_for(f"intruded-dh-{run}")
        assert intruder_token is not None and intruder_token > token
        still = held(worker, key)
        assert (still.owner, still.token) == (INTRUDER, intruder_token)

    def test_another_processes_lease_is_untouched(self, worker: Worker):
        """Only the dead child's own leases go: one held by this test process stays."""
        run = new_run()
        mine = f"dh:{run}-mine"
        token = worker.store.acquire(mine, f"{os.uname().nodename}/{os.getpid()}/x;i=y", 30_000)
        result = worker.app.send_task("dh.hold", kwargs={"run": run})
        ((child, _, _),) = worker.wait_for(f"attempts-{run}")
        os.kill(child, signal.SIGKILL)
        assert worker.wait_free(f"dh:{run}", timeout=TIMEOUT) is not None, worker.tail()
        result.get(timeout=TIMEOUT)
        still = held(worker, mine)
        assert still.token == token


class TestKept:
    def test_a_cooldown_of_a_finished_task_survives_its_childs_death(self, worker: Worker):
        """A key kept for ``cooldown`` after a success is not released when the idle child dies."""
        run = new_run()
        key = f"dh:{run}"
        child = worker.app.send_task("dh.cool", kwargs={"run": run}).get(timeout=TIMEOUT)
        before = held(worker, key)
        assert f"/{child}/" in before.owner
        os.kill(child, signal.SIGKILL)
        # The next task runs in the replacement child: the pool has joined the dead one by then,
        # and the release it would have caused happens before the replacement is forked.
        replacement = worker.app.send_task("dh.pid").get(timeout=TIMEOUT)
        assert replacement != child
        assert_reaped(child)
        after = held(worker, key)
        assert (after.owner, after.token) == (before.owner, before.token)
        assert not (worker.directory / f"released-dh-{run}").exists()
        assert not (worker.directory / f"releases-dh-{run}").exists()


class TestRevokeTerminate:
    """``revoke(terminate=True)``: Celery marks the request ready (``task_ready``) *before* the
    child is reaped, so the reaper finds the task of the terminated child in the pool's own jobs,
    not only in the worker's active requests."""

    def test_a_child_terminated_by_revoke_frees_its_key_at_once(self, worker: Worker) -> None:
        """``revoke(terminate=True, signal="SIGKILL")`` of a running locked task: the child dies
        without running any cleanup; its 30 s lease is released once the child is reaped."""
        run = new_run()
        key = f"dh:{run}"
        result = worker.app.send_task("dh.hold", kwargs={"run": run})
        ((child, token, _),) = worker.wait_for(f"attempts-{run}")
        assert held(worker, key).token == token
        worker.app.control.revoke(result.id, terminate=True, signal="SIGKILL")
        killed = time.monotonic()
        freed = worker.wait_free(key, timeout=TIMEOUT)
        assert freed is not None, f"key still held {TIMEOUT}s after revoke; log:\n{worker.tail()}"
        measured = time.monotonic() - killed
        assert measured <= FREED_BOUND, f"freed after {measured:.3f}s; log:\n{worker.tail()}"
        released_after_reaping(worker, run, child)
        (released,) = worker.wait_for(f"released-dh-{run}")
        assert released["reason"] == "holder_died" and released["pid"] == child
        assert released["exitcode"] == -signal.SIGKILL
        assert_reaped(child)

    def test_the_default_terminate_signal_frees_the_key_at_once_too(self, worker: Worker) -> None:
        """``revoke(terminate=True)`` with Celery's default SIGTERM: the key is free at once,
        whether the child released it itself or died and the main process released it."""
        run = new_run()
        key = f"dh:{run}"
        result = worker.app.send_task("dh.hold", kwargs={"run": run})
        ((_, token, _),) = worker.wait_for(f"attempts-{run}")
        assert held(worker, key).token == token
        worker.app.control.revoke(result.id, terminate=True)
        killed = time.monotonic()
        freed = worker.wait_free(key, timeout=TIMEOUT)
        assert freed is not None, f"key still held {TIMEOUT}s after revoke; log:\n{worker.tail()}"
        measured = time.monotonic() - killed
        assert measured <= FREED_BOUND, f"freed after {measured:.3f}s; log:\n{worker.tail()}"
