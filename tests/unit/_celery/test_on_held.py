"""The ``on_held`` policies, applied to an execution whose key stayed held past ``wait``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_lease import LockNotAcquiredError, MemoryLockStore, locked
from celery_lease import signals as lease_signals
from celery_lease._celery.on_held import apply_policy, skip_quietly, superseded
from celery_lease._core.options import LockOptions
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.testing import FakeClock


class Backend:
    def __init__(self) -> None:
        self.revoked: list[tuple[str, str, bool]] = []
        self.states: dict[str, str] = {}

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        """The stored meta of a task, as Celery's key-value and database backends read it."""
        return {"status": self.states.get(task_id, "PENDING")}

    def mark_as_revoked(self, task_id: str, reason: str, request: Any, store_result: bool) -> None:
        self.revoked.append((task_id, reason, store_result))


class Task:
    """What the policies read of a Celery task."""

    name = "proj.report"
    ignore_result = False
    store_errors_even_if_ignored = False
    send_events = True

    def __init__(self) -> None:
        self.backend = Backend()
        self.events: list[tuple[str, str]] = []
        self.rejected: list[str] = []
        self.retried: list[dict[str, Any]] = []

    def send_event(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields["reason"]))

    def on_lock_rejected(self, key: str) -> None:
        self.rejected.append(key)

    def retry(self, **kwargs: Any) -> Exception:
        self.retried.append(kwargs)
        return RuntimeError("retry")


class Request:
    """A worker execution's request (not called directly, not eager)."""

    id = "t-1"
    called_directly = False
    is_eager = False
    retries = 3
    ignore_result = None


def _exc() -> LockNotAcquiredError:
    return LockNotAcquiredError("k", "held")


@pytest.fixture
def rejected() -> Any:
    sent: list[tuple[Any, Any]] = []

    def receiver(sender: Any = None, key: Any = None, task_id: Any = None, **_: Any) -> None:
        sent.append((key, task_id))

    lease_signals.lock_rejected.connect(receiver, weak=False)
    yield sent
    lease_signals.lock_rejected.disconnect(receiver)


class TestRaise:
    def test_the_error_is_raised_after_the_signal_and_the_hook(self, rejected: Any) -> None:
        """``"raise"``: ``lock_rejected`` is sent and ``on_lock_rejected`` called first."""
        task, exc = Task(), _exc()
        with pytest.raises(LockNotAcquiredError) as raised:
            apply_policy(task, Request(), "k", LockOptions(), exc, nested=False)
        assert raised.value is exc
        assert rejected == [("k", "t-1")]
        assert task.rejected == ["k"]


class TestRetry:
    def test_the_tasks_retry_is_raised_with_the_countdown(self) -> None:
        task = Task()
        options = LockOptions(on_held="retry", retry_countdown=7.0)
        with pytest.raises(RuntimeError, match="retry"):
            apply_policy(task, Request(), "k", options, _exc(), nested=False)
        assert [call["countdown"] for call in task.retried] == [7.0]

    def test_without_a_request_it_raises_the_error(self) -> None:
        """No request to retry (a direct call outside Celery): the error itself."""
        with pytest.raises(LockNotAcquiredError):
            apply_policy(None, None, "k", LockOptions(on_held="retry"), _exc(), nested=False)


class TestSkip:
    def test_a_worker_execution_ends_revoked_as_skipped(self) -> None:
        """Its own body skipped: REVOKED with a reason that says skipped, an event, Ignore."""
        task = Task()
        with pytest.raises(Ignore, match="skipped: 'k' held"):
            apply_policy(task, Request(), "k", LockOptions(on_held="skip"), _exc(), nested=False)
        [(task_id, reason, stored)] = task.backend.revoked
        assert (task_id, stored) == ("t-1", True)
        assert reason.startswith("skipped: 'k' held")
        assert task.events == [("task-revoked", reason)]

    def test_a_nested_run_returns_none(self) -> None:
        """Inside another locked run of the same execution: the enclosing body goes on."""
        task = Task()
        options = LockOptions(on_held="skip")
        assert apply_policy(task, Request(), "k", options, _exc(), nested=True) is None
        assert task.backend.revoked == []

    def test_a_helper_skipped_quietly_returns_none(self) -> None:
        """A ``@locked`` helper that is not its task's body returns ``None`` to the body."""
        task = Task()
        token = skip_quietly.set(True)
        try:
            options = LockOptions(on_held="skip")
            assert apply_policy(task, Request(), "k", options, _exc(), nested=False) is None
        finally:
            skip_quietly.reset(token)
        assert task.backend.revoked == []

    def test_a_direct_call_returns_none(self) -> None:
        class Direct(Request):
            called_directly = True

        task = Task()
        options = LockOptions(on_held="skip")
        assert apply_policy(task, Direct(), "k", options, _exc(), nested=False) is None
        assert task.backend.revoked == []


# The manual run of the report in the example: it succeeded at 21:50:36 UTC and keeps its key
# for a cooldown of 10 minutes; the beat tick comes at 21:51:00.
_RUN_AT = 1796507436.0  # 2026-12-05T21:50:36Z
_KEY = "nc5:nightly-report"


def _held_store(keep_ms: int, *, task_id: str = "t-0") -> tuple[MemoryLockStore, FakeClock]:
    """A store where the execution ``task_id`` of proj.report on w1@vm took ``_KEY`` at
    ``_RUN_AT`` with a 30 s ttl and then set it to ``keep_ms`` (its cooldown, or a renewal)."""
    clock = FakeClock(_RUN_AT)
    store = MemoryLockStore(clock=clock)
    owner = make_owner(node="w1@vm", task="proj.report", task_id=task_id)
    assert store.acquire(_KEY, owner, 30_000) is not None
    assert store.renew(_KEY, owner, keep_ms)
    clock.advance(24)  # the tick
    return store, clock


@pytest.fixture
def rejections() -> Any:
    sent: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        kwargs.pop("signal", None)
        sent.append(kwargs)

    lease_signals.lock_rejected.connect(receiver, weak=False)
    yield sent
    lease_signals.lock_rejected.disconnect(receiver)


class TestSkipReason:
    """A skip says why: the key's cooldown (until when, and after which execution) or the
    execution holding it, in the REVOKED reason, the log line and ``lock_rejected``."""

    def test_a_skip_in_a_cooldown_says_cooldown_until_when_and_after_which_run(
        self, rejections: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        store, _ = _held_store(600_000)
        task = Task()
        options = LockOptions(on_held="skip")
        exc = LockNotAcquiredError(_KEY, "held")
        with (
            caplog.at_level(logging.INFO, logger="celery_lease.engine"),
            pytest.raises(Ignore),
        ):
            apply_policy(task, Request(), _KEY, options, exc, nested=False, store=store, ttl=30.0)
        cooldown = (
            "'nc5:nightly-report' in its cooldown until 2026-12-05T22:00:36Z (576.0 s left),"
            " kept by proj.report[t-0] on w1@vm after it succeeded"
        )
        [(_, reason, _)] = task.backend.revoked
        assert reason == f"skipped: {cooldown} (on_held='skip')"
        assert f"proj.report[t-1] skipped: {cooldown.replace(' in its', ' is in its', 1)}" in (
            caplog.text
        )
        assert rejections == [
            {
                "key": _KEY,
                "task_id": "t-1",
                "reason": "cooldown",
                "until": _RUN_AT + 600,
                "holder_task_id": "t-0",
            }
        ]

    def test_a_skip_behind_a_running_execution_names_it(self, rejections: Any) -> None:
        """A lease renewed to its ttl is a running execution's: "held", and whose."""
        store, _ = _held_store(30_000)
        task = Task()
        exc = LockNotAcquiredError(_KEY, "held")
        with pytest.raises(Ignore):
            apply_policy(
                task,
                Request(),
                _KEY,
                LockOptions(on_held="skip"),
                exc,
                nested=False,
                store=store,
                ttl=30.0,
            )
        [(_, reason, _)] = task.backend.revoked
        assert reason == (
            "skipped: 'nc5:nightly-report' held by another execution, proj.report[t-0] on w1@vm"
            " (on_held='skip')"
        )
        assert [(r["reason"], r["holder_task_id"], r["until"]) for r in rejections] == [
            ("held", "t-0", _RUN_AT + 30)
        ]

    def test_a_holder_the_result_backend_shows_succeeded_is_in_its_cooldown(
        self, rejections: Any
    ) -> None:
        """A cooldown shorter than the ttl cannot be told by its length: the holder's task
        succeeded, as the result backend says, so the key is kept for its cooldown."""
        store, _ = _held_store(28_000)
        task = Task()
        task.backend.states = {"t-0": "SUCCESS"}
        exc = LockNotAcquiredError(_KEY, "held")
        cooldown = r"in its cooldown until 2026-12-05T21:51:04Z \(4.0 s left\)"
        with pytest.raises(Ignore, match=cooldown):
            apply_policy(
                task,
                Request(),
                _KEY,
                LockOptions(on_held="skip"),
                exc,
                nested=False,
                store=store,
                ttl=30.0,
            )
        assert [r["reason"] for r in rejections] == ["cooldown"]

    def test_a_store_that_cannot_answer_leaves_the_plain_reason(self, rejections: Any) -> None:
        """Describing the holder never fails the skip: a store error gives the plain text."""

        class Down(MemoryLockStore):
            def get(self, key: str) -> Any:
                raise ConnectionError("store down")

        task = Task()
        exc = LockNotAcquiredError(_KEY, "held")
        with pytest.raises(Ignore):
            apply_policy(
                task,
                Request(),
                _KEY,
                LockOptions(on_held="skip"),
                exc,
                nested=False,
                store=Down(),
                ttl=30.0,
            )
        [(_, reason, _)] = task.backend.revoked
        assert reason == "skipped: 'nc5:nightly-report' held by another execution (on_held='skip')"
        assert [(r["reason"], r["until"], r["holder_task_id"]) for r in rejections] == [
            ("held", None, None)
        ]

    def test_an_eager_tick_after_a_manual_run_logs_the_cooldown(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Through the run engine: the manual run succeeds and keeps its key; the tick that
        follows is skipped, and the log line says cooldown, until when, and after which run."""
        clock = FakeClock(_RUN_AT)
        app = Celery("beat", broker="memory://", set_as_current=False)
        app.conf.task_always_eager = True
        app.conf.lease_store = MemoryLockStore(clock=clock)

        @app.task(bind=True, name="proj.nightly_report_after_a_manual_run")
        @locked(key="nightly-report", on_held="skip", cooldown="10m")
        def nightly_report(self: Any) -> str:
            return "sent"

        manual = nightly_report.delay()
        assert manual.get() == "sent"
        clock.advance(24)
        with caplog.at_level(logging.INFO, logger="celery_lease.engine"):
            assert nightly_report.delay().get() is None
        assert (
            "skipped: 'nightly-report' is in its cooldown until 2026-12-05T22:00:36Z"
            f" (576.0 s left), kept by proj.nightly_report_after_a_manual_run[{manual.id}]"
        ) in caplog.text


class TestSuperseded:
    def test_a_worker_execution_ends_revoked_with_reason_replaced(self, rejected: Any) -> None:
        """Overtaken by a newer replace call: lock_rejected, on_lock_rejected, then REVOKED
        (task-revoked sent) and Ignore, as a skip; the reason names on_held='replace'."""
        task = Task()
        newer = parse_owner(make_owner(task="proj.report", task_id="t-2"))
        with pytest.raises(Ignore):
            superseded(task, Request(), "k", newer, nested=False)  # type: ignore[arg-type]
        assert rejected == [("k", "t-1")]
        assert task.rejected == ["k"]
        [(task_id, reason, _stored)] = task.backend.revoked
        assert task_id == "t-1"
        assert "on_held='replace'" in reason and "t-2" in reason
        assert task.events == [("task-revoked", reason)]

    def test_a_direct_call_returns_none(self, rejected: Any) -> None:
        task = Task()
        newer = parse_owner(make_owner())
        assert superseded(task, None, "k", newer, nested=False) is None  # type: ignore[arg-type]
        assert task.backend.revoked == []
