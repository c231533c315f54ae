"""Review RC: attacks on the hot-path changes of the safety core (issue 10, issue 11 item 4).

Each test forces one dangerous order between the actors (task body, renewer, watchdog,
dispatcher, store) with events, a store that pauses or races one chosen call, and a FakeClock;
none sleeps or times anything. A test marked ``xfail(strict=True)`` shows a bug found by this
review (the reason names it); it starts to pass, and then fails as XPASS, once that bug is fixed.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import LockedTask, LockNotAcquiredError, MemoryLockStore, lease
from celery_lease import renewer as renewer_module
from celery_lease import signals as lease_signals
from celery_lease._aio_store import ThreadedAsyncStore
from celery_lease.dispatch import drain
from celery_lease.owners import make_owner, parse_owner
from celery_lease.renewer import Renewer, get_renewer, observe_renewals, snapshot
from celery_lease.testing import FakeClock

REAL = 10.0
"""Real seconds a test waits for another thread before it fails."""


# Stores that let a test choose the order -----------------------------------------------------


class _GatedStore(MemoryLockStore):
    """Counts renewals per (key, owner); the first renewal of ``gate_key`` waits for ``go``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.gate_key: str | None = None
        self.entered = threading.Event()
        self.go = threading.Event()
        self.renewed: Counter[tuple[str, str]] = Counter()
        self.cond = threading.Condition()

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if key == self.gate_key:
            self.gate_key = None
            self.entered.set()
            if not self.go.wait(REAL):
                raise AssertionError("the test never let the gated renewal go on")
        ok = super().renew(key, owner, ttl_ms)
        with self.cond:
            self.renewed[(key, owner)] += 1
            self.cond.notify_all()
        return ok

    def wait_renewed(self, pairs: list[tuple[str, str]], count: int) -> None:
        """Block (real time) until each (key, owner) was renewed at least ``count`` times."""
        with self.cond:
            if not self.cond.wait_for(lambda: all(self.renewed[p] >= count for p in pairs), REAL):
                raise AssertionError(f"renewals {dict(self.renewed)}, expected {count} each")


class _RacingInspection(MemoryLockStore):
    """After the first inspection call (``get`` or ``last_token``) of a refused renewal
    returns, another owner acquires ``key``: the store moves between the two calls."""

    def __init__(self, clock: FakeClock, key: str) -> None:
        super().__init__(clock=clock)
        self.key = key
        self.armed = False

    def _between(self) -> None:
        if self.armed:
            self.armed = False
            assert MemoryLockStore.acquire(self, self.key, "another-owner", 60_000) is not None

    def get(self, key: str) -> Any:
        info = super().get(key)
        self._between()
        return info

    def last_token(self, key: str) -> int | None:
        token = super().last_token(key)
        self._between()
        return token


class _SlowInspection(MemoryLockStore):
    """``get`` (the loss path's inspection) waits for ``go`` once ``gate`` is set."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.gate = False
        self.entered = threading.Event()
        self.go = threading.Event()

    def get(self, key: str) -> Any:
        if self.gate:
            self.gate = False
            self.entered.set()
            if not self.go.wait(REAL):
                raise AssertionError("the test never let the inspection go on")
        return super().get(key)


@pytest.fixture
def compactions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Make the renewer compact its heaps after 2 closed entries; counts the compactions."""
    monkeypatch.setattr(renewer_module, "COMPACT_AFTER", 2)
    calls: list[int] = []
    original = Renewer._compact

    def counting(self: Renewer) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(Renewer, "_compact", counting)
    yield calls


def _churn(store: MemoryLockStore, clock: FakeClock, prefix: str, count: int) -> None:
    """Take and leave ``count`` short leases: each exit closes one renewer entry."""
    for i in range(count):
        with lease(f"{prefix}{i}", store=store, ttl=3, clock=clock):
            pass


# Heap compaction -----------------------------------------------------------------------------


class TestCompaction:
    def test_a_lease_whose_renewal_is_in_flight_survives_a_compaction(
        self, compactions: list[int]
    ) -> None:
        """Compaction while the only item of a live entry is out of the heap (its renewal is in
        flight): the entry is pushed back after the answer and renewed every ttl/3 after."""
        clock = FakeClock(1000.0)
        store = _GatedStore(clock)
        with lease("live", store=store, ttl=3, clock=clock) as live:
            store.gate_key = "live"
            clock.advance(1.0)
            assert store.entered.wait(REAL)
            _churn(store, clock, "short", 6)
            assert compactions, "the churn did not compact the heaps"
            store.go.set()
            pair = ("live", live.owner)
            store.wait_renewed([pair], 1)
            for cycle in range(2, 8):
                clock.advance(1.0)
                store.wait_renewed([pair], cycle)
            assert not live.lost

    def test_an_entry_closed_during_its_flight_is_never_renewed_after_a_compaction(
        self, compactions: list[int]
    ) -> None:
        """The holder exits while its renewal is in flight (remove() waits for it), the heaps
        are compacted meanwhile: the late answer neither revives the entry nor keeps the key."""
        clock = FakeClock(1000.0)
        store = _GatedStore(clock)
        store.gate_key = "gone"
        held: list[Any] = []
        inside, leave = threading.Event(), threading.Event()

        def holder() -> None:
            with lease("gone", store=store, ttl=3, clock=clock) as gone:
                held.append(gone)
                inside.set()
                assert leave.wait(REAL)

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert inside.wait(REAL)
            clock.advance(1.0)
            assert store.entered.wait(REAL)  # the renewal of "gone" is in flight
            leave.set()
            clock.wait_for_sleepers(2, timeout=REAL)  # the watchdog and the exit, waiting
            _churn(store, clock, "short", 6)
            assert compactions
        finally:
            store.go.set()
            thread.join(REAL)
        assert not thread.is_alive()
        assert store.get("gone") is None
        with lease("witness", store=store, ttl=3, clock=clock) as witness:
            for cycle in range(1, 5):
                clock.advance(1.0)
                store.wait_renewed([("witness", witness.owner)], cycle)
        assert store.renewed[("gone", held[0].owner)] == 1  # only the one in flight
        assert not held[0].lost

    def test_the_watchdog_reports_a_hung_lease_after_a_compaction(
        self, compactions: list[int]
    ) -> None:
        """The renewal of a lease hangs in the store; the deadline heap is compacted meanwhile;
        the watchdog still reports that lease at its validity deadline."""
        clock = FakeClock(1000.0)
        store = _GatedStore(clock)
        try:
            with lease("hung", store=store, ttl=3, clock=clock) as hung:
                store.gate_key = "hung"
                clock.advance(1.0)
                assert store.entered.wait(REAL)
                _churn(store, clock, "short", 6)
                assert compactions
                clock.advance(2.5)  # past the validity of "hung" (3 s less the drift margin)
                assert hung.wait_lost(REAL)
                assert hung.lost_reason == "expired"
        finally:
            store.go.set()

    def test_held_leases_stay_renewed_while_other_threads_churn(
        self, compactions: list[int]
    ) -> None:
        """Two threads take and leave leases (compacting again and again) while the renewer
        renews three long-held ones through six ttl/3 periods: none is dropped or lost."""
        clock = FakeClock(1000.0)
        store = _GatedStore(clock)
        errors: list[BaseException] = []

        def churner(prefix: str) -> None:
            try:
                _churn(store, clock, prefix, 300)
            except BaseException as exc:  # reported below
                errors.append(exc)

        contexts = [lease(f"long{i}", store=store, ttl=3, clock=clock) for i in range(3)]
        helds = [context.__enter__() for context in contexts]
        pairs = [(held.key, held.owner) for held in helds]
        threads = [threading.Thread(target=churner, args=(p,)) for p in ("a", "b")]
        try:
            for thread in threads:
                thread.start()
            for cycle in range(1, 7):
                clock.advance(1.0)
                store.wait_renewed(pairs, cycle)
            for thread in threads:
                thread.join(REAL)
            assert not errors
            assert compactions
            assert [held.lost for held in helds] == [False, False, False]
        finally:
            for context in reversed(contexts):
                context.__exit__(None, None, None)

    def test_an_entry_ended_between_its_take_and_its_renewal_is_not_renewed(self) -> None:
        """One sweep takes two due leases; the first is past max_hold, and its immediate loss
        listener (on the renewer thread, between the take and the renewal) ends the second
        one early: the second is not renewed, and its key stays free."""
        clock = FakeClock(1000.0)
        store = _GatedStore(clock)
        first = lease("first", store=store, ttl=3, max_hold=1.0, clock=clock)
        second = lease("second", store=store, ttl=3, clock=clock)
        with first as held_first, second as held_second:
            ended = threading.Event()

            def end_second(_: object) -> None:
                second.release_early()
                ended.set()

            held_first.add_loss_listener(end_second, immediate=True)
            clock.advance(1.0)
            assert ended.wait(REAL)
            assert held_first.lost_reason == "max_hold"
            with lease("witness", store=store, ttl=3, clock=clock) as witness:
                clock.advance(1.0)
                store.wait_renewed([("witness", witness.owner)], 1)
            assert store.renewed[("second", held_second.owner)] == 0
            assert held_second.lost_reason == "released"
            assert store.get("second") is None


# snapshot() ----------------------------------------------------------------------------------


class TestSnapshot:
    def test_snapshot_under_churn_lists_only_held_leases_and_never_raises(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        stop = threading.Event()
        problems: list[object] = []

        def reader() -> None:
            while not stop.is_set():
                try:
                    for row in snapshot():
                        if not str(row["key"]).startswith(("c", "steady")):
                            continue  # another test's clock: not ours to judge
                        if not isinstance(row["token"], int) or row["valid_for_seconds"] < 0:
                            problems.append(row)
                except BaseException as exc:
                    problems.append(exc)
                    return

        with lease("steady", store=store, ttl=3, clock=clock) as steady:
            thread = threading.Thread(target=reader)
            thread.start()
            try:
                _churn(store, clock, "c", 500)
            finally:
                stop.set()
                thread.join(REAL)
            rows = [row for row in snapshot() if row["key"] in ("steady", "c0", "c499")]
            assert rows == [
                {
                    "key": "steady",
                    "token": steady.token,
                    "owner": steady.owner,
                    "held_seconds": 0.0,
                    "valid_for_seconds": pytest.approx(3 - 0.03 - 0.002),
                    "renewals": 0,
                    "last_renewal_error": None,
                }
            ]
        assert problems == []

    def test_snapshot_answers_while_a_renewal_hangs(self) -> None:
        clock = FakeClock(1000.0)
        store = _GatedStore(clock)
        try:
            with lease("stuck", store=store, ttl=3, clock=clock) as stuck:
                store.gate_key = "stuck"
                clock.advance(1.0)
                assert store.entered.wait(REAL)
                rows: list[list[dict[str, Any]]] = []
                thread = threading.Thread(target=lambda: rows.append(snapshot()))
                thread.start()
                thread.join(REAL)
                assert not thread.is_alive(), "snapshot() waited for the store"
                assert [r["owner"] for r in rows[0] if r["key"] == "stuck"] == [stuck.owner]
                store.go.set()  # before the exit, which waits for the renewal in flight
        finally:
            store.go.set()


# Owner ids -----------------------------------------------------------------------------------


class TestOwnerIds:
    def test_owner_ids_are_unique_across_threads(self) -> None:
        made: list[list[str]] = [[] for _ in range(8)]
        start = threading.Barrier(8)

        def make(out: list[str]) -> None:
            start.wait(REAL)
            out.extend(make_owner(task="t", task_id="same") for _ in range(5000))

        threads = [threading.Thread(target=make, args=(out,)) for out in made]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REAL)
        heads = [owner.split(";")[0] for out in made for owner in out]
        assert len(set(heads)) == len(heads) == 40_000

    def test_two_contexts_of_one_task_execution_never_share_an_owner(self) -> None:
        """Same node, task and task id (a redelivered message): the second acquisition must
        not be handed the first one's lease by the store's idempotent same-owner acquire."""
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        first = lease("k", store=store, ttl=3, clock=clock)
        first.task, first.task_id, first.node = "t", "same-id", "w1@h"
        with first as held:
            second: list[BaseException] = []

            def other_thread() -> None:  # another execution of the same task id elsewhere
                context = lease("k", store=store, ttl=3, clock=clock)
                context.task, context.task_id, context.node = "t", "same-id", "w1@h"
                try:
                    with context:
                        pass
                except LockNotAcquiredError as exc:
                    second.append(exc)

            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join(REAL)
            assert len(second) == 1
            assert parse_owner(held.owner).task_id == "same-id"
            info = store.get("k")
            assert info is not None and info.owner == held.owner


# Re-entry ------------------------------------------------------------------------------------


class TestReentry:
    def test_a_reentered_lease_is_the_outer_one_and_its_exit_releases_nothing(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with lease("k", store=store, ttl=3, clock=clock) as outer:
            with lease("k", store=store, ttl=3, clock=clock) as inner:
                assert inner is outer
            info = store.get("k")
            assert info is not None and info.owner == outer.owner
        assert store.get("k") is None

    def test_reentry_after_the_outer_lease_was_lost_acquires_anew(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with lease("k", store=store, ttl=3, clock=clock) as outer:
            store.force_release("k")
            clock.advance(1.0)
            assert outer.wait_lost(REAL)
            with lease("k", store=store, ttl=3, clock=clock) as inner:
                assert inner is not outer and inner.owner != outer.owner
                assert inner.token > outer.token


# _why_gone -----------------------------------------------------------------------------------


class TestWhyGone:
    def test_an_acquisition_between_the_two_inspection_calls_reads_taken(self) -> None:
        """The store lost the lease's data (a restart without persistence), and another owner
        acquires the key between the two inspection calls of the loss path: when the loss is
        reported, another owner holds the key, so the reason must be ``"taken"``."""
        clock = FakeClock(1000.0)
        store = _RacingInspection(clock, "k")
        with lease("k", store=store, ttl=3, clock=clock) as held:
            with store._lock:
                del store._entries["k"]  # lost with the store's data: key and counter
            store.armed = True
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            reason = held.lost_reason
        info = store.get("k")
        assert info is not None and info.owner == "another-owner"
        assert reason == "taken"

    def test_a_slow_inspection_of_one_loss_does_not_lose_the_lease_renewed_beside_it(
        self,
    ) -> None:
        """Two leases renewed in one batch: the store refuses one (an operator freed it) and
        renews the other. While the inspection of the refused one is slow, the renewed one
        must count from its renewal, not from the deadline it had before."""
        clock = FakeClock(1000.0)
        store = _SlowInspection(clock)
        try:
            with (
                lease("freed", store=store, ttl=3, clock=clock) as freed,
                lease("kept", store=store, ttl=3, clock=clock) as kept,
            ):
                assert store.force_release("freed") is not None
                store.gate = True
                clock.advance(1.0)  # one renew_many: [refused, renewed]; then the inspection
                assert store.entered.wait(REAL)
                info = store._entries["kept"]
                assert info.expires == 1004.0  # the store renewed "kept" at 1001 for 3 s
                clock.advance(2.5)  # 1003.5: past the old deadline of both, not kept's new one
                assert freed.wait_lost(REAL)  # the watchdog's pass has run
                store.go.set()
                assert not kept.lost, kept.lost_reason
        finally:
            store.go.set()

    def test_without_the_race_a_lost_store_reads_expired(self) -> None:
        """The same loss with nobody acquiring in between: ``"expired"`` (control case)."""
        clock = FakeClock(1000.0)
        store = _RacingInspection(clock, "k")
        with lease("k", store=store, ttl=3, clock=clock) as held:
            with store._lock:
                del store._entries["k"]
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert held.lost_reason == "expired"


# The engine (the Celery task layer) ----------------------------------------------------------


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("rc", broker="memory://", backend="cache+memory://", set_as_current=False)
    yield app
    from celery_lease import config

    config.reset(app)


class TestEngine:
    def test_a_loss_recorded_just_before_the_body_resends_itself_is_reported(
        self, app: Celery
    ) -> None:
        """The renewer records the loss ("taken"); before its listeners are dispatched, the
        body publishes a message with its own id (retry / apply_async(task_id=...)), which
        releases early. The loss happened before: lock_lost must still be sent."""
        store = MemoryLockStore()
        app.conf.lease_store = store
        recorded, published = threading.Event(), threading.Event()

        def between_record_and_notify(key: str, token: object, seconds: float, ok: object) -> None:
            if key == "resend" and ok is False:  # on the renewer: recorded, not yet notified
                recorded.set()
                published.wait(REAL)

        lost: list[dict[str, Any]] = []

        def on_lock_lost(sender: Any = None, **named: Any) -> None:
            lost.append(named)

        notified = threading.Event()

        @app.task(bind=True, base=LockedTask, lock_key="resend", lock_ttl="3s", shared=False)
        def body(self: Any) -> str:
            # Immediate listeners run once the dispatched ones (lock_lost's) were handed over.
            self.request.lease.add_loss_listener(lambda _: notified.set(), immediate=True)
            assert store.force_release("resend") is not None  # an operator, then:
            assert store.acquire("resend", "another-owner", 60_000) is not None
            assert recorded.wait(REAL)  # the renewal found it taken and recorded that
            try:
                self.apply_async(task_id=self.request.id, countdown=3600)  # re-sends itself
            finally:
                published.set()
            return "ran"

        forget = observe_renewals(between_record_and_notify)
        lease_signals.lock_lost.connect(on_lock_lost, weak=False)
        try:
            assert body.apply().get() == "ran"
            assert notified.wait(REAL)
            assert drain(REAL)
        finally:
            published.set()
            forget()
            lease_signals.lock_lost.disconnect(on_lock_lost)
        assert [named["reason"] for named in lost] == ["taken"]

    def test_an_async_store_configured_for_a_task_holds_the_key(self, app: Celery) -> None:
        memory = MemoryLockStore()
        app.conf.lease_store = ThreadedAsyncStore(memory)
        seen: list[tuple[object, object]] = []

        @app.task(bind=True, base=LockedTask, lock_key="async-k", shared=False)
        def body(self: Any) -> str:
            seen.append((self.request.lock_token, memory.get("async-k")))
            return "ran"

        with _ignore_runtime_warnings():
            body.apply()
        [(token, info)] = seen
        assert isinstance(token, int)
        assert info is not None

    @pytest.mark.parametrize("task_id", [uuid.UUID(int=7), "x" * 1001], ids=["uuid", "long"])
    def test_a_task_id_celery_accepts_never_fails_the_acquisition(
        self, app: Celery, task_id: object
    ) -> None:
        """The owner id only describes the holder: whatever id Celery runs a task with, the
        locked task runs as the plain one does."""
        app.conf.lease_store = MemoryLockStore()

        @app.task(shared=False)
        def plain() -> str:
            return "ran"

        @app.task(base=LockedTask, lock_key="tid", shared=False)
        def locked_body() -> str:
            return "ran"

        assert plain.apply(task_id=task_id).state == "SUCCESS"
        result = locked_body.apply(task_id=task_id)
        assert (result.state, result.result) == ("SUCCESS", "ran")

    def test_every_execution_of_one_task_id_has_its_own_owner(self, app: Celery) -> None:
        """Owner ids name the task id, but two executions with the same id (a redelivery)
        still differ: one can never release the other's lease."""
        store = MemoryLockStore()
        app.conf.lease_store = store
        owners: list[str] = []

        @app.task(bind=True, base=LockedTask, lock_key="same", shared=False)
        def body(self: Any) -> None:
            owners.append(self.request.lease.owner)

        body.apply(task_id="one-id")
        body.apply(task_id="one-id")
        assert len(set(owners)) == 2
        assert [parse_owner(o).task_id for o in owners] == ["one-id", "one-id"]

    def test_the_key_is_free_before_apply_returns_the_result(self, app: Celery) -> None:
        store = MemoryLockStore()
        app.conf.lease_store = store
        seen: list[object] = []

        @app.task(base=LockedTask, lock_key="vis", shared=False)
        def body() -> str:
            seen.append(store.get("vis"))
            return "ran"

        result = body.apply()
        assert store.get("vis") is None
        assert result.get() == "ran" and seen[0] is not None


@contextlib.contextmanager
def _ignore_runtime_warnings() -> Iterator[None]:
    """Swallow the "coroutine was never awaited" warnings the bug produces (so the test fails
    on its assertions, not on the warning filter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_the_renewer_of_a_fake_clock_is_per_clock() -> None:
    """Sanity: the attacks above run on their own clock's renewer, not the system one."""
    clock = FakeClock(0.0)
    assert get_renewer(clock) is get_renewer(clock)
    assert get_renewer(clock) is not get_renewer()
