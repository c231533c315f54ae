"""until_done copies as a worker runs them: a second delivery of a running copy is re-sent
(``lease_deferred``) until its copy finished or died, never run beside it or after it; both keys
are free by the time the execution returns.

Each test drives the engine as a worker would (a request pushed with ``called_directly=False``,
then ``task(...)``) against a memory store, a ``memory://`` broker and a ``cache+memory://``
backend; no sleeps (threads joined, events).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_lease import LockedTask, signals
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import make_owner
from celery_lease.errors import LockNotAcquiredError
from tests.unit._celery.test_deferral import only_our_receivers  # noqa: F401 (autouse fixture)
from tests.unit.conftest import REAL_TIMEOUT, Published, SpyStore
from tests.unit.unique_copies import (
    Bodies,
    define_recorded,
    deliver,
    hook_once,
    until_done_copy,
)


class TestDeferredMeetsAnotherCopy:
    @pytest.mark.parametrize("on_held", ["raise", "retry"])
    def test_a_deferred_delivery_of_a_finished_copy_is_dropped_whoever_runs_the_key(
        self, app: Celery, published: Published, store: SpyStore, on_held: str
    ) -> None:
        bodies = Bodies()
        task = define_recorded(
            app, f"d.other.{on_held}", bodies, lock_unique="until_done", lock_on_held=on_held
        )
        first = task.delay(1)
        first_headers = published.headers[0]
        # The first copy was delivered twice (acks_late redelivery) while it ran: the second
        # delivery was re-sent with lease_deferred. Then the first copy finished: SUCCESS, both
        # keys freed.
        task.backend.mark_as_done(first.id, 1)
        store.release("queued:k:1", first_headers[unique_common.HEADER][1])
        # A new call: a new copy B, now running (holds the run key) when the deferred message
        # of the first copy comes back.
        second = task.delay(1)
        assert second.id != first.id
        store.acquire("k:1", make_owner(task=task.name, task_id=second.id), 60_000)
        before = len(published.ids)
        with pytest.raises(Ignore):
            deliver(task, first_headers, deferred=True)
        assert len(published.ids) == before  # no retry of a finished copy published
        assert task.AsyncResult(first.id).state == "SUCCESS"


class TestDeferredDuringRetry:
    def test_a_deferred_delivery_during_the_retry_wait_does_not_run_the_body(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        bodies, task, first, headers = until_done_copy(app, published, "d.retry-wait")
        # Attempt 0 ran, met a second delivery of itself (re-sent, deferred), then called
        # retry(countdown=600): RETRY stored, its run lease released early, the retry message
        # (retries=1) waits in the broker; the queued key is kept for the retry.
        task.backend.mark_as_retry(first.id, RuntimeError("try again"))
        assert store.get("queued:k:1") is not None
        assert store.get("k:1") is None
        with contextlib.suppress(Ignore):
            deliver(task, headers, deferred=True)
        assert bodies.runs == []  # the retry message (retries=1) is the one to run the body


class TestReleaseBeforeStore:
    def test_a_deferred_delivery_between_release_and_result_does_not_rerun(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        bodies, task, first, headers = until_done_copy(app, published, "d.window")
        errors: list[BaseException] = []
        fired: list[bool] = []

        def deferred_arrives(sender: Any = None, key: str = "", **_: Any) -> None:
            # The first copy's run lease was just released (lock_released is sent after it);
            # the tracer has not stored its SUCCESS yet. The deferred message comes back now,
            # on another worker thread.
            if key != "k:1" or fired:
                return
            fired.append(True)

            def other_worker() -> None:
                try:
                    deliver(task, headers, deferred=True)
                except Ignore:
                    pass
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            t = threading.Thread(target=other_worker)
            t.start()
            t.join(10)

        signals.lock_released.connect(deferred_arrives, weak=False)
        try:
            assert deliver(task, headers, deferred=False) == 1
        finally:
            signals.lock_released.disconnect(deferred_arrives)
        task.backend.mark_as_done(first.id, 1)  # what the tracer does next
        assert errors == []
        assert [r for r, _ in bodies.runs] == [first.id]  # the body ran once


class TestBackendErrorAtDeferredStart:
    def test_a_backend_error_does_not_rerun_a_finished_body(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        bodies, task, first, headers = until_done_copy(app, published, "d.backend-down")
        task.backend.mark_as_done(first.id, 1)  # the first copy finished
        store.release("queued:k:1", headers[unique_common.HEADER][1])

        def down(task_id: str) -> str:
            raise ConnectionError("result backend down")

        monkeypatch.setattr(task.backend, "get_state", down)
        # Dropped, or failed loudly: both fine; running the body again is not.
        with contextlib.suppress(Ignore, ConnectionError):
            deliver(task, headers, deferred=True)
        assert bodies.runs == []


def test_the_harness_runs_a_plain_delivery_once(app: Celery, published: Published) -> None:
    """The harness itself: a first delivery with no rival runs the body once, and a deferred
    delivery of a copy whose SUCCESS is stored (run key free) ends before its body."""
    bodies = Bodies()
    task = define_recorded(app, "d.sanity", bodies, lock_unique="until_done")
    first = task.delay(1)
    assert deliver(task, published.headers[0], deferred=False) == 1
    task.backend.mark_as_done(first.id, 1)
    with pytest.raises(Ignore):
        deliver(task, published.headers[0], deferred=True)
    assert [r for r, _ in bodies.runs] == [first.id]


class TestDeadCopy:
    def test_a_copy_whose_worker_died_runs_on_the_second_free_arrival(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """The deferred delivery of a copy that never finished (its worker died: PENDING, run
        key free) is re-sent once more (count 2), then runs the body: once, a ttl later."""
        bodies, task, _, headers = until_done_copy(app, published, "d.dead")
        with pytest.raises(Ignore):
            deliver(task, headers, deferred=1)
        assert bodies.runs == []
        again = published.headers[-1]
        assert again["id"] == headers["id"] and again[unique_common.DEFERRED] == 2
        assert store.get("k:1") is None  # the run lease it took is released again
        assert deliver(task, again, deferred=2) == 1
        assert [r for r, _ in bodies.runs] == [headers["id"]]

    def test_a_backend_error_waits_without_counting(
        self, app: Celery, published: Published, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """No answer from the backend: re-sent with the same count (asked again later)."""
        bodies, task, _, headers = until_done_copy(app, published, "d.ask-later")

        def down(task_id: str) -> str:
            raise ConnectionError("result backend down")

        monkeypatch.setattr(task.backend, "get_state", down)
        with pytest.raises(Ignore):
            deliver(task, headers, deferred=2)
        assert bodies.runs == []
        assert published.headers[-1][unique_common.DEFERRED] == 2


class TestResendFails:
    @pytest.mark.parametrize(("acks_late", "raised"), [(True, Reject), (False, Ignore)])
    def test_only_an_acks_late_message_goes_back_to_the_broker(
        self,
        app: Celery,
        published: Published,
        store: SpyStore,
        monkeypatch: pytest.MonkeyPatch,
        acks_late: bool,
        raised: type[BaseException],
    ) -> None:
        """A failed re-send rejects an acks_late message back to the broker; any other message
        was acked on arrival (a requeue would do nothing): it ends, logged, never stored."""
        bodies, task, first, headers = until_done_copy(app, published, f"d.resend.{acks_late}")
        store.acquire("k:1", make_owner(task=task.name, task_id=first.id), 60_000)  # running

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError("broker down")

        monkeypatch.setattr(Celery, "send_task", broken)
        monkeypatch.setattr(task, "acks_late", acks_late)
        with pytest.raises(raised):
            deliver(task, headers, deferred=False)
        assert bodies.runs == []
        assert task.AsyncResult(first.id).state == "PENDING"


REFUSALS = ["acquire", "acquire_or_holder"]
"""The store call that refuses the run key, hooked: ``acquire`` (replaced on the instance, the
engine reads the holder with a later ``get``) or ``acquire_or_holder`` (names it atomically)."""
REFUSAL_IDS = ["holder-read-after", "holder-named-by-refusal"]


class TestSecondDeliveryAsItsCopyEnds:
    @pytest.mark.parametrize("op", REFUSALS, ids=REFUSAL_IDS)
    @pytest.mark.parametrize("stored", [True, False], ids=["result-stored", "result-not-yet"])
    def test_the_copy_ending_after_the_refusal_fires_no_failure_path(
        self,
        app: Celery,
        published: Published,
        store: SpyStore,
        monkeypatch: pytest.MonkeyPatch,
        stored: bool,
        op: str,
    ) -> None:
        """A second delivery of a running copy is refused the run key by that copy; the copy
        then finishes (run lease and queued key released, its SUCCESS stored or about to be)
        before the delivery looks at who held the key. The delivery is still no rejection:
        on_held is not applied (no LockNotAcquiredError, whose FAILURE would fire task_failure,
        on_failure and the errbacks; no lock_rejected), the
        body does not run again, and nothing is stored under the id."""
        bodies = Bodies()
        gate = threading.Event()

        @app.task(
            name="d.ends-between", base=LockedTask, lock_key="k:{n}", lock_wait=0, shared=False,
            bind=True, lock_unique="until_done", acks_late=True,
        )  # fmt: skip
        def body(self: Any, n: int) -> int:
            with bodies.lock:
                bodies.runs.append((self.request.id, 0))
            assert gate.wait(REAL_TIMEOUT)
            return n

        task = body._get_current_object()
        first = task.delay(1)
        headers = published.headers[0]
        running = threading.Event()
        first_done: list[Any] = []

        def first_delivery() -> None:
            first_done.append(deliver(task, headers, deferred=False))
            if stored:
                task.backend.mark_as_done(first.id, first_done[0])  # what the tracer does next

        runner = threading.Thread(target=first_delivery)
        started = signals.lock_acquired.connect(lambda sender=None, **_: running.set(), weak=False)
        runner.start()
        assert running.wait(REAL_TIMEOUT)
        signals.lock_acquired.disconnect(started)

        def copy_finishes() -> None:  # between the refused acquire and the holder read
            gate.set()
            runner.join(REAL_TIMEOUT)
            assert not runner.is_alive()

        hook_once(monkeypatch, store, op, lambda key, *_: key == "k:1", copy_finishes,
                  after=True)  # fmt: skip
        rejected: list[Any] = []

        def on_rejected(sender: Any = None, **kwargs: Any) -> None:
            rejected.append(kwargs)

        signals.lock_rejected.connect(on_rejected, weak=False)
        try:
            with pytest.raises(Ignore):  # the engine's failure path: LockNotAcquiredError
                deliver(task, headers, deferred=False)
        finally:
            signals.lock_rejected.disconnect(on_rejected)
        assert first_done == [1]
        assert bodies.runs == [(first.id, 0)]
        assert rejected == []
        assert task.AsyncResult(first.id).state == ("SUCCESS" if stored else "PENDING")

    def test_a_delivery_of_a_finished_copy_refused_by_the_next_one_stores_nothing(
        self, app: Celery, published: Published, store: SpyStore
    ) -> None:
        """The copy finished (SUCCESS stored) and the next copy took the run key before this
        delivery of the finished copy looked: it ends without the policy, nothing stored, and
        leaves the queued key alone."""
        bodies, task, first, headers = until_done_copy(app, published, "d.next-holds")
        task.backend.mark_as_done(first.id, 1)
        store.acquire("k:1", make_owner(task=task.name, task_id="next-id"), 60_000)
        with pytest.raises(Ignore, match="finished"):
            deliver(task, headers, deferred=False)
        assert bodies.runs == []
        assert task.AsyncResult(first.id).get() == 1
        assert store.get("queued:k:1") is not None

    @pytest.mark.parametrize("op", REFUSALS, ids=REFUSAL_IDS)
    def test_a_copy_refused_by_another_that_ends_at_once_is_never_lost(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch,
        op: str,
    ) -> None:  # fmt: skip
        """A copy refused the run key by another copy, which ends before the refusal's holder is
        looked at. Where the refusal named its holder, on_held applies as for any rejection
        (LockNotAcquiredError); where the key is only read afterwards (found free: the refuser
        may have been this very copy) the delivery is re-sent as a second delivery, to run
        later: never lost, never a failure of a copy that ran."""
        bodies, task, first, headers = until_done_copy(app, published, f"d.other-ends.{op}")
        other = make_owner(task=task.name, task_id="other-id")
        store.acquire("k:1", other, 60_000)
        hook_once(monkeypatch, store, op, lambda key, *_: key == "k:1",
                  lambda: store.release("k:1", other), after=True)  # fmt: skip
        if op == "acquire_or_holder":
            with pytest.raises(LockNotAcquiredError):
                deliver(task, headers, deferred=False)
            assert published.ids == [first.id]
            assert store.get("queued:k:1") is None  # the rejected copy freed its key
        else:
            with pytest.raises(Ignore):
                deliver(task, headers, deferred=False)
            assert published.ids == [first.id, first.id]
            assert published.headers[1][unique_common.DEFERRED] == 1
        assert bodies.runs == []
