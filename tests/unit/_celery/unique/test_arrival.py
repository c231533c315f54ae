"""A debounced copy's claim on its own tombstone key, from its arrival to the end of its
execution, under racing callers and store faults.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery, states
from celery.exceptions import Ignore

from celery_lease import LockedTask
from celery_lease._celery import unique as unique_module
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.owners import make_owner, parse_owner, queued_owner
from celery_lease.errors import LockNotAcquiredError, StoreUnavailableError
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, Published, SpyStore
from tests.unit.unique_copies import (
    Bodies,
    define_recorded,
    deliver,
    hook_once,
)


def _run_op(store: SpyStore) -> str:
    """The store operation the engine takes a unique copy's run lease with."""
    return "acquire_or_holder" if unique_module.names_holder(store) else "acquire"


class TestArrivalClaim:
    """A debounced copy's claim on its own tombstone, from its arrival at a worker to the end of
    its execution: taken before the run lease, re-asserted once it is held, freed on every way
    out (body run, refused, store error)."""

    def test_the_superseded_copy_never_holds_the_run_key_the_newest_needs(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A is superseded by B. A's worker reaches A's tombstone; right then B's worker runs
        B. B finds the run key free (A learnt it was superseded before taking the run lease)
        and runs its body; A ends REVOKED without its body."""
        bodies = Bodies()
        task = define_recorded(app, "d.order", bodies, lock_unique="while_queued",
                               lock_debounce=1, lock_ttl=30)  # fmt: skip
        a = task.delay(1)
        b = task.delay(1)
        assert published.ids == [a.id, b.id]
        seen: list[object] = []

        def b_runs() -> None:
            seen.append(store.get("k:1"))
            try:
                seen.append(deliver(task, published.headers[1], deferred=False))
            except Exception as exc:  # what B's worker stores: its FAILURE
                seen.append(exc)

        hook_once(monkeypatch, store, "acquire", lambda key, *_: key == f"superseded:{a.id}",
                  b_runs, after=True)  # fmt: skip
        with pytest.raises(Ignore):
            deliver(task, published.headers[0], deferred=False)
        assert seen == [None, 1], f"A held the run key when B ran: {seen}"
        assert bodies.runs == [(b.id, 0)]
        assert task.AsyncResult(a.id).state == states.REVOKED

    def test_a_call_while_the_copy_is_refused_the_run_key_is_never_its_duplicate(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """until_done with debounce: copy X (not of this call chain) runs the key. B arrives,
        claims its tombstone, is refused the run key and ends FAILURE. A call C made while B
        waits for the run lease is the duplicate of the running X, never of B; once B ended,
        nothing of B is held: the next call is published."""
        bodies = Bodies()
        task = define_recorded(app, "d.refused", bodies, lock_unique="until_done",
                               lock_debounce=1, lock_ttl=30)  # fmt: skip
        b = task.delay(1)
        store.acquire("k:1", make_owner(task=task.name, task_id="X"), 60_000)
        calls: list[Any] = []
        hook_once(monkeypatch, store, _run_op(store), lambda key, *_: key == "k:1",
                  lambda: calls.append(task.apply_async((1,), task_id="C")))  # fmt: skip
        with pytest.raises(LockNotAcquiredError):
            deliver(task, published.headers[0], deferred=False)
        assert calls[0].id == "X", f"C handed {calls[0].id} (B: {b.id}), not the running copy"
        assert store.get(f"superseded:{b.id}") is None
        assert store.get("queued:k:1") is None
        assert task.apply_async((1,), task_id="D").id == "X"
        store.release("k:1", store.get("k:1").owner)  # type: ignore[union-attr]
        assert task.apply_async((1,), task_id="E").id == "E"
        assert bodies.runs == []

    def test_the_running_backlogged_copy_answers_a_call_made_while_the_next_is_refused(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch,
        clock: FakeClock,
    ) -> None:  # fmt: skip
        """until_done with debounce: A waited in a backlog past its queue_ttl (its queued lease
        expired) and B was enqueued meanwhile; A's body runs when B arrives. C, called while B
        is between its claim and its refused run lease, is handed A's id (the running copy),
        never B's (which ends FAILURE)."""
        gate, running = threading.Event(), threading.Event()
        runs: list[int] = []

        @app.task(name="d.backlog", base=LockedTask, lock_key="k:{n}", lock_wait=0, lock_ttl=30,
                  lock_unique="until_done", lock_debounce=1, lock_queue_ttl=5, shared=False,
                  bind=True)  # fmt: skip
        def body(self: Any, n: int, extra: int = 0) -> int:
            runs.append(extra)
            running.set()
            assert gate.wait(REAL_TIMEOUT)
            return n

        task = body._get_current_object()
        a = task.apply_async((1,), {"extra": 1})
        clock.advance(7)  # debounce + queue_ttl: A's queued lease expired in the backlog
        b = task.apply_async((1,), {"extra": 2})
        assert b.id != a.id

        def deliver_kw(headers: dict[str, Any], extra: int) -> Any:
            task.push_request(
                id=headers["id"], args=[1], kwargs={"extra": extra}, is_eager=False,
                called_directly=False, lease_queued=headers["lease_queued"],
            )  # fmt: skip
            try:
                return task(1, extra=extra)
            finally:
                task.pop_request()

        first = threading.Thread(target=deliver_kw, args=(published.headers[0], 1))
        first.start()
        calls: list[Any] = []
        try:
            assert running.wait(REAL_TIMEOUT)

            def c_calls() -> None:
                calls.append(task.apply_async((1,), {"extra": 3}, task_id="C"))

            hook_once(monkeypatch, store, _run_op(store), lambda key, *_: key == "k:1", c_calls)
            with pytest.raises(LockNotAcquiredError):
                deliver_kw(published.headers[1], 2)
        finally:
            gate.set()
            first.join(REAL_TIMEOUT)
        assert calls[0].id == a.id, f"C handed {calls[0].id}; B ({b.id}) failed"
        assert runs == [1]

    def test_a_copy_superseded_while_it_waits_for_the_run_lease_ends_revoked(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch,
        clock: FakeClock,
    ) -> None:  # fmt: skip
        """B claims its tombstone, then waits for the run lease longer than its claim lasts (a
        stall, or a holder that outlives lock_ttl + lock_wait); a call that read B's queued
        lease before B arrived takes the lapsed tombstone. B, once it holds the run lease,
        finds the claim no longer its own: it ends REVOKED "superseded by" that call, without
        its body, and leaves the run key free."""
        bodies = Bodies()
        task = define_recorded(app, "d.lapsed", bodies, lock_unique="until_done",
                               lock_debounce=1, lock_ttl=30)  # fmt: skip
        b = task.delay(1)
        tomb = f"superseded:{b.id}"

        def stall_then_superseded() -> None:
            clock.advance(31)  # past the claim's ttl (lock_ttl 30 + lock_wait 0)
            assert store.acquire(tomb, queued_owner(task.name, "C", 0), 60_000) is not None

        # Right after B's own claim, before its run lease is asked for: the run lease (on the
        # store's clock) is then taken after the stall, and lasts its own ttl.
        hook_once(monkeypatch, store, "acquire", lambda key, *_: key == tomb,
                  stall_then_superseded, after=True)  # fmt: skip
        with pytest.raises(Ignore):
            deliver(task, published.headers[0], deferred=False)
        assert bodies.runs == []
        assert task.AsyncResult(b.id).state == states.REVOKED
        assert "superseded by C" in str(task.AsyncResult(b.id).result)
        assert store.get("k:1") is None
        assert parse_owner(store.get(tomb).owner).task_id == "C"  # type: ignore[union-attr]

    def test_a_key_handed_back_while_the_claim_had_lapsed_is_freed_by_the_copy(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch,
        clock: FakeClock,
    ) -> None:  # fmt: skip
        """B's claim lapses while it waits for the run lease; a call that read B's queued lease
        before B arrived supersedes it, fails to publish and hands the queued key back under
        B's owner, removing its tombstone (see _withdraw). B takes its claim again once it holds
        the run lease, runs, and frees that key: it is left to no copy that would free it."""
        bodies = Bodies()
        task = define_recorded(app, "d.handed-back", bodies, lock_unique="until_done",
                               lock_debounce=1, lock_ttl=30)  # fmt: skip
        b = task.delay(1)
        qkey, b_owner = published.headers[0][unique_common.HEADER]

        tomb, c_owner = f"superseded:{b.id}", queued_owner(task.name, "C", 0)

        def lapsed_then_handed_back() -> None:
            clock.advance(31)  # past the claim's ttl (lock_ttl 30 + lock_wait 0)
            assert store.acquire(tomb, c_owner, 60_000) is not None  # C supersedes B
            assert store.acquire(qkey, b_owner, 60_000) is not None  # C's publish failed
            store.release(tomb, c_owner)

        # Right after B's own claim, before its run lease is asked for (see above).
        hook_once(monkeypatch, store, "acquire", lambda key, *_: key == tomb,
                  lapsed_then_handed_back, after=True)  # fmt: skip
        assert deliver(task, published.headers[0], deferred=False) == 1
        assert bodies.runs == [(b.id, 0)]
        assert store.get(qkey) is None, "the key handed back to B is left held"
        assert task.apply_async((1,), task_id="N").id == "N"

    def test_the_claim_lasts_the_wait_for_the_run_lease(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The claim is taken for lock_ttl + lock_wait: a copy waiting lock_wait for the run
        lease cannot be superseded meanwhile."""
        ran: list[int] = []

        @app.task(
            name="d.claim-ttl", base=LockedTask, lock_key="k:{n}", lock_wait=50, lock_ttl=30,
            lock_unique="while_queued", lock_debounce=1, shared=False,
        )  # fmt: skip
        def body(n: int) -> int:
            ran.append(n)
            return n

        task = body._get_current_object()
        b = task.delay(1)
        claims: list[int] = []
        real = store.acquire

        def acquire(key: str, owner: str, ttl_ms: int) -> Any:
            if key == f"superseded:{b.id}":
                claims.append(ttl_ms)
            return real(key, owner, ttl_ms)

        monkeypatch.setattr(store, "acquire", acquire)
        deliver(task, published.headers[0], deferred=False)
        assert claims and set(claims) == {80_000}
        assert ran == [1]
        assert store.get(f"superseded:{b.id}") is None

    def test_a_lost_reply_on_the_claim_leaves_nothing_held(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """until_done with debounce: the claim takes effect and its reply is lost; the copy ends
        FAILURE without its body. Neither its queued key nor its claim stays held: the next
        call is published, not handed the failed copy's id."""
        bodies = Bodies()
        task = define_recorded(app, "d.lost-claim", bodies, lock_unique="until_done",
                               lock_debounce=1, lock_ttl=30)  # fmt: skip
        a = task.delay(1)
        real = store.acquire
        lost: list[bool] = []

        def acquire(key: str, owner: str, ttl_ms: int) -> Any:
            token = real(key, owner, ttl_ms)
            if not lost and key.startswith("superseded:"):
                lost.append(True)
                raise StoreUnavailableError("reply lost after the effect")
            return token

        monkeypatch.setattr(store, "acquire", acquire)
        with pytest.raises(StoreUnavailableError):
            deliver(task, published.headers[0], deferred=False)
        assert store.get(f"superseded:{a.id}") is None
        assert store.get("queued:k:1") is None
        assert task.apply_async((1,), task_id="N").id == "N"
        assert bodies.runs == []

    def test_a_store_error_on_the_run_lease_leaves_nothing_held(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """until_done with debounce: the claim stands, then taking the run lease raises. The copy
        ends FAILURE without its body; its queued key and its claim are free: the next call is
        published."""
        bodies = Bodies()
        task = define_recorded(app, "d.run-error", bodies, lock_unique="until_done",
                               lock_debounce=1, lock_ttl=30)  # fmt: skip
        a = task.delay(1)
        op = _run_op(store)
        real = getattr(store, op)
        failed: list[bool] = []

        def failing(key: str, owner: str, ttl_ms: int) -> Any:
            if key == "k:1" and not failed:
                failed.append(True)
                raise StoreUnavailableError("run acquire failed")
            return real(key, owner, ttl_ms)

        monkeypatch.setattr(store, op, failing)
        with pytest.raises(StoreUnavailableError):
            deliver(task, published.headers[0], deferred=False)
        assert store.get(f"superseded:{a.id}") is None
        assert store.get("queued:k:1") is None
        assert task.apply_async((1,), task_id="N").id == "N"
        assert bodies.runs == []
