"""Hostile review of the until_done "no wait" change (8100351, 8e3cb4b and the working tree):
the queued key released on the task's thread, its first renewal and the run lease's release
sent without waiting, and the re-sent second delivery rules (``_finished`` / ``_defer``).

Each test failed before its fix.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_lease import unique as unique_module
from celery_lease.owners import make_owner
from tests.unit.conftest import Published, SpyStore
from tests.unit.test_unique_deferral_review import Bodies, deliver, until_done_copy


def retried_copy(
    app: Celery, published: Published, name: str
) -> tuple[Bodies, Any, Any, dict[str, Any]]:
    """An until_done, acks_late copy (``until_done_copy``) whose attempt 0 retried: RETRY
    stored, the retry message (same id, retries=1) published."""
    bodies, task, first, headers = until_done_copy(app, published, name, acks_late=True)
    task.backend.mark_as_retry(first.id, RuntimeError("try again"))
    return bodies, task, first, headers


class TestRedeliveredRetryAttempt:
    """``_finished`` counts RETRY as done ("the retry message carries the work"). But the
    RETRY state stays in the backend while the retry attempt itself runs (Celery writes
    STARTED only with ``track_started``): a second delivery *of the retry attempt* (retries=1)
    is then taken for a delivery of the attempt that retried (retries=0) and dropped. When the
    retry attempt's worker died (acks_late: its message redelivered to another worker while the
    dead holder's run lease is still live), that redelivery was the only message left: the
    work is lost, silently (acked with Ignore, nothing stored)."""

    def test_a_redelivered_retry_attempt_is_re_sent_not_dropped(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        _, task, first, headers = retried_copy(app, published, "nw.retry-redelivered")
        # Attempt 1 started on worker W1 (run lease taken under the copy's id), then W1 was
        # killed: its run lease lives on for its ttl, the unacked message is redelivered now.
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)
        before = len(published.ids)
        with pytest.raises(Ignore):
            deliver(task, headers, deferred=False, retries=1, acks_late=True)
        # Expected: re-sent to come back once the dead holder's lease expired. Got: dropped.
        assert len(published.ids) == before + 1
        assert published.headers[-1][unique_module.DEFERRED] == 1

    def test_a_dead_retry_attempt_runs_on_its_second_free_arrival(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        bodies, task, first, headers = retried_copy(app, published, "nw.retry-dead")
        # The retry attempt's redelivery was re-sent once (count 1) and again with the key free
        # (count 2): its worker is dead, the copy never finished. It must run now.
        result: Any = None
        with contextlib.suppress(Ignore):
            result = deliver(task, headers, deferred=2, retries=1, acks_late=True)
        assert bodies.runs == [(first.id, 1)]
        assert result == 1
