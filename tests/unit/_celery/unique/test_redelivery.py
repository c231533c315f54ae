"""Unique copies as a worker meets their messages: the start of a copy, a newer call handing over,
a copy that starts after its queue ttl, and a copy's message delivered again.

Each delivery runs the worker's hooks (``on_start`` / ``on_rejected``) or the engine as a worker
would, on a memory store and a FakeClock; a competing call is made at a chosen store operation.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_lease._celery import settings as config
from celery_lease._celery import unique as unique_module
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.testing import FakeClock
from tests.unit.conftest import Published, SpyStore
from tests.unit.unique_copies import (
    Bodies,
    define_task,
    deliver,
    hook_once,
    request_of,
    start_copy,
    until_done_copy,
)


class TestDebounceHandOver:
    @pytest.mark.parametrize(
        ("op", "after"),
        [("release", False), ("release", True), ("acquire", False), ("acquire", True)],
    )
    def test_a_superseded_copy_never_runs_its_body(
        self,
        app: Celery,
        published: Published,
        store: SpyStore,
        monkeypatch: pytest.MonkeyPatch,
        op: str,
        after: bool,
    ) -> None:
        """A newer call landing at any point of the waiting copy's start (each store call it
        makes there): either the copy ends (Ignore) or it was not superseded (no tombstone names
        a newer call: the copy's own claim only)."""
        task = define_task(
            app, f"r.handover.{op}.{after}", lock_unique="while_queued", lock_debounce=1
        )
        first = task.delay(1, 0)
        request = request_of(published.headers[0])
        newer: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            op,
            lambda *a: True,
            lambda: newer.append(task.delay(1, 5)),
            after=after,
        )
        unique = type(task)._lock_options.unique
        settings = config.get_settings(app)
        try:
            start_copy(task, request, store, "k:1", settings, unique, 30, 0)
        except Ignore:
            ran = False
        else:
            ran = True
        assert newer, "the competing call was made"
        tomb = store.get(unique_common.superseded_key(first.id, ""))
        superseded = tomb is not None and parse_owner(tomb.owner).task_id != first.id
        assert not (ran and superseded), "the superseded copy went on to run its body"


class TestFakeClockAroundQueueTtl:
    def test_a_copy_starting_after_its_queue_ttl_frees_nothing_of_the_next(
        self, app: Celery, published: Published, store: SpyStore, clock: FakeClock
    ) -> None:
        """A's queued lease expired, B took the key; A starting late releases only its own."""
        task = define_task(app, "r.late", lock_unique="while_queued", lock_queue_ttl=10)
        a = task.delay(1)
        clock.advance(10.1)
        b = task.delay(1)
        assert b.id != a.id
        unique = type(task)._lock_options.unique
        settings = config.get_settings(app)
        start_copy(task, request_of(published.headers[0]), store, "k:1", settings, unique, 30, 0)
        info = store.get("queued:k:1")
        assert info is not None and parse_owner(info.owner).task_id == b.id
        assert task.delay(1).id == b.id


class TestRedelivery:
    def test_a_redelivered_copy_meeting_its_own_run_lease_keeps_the_queued_key(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """acks_late redelivery of a running until_done copy: the run lease is its own, so it
        is turned away without freeing the queued key the running body keeps."""
        task = define_task(app, "r.redelivered", lock_unique="until_done")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)  # running
        settings = config.get_settings(app)
        unique_module.on_rejected(request_of(published.headers[0]), store, "k:1", settings)
        assert task.delay(1).id == first.id
        assert published.ids == [first.id]

    def test_a_second_delivery_of_the_running_copy_is_resent_and_stores_nothing(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """With the engine's arguments, a delivery meeting its own running copy's run lease is
        re-sent with the same id, ``lease_deferred`` and a countdown of the run ttl, then ends
        with Ignore: nothing stored under the id, the queued key kept."""
        task = define_task(app, "r.deferred", lock_unique="until_done")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)  # running
        request = request_of(published.headers[0])
        request.args, request.kwargs = [1], {}
        settings = config.get_settings(app)
        with pytest.raises(Ignore):
            unique_module.on_rejected(request, store, "k:1", settings, task=task, ttl=5.0)
        assert published.ids == [first.id, first.id]
        again = published.headers[1]
        assert again[unique_common.DEFERRED] == 1  # re-sent once so far
        assert again[unique_common.HEADER] == published.headers[0][unique_common.HEADER]
        assert again["eta"] is not None and again["expires"] is None
        assert task.AsyncResult(first.id).state == "PENDING"
        assert store.get("queued:k:1") is not None

    def test_a_deferred_delivery_of_a_finished_copy_ends_before_its_body(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """A deferred delivery that finds its copy's result ready raises Ignore at start."""
        task = define_task(app, "r.deferred-done", lock_unique="until_done")
        first = task.delay(1)
        task.backend.mark_as_done(first.id, 1)
        request = request_of(published.headers[0])
        setattr(request, unique_common.DEFERRED, 1)  # re-sent once
        settings = config.get_settings(app)
        unique = type(task)._lock_options.unique
        with pytest.raises(Ignore, match="finished"):
            start_copy(task, request, store, "k:1", settings, unique, 30, 0)
        assert task.AsyncResult(first.id).get() == 1

    def test_a_deferred_delivery_whose_re_send_fails_with_the_key_free_ends_failure(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A deferred delivery back with the run key free and its copy not done is re-sent once
        more; when that publish fails (not acks_late: nothing keeps the message), no copy is
        left to run: the publish error is stored as the copy's FAILURE, never PENDING."""
        task = define_task(app, "r.deferred-lost", lock_unique="while_queued", lock_debounce=1)
        first = task.delay(1)
        request = request_of(published.headers[0])
        request.args, request.kwargs = [1], {}
        setattr(request, unique_common.DEFERRED, 1)  # re-sent once: its worker may have died

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", refuse)
        settings = config.get_settings(app)
        unique = type(task)._lock_options.unique
        with pytest.raises(Ignore):
            start_copy(task, request, store, "k:1", settings, unique, 30, 0)
        result = task.AsyncResult(first.id)
        assert result.state == "FAILURE"
        assert isinstance(result.result, ConnectionError)

    def test_a_deferred_delivery_whose_re_send_fails_leaves_a_retry_state_alone(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The copy retried (RETRY stored: a retry message carries its work): a deferred
        delivery whose re-send fails with the key free stores no FAILURE over it."""
        task = define_task(app, "r.deferred-retry", lock_unique="while_queued", lock_debounce=1)
        first = task.delay(1)
        task.backend.mark_as_retry(first.id, RuntimeError("try again"))
        request = request_of(published.headers[0])
        request.args, request.kwargs = [1], {}
        setattr(request, unique_common.DEFERRED, 1)

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", refuse)
        settings = config.get_settings(app)
        unique = type(task)._lock_options.unique
        with pytest.raises(Ignore):
            start_copy(task, request, store, "k:1", settings, unique, 30, 0)
        assert task.AsyncResult(first.id).state == "RETRY"

    def test_a_deferred_delivery_whose_re_send_fails_keeps_a_stored_result(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A second delivery of the running copy (its own run lease) whose re-send fails stores
        nothing: the running copy carries the work and stores its own result."""
        task = define_task(app, "r.deferred-running", lock_unique="until_done")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)  # running
        request = request_of(published.headers[0])
        request.args, request.kwargs = [1], {}

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", refuse)
        settings = config.get_settings(app)
        with pytest.raises(Ignore):
            unique_module.on_rejected(request, store, "k:1", settings, task=task, ttl=5.0)
        assert task.AsyncResult(first.id).state == "PENDING"

    def test_a_copy_turned_away_by_another_copy_frees_its_queued_key(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """The run lease is another copy's: the rejected copy frees its own queued key."""
        task = define_task(app, "r.rejected", lock_unique="while_queued")
        first = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id="other-id"), 60_000)
        settings = config.get_settings(app)
        unique_module.on_rejected(request_of(published.headers[0]), store, "k:1", settings)
        assert store.get("queued:k:1") is None
        assert task.delay(1).id != first.id


def retried_copy(
    app: Celery, published: Published, name: str
) -> tuple[Bodies, Any, Any, dict[str, Any]]:
    """An until_done, acks_late copy (``until_done_copy``) whose attempt 0 retried: RETRY
    stored, the retry message (same id, retries=1) published."""
    bodies, task, first, headers = until_done_copy(app, published, name, acks_late=True)
    task.backend.mark_as_retry(first.id, RuntimeError("try again"))
    return bodies, task, first, headers


class TestRedeliveredRetryAttempt:
    """A second delivery of a retry attempt (retries=1) is re-sent, never dropped.

    ``_finished`` counts RETRY as done ("the retry message carries the work"), and the RETRY
    state stays in the backend while the retry attempt itself runs (Celery writes STARTED only
    with ``track_started``). A second delivery of the retry attempt must not be taken for one of
    the attempt that retried (retries=0): when the retry attempt's worker died (acks_late: its
    message redelivered to another worker while the dead holder's run lease is still live), that
    redelivery is the only message left, and dropping it (acked with Ignore, nothing stored)
    would lose the work silently."""

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
        # Re-sent, to come back once the dead holder's lease expired (never dropped).
        assert len(published.ids) == before + 1
        assert published.headers[-1][unique_common.DEFERRED] == 1

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
