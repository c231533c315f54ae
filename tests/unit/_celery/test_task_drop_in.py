"""LockedTask as a drop-in base for ``celery.Task``: class order, requests, arguments, pydantic.

Each behaviour is checked in every way a task body runs: ``.apply()``, ``task_always_eager``, a
direct call ``task(...)``, the embedded test worker (``celery.contrib.testing.worker``, where
``super().__call__()`` pushes a second request) and a real ``celery worker`` subprocess (where
Celery's stack protection makes ``super().__call__()`` run the body directly). Wherever plain
Celery has a behaviour of its own, the locked task is compared with a plain twin in the same mode.

This module is also the app of that real worker: with ``DI_BROKER`` set (the worker's
environment) it builds ``app`` at import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task
from celery._state import get_current_task
from pydantic import BaseModel

from celery_lease import LockedTask, LockLostError, current_lease, get_lock_token
from celery_lease.signals import lock_released
from tests.support import CELERY_MINOR, complete_lines, needs_celery_pydantic

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 20.0  # seconds a test waits for a result
POLL = 0.01  # seconds between result polls
READY_TIMEOUT = 40.0  # seconds for the real worker to log "ready."

# What the mixin saw: one item per mixin __call__ active around the body, True when a lease was
# held as it opened (a context variable: per execution, per thread, never on the task).
_opened: ContextVar[tuple[bool, ...]] = ContextVar("drop_in_opened", default=())


class Opener(Task):  # type: ignore[misc]
    """A user mixin whose ``__call__`` opens something (a DB session, a span) around the body."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = _opened.set((*_opened.get(), current_lease() is not None))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _opened.reset(token)


class LockedFirst(LockedTask, Opener):
    """The lease is taken first, the mixin runs inside it."""


class LockedLast(Opener, LockedTask):
    """The mixin runs first, the lease inside it."""


class Doubler(LockedTask):
    """A subclass ``__call__`` that changes the arguments before calling ``super().__call__``."""

    def __call__(self, x: int, retry: bool = False) -> Any:
        return super().__call__(x * 2, retry)


class PlainDoubler(Task):  # type: ignore[misc]
    """The same subclass on a plain ``celery.Task``: what Celery itself does."""

    def __call__(self, x: int, retry: bool = False) -> Any:
        return super().__call__(x * 2, retry)


class Item(BaseModel):
    n: int = 0
    tags: list[str] = ["a"]


LOCK_FIELDS = {"lock_key", "lock_token", "lock_slot", "lock_waited", "lock_lost", "lease"}


def request_fields(request: Any) -> dict[str, str]:
    """The request's public, non-callable attributes (lock attributes left out), as reprs."""
    fields = {}
    for name in dir(request):
        value = getattr(request, name)
        if name.startswith("_") or callable(value) or name in LOCK_FIELDS:
            continue
        fields[name] = repr(value)
    return fields


def report(task: Any, *received: Any) -> dict[str, Any]:
    """What the body sees, as JSON: its arguments, its request and the lease."""
    req = task.request
    return {
        "received": list(received),
        "args": list(req.args or ()),
        "kwargs": dict(req.kwargs or {}),
        "has_id": req.id is not None,
        "retries": int(req.retries or 0),
        "depth": len(task.request_stack.stack),
        "current_task": get_current_task() is task,
        "opened": list(_opened.get()),
        "key": getattr(req, "lock_key", None),
        "token": getattr(req, "lock_token", None),
        "slot": getattr(req, "lock_slot", None),
        "lease_token": req.lease.token if getattr(req, "lease", None) is not None else None,
        "ambient": get_lock_token(),
        "fields": request_fields(req),
    }


def await_retry_stored(task: Any) -> None:
    """In a worker, a retried copy waits until the attempt before it has stored RETRY.

    Celery publishes the retry before its tracer stores RETRY for the same id; a quick copy on
    another pool slot could store SUCCESS first and have it replaced (celery/celery#6115).
    """
    req = task.request
    if req.retries and not req.is_eager and not req.called_directly:
        deadline = time.monotonic() + TIMEOUT
        result = task.AsyncResult(req.id)
        while result.state != "RETRY" and time.monotonic() < deadline:
            time.sleep(POLL)


def make_app(broker: str, backend: str, store: Any, directory: str = "") -> Celery:
    """The tasks of this module on one app; the test process and the real worker build it alike."""
    app = Celery("di", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        lease_store=store,
        accept_content=["json"],
        result_accept_content=["json"],
        task_eager_propagates=False,  # eager retries are re-run by apply(), as on a worker
        broker_connection_retry_on_startup=True,
        broker_transport_options={"polling_interval": POLL},
    )
    if broker.startswith("filesystem"):
        folder = os.path.join(directory, "broker")
        os.makedirs(folder, exist_ok=True)
        app.conf.broker_transport = "example_project.transport:FilesystemTransport"
        app.conf.broker_transport_options = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": os.path.join(folder, "control"),
            "polling_interval": 0.05,
        }

    @app.task(name="di.plain", bind=True, shared=False)
    def plain(self: Any, x: int) -> dict[str, Any]:
        return report(self, x)

    @app.task(name="di.locked", bind=True, base=LockedTask, lock_key="lk:{x}", shared=False)
    def locked_plain(self: Any, x: int) -> dict[str, Any]:
        return report(self, x)

    @app.task(name="di.plain_mixin", bind=True, base=Opener, shared=False)
    def plain_mixin(self: Any, x: int) -> dict[str, Any]:
        return report(self, x)

    @app.task(name="di.mixin_first", bind=True, base=LockedFirst, lock_key="mx:{x}", shared=False)
    def mixin_first(self: Any, x: int) -> dict[str, Any]:
        return report(self, x)

    @app.task(name="di.mixin_last", bind=True, base=LockedLast, lock_key="mx:{x}", shared=False)
    def mixin_last(self: Any, x: int) -> dict[str, Any]:
        return report(self, x)

    def doubled_body(self: Any, x: int, retry: bool) -> dict[str, Any]:
        await_retry_stored(self)
        if retry and self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=1)
        return report(self, x, retry)

    @app.task(name="di.doubled", bind=True, base=Doubler, lock_key="dbl:{x}", shared=False)
    def doubled(self: Any, x: int, retry: bool = False) -> dict[str, Any]:
        return doubled_body(self, x, retry)

    @app.task(name="di.plain_doubled", bind=True, base=PlainDoubler, shared=False)
    def plain_doubled(self: Any, x: int, retry: bool = False) -> dict[str, Any]:
        return doubled_body(self, x, retry)

    default_item = Item(n=1, tags=["a"])

    @app.task(name="di.pydantic", bind=True, base=LockedTask, pydantic=True, shared=False)
    def with_model(self: Any, item: Item = default_item) -> dict[str, Any]:
        assert isinstance(item, Item), f"the body gets a model, not {item!r}"
        return {"key": self.request.lock_key, "n": item.n}

    out = Path(directory) if directory else None

    @app.task(name="di.early", bind=True, base=LockedTask, lock_key="early:{run}", shared=False)
    def early(self: Any, run: str) -> str:
        assert out is not None
        if self.request.retries:
            (out / f"copy-{run}.tmp").write_text(str(self.request.lock_token))
            (out / f"copy-{run}.tmp").rename(out / f"copy-{run}")  # seen whole or not at all
            wait_file(out / f"first-{run}")
            return "copy"
        self.retry(countdown=0, throw=False)
        wait_file(out / f"copy-{run}")  # the retried copy holds the key now
        seen: dict[str, Any] = {"token": self.request.lock_token, "lost": self.request.lock_lost}
        try:
            self.request.lease.check()
        except LockLostError as exc:
            seen["check"] = exc.reason
        (out / f"first-{run}.tmp").write_text(json.dumps(seen))
        (out / f"first-{run}.tmp").rename(out / f"first-{run}")
        return "first"

    @app.task(
        name="di.early_revoke", bind=True, base=LockedTask, lock_key="early-rv:{run}",
        lock_on_lost="revoke", shared=False,
    )  # fmt: skip
    def early_revoke(self: Any, run: str, throw: bool) -> str:
        assert out is not None
        if self.request.retries:
            await_retry_stored(self)
            return "second"
        self.retry(countdown=0, throw=throw)
        (out / f"ran-on-{run}").touch()
        return "first"

    class Hooks(Task):  # type: ignore[misc]
        """Records Celery's hooks of an execution (the body reads them from the request)."""

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            HOOKS.append(("before_start", self.name, task_id))

        def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
            HOOKS.append(("on_success", self.name, task_id))

        def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            HOOKS.append(("on_failure", self.name, task_id))

        def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            HOOKS.append(("on_retry", self.name, task_id))

        def after_return(self, status: str, *args: Any, **kwargs: Any) -> None:
            HOOKS.append((f"after_return:{status}", self.name, args[1]))

    class LockedHooks(LockedTask, Hooks):
        lock_key = "hooks"

    def hooked_body(self: Any, outcome: str) -> str:
        HOOKS.append(("body", self.name, self.request.id))
        if outcome == "fail":
            raise ValueError("the body failed")
        if outcome == "retry" and not self.request.retries:
            raise self.retry(countdown=0, max_retries=1)
        return outcome

    @app.task(name="di.hooks_plain", bind=True, base=Hooks, shared=False)
    def hooks_plain(self: Any, outcome: str) -> str:
        return hooked_body(self, outcome)

    @app.task(name="di.hooks_locked", bind=True, base=LockedHooks, shared=False)
    def hooks_locked(self: Any, outcome: str) -> str:
        return hooked_body(self, outcome)

    return app


HOOKS: list[tuple[str, str, str]] = []
"""Hook calls of the ``di.hooks_*`` tasks in this process: (hook, task name, task id)."""


def wait_file(path: Path) -> None:
    """Wait (polling, up to TIMEOUT) for a marker file."""
    deadline = time.monotonic() + TIMEOUT
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(POLL)


if os.environ.get("DI_BROKER"):  # the real worker's environment
    app = make_app(
        os.environ["DI_BROKER"],
        os.environ["DI_BACKEND"],
        os.environ["DI_STORE"],
        os.environ["DI_DIR"],
    )

    def _record_release(key: str = "", token: int = 0, **_: Any) -> None:
        line = f"{key} {token}\n".encode()
        fd = os.open(
            Path(os.environ["DI_DIR"]) / "released", os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    lock_released.connect(_record_release, weak=False)


# Environments ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local() -> Iterator[SimpleNamespace]:
    """The app for eager runs, direct calls and the embedded worker (memory broker and store)."""
    from celery_lease import MemoryLockStore

    store = MemoryLockStore()
    local_app = make_app("memory://", "cache+memory://", store)
    yield SimpleNamespace(app=local_app, store=store, worker=None)
    local_app.close()


@pytest.fixture(scope="module")
def embedded(local: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """An embedded threads-pool worker on ``local``'s app."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        local.app, pool="threads", concurrency=3, perform_ping_check=False, shutdown_timeout=TIMEOUT
    ):
        yield local


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A real ``celery worker -P prefork -c 2`` on a filesystem broker with a SQLite store."""
    directory = tmp_path_factory.mktemp("drop-in")
    (directory / "results").mkdir()
    env = {
        "DI_BROKER": "filesystem://",
        "DI_BACKEND": f"file://{directory / 'results'}",
        "DI_STORE": f"sqlite:///{directory / 'leases.db'}",
        "DI_DIR": str(directory),
    }
    client = make_app(env["DI_BROKER"], env["DI_BACKEND"], env["DI_STORE"], str(directory))
    log = directory / "worker.log"
    cmd = [
        sys.executable, "-m", "celery", "-A", "tests.unit._celery.test_task_drop_in:app", "worker",
        "-P", "prefork", "-c", "2", "-n", "drop-in@%h", "--loglevel", "INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT), "C_FORCE_ROOT": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while "ready." not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.05)
        yield SimpleNamespace(app=client, directory=directory, log=log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        client.close()


WORKER = pytest.param("worker", marks=pytest.mark.worker)  # a real `celery worker` subprocess
MODES = ["apply", "always_eager", "direct", "embedded", WORKER]


@pytest.fixture
def run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``run(mode, name, *args, **kwargs)``: the task's result when run in ``mode``."""

    def call(mode: str, name: str, *args: Any, **kwargs: Any) -> Any:
        if mode == "worker":
            real = request.getfixturevalue("real")
            result = real.app.send_task(name, args, kwargs)
            return result.get(timeout=TIMEOUT, interval=POLL)
        env = request.getfixturevalue("embedded" if mode == "embedded" else "local")
        task = env.app.tasks[name]
        if mode == "apply":
            return task.apply(args, kwargs).get()
        if mode == "always_eager":
            env.app.conf.task_always_eager = True
            try:
                return task.apply_async(args, kwargs).get()
            finally:
                env.app.conf.task_always_eager = False
        if mode == "direct":
            return task(*args, **kwargs)
        assert mode == "embedded"
        return task.apply_async(args, kwargs).get(timeout=TIMEOUT, interval=POLL)

    return call


SAME_AS_PLAIN = ("args", "kwargs", "has_id", "retries", "depth", "current_task", "received")


# The rest of the class order runs, with the lease held --------------------------------------


@pytest.mark.parametrize("mode", MODES)
class TestClassOrder:
    def test_mixin_after_locked_task_runs_once_inside_the_lease(
        self, run: Callable[..., Any], mode: str
    ) -> None:
        """``class Base(LockedTask, Mixin)``: the mixin runs once, under the lease."""
        locked = run(mode, "di.mixin_first", 3)
        plain = run(mode, "di.plain_mixin", 3)
        assert locked["opened"] == [True], "the mixin ran once, with the lease already held"
        assert plain["opened"] == [False]
        assert {k: locked[k] for k in SAME_AS_PLAIN} == {k: plain[k] for k in SAME_AS_PLAIN}
        assert locked["key"] == "mx:3"
        assert isinstance(locked["token"], int)
        assert locked["token"] == locked["lease_token"] == locked["ambient"]

    def test_mixin_before_locked_task_runs_once_around_the_lease(
        self, run: Callable[..., Any], mode: str
    ) -> None:
        """``class Base(Mixin, LockedTask)``: the mixin runs once; the body still sees the lease."""
        locked = run(mode, "di.mixin_last", 4)
        plain = run(mode, "di.plain_mixin", 4)
        assert locked["opened"] == [False], "the mixin ran once, before the lease was taken"
        assert {k: locked[k] for k in SAME_AS_PLAIN} == {k: plain[k] for k in SAME_AS_PLAIN}
        assert locked["key"] == "mx:4"
        assert isinstance(locked["token"], int)
        assert locked["token"] == locked["lease_token"] == locked["ambient"]

    def test_locked_task_alone_is_like_a_plain_task(
        self, run: Callable[..., Any], mode: str
    ) -> None:
        """Without mixins the body sees what a plain Task's body sees (request, stack depth)."""
        locked = run(mode, "di.locked", 5)
        plain = run(mode, "di.plain", 5)
        assert {k: locked[k] for k in SAME_AS_PLAIN} == {k: plain[k] for k in SAME_AS_PLAIN}
        assert locked["opened"] == plain["opened"] == []
        assert locked["key"] == "lk:5"
        assert isinstance(locked["token"], int) and locked["token"] == locked["ambient"]


@pytest.mark.parametrize("name", ["di.locked", "di.mixin_first", "di.mixin_last"])
def test_stacks_are_restored_after_a_direct_call(local: SimpleNamespace, name: str) -> None:
    """After ``task(...)`` returns (or raises), no request or current task is left pushed."""
    task = local.app.tasks[name]
    assert task(1)["token"] is not None
    assert len(task.request_stack.stack) == 0 and get_current_task() is None
    assert task.request.lock_token is None, "the shared default request was not written"
    with pytest.raises(TypeError):
        task(1, 2, 3, 4)
    assert len(task.request_stack.stack) == 0 and get_current_task() is None
    assert local.store.get(task.request.lock_key or "mx:1") is None


# A subclass __call__ that changes the arguments ----------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_changed_arguments_are_keyed_and_requested_as_plain_celery(
    run: Callable[..., Any], mode: str
) -> None:
    """A subclass ``__call__`` doubling ``x``: the key uses what the body gets; the request's
    args (what ``retry()`` re-sends) are what plain Celery has in the same mode."""
    locked = run(mode, "di.doubled", 1)
    plain = run(mode, "di.plain_doubled", 1)
    assert locked["received"][0] == 2
    assert {k: locked[k] for k in SAME_AS_PLAIN} == {k: plain[k] for k in SAME_AS_PLAIN}
    assert locked["key"] == "dbl:2"


@pytest.mark.parametrize("mode", ["apply", "always_eager", "embedded", WORKER])
def test_retry_resends_the_arguments_plain_celery_resends(
    run: Callable[..., Any], mode: str
) -> None:
    """``retry()`` from a body whose arguments a subclass changed: the retried attempt gets what
    it gets under plain Celery (eager and embedded: the doubled value again; worker: the
    original), and its key follows what its body gets."""
    if CELERY_MINOR < (5, 5) and mode == "embedded":
        pytest.skip(
            "Celery 5.4: under a class defining __call__ the body runs on a request without the"
            " message's id on a threads pool: plain Celery's retry() leaves no result to wait on"
        )
    locked = run(mode, "di.doubled", 1, True)
    plain = run(mode, "di.plain_doubled", 1, True)
    if CELERY_MINOR < (5, 5) and mode in ("apply", "always_eager"):
        # Celery 5.4's apply() ends an eager retry() with the Retry: no second attempt runs.
        assert plain is None and locked is None
        return
    assert plain["retries"] == 1
    assert {k: locked[k] for k in SAME_AS_PLAIN} == {k: plain[k] for k in SAME_AS_PLAIN}
    assert locked["key"] == f"dbl:{locked['received'][0]}"


# pydantic=True -------------------------------------------------------------------------------


@needs_celery_pydantic
@pytest.mark.parametrize("mode", MODES)
def test_pydantic_model_arguments_key_alike_however_they_arrive(
    run: Callable[..., Any], mode: str
) -> None:
    """A model default, an equal model passed, its JSON form, a partial JSON form (defaults
    filled in by validation) and one Celery's lax validation coerces all give one key; another
    value gives another. The key is built from the arguments the body gets, after Celery's
    pydantic validation, not from what arrived."""
    default = run(mode, "di.pydantic")
    keys = {default["key"]}
    if mode in ("apply", "direct"):  # models can be passed as they are
        keys.add(run(mode, "di.pydantic", Item(n=1, tags=["a"]))["key"])
    keys.add(run(mode, "di.pydantic", {"n": 1, "tags": ["a"]})["key"])
    keys.add(run(mode, "di.pydantic", item={"tags": ["a"], "n": 1})["key"])
    keys.add(run(mode, "di.pydantic", {"n": 1})["key"])  # tags: the model's default
    keys.add(run(mode, "di.pydantic", {"n": "1"})["key"])  # pydantic_strict=False coerces
    # Celery 5.7's apply_async dumps the caller's model to JSON; Celery 5.6 sends it as it is,
    # which the json serializer refuses (plain Celery too), so only apply() and a call take it.
    if mode != "worker" and (CELERY_MINOR >= (5, 7) or mode in ("apply", "direct")):
        keys.add(run(mode, "di.pydantic", Item(n=1, tags=["a"]))["key"])
    assert len(keys) == 1, keys
    other = run(mode, "di.pydantic", {"n": 2})
    assert other["n"] == 2 and other["key"] != default["key"]


# On a real worker: retry(throw=False) frees the key while the body runs on -------------------


@pytest.mark.worker
class TestEarlyReleaseOnARealWorker:
    def test_body_running_on_after_retry_sees_its_lease_released(
        self, real: SimpleNamespace
    ) -> None:
        """The retried copy takes the key (higher token) while the first body runs on; that
        body reads lock_lost True and check() raises LockLostError("released"); each token is
        reported released exactly once."""
        run = "r" + uuid.uuid4().hex[:12]  # a digits-only str is keyed ~str.<digits>
        real.app.send_task("di.early", (run,))
        wait_file(real.directory / f"first-{run}")
        first = json.loads((real.directory / f"first-{run}").read_text())
        copy_token = int((real.directory / f"copy-{run}").read_text())
        assert copy_token > first["token"]
        assert (first["lost"], first.get("check")) == (True, "released"), real.log.read_text()
        released = real.directory / "released"
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            lines = complete_lines(released)
            mine = sorted(
                int(t) for k, t in (line.split() for line in lines) if k == f"early:{run}"
            )
            if len(mine) >= 2:
                break
            time.sleep(POLL)
        assert mine == sorted([first["token"], copy_token])

    @pytest.mark.parametrize("throw", [True, False])
    def test_revoke_stops_at_the_retry_and_ends_in_retry(
        self, real: SimpleNamespace, throw: bool
    ) -> None:
        """on_lost="revoke": ``retry()`` (even throw=False) ends the attempt in RETRY; the body
        never runs on without its key, and the retry succeeds."""
        run = "r" + uuid.uuid4().hex[:12]
        result = real.app.send_task("di.early_revoke", (run, throw))
        assert result.get(timeout=TIMEOUT, interval=POLL) == "second"
        assert not (real.directory / f"ran-on-{run}").exists()


# What else a drop-in base must preserve ------------------------------------------------------


@pytest.mark.parametrize("mode", ["apply", "embedded", WORKER])
def test_request_fields_are_those_of_a_plain_task(run: Callable[..., Any], mode: str) -> None:
    """Apart from the lock attributes, the body's request has the fields a plain task's has
    (with the same values, where they do not depend on the message)."""
    locked = run(mode, "di.locked", 1)["fields"]
    plain = run(mode, "di.plain", 1)["fields"]
    assert set(locked) == set(plain)
    varying = {"id", "root_id", "correlation_id", "reply_to", "delivery_info", "properties", "task"}
    assert {k: v for k, v in locked.items() if k not in varying} == {
        k: v for k, v in plain.items() if k not in varying
    }


FORGED_HEADERS = {
    "_lease_run": True,
    "lock_token": 10**30,
    "lock_slot": 999,
    "lock_key": "forged",
    "lock_lost": True,
}


@pytest.mark.parametrize("mode", ["embedded", WORKER])
@pytest.mark.parametrize("name", ["di.locked", "di.mixin_first", "di.mixin_last"])
def test_message_headers_cannot_forge_the_lock_attributes(
    request: pytest.FixtureRequest, mode: str, name: str
) -> None:
    """Headers named like the lock attributes (and the private ``_lease_run`` mark) become
    request attributes on a worker: the body still sees its own key and token, on the request
    Celery gives it (a real worker runs a mixin's ``super().__call__()`` on the worker's own
    request, so nothing is pushed over a forged one)."""
    if mode == "worker":
        app = request.getfixturevalue("real").app
    else:
        app = request.getfixturevalue("embedded").app
    plain = app.send_task(name, (7,)).get(timeout=TIMEOUT, interval=POLL)
    forged = app.send_task(name, (7,), headers=FORGED_HEADERS).get(timeout=TIMEOUT, interval=POLL)
    assert forged["key"] == plain["key"] == ("lk:7" if name == "di.locked" else "mx:7")
    assert forged["token"] == forged["lease_token"] == forged["ambient"] != 10**30
    assert forged["slot"] == plain["slot"] == 0
    assert forged["depth"] == plain["depth"]
    # Celery 5.4's Task.__call__ pushes a request of its own (no id) under a class that defines
    # __call__ (the mixins), on a threads pool: the body sees no id, with or without headers.
    assert forged["has_id"] == plain["has_id"]
    old_call = CELERY_MINOR < (5, 5) and mode == "embedded" and name != "di.locked"
    assert forged["has_id"] or old_call


@pytest.mark.parametrize("outcome", ["ok", "fail", "retry"])
def test_hooks_run_in_celery_order(local: SimpleNamespace, outcome: str) -> None:
    """before_start, the body, on_success / on_failure / on_retry and after_return run as for a
    plain task, in the same order, with the same task ids (``.apply()``)."""
    traces = {}
    for name in ("di.hooks_plain", "di.hooks_locked"):
        HOOKS.clear()
        result = local.app.tasks[name].apply((outcome,), task_id=f"id-{outcome}")
        assert result.state == ("FAILURE" if outcome == "fail" else "SUCCESS")
        traces[name] = [(hook, task_id) for hook, _, task_id in HOOKS]
    assert traces["di.hooks_locked"] == traces["di.hooks_plain"]
    assert ("body", f"id-{outcome}") in traces["di.hooks_plain"]
    assert local.store.get("hooks") is None


def test_call_time_argument_check_is_kept(local: SimpleNamespace) -> None:
    """``delay()`` with arguments the body cannot take fails at once (Celery's ``typing``
    check from the body's signature), as for a plain task."""
    for name in ("di.locked", "di.plain", "di.mixin_first", "di.doubled"):
        with pytest.raises(TypeError):
            local.app.tasks[name].delay(1, 2, 3, 4)


@needs_celery_pydantic
def test_pydantic_unbound_optional_model_and_decorator_form(local: SimpleNamespace) -> None:
    """``pydantic=True`` without ``bind``, an ``Item | None`` parameter and the ``@locked``
    form: the key follows the validated model, and ``None`` stays ``None``."""
    from celery_lease import locked

    app = local.app

    @app.task(name="di.pyd_unbound", base=LockedTask, pydantic=True, shared=False)
    def unbound(item: Item | None = None) -> Any:
        return app.tasks["di.pyd_unbound"].request.lock_key

    @app.task(name="di.pyd_locked", bind=True, pydantic=True, shared=False)
    @locked()
    def decorated(self: Any, item: Item) -> Any:
        return self.request.lock_key

    for task in (unbound, decorated):
        keys = {
            task.apply(({"n": 1},)).get(),
            task.apply((Item(n=1),)).get(),
            task.apply(({"n": "1", "tags": ["a"]},)).get(),
        }
        assert len(keys) == 1, (task.name, keys)
    assert unbound.apply().get() == unbound.apply((None,)).get()
    assert unbound.apply().get() != unbound.apply(({"n": 1},)).get()
