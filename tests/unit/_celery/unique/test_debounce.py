"""Unique and debounce under racing callers and late starts: never two bodies for one key.

In-process broker and result backend, MemoryLockStore on a FakeClock; a competing call is made at
a chosen store operation or publish (``hook_once``, a wrapped ``send_task``).
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery, states
from celery.exceptions import Ignore, Retry, TaskRevokedError

from celery_lease import LockedTask
from celery_lease._celery import settings as config
from celery_lease._celery import unique as unique_module
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.errors import StoreUnavailableError
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, Published, SpyStore
from tests.unit.unique_copies import (
    Bodies,
    define_recorded,
    define_task,
    deliver,
    hook_once,
    request_of,
    start_copy,
)


def hand_b_to_c_then_let_d_take_the_key(
    task: Any, store: SpyStore, monkeypatch: pytest.MonkeyPatch, a_id: str
) -> tuple[list[Any], list[Any]]:
    """The race around a call B (to come) that supersedes the waiting copy ``a_id`` of ``(1, 1)``.

    Once B wrote A's tombstone, C calls and is handed B's id; once B freed A's queued key, D
    calls and takes it. Returns C's and D's results (one each, once they called).
    """
    a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]
    c: list[Any] = []
    d: list[Any] = []
    hook_once(
        monkeypatch,
        store,
        "acquire",
        lambda key, owner, ttl: key == unique_common.superseded_key(a_id, ""),
        lambda: c.append(task.apply_async((1, 3), task_id="C")),
        after=True,
    )
    hook_once(
        monkeypatch,
        store,
        "release",
        lambda key, owner: key == "queued:k:1" and owner == a_owner,
        lambda: d.append(task.apply_async((1, 4), task_id="D")),
        after=True,
    )
    return c, d


class TestSupersedingCallerFails:
    def test_a_failed_publish_does_not_revive_a_copy_superseded_again(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A waits; X supersedes A; while X's publish is on its way Y supersedes X; then X's
        publish fails. X no longer stands in for A, so A stays superseded: only Y runs."""
        task = define_task(app, "d.revive", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        real = app.send_task
        y: list[Any] = []

        def send(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("task_id") == "X":
                y.append(task.apply_async((1, 3), task_id="Y"))  # Y supersedes X meanwhile
                raise ConnectionError("broker down")
            return real(*args, **kwargs)

        monkeypatch.setattr(app, "send_task", send)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert [r.id for r in y] == ["Y"]
        assert published.ids == [a.id, "Y"]
        assert store.get(unique_common.superseded_key(a.id, "")) is not None, (
            "A's tombstone is gone: A runs beside Y"
        )
        holder = store.get("queued:k:1")
        assert holder is not None and parse_owner(holder.owner).task_id == y[0].id

    def test_a_caller_that_loses_the_tombstone_leaves_the_waiting_copy_alone(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B and C both supersede A; B writes A's tombstone first. C finds it B's: C is a
        duplicate of B and never touches A's queued lease; B publishes."""
        task = define_task(app, "d.tomb-race", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]
        c: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            "release",
            lambda key, owner: key == "queued:k:1" and owner == a_owner,
            lambda: c.append(task.apply_async((1, 3), task_id="C")),
        )
        b = task.apply_async((1, 2), task_id="B")
        assert [r.id for r in c] == ["B"], "C lost the tombstone to B: it is B's duplicate"
        assert b.id == "B"
        assert published.ids == [a.id, "B"]

    def test_a_caller_handed_an_id_that_is_never_published_sees_it_revoked(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """B writes A's tombstone; C finds it B's and is handed B's id; then D takes the key B
        freed before B takes it, and B is D's duplicate, never published. B's id is stored
        REVOKED ("superseded by D"): C's get() raises at once instead of waiting forever."""
        task = define_task(app, "d.gave-way", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        c, d = hand_b_to_c_then_let_d_take_the_key(task, store, monkeypatch, a.id)
        b = task.apply_async((1, 2), task_id="B")
        assert [r.id for r in c] == ["B"], "C was not handed B's id"
        assert [r.id for r in d] == ["D"]
        assert b.id == "D"
        assert published.ids == [a.id, "D"], "B was published after all"
        assert c[0].state == states.REVOKED, f"B, never published, is left {c[0].state}"
        with pytest.raises(TaskRevokedError, match="superseded by D"):
            c[0].get(timeout=1)

    def test_a_store_error_after_an_id_was_handed_out_is_stored_as_its_failure(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As above, but B's look at the key after D took it fails with a store error: B's
        caller gets the error, and B's id is stored as that FAILURE, so C's get() raises it
        instead of waiting forever."""
        task = define_task(
            app, "d.error-after-hand-out", lock_unique="while_queued", lock_debounce=1
        )
        a = task.delay(1, 1)
        c, d = hand_b_to_c_then_let_d_take_the_key(task, store, monkeypatch, a.id)
        real_get = store.get

        def get(key: str) -> Any:
            if d and key == "queued:k:1":
                raise StoreUnavailableError("injected: the store fails B's look at the key")
            return real_get(key)

        monkeypatch.setattr(store, "get", get)
        with pytest.raises(StoreUnavailableError):
            task.apply_async((1, 2), task_id="B")
        assert [r.id for r in c] == ["B"], "C was not handed B's id"
        assert c[0].state == states.FAILURE, f"B, never published, is left {c[0].state}"


class TestLateStart:
    def test_an_until_done_copy_starting_after_its_queue_ttl_takes_its_key_back(
        self, app: Celery, published: Published, clock: FakeClock
    ) -> None:
        """The copy's queued key expired while it waited in the queue. Once it starts it takes
        the key back: a call made while its body runs is its duplicate, not a second copy."""
        inner: list[str] = []

        @app.task(
            name="late.start",
            base=LockedTask,
            lock_key="k:{n}",
            lock_unique="until_done",
            lock_queue_ttl=10,
            shared=False,
            bind=True,
        )
        def body(self: Any, n: int) -> int:
            inner.append(self.delay(n).id)
            return n

        task = body._get_current_object()
        first = task.delay(1)
        clock.advance(10.5)  # the queued key expires before a worker starts the copy
        deliver(task, published.headers[0], deferred=False)
        assert inner == [first.id], "a call during the body was published as a second copy"
        assert published.ids == [first.id]

    @pytest.mark.parametrize(("started_after", "retaken"), [(0.0, 0), (5.0, 1)])
    def test_an_until_done_copy_with_a_countdown_is_late_counted_from_its_eta(
        self,
        app: Celery,
        published: Published,
        store: SpyStore,
        clock: FakeClock,
        monkeypatch: pytest.MonkeyPatch,
        started_after: float,
        retaken: int,
    ) -> None:
        """A copy published with a countdown of 8 s (queue_ttl 10 s) holds its queued lease for
        18 s. Started at its eta it keeps that lease without taking the key again; started half
        its queue_ttl after its eta it takes the key back before its body."""
        task = define_recorded(
            app, f"late.eta-{started_after}", Bodies(), lock_unique="until_done", lock_queue_ttl=10
        )
        eta = datetime.fromtimestamp(clock.time() + 8, tz=timezone.utc).isoformat()
        copy = task.apply_async((1,), countdown=8)
        headers = published.headers[0]
        clock.advance(8 + started_after)
        real_acquire = store.acquire
        queued_acquires: list[str] = []

        def acquire(key: str, owner: str, ttl_ms: int) -> Any:
            if key == "queued:k:1":
                queued_acquires.append(owner)
            return real_acquire(key, owner, ttl_ms)

        monkeypatch.setattr(store, "acquire", acquire)
        assert deliver(task, headers, deferred=False, eta=eta) == 1
        assert headers["id"] == copy.id
        assert len(queued_acquires) == retaken, (
            f"started {started_after} s after its eta: {len(queued_acquires)} blocking acquires"
            " of its queued key"
        )


class TestWithdrawAfterFailedPublish:
    """X superseded the waiting copy A, X's publish failed, and X hands the key back to A while
    Y calls at a chosen step of that: whatever the step, exactly one copy stays to run."""

    def _supersede_and_fail(
        self, app: Celery, store: SpyStore, monkeypatch: pytest.MonkeyPatch, name: str
    ) -> tuple[Any, Any, str]:
        task = define_task(app, name, lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", refuse)
        return task, a, a_owner

    def test_a_call_taking_the_freed_key_keeps_the_waiting_copy_superseded(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Y lands right after X freed its own queued lease: Y takes the free key and is
        published; X cannot hand the key back, so A stays superseded."""
        real = app.send_task
        task, a, _ = self._supersede_and_fail(app, store, monkeypatch, "w.freed")
        y: list[Any] = []

        def call_y() -> None:
            monkeypatch.setattr(app, "send_task", real)
            y.append(task.apply_async((1, 3), task_id="Y"))

        hook_once(
            monkeypatch,
            store,
            "release",
            lambda key, owner: key == "queued:k:1" and parse_owner(owner).task_id == "X",
            call_y,
            after=True,
        )
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert [r.id for r in y] == ["Y"]
        assert published.ids == [a.id, "Y"]
        tomb = store.get(unique_common.superseded_key(a.id, ""))
        assert tomb is not None and parse_owner(tomb.owner).task_id == "X", "A runs beside Y"

    def test_a_call_landing_after_the_key_is_handed_back_is_the_waiting_copys_duplicate(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Y lands after X gave A its key back, before X removed A's tombstone: Y is A's
        duplicate (A runs once the tombstone is gone); nothing else is published."""
        task, a, a_owner = self._supersede_and_fail(app, store, monkeypatch, "w.handed")
        y: list[Any] = []
        hook_once(
            monkeypatch,
            store,
            "acquire",
            lambda key, owner, ttl: key == "queued:k:1" and owner == a_owner,
            lambda: y.append(task.apply_async((1, 3), task_id="Y")),
            after=True,
        )
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert [r.id for r in y] == [a.id]
        assert published.ids == [a.id]
        assert store.get(unique_common.superseded_key(a.id, "")) is None
        holder = store.get("queued:k:1")
        assert holder is not None and holder.owner == a_owner

    def test_a_message_that_reached_the_broker_after_all_ends_without_its_body(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """X's publish raised but its message was taken: X handed the key back to A, and X's
        message, when it starts, ends superseded (REVOKED): A runs, X does not."""
        task = define_task(app, "w.taken", lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        real = app.send_task

        def taken_then_fail(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            raise ConnectionError("connection lost after the broker took it")

        monkeypatch.setattr(app, "send_task", taken_then_fail)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert published.ids == [a.id, "X"]
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        x_request = request_of(published.headers[1])
        with pytest.raises(Ignore):
            start_copy(task, x_request, store, "k:1", settings, options, 30, 0)
        a_request = request_of(published.headers[0])
        hold = start_copy(task, a_request, store, "k:1", settings, options, 30, 0)
        assert hold is None  # A runs its body (no Ignore)


class TestFailedPublishFinalState:
    """What a debounced call whose publish raised leaves stored under its id, whatever a
    worker wrote there meanwhile: a superseded copy ends REVOKED, a withdrawn call's own
    message never calls its id superseded by itself."""

    def test_a_copy_superseded_while_its_publish_fails_ends_revoked_not_failure(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A's publish reaches the broker but its reply is lost; before A's caller stores the
        error, Y supersedes A and A's message starts and ends "superseded by Y": A's caller
        stores no FAILURE over that (no failure state for a superseded copy)."""
        task = define_task(app, "f.superseded", lock_unique="while_queued", lock_debounce=1)
        real = app.send_task
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        ended: list[str] = []

        def taken_then_fail(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            monkeypatch.setattr(app, "send_task", real)
            assert task.apply_async((1, 2), task_id="Y").id == "Y"
            try:
                start_copy(
                    task, request_of(published.headers[0]), store, "k:1", settings, options, 30, 0
                )
            except Ignore as exc:
                ended.append(str(exc))
            raise ConnectionError("connection lost after the broker took it")

        monkeypatch.setattr(app, "send_task", taken_then_fail)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 1), task_id="A")
        assert ended == ["superseded by Y"]
        a = task.AsyncResult("A")
        assert a.state == states.REVOKED, a.result
        assert published.ids == ["A", "Y"]

    def test_a_withdrawn_calls_own_message_keeps_its_failure(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """X superseded the waiting A; X's publish reached the broker but raised, and X handed
        the key back to A. X's message ends without its body and stores nothing: X keeps the
        publish error as its FAILURE, never REVOKED "superseded by X" (by itself)."""
        task = define_task(app, "f.withdrawn", lock_unique="while_queued", lock_debounce=1)
        task.delay(1, 1)
        real = app.send_task

        def taken_then_fail(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            raise ConnectionError("connection lost after the broker took it")

        monkeypatch.setattr(app, "send_task", taken_then_fail)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        with pytest.raises(Ignore) as ended:
            start_copy(
                task, request_of(published.headers[1]), store, "k:1", settings, options, 30, 0
            )
        assert "superseded by X" not in str(ended.value)
        x = task.AsyncResult("X")
        assert x.state == states.FAILURE
        assert isinstance(x.result, ConnectionError)


class TestWithdrawWhileTheWaitingCopyStarts:
    """X superseded the waiting copy A; X's publish fails while A's worker starts A (A finds
    its tombstone X's and ends REVOKED). Whatever the order of A's steps and X's hand-back,
    no lease is left for the ended A: the next call is published, not A's duplicate."""

    def _setup(
        self, app: Celery, store: SpyStore, monkeypatch: pytest.MonkeyPatch, name: str
    ) -> tuple[Any, Any, str, Any]:
        task = define_task(app, name, lock_unique="while_queued", lock_debounce=1)
        a = task.delay(1, 1)
        a_owner = store.get("queued:k:1").owner  # type: ignore[union-attr]
        return task, a, a_owner, app.send_task

    @staticmethod
    def _start(task: Any, published: Published, store: SpyStore) -> list[str]:
        """Start A (the first message) as its worker does; returns what it ended with."""
        settings = config.get_settings(task.app)
        options = type(task)._lock_options.unique
        try:
            start_copy(
                task, request_of(published.headers[0]), store, "k:1", settings, options, 30, 0
            )
        except Ignore as exc:
            return [str(exc)]
        return ["ran"]

    def _assert_no_lease_for_a(
        self, task: Any, a: Any, real_send: Any, monkeypatch: pytest.MonkeyPatch, store: SpyStore
    ) -> None:
        assert a.state == states.REVOKED
        assert store.get("queued:k:1") is None, "a lease is left for the ended copy A"
        monkeypatch.setattr(task.app, "send_task", real_send)
        assert task.apply_async((1, 9), task_id="E").id == "E", "E is the ended A's duplicate"

    def test_a_copy_that_ended_before_the_hand_back_gets_no_lease(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A starts and ends while X's publish hangs; then the publish fails: X frees its own
        lease and hands nothing back (A's tombstone stays X's)."""
        task, a, _, real = self._setup(app, store, monkeypatch, "s.ended")
        ended: list[str] = []

        def send(*args: Any, **kwargs: Any) -> Any:
            ended.extend(self._start(task, published, store))
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", send)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        assert ended == ["superseded by X"]
        tomb = store.get(unique_common.superseded_key(a.id, ""))
        assert tomb is not None and parse_owner(tomb.owner).task_id == "X"
        self._assert_no_lease_for_a(task, a, real, monkeypatch, store)

    def test_a_copy_ending_just_before_the_key_is_taken_back_loses_it_again(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A starts and ends after X read its state (not ended), before X takes the key back
        for it: X reads the state again after taking it, and frees it."""
        task, a, a_owner, real = self._setup(app, store, monkeypatch, "s.between")
        ended = self._start_a_as_x_takes_the_key_back(
            app, task, published, store, monkeypatch, a_owner, after=False
        )
        assert ended == ["superseded by X"]
        self._assert_no_lease_for_a(task, a, real, monkeypatch, store)

    def test_a_copy_storing_its_end_after_the_hand_back_frees_the_key_itself(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A's claim is refused before X's hand-back, but A stores its REVOKED state only after
        X took the key back, read A as not ended and removed A's tombstone: A frees the lease
        under its own owner after storing its state."""
        task, a, _, real = self._setup(app, store, monkeypatch, "s.late-state")
        backend_class = type(task.backend)  # the app's backend is one per thread: patch them all
        store_revoked = backend_class.mark_as_revoked
        refused = threading.Event()
        go_on = threading.Event()

        def gated(backend: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
            if task_id == a.id:
                refused.set()
                assert go_on.wait(REAL_TIMEOUT)
            return store_revoked(backend, task_id, *args, **kwargs)

        monkeypatch.setattr(backend_class, "mark_as_revoked", gated)
        ended: list[str] = []
        starter = threading.Thread(target=lambda: ended.extend(self._start(task, published, store)))

        def send(*args: Any, **kwargs: Any) -> Any:
            starter.start()
            assert refused.wait(REAL_TIMEOUT)  # A's claim was refused: it is storing its end
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", send)
        try:
            with pytest.raises(ConnectionError):
                task.apply_async((1, 2), task_id="X")
            holder = store.get("queued:k:1")
            assert holder is not None and parse_owner(holder.owner).task_id == a.id
            assert store.get(unique_common.superseded_key(a.id, "")) is None
        finally:
            go_on.set()
            starter.join(REAL_TIMEOUT)
        assert ended == ["superseded by X"]
        self._assert_no_lease_for_a(task, a, real, monkeypatch, store)

    def test_a_copy_starting_after_the_key_is_taken_back_ends_with_no_lease_left(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A starts right after X took the key back for it, before X removed A's tombstone: A
        frees the lease as its own, its claim is refused and it ends superseded. Nothing runs
        (X's caller has the error, A's caller its REVOKED state), and no lease is left."""
        task, a, a_owner, real = self._setup(app, store, monkeypatch, "s.after")
        ended = self._start_a_as_x_takes_the_key_back(
            app, task, published, store, monkeypatch, a_owner, after=True
        )
        assert ended == ["superseded by X"]
        self._assert_no_lease_for_a(task, a, real, monkeypatch, store)

    def _start_a_as_x_takes_the_key_back(
        self,
        app: Celery,
        task: Any,
        published: Published,
        store: SpyStore,
        monkeypatch: pytest.MonkeyPatch,
        a_owner: str,
        *,
        after: bool,
    ) -> list[str]:
        """X supersedes A and its publish fails; A starts as X takes A's queued key back for it
        (just before that acquire, or just ``after`` it). Returns how A's start ended."""
        monkeypatch.setattr(app, "send_task", self._refuse)
        ended: list[str] = []
        hook_once(
            monkeypatch,
            store,
            "acquire",
            lambda key, owner, ttl: key == "queued:k:1" and owner == a_owner,
            lambda: ended.extend(self._start(task, published, store)),
            after=after,
        )
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        return ended

    @staticmethod
    def _refuse(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("broker down")

    def test_a_copy_whose_claim_follows_the_hand_back_runs_with_its_key_free(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A starts and releases its queued lease (a no-op: X holds the key); X's publish fails
        and X hands the key back to A, then removes A's tombstone; only then A claims its
        tombstone, which stands: A runs its body, and its key is free, so a new call is not
        refused while A runs."""
        task = define_task(
            app, "s.claim-after-hand-back", lock_unique="while_queued", lock_debounce=1
        )
        a = task.delay(1, 1)
        tomb_a = unique_common.superseded_key(a.id, "")
        real_acquire = store.acquire
        at_claim = threading.Event()
        go_on = threading.Event()

        def acquire(key: str, owner: str, ttl: int) -> Any:
            if key == tomb_a and parse_owner(owner).task_id == a.id:
                at_claim.set()  # A released its queued lease and now claims its tombstone
                assert go_on.wait(REAL_TIMEOUT)
            return real_acquire(key, owner, ttl)

        monkeypatch.setattr(store, "acquire", acquire)
        ended: list[str] = []

        def start() -> None:
            options = type(task)._lock_options.unique
            try:
                start_copy(
                    task,
                    request_of(published.headers[0]),
                    store,
                    "k:1",
                    config.get_settings(task.app),
                    options,
                    30,
                    0,
                )
                ended.append("ran")
            except Ignore as exc:
                ended.append(str(exc))

        starter = threading.Thread(target=start)
        real_send = app.send_task

        def send(*args: Any, **kwargs: Any) -> Any:
            starter.start()
            assert at_claim.wait(REAL_TIMEOUT)
            raise ConnectionError("broker down")

        monkeypatch.setattr(app, "send_task", send)
        with pytest.raises(ConnectionError):
            task.apply_async((1, 2), task_id="X")
        go_on.set()
        starter.join(REAL_TIMEOUT)
        holder = store.get("queued:k:1")
        monkeypatch.setattr(app, "send_task", real_send)
        assert ended == ["ran"]
        assert holder is None, f"A runs its body with its queued key still held: {holder}"
        assert task.apply_async((1, 9), task_id="E").id == "E", "a new call is refused"


class TestUntilDoneDebounceStart:
    def test_a_call_racing_the_copys_start_is_not_enqueued_while_its_body_runs(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """N reads the waiting copy A's queued lease; A starts (run lease taken, queued lease
        freed); then N goes on superseding it. Either A ends superseded, or N is A's duplicate:
        never a second copy enqueued while A's body runs."""
        task = define_task(
            app, "d.start-race", lock_unique="until_done", lock_debounce=1, lock_ttl=30
        )
        a = task.delay(1, 1)
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        ran: list[bool] = []

        def start_a() -> None:
            store.acquire("k:1", make_owner(task=task.name, task_id=a.id), 30_000)
            try:
                start_copy(
                    task, request_of(published.headers[0]), store, "k:1", settings, options, 30, 0
                )
            except Ignore:
                ran.append(False)
            else:
                ran.append(True)

        hook_once(monkeypatch, store, "get", lambda key: key == "queued:k:1", start_a, after=True)
        n = task.apply_async((1, 2), task_id="N")
        assert ran == [True]
        assert n.id == a.id, "N was enqueued while A's body runs"
        assert published.ids == [a.id]


class TestDebouncedRetry:
    @pytest.mark.parametrize("unique", ["while_queued", "until_done"])
    def test_a_retry_of_a_debounced_copy_runs_its_body(
        self, app: Celery, published: Published, store: SpyStore, unique: str
    ) -> None:
        """A debounced copy whose body calls retry(): the retry attempt (same id) comes back
        within the run ttl and finds its tombstone claimed by its own first attempt. That claim
        is its own, not a newer call's: the retry runs its body and is not stored REVOKED
        "superseded by" itself."""
        bodies = Bodies()

        @app.task(
            name=f"d.retry.{unique}", base=LockedTask, lock_key="k:{n}", lock_wait=0,
            lock_ttl=30, lock_unique=unique, lock_debounce=1, shared=False, bind=True,
        )  # fmt: skip
        def body(self: Any, n: int) -> int:
            with bodies.lock:
                bodies.runs.append((self.request.id, int(self.request.retries or 0)))
            if not self.request.retries:
                raise self.retry(countdown=1)
            return n

        task = body._get_current_object()
        first = task.delay(1)
        with pytest.raises(Retry):
            deliver(task, published.headers[0], deferred=False)
        assert published.ids == [first.id, first.id]
        assert deliver(task, published.headers[1], deferred=False, retries=1) == 1
        assert bodies.runs == [(first.id, 0), (first.id, 1)]
        assert task.AsyncResult(first.id).state != "REVOKED"

    def test_a_call_meeting_the_started_claim_before_the_run_lease_is_the_next_copy(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """until_done with debounce: N reads the waiting copy A's queued lease; A arrives at a
        worker, frees its queued lease and claims its tombstone (its run lease not taken yet:
        it may still be refused it). N, refused the tombstone by A's own claim, looks again,
        finds the queued key free and the run key not A's, and is published as the next copy
        holding the queued key: never the duplicate of a copy that may end without its body."""
        task = define_task(app, "d.claim-race", lock_unique="until_done", lock_debounce=1)
        a = task.delay(1, 1)
        settings = config.get_settings(app)
        options = type(task)._lock_options.unique
        request = request_of(published.headers[0])

        def a_arrives() -> None:
            unique_module.on_arrival(task, request, store, "k:1", settings, options, 30)

        hook_once(monkeypatch, store, "get", lambda key: key == "queued:k:1", a_arrives, after=True)
        assert task.apply_async((1, 2), task_id="N").id == "N"
        assert published.ids == [a.id, "N"]
        held = store.get("queued:k:1")
        assert held is not None and parse_owner(held.owner).task_id == "N"

    @pytest.mark.parametrize("unique", ["while_queued", "until_done"])
    def test_the_newest_call_supersedes_a_waiting_retry(
        self, app: Celery, published: Published, store: SpyStore, unique: str
    ) -> None:
        """A debounced copy's body retried; its execution ended (its claim freed with it). A
        call during the retry's wait supersedes the retry as it would any waiting copy: the
        retry ends REVOKED "superseded by" the call, whose body runs with the newest
        arguments."""
        bodies = Bodies()

        @app.task(
            name=f"d.retry-wait.{unique}", base=LockedTask, lock_key="k:{n}", lock_wait=0,
            lock_ttl=30, lock_unique=unique, lock_debounce=1, shared=False, bind=True,
        )  # fmt: skip
        def body(self: Any, n: int) -> int:
            with bodies.lock:
                bodies.runs.append((self.request.id, int(self.request.retries or 0)))
            if not self.request.retries and self.request.id != "N":
                raise self.retry(countdown=1)
            return n

        task = body._get_current_object()
        first = task.delay(1)
        with pytest.raises(Retry):
            deliver(task, published.headers[0], deferred=False)
        assert store.get(f"superseded:{first.id}") is None, "the ended run's claim is kept"
        assert task.apply_async((1,), task_id="N").id == "N"
        assert published.ids == [first.id, first.id, "N"]
        with pytest.raises(Ignore):
            deliver(task, published.headers[1], deferred=False, retries=1)
        assert task.AsyncResult(first.id).state == states.REVOKED
        assert "superseded by N" in str(task.AsyncResult(first.id).result)
        assert deliver(task, published.headers[2], deferred=False) == 1
        assert bodies.runs == [(first.id, 0), ("N", 0)]
