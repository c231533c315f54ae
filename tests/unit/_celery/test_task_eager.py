"""LockedTask and @locked run eagerly (``.apply()``): options, policies, request, signals."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import (
    LeaseConfigError,
    LockedTask,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    current_lease,
    get_lock_token,
    locked,
)
from celery_lease import signals as lease_signals

REAL_TIMEOUT = 10.0


@pytest.fixture
def store() -> MemoryLockStore:
    return MemoryLockStore()


@pytest.fixture
def app(store: MemoryLockStore) -> Iterator[Celery]:
    app = Celery("t", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.task_eager_propagates = False
    yield app
    app.close()


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every celery-lease signal sent during the test, as ``(name, kwargs)``."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def make(name: str) -> Any:
        def receiver(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
            seen.append((name, {"sender": sender, **kwargs}))

        return receiver

    receivers = {}
    for name in ("lock_acquired", "lock_rejected", "lock_lost", "lock_released"):
        receivers[name] = make(name)
        getattr(lease_signals, name).connect(receivers[name], weak=False)
    yield seen
    for name, receiver in receivers.items():
        getattr(lease_signals, name).disconnect(receiver)


def wait_for_signal(received: list[tuple[str, dict[str, Any]]], name: str) -> None:
    """Wait (polling, real time) until the signal ``name`` was received."""
    deadline = time.monotonic() + REAL_TIMEOUT
    while not any(n == name for n, _ in received):
        assert time.monotonic() < deadline, f"{name} was not sent within {REAL_TIMEOUT}s"
        time.sleep(0.005)


def hold(store: MemoryLockStore, key: str, ttl_ms: int = 60_000) -> None:
    """Take ``key`` for another owner."""
    assert store.acquire(key, "someone-else", ttl_ms) is not None


class TestOptionsAtDefinition:
    def test_unknown_lock_attribute_names_the_options(self, app: Celery) -> None:
        """A typo such as ``lock_tll`` fails at class creation, listing the known options."""
        with pytest.raises(LeaseConfigError, match=r"lock_tll=.*lock_key, lock_ttl, lock_wait"):

            @app.task(base=LockedTask, lock_tll="30s", shared=False)
            def typo() -> None: ...

            app.finalize()
            typo.name  # noqa: B018 - forces the lazy task

    def test_bad_policy_names_option_value_and_allowed(self, app: Celery) -> None:
        """An unknown on_held policy is refused with what is allowed."""
        with pytest.raises(LeaseConfigError, match=r"lock_on_held.*'ignore'.*raise, skip, retry"):

            class Bad(LockedTask):
                lock_on_held = "ignore"

    def test_bad_duration_names_option(self) -> None:
        """A malformed ttl names ``lock_ttl`` and the value."""
        with pytest.raises(LeaseConfigError, match=r"lock_ttl of .*'30 parsecs'"):

            class Bad(LockedTask):
                lock_ttl = "30 parsecs"

    def test_template_with_unknown_parameter_fails_at_definition(self, app: Celery) -> None:
        """A template naming a missing parameter fails when the task is created."""
        app.finalize()
        with pytest.raises(LeaseConfigError, match=r"\{acount\}.*parameters are: account_id"):

            @app.task(base=LockedTask, lock_key="a:{acount}", shared=False)
            def task(account_id: int) -> None: ...

    def test_decorator_template_checked_at_decoration(self) -> None:
        """@locked checks its template against the function at decoration time."""
        with pytest.raises(LeaseConfigError, match=r"\{nope\}"):

            @locked(key="x:{nope}")
            def f(self: Any, a: int) -> None: ...

    def test_decorator_keeps_celery_argument_check(self, app: Celery) -> None:
        """The decorated task still rejects a wrong call at ``delay`` time."""
        app.conf.task_always_eager = True

        @app.task(bind=True, shared=False)
        @locked(key="k:{a}")
        def f(self: Any, a: int) -> int:
            return a

        with pytest.raises(TypeError):
            f.delay(1, 2, 3)
        assert f.delay(4).get() == 4

    def test_function_key_is_not_bound(self, app: Celery, store: MemoryLockStore) -> None:
        """A plain function given as ``lock_key`` is called with the task's arguments only."""

        def key_fn(account_id: int, amount: int = 0) -> str:
            return f"fn:{account_id}"

        @app.task(base=LockedTask, lock_key=key_fn, shared=False)
        def task(account_id: int, amount: int = 0) -> str:
            return str(task.request.lock_key)

        assert task.apply((3,), {"amount": 1}).get() == "fn:3"


class TestEagerExecution:
    def test_request_and_ambient_token(self, app: Celery, received: list[Any]) -> None:
        """The request carries key, token, waited and lease; get_lock_token() agrees."""

        @app.task(base=LockedTask, lock_key="acct:{account_id}", shared=False)
        def task(account_id: int) -> tuple[Any, ...]:
            req = task.request
            return (req.lock_key, req.lock_token, req.lock_waited, req.lease.key, get_lock_token())

        key, token, waited, lease_key, ambient = task.apply((9,)).get()
        assert (key, waited, lease_key) == ("acct:9", False, "acct:9")
        assert token == ambient and isinstance(token, int)
        names = [name for name, _ in received]
        assert names == ["lock_acquired", "lock_released"]
        assert received[0][1]["sender"].name == task.name and received[0][1]["token"] == token
        assert received[0][1]["task_id"] == received[1][1]["task_id"] is not None

    def test_header_cannot_forge_token(self, app: Celery) -> None:
        """Message headers named like the lock attributes are overwritten by the real ones.

        Run as a worker's tracer runs a message (its headers become request attributes);
        ``apply(headers=...)`` would not do: it keeps them in ``request.headers`` only.
        """
        import uuid

        from celery.app.trace import build_tracer

        @app.task(base=LockedTask, lock_key="forge", shared=False)
        def task() -> Any:
            req = task.request
            return req.lock_token, req.lock_key, req.lock_waited, req.lease.token, req.lock_lost

        app.finalize()
        forged = {"lock_token": 10**30, "lock_key": "other", "lock_waited": True,
                  "lease": "other", "lock_lost": True, "_lease_run": True}  # fmt: skip
        task_id = str(uuid.uuid4())
        request = {"id": task_id, "task": task.name, "delivery_info": {}, **forged}
        tracer = build_tracer(task.name, task, app=app, eager=False, propagate=True)
        token, key, waited, lease_token, lost = tracer(task_id, (), {}, request).retval
        assert token == lease_token != 10**30
        assert (key, waited, lost) == ("forge", False, False)

    def test_key_prefix_and_default_ttl_from_app_conf(self, app: Celery) -> None:
        """``lease_key_prefix`` is prepended and ``lease_default_ttl`` applies."""
        app.conf.lease_key_prefix = "billing/"
        app.conf.lease_default_ttl = "7s"

        @app.task(base=LockedTask, lock_key="acct:{a}", shared=False)
        def task(a: int) -> Any:
            return task.request.lock_key, task.request.lease._entry.ttl

        assert task.apply((1,)).get() == ["billing/acct:1", 7.0] or task.apply((1,)).get() == (
            "billing/acct:1",
            7.0,
        )

    def test_bad_setting_fails_when_read(self, app: Celery) -> None:
        """A malformed ``lease_default_wait`` fails naming the setting."""
        app.conf.lease_default_wait = "soon"
        app.conf.task_eager_propagates = True

        @app.task(base=LockedTask, lock_key="k", shared=False)
        def task() -> None: ...

        with pytest.raises(LeaseConfigError, match="lease_default_wait='soon'"):
            task.apply()

    def test_held_raise(self, app: Celery, store: MemoryLockStore, received: list[Any]) -> None:
        """on_held="raise": FAILURE with LockNotAcquiredError carrying the key; body not run."""
        ran = []

        @app.task(base=LockedTask, lock_key="busy", shared=False)
        def task() -> None:
            ran.append(1)

        hold(store, "busy")
        result = task.apply()
        assert result.state == "FAILURE"
        assert isinstance(result.result, LockNotAcquiredError) and result.result.key == "busy"
        assert ran == [] and [n for n, _ in received] == ["lock_rejected"]

    def test_held_skip(
        self,
        app: Celery,
        store: MemoryLockStore,
        caplog: pytest.LogCaptureFixture,
        received: list[Any],
    ) -> None:
        """on_held="skip": SUCCESS with None, logged at INFO, lock_rejected sent."""
        rejected = []

        class Task(LockedTask):
            lock_on_held = "skip"

            def on_lock_rejected(self, key: str) -> None:
                rejected.append(key)

        @app.task(base=Task, lock_key="busy", shared=False)
        def task() -> str:
            return "ran"

        hold(store, "busy")
        with caplog.at_level(logging.INFO, logger="celery_lease.engine"):
            result = task.apply()
        assert (result.state, result.result) == ("SUCCESS", None)
        assert rejected == ["busy"]
        assert any(r.levelno == logging.INFO and "skipped" in r.message for r in caplog.records)
        assert received[0][0] == "lock_rejected" and received[0][1]["key"] == "busy"

    def test_held_retry_then_raise(self, app: Celery, store: MemoryLockStore) -> None:
        """on_held="retry" retries within max_retries, then fails with LockNotAcquiredError."""
        rejected = []

        class Task(LockedTask):
            lock_on_held = "retry"
            lock_retry_countdown = 0
            max_retries = 2

            def on_lock_rejected(self, key: str) -> None:
                rejected.append(key)

        @app.task(base=Task, lock_key="busy", shared=False)
        def task() -> None: ...

        hold(store, "busy")
        result = task.apply()
        assert result.state == "FAILURE" and isinstance(result.result, LockNotAcquiredError)
        assert rejected == ["busy"] * 3

    def test_retry_releases_and_keeps_key(self, app: Celery, store: MemoryLockStore) -> None:
        """A body that retries gets the same key on every attempt and never meets its own lease."""
        attempts: list[tuple[str, int]] = []

        @app.task(bind=True, base=LockedTask, lock_key="r:{n}", max_retries=3, shared=False)
        def task(self: Any, n: int) -> int:
            attempts.append((self.request.lock_key, self.request.lock_token))
            if len(attempts) < 3:
                raise self.retry(countdown=0)
            return n

        result = task.apply((5,))
        assert (result.state, result.result) == ("SUCCESS", 5)
        assert [k for k, _ in attempts] == ["r:5"] * 3
        assert len({t for _, t in attempts}) == 3
        assert store.get("r:5") is None

    def test_reentrant_direct_call_reuses_lease(self, app: Celery) -> None:
        """A locked task calling another locked function on the same key reuses its lease."""

        @app.task(bind=True, shared=False)
        @locked(key="same:{a}")
        def inner(self: Any, a: int) -> Any:
            return get_lock_token()

        @app.task(base=LockedTask, lock_key="same:{a}", shared=False)
        def outer(a: int) -> Any:
            return outer.request.lock_token, inner(a)

        result = outer.apply((1,))
        assert result.state == "SUCCESS", result.traceback
        outer_token, inner_token = result.result
        assert outer_token == inner_token

    def test_cooldown_keeps_key_after_success(self, app: Celery, store: MemoryLockStore) -> None:
        """With cooldown, a late duplicate after a successful run is turned away."""

        @app.task(base=LockedTask, lock_key="nightly", lock_cooldown="1h", shared=False)
        def task() -> str:
            return "done"

        assert task.apply().result == "done"
        second = task.apply()
        assert isinstance(second.result, LockNotAcquiredError)

    def test_receiver_that_raises_does_not_break_task(self, app: Celery) -> None:
        """A lock_acquired receiver raising is logged; the task still succeeds."""

        def boom(**kwargs: Any) -> None:
            raise RuntimeError("receiver bug")

        lease_signals.lock_acquired.connect(boom, weak=False)
        try:

            @app.task(base=LockedTask, lock_key="k", shared=False)
            def task() -> int:
                return 1

            assert task.apply().result == 1
        finally:
            lease_signals.lock_acquired.disconnect(boom)

    def test_unkeyable_argument_fails_clearly(self, app: Celery) -> None:
        """The default key refuses an argument it cannot canonicalise, naming it."""

        @app.task(base=LockedTask, shared=False)
        def task(thing: Any) -> None: ...

        result = task.apply((threading.Lock(),))
        assert isinstance(result.result, LeaseConfigError)
        assert "'thing'" in str(result.result) and "`key`" in str(result.result)


class TestLoss:
    def _lose_soon(self, store: MemoryLockStore, key: str) -> None:
        """Take the key away from its holder once it is held (the next renewal fails)."""

        def run() -> None:
            deadline = time.monotonic() + REAL_TIMEOUT
            while store.get(key) is None and time.monotonic() < deadline:
                time.sleep(0.005)
            store.force_release(key)
            store.acquire(key, "another-owner", 60_000)  # taken, not just freed

        threading.Thread(target=run, daemon=True).start()

    def test_mark_success_is_returned_with_warning(
        self,
        app: Celery,
        store: MemoryLockStore,
        received: list[Any],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """on_lost="mark": lock_lost flag and signal; a body that succeeds anyway is returned."""

        # 3 s: the renewal at 1 s reads the key taken long before the lease could expire (a
        # 0.3 s lease expired first on a loaded machine, its renewal late).
        @app.task(base=LockedTask, lock_key="m", lock_ttl="3s", shared=False)
        def task() -> Any:
            assert task.request.lease.wait_lost(REAL_TIMEOUT)
            return task.request.lock_lost, task.request.lease.lost_reason

        self._lose_soon(store, "m")
        with caplog.at_level(logging.WARNING):
            result = task.apply()
        assert result.state == "SUCCESS" and tuple(result.result) == (True, "taken")
        wait_for_signal(received, "lock_lost")  # sent from the dispatcher, maybe after the body
        lost = [kw for name, kw in received if name == "lock_lost"]
        assert len(lost) == 1 and lost[0]["reason"] == "taken" and lost[0]["key"] == "m"
        assert lost[0]["task_id"] == result.id, "lock_lost names the execution it came from"
        names = [name for name, _ in received]
        assert names == ["lock_acquired", "lock_lost"], "a lost lease is not reported released"
        assert any("succeeded although" in r.message for r in caplog.records)

    def test_mark_failure_is_reported_as_lock_lost(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """on_lost="mark": a body that fails after the loss is reported as LockLostError."""

        @app.task(base=LockedTask, lock_key="m2", lock_ttl="0.3s", shared=False)
        def task() -> None:
            assert task.request.lease.wait_lost(REAL_TIMEOUT)
            task.request.lease.check()

        self._lose_soon(store, "m2")
        result = task.apply()
        assert result.state == "FAILURE" and isinstance(result.result, LockLostError)

    def test_revoke_interrupts_main_thread_body(self, app: Celery, store: MemoryLockStore) -> None:
        """on_lost="revoke" in the main thread (prefork/solo path) interrupts a sleeping body."""

        @app.task(
            base=LockedTask, lock_key="v", lock_ttl="0.3s", lock_on_lost="revoke", shared=False
        )
        def task() -> str:
            time.sleep(REAL_TIMEOUT)
            return "finished"

        assert threading.current_thread() is threading.main_thread()
        self._lose_soon(store, "v")
        started = time.monotonic()
        result = task.apply()
        assert result.state == "FAILURE" and isinstance(result.result, LockLostError)
        assert time.monotonic() - started < REAL_TIMEOUT / 2

    def test_revoke_interrupts_thread_body(self, app: Celery, store: MemoryLockStore) -> None:
        """on_lost="revoke" in a worker thread (threads pool path) raises in the body."""

        @app.task(
            base=LockedTask, lock_key="v2", lock_ttl="0.3s", lock_on_lost="revoke", shared=False
        )
        def task() -> str:
            deadline = time.monotonic() + REAL_TIMEOUT
            while time.monotonic() < deadline:
                time.sleep(0.01)
            return "finished"

        results: list[Any] = []
        self._lose_soon(store, "v2")
        thread = threading.Thread(target=lambda: results.append(task.apply()))
        started = time.monotonic()
        thread.start()
        thread.join(REAL_TIMEOUT * 2)
        assert results and results[0].state == "FAILURE"
        assert isinstance(results[0].result, LockLostError)
        assert time.monotonic() - started < REAL_TIMEOUT / 2


class TestErrorsAcrossBackends:
    @pytest.mark.parametrize("serializer", ["json", "pickle"])
    def test_errors_round_trip(self, app: Celery, serializer: str) -> None:
        """Both lock errors keep type and ``.key`` through the backend's exception encoding."""
        app.conf.result_serializer = serializer
        app.conf.accept_content = ["json", "pickle"]
        app.conf.result_accept_content = ["json", "pickle"]
        backend = app.backend
        for exc in (LockNotAcquiredError("acct:1"), LockLostError("acct:1", "taken")):
            stored = backend.prepare_exception(exc, serializer)
            data = backend.decode(backend.encode({"result": stored}))["result"]
            back = backend.exception_to_python(data)
            assert type(back) is type(exc) and back.key == "acct:1"
            assert pickle.loads(pickle.dumps(back)).args == exc.args


class TestEarlyRelease:
    """A body that publishes its own task id (``retry()``, ``apply_async(task_id=...)``) frees
    its key while it runs on: the lease reads lost with reason ``"released"``."""

    def test_own_id_publish_marks_the_lease_released(
        self, app: Celery, store: MemoryLockStore, received: list[Any]
    ) -> None:
        """After ``apply_async(task_id=self.request.id)``, lock_lost is True, check() raises
        LockLostError("released"), another owner can take the key and keeps it."""

        @app.task(bind=True, base=LockedTask, lock_key="early:{n}", shared=False)
        def task(self: Any, n: int) -> dict[str, Any]:
            self.apply_async((n,), task_id=self.request.id)  # to the memory broker, unconsumed
            seen: dict[str, Any] = {
                "held": store.get("early:1"),
                "lost": self.request.lock_lost,
                "reason": self.request.lease.lost_reason,
            }
            try:
                self.request.lease.check()
            except LockLostError as exc:
                seen["check"] = exc.reason
            seen["other"] = store.acquire("early:1", "someone-else", 60_000)
            return seen

        result = task.apply((1,))
        assert result.state == "SUCCESS", result.traceback
        seen = result.result
        assert seen["held"] is None, "the key was free while the body ran on"
        assert (seen["lost"], seen["reason"], seen.get("check")) == (True, "released", "released")
        assert seen["other"] is not None
        after = store.get("early:1")
        assert after is not None and after.owner == "someone-else", "the new holder kept it"
        names = [name for name, _ in received]
        assert names == ["lock_acquired", "lock_released"], "released once, and no lock_lost"

    def test_eager_retry_without_throw_publishes_nothing_and_keeps_the_lease(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """Eager ``retry(throw=False)`` sends no message: the lease stays held and not lost."""

        @app.task(bind=True, base=LockedTask, lock_key="keep", shared=False)
        def task(self: Any) -> list[Any]:
            self.retry(countdown=0, throw=False)
            held = store.get("keep")
            return [held is not None and held.owner == self.request.lease.owner,
                    self.request.lock_lost]  # fmt: skip

        result = task.apply()
        assert result.state == "SUCCESS", result.traceback
        assert list(result.result) == [True, False]
        assert store.get("keep") is None

    def test_raise_retry_with_revoke_ends_in_success(self, app: Celery) -> None:
        """``raise self.retry()`` with on_lost="revoke" retries (not FAILURE), then succeeds."""
        attempts: list[int] = []

        @app.task(
            bind=True, base=LockedTask, lock_key="rv", lock_on_lost="revoke", max_retries=1,
            shared=False,
        )  # fmt: skip
        def task(self: Any) -> int:
            attempts.append(self.request.retries)
            if self.request.retries == 0:
                raise self.retry(countdown=0)
            return 7

        result = task.apply()
        assert (result.state, result.result, attempts) == ("SUCCESS", 7, [0, 1])


class TestLossListeners:
    """lock_lost receivers and on_lock_lost are user code: never on the renewer's thread, and
    one that blocks delays neither the interrupt nor anything else."""

    def test_receiver_and_hook_run_off_the_renewer_and_watchdog(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """The lock_lost receiver and on_lock_lost run on another thread than the renewer's."""
        threads: dict[str, str] = {}
        done = threading.Event()

        def receiver(sender: Any = None, **kwargs: Any) -> None:
            threads["signal"] = threading.current_thread().name
            if "hook" in threads:
                done.set()

        class Task(LockedTask):
            def on_lock_lost(self, lease: Any) -> None:
                threads["hook"] = threading.current_thread().name
                if "signal" in threads:
                    done.set()

        @app.task(base=Task, lock_key="off", lock_ttl="0.3s", shared=False)
        def task() -> bool:
            return done.wait(REAL_TIMEOUT)

        lease_signals.lock_lost.connect(receiver, weak=False)
        try:
            TestLoss()._lose_soon(store, "off")
            result = task.apply()
        finally:
            lease_signals.lock_lost.disconnect(receiver)
        assert result.result is True, threads
        infrastructure = {"celery-lease-renewer", "celery-lease-watchdog"}
        assert not {threads["signal"], threads["hook"]} & infrastructure, threads

    def test_blocking_receiver_does_not_delay_the_interrupt(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """With on_lost="revoke", a lock_lost receiver blocked for seconds does not hold up the
        interrupt of the body."""
        unblock = threading.Event()
        entered = threading.Event()

        def blocking(sender: Any = None, **kwargs: Any) -> None:
            entered.set()
            unblock.wait(REAL_TIMEOUT / 2)

        @app.task(
            base=LockedTask, lock_key="blk", lock_ttl="0.3s", lock_on_lost="revoke", shared=False
        )
        def task() -> str:
            deadline = time.monotonic() + REAL_TIMEOUT
            while time.monotonic() < deadline:
                time.sleep(0.01)
            return "finished"

        lease_signals.lock_lost.connect(blocking, weak=False)
        try:
            TestLoss()._lose_soon(store, "blk")
            started = time.monotonic()
            result = task.apply()
            elapsed = time.monotonic() - started
            # The receiver runs on the dispatcher: wait for it before disconnecting it.
            reached = entered.wait(REAL_TIMEOUT)
            still_blocked = not unblock.is_set()
        finally:
            unblock.set()
            lease_signals.lock_lost.disconnect(blocking)
        assert result.state == "FAILURE" and isinstance(result.result, LockLostError)
        assert reached and still_blocked, "the lock_lost receiver never ran"
        assert elapsed < REAL_TIMEOUT / 4, f"the interrupt waited for the receiver ({elapsed:.1f}s)"

    def test_revoke_lease_lost_before_the_body_starts_never_runs_it(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """on_lost="revoke": a lease lost between acquiring and the body (forced in a
        lock_acquired receiver) fails with LockLostError and the body never runs."""
        ran: list[int] = []

        def lose_now(key: str = "", **kwargs: Any) -> None:
            if key == "before":
                store.force_release(key)
                held = current_lease()
                assert held is not None and held.wait_lost(REAL_TIMEOUT)

        @app.task(
            base=LockedTask, lock_key="before", lock_ttl="0.3s", lock_on_lost="revoke",
            shared=False,
        )  # fmt: skip
        def task() -> None:
            ran.append(1)

        lease_signals.lock_acquired.connect(lose_now, weak=False)
        try:
            result = task.apply()
        finally:
            lease_signals.lock_acquired.disconnect(lose_now)
        assert result.state == "FAILURE" and isinstance(result.result, LockLostError)
        assert ran == []


# Nested runs and the moments around the body ----------------------------------------------------


def busy(seconds: float = REAL_TIMEOUT) -> None:
    """Work (bytecode between short sleeps) that an interrupt can land in."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


class TestOuterInterruptThroughInnerRun:
    """on_lost="revoke" of an outer execution lands in the body of an inner locked task the
    outer body called directly: the inner run must release its own lease on the way out."""

    @pytest.mark.parametrize("where", ["main", "thread"])
    @pytest.mark.parametrize("inner_key", ["inner", "outer"])
    def test_inner_lease_and_frames_are_gone_after_the_interrupt(
        self, app: Celery, store: MemoryLockStore, where: str, inner_key: str
    ) -> None:
        @app.task(base=LockedTask, lock_key=inner_key, shared=False)
        def inner() -> None:
            store.force_release("outer")  # the outer lease's next renewal finds it taken
            busy()

        @app.task(
            base=LockedTask, lock_key="outer", lock_ttl="0.3s", lock_on_lost="revoke",
            shared=False,
        )  # fmt: skip
        def outer() -> None:
            inner()

        seen: dict[str, Any] = {}

        def run() -> None:
            seen["result"] = outer.apply()
            seen["current"] = current_lease()
            seen["token"] = get_lock_token()

        if where == "main":
            run()
        else:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join(REAL_TIMEOUT * 2)
        result = seen["result"]
        assert result.state == "FAILURE" and isinstance(result.result, LockLostError)
        assert store.get("inner") is None, "the inner run's lease was left held (and renewed)"
        assert seen["current"] is None and seen["token"] is None, "a lease frame leaked"


class _Abort(BaseException):
    """What an asynchronous exception (gevent.Timeout, a KeyboardInterrupt) looks like."""


class TestAcquiredButNotYetRunning:
    """Between acquiring and the body, something may raise (a lock_acquired receiver raising
    a BaseException - Celery's robust send catches only Exception - or an asynchronous
    exception): the lease must not be left held and renewed for ever."""

    def test_base_exception_from_a_lock_acquired_receiver_releases(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        from celery_lease import signals as lease_signals

        def abort(key: str = "", **kwargs: Any) -> None:
            if key == "window":
                raise _Abort()

        @app.task(base=LockedTask, lock_key="window", shared=False)
        def task() -> None: ...

        lease_signals.lock_acquired.connect(abort, weak=False)
        try:
            with pytest.raises(_Abort):
                task.apply()
        finally:
            lease_signals.lock_acquired.disconnect(abort)
        assert store.get("window") is None, "acquired, never released, renewed for ever"
        assert current_lease() is None


class TestNestedLockedHelper:
    """A ``@locked`` plain function called from a locked task's body runs on the task's
    request (``get_current_task()``): the task's own lock attributes must come back after it."""

    def test_request_reads_the_outer_lease_again_after_the_helper(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        from celery_lease import LockNotAcquiredError, locked

        @locked(key="helper")
        def helper() -> int | None:
            return get_lock_token()

        @app.task(bind=True, base=LockedTask, lock_key="outer-h", lock_ttl="0.3s", shared=False)
        def task(self: Any) -> dict[str, Any]:
            own = self.request.lease
            seen: dict[str, Any] = {"outer": (self.request.lock_key, self.request.lock_token)}
            seen["helper_token"] = helper()
            seen["after"] = (self.request.lock_key, self.request.lock_token)
            assert store.acquire("helper", "someone-else", 60_000) is not None
            with pytest.raises(LockNotAcquiredError):
                helper()
            seen["after_rejected"] = (self.request.lock_key, self.request.lock_token)
            store.force_release("outer-h")  # now lose the task's own lease
            assert own.wait_lost(REAL_TIMEOUT)
            seen["lost"] = self.request.lock_lost
            return seen

        result = task.apply()
        assert result.state == "SUCCESS", result.traceback
        seen = result.result
        outer = tuple(seen["outer"])
        assert seen["helper_token"] != outer[1]
        assert tuple(seen["after"]) == outer, "the helper's lease was left on the request"
        assert tuple(seen["after_rejected"]) == outer
        assert seen["lost"] is True, "request.lock_lost read the helper's lease: loss hidden"


class TestEagerPropagates:
    """``task_eager_propagates``: Celery's on_failure/after_return do not run; the lease is
    released anyway and the error reaches the caller unchanged (or as LockLostError)."""

    def test_errors_propagate_and_the_lease_is_released(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        from celery_lease import LockNotAcquiredError

        app.conf.task_eager_propagates = True

        @app.task(bind=True, base=LockedTask, lock_key="prop", lock_ttl="0.3s", shared=False)
        def task(self: Any, mode: str) -> None:
            if mode == "lose":
                store.force_release("prop")
                assert self.request.lease.wait_lost(REAL_TIMEOUT)
            raise ValueError(mode)

        with pytest.raises(ValueError, match="plain"):
            task.apply(("plain",))
        assert store.get("prop") is None
        with pytest.raises(LockLostError) as lost:
            task.apply(("lose",))
        assert isinstance(lost.value.__cause__, ValueError)
        assert store.get("prop") is None
        assert store.acquire("prop", "someone-else", 60_000) is not None
        with pytest.raises(LockNotAcquiredError):
            task.apply(("plain",))
        assert store.get("prop").owner == "someone-else"  # type: ignore[union-attr]


class _ReleaseAfterOuterLoss(MemoryLockStore):
    """``release("inner")`` runs Python code until well after the outer lease is lost, so the
    outer execution's interrupt lands inside the inner run's release."""

    def __init__(self) -> None:
        super().__init__()
        self.outer: Any = None

    def release(self, key: str, owner: str) -> bool:
        if key == "inner-r":
            assert self.outer is not None and self.outer.wait_lost(REAL_TIMEOUT)
            busy(0.5)
        return bool(super().release(key, owner))


@pytest.mark.parametrize("where", ["main", "thread"])
def test_outer_interrupt_landing_in_a_nested_release_is_not_swallowed(where: str) -> None:
    store = _ReleaseAfterOuterLoss()
    app = Celery("nested", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.task_eager_propagates = False

    @app.task(base=LockedTask, lock_key="inner-r", shared=False)
    def inner() -> None:
        store.force_release("outer-r")

    @app.task(
        # 3 s: the renewer reads the key freed (at 1 s) long before the lease's own validity
        # ends; with 0.3 s a loaded machine let the body thread see it expire first, and a body
        # that learns of its loss itself is not interrupted (it reads it).
        bind=True, base=LockedTask, lock_key="outer-r", lock_ttl="3s", lock_on_lost="revoke",
        shared=False,
    )  # fmt: skip
    def outer(self: Any) -> str:
        store.outer = self.request.lease
        inner()
        return "ran on after the loss"

    results: list[Any] = []
    if where == "main":
        results.append(outer.apply())
    else:
        thread = threading.Thread(target=lambda: results.append(outer.apply()))
        thread.start()
        thread.join(REAL_TIMEOUT * 2)
    app.close()
    assert results[0].state == "FAILURE" and isinstance(results[0].result, LockLostError)
    assert store.get("inner-r") is None
