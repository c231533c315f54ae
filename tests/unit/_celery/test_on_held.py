"""The ``on_held`` policies, applied to an execution whose key stayed held past ``wait``."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Ignore

from celery_lease import LockNotAcquiredError
from celery_lease import signals as lease_signals
from celery_lease._celery.on_held import apply_policy, skip_quietly
from celery_lease._core.options import LockOptions


class Backend:
    def __init__(self) -> None:
        self.revoked: list[tuple[str, str, bool]] = []

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
