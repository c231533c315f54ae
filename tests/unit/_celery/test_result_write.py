"""Which result backends read the deferred release replies before they write a result: Celery's
key-value backends (their write path ends in ``_set_with_state``), on that instance only; never a
stand-in, nor a backend with a step of that path replaced on the instance. The order it gives a
locked task's release and its result: ``test_deferral.TestAStoredResultIsWrittenAfterTheReply``.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from celery import Celery

from celery_lease._celery import result_write


@pytest.mark.parametrize(
    ("url", "qualifies"),
    [
        ("redis://127.0.0.1:1/0", True),
        ("sentinel://127.0.0.1:1", True),
        ("cache+memory://", True),
        ("file:///tmp", True),
        ("rpc://", False),
        ("db+sqlite://", False),
    ],
)
def test_which_of_celerys_backends_read_the_replies_first(url: str, qualifies: bool) -> None:
    """Celery's key-value backends write through ``_set_with_state``; the database and
    RPC backends write their own way (built only: nothing connects)."""
    made = Celery("backends", backend=url, set_as_current=False)
    try:
        calls: list[str] = []
        backend = made.backend
        if qualifies:  # the key-value store itself, in memory: nothing connects
            backend.get = lambda key: None
            backend.set = lambda key, value, **options: calls.append("write")
        assert result_write.reads_releases_first(backend, lambda: calls.append("read")) is (
            qualifies
        )
        if qualifies:
            backend.store_result("t", 1, "SUCCESS")
            assert calls == ["read", "write"]
    finally:
        made.close()


def test_the_answer_is_kept_per_instance() -> None:
    made = Celery("kept", backend="cache+memory://", set_as_current=False)
    try:
        reads: list[str] = []
        backend = made.backend
        assert result_write.reads_releases_first(backend, lambda: reads.append("first"))
        assert result_write.reads_releases_first(backend, lambda: reads.append("second"))
        backend.set = lambda key, value, **options: reads.append("write")
        backend.get = lambda key: None
        backend.store_result("t", 1, "SUCCESS")
        assert reads == ["first", "write"]  # wrapped once
    finally:
        made.close()


def test_a_stand_in_is_never_taken_for_a_backend() -> None:
    assert result_write.reads_releases_first(mock.MagicMock(), lambda: None) is False
    assert result_write.reads_releases_first(object(), lambda: None) is False


@pytest.mark.parametrize(
    "step", ["mark_as_done", "store_result", "_store_result", "_set_with_state"]
)
def test_a_step_replaced_on_the_instance_disqualifies_it(step: str) -> None:
    made = Celery("replaced", backend="cache+memory://", set_as_current=False)
    try:
        backend: Any = made.backend
        setattr(backend, step, getattr(backend, step))
        assert result_write.reads_releases_first(backend, lambda: None) is False
    finally:
        made.close()
