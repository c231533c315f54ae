"""A locked task's ``limit`` (``lock_limit``, ``@locked(limit=...)``): up to ``limit`` executions
of one key at once, each in its own slot, seen as ``request.lock_slot``; a callable limit is
called with the task's arguments as a key callable is, and always uses slots."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_lease import (
    LeaseConfigError,
    LockedTask,
    LockNotAcquiredError,
    MemoryLockStore,
    lease,
    locked,
)
from celery_lease import signals as lease_signals
from celery_lease._celery import (
    early_release,  # noqa: F401  # connects the receiver
)
from celery_lease._celery import settings as config
from celery_lease._core import renewer
from celery_lease._core.dispatch import drain
from celery_lease.stores.slots import MAX_LIMIT, slot_key

REAL_TIMEOUT = 10.0


@pytest.fixture
def store() -> MemoryLockStore:
    return MemoryLockStore()


@pytest.fixture
def app(store: MemoryLockStore) -> Iterator[Celery]:
    app = Celery("limits", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.task_eager_propagates = False
    yield app
    config.reset(app)
    app.close()


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The lock_acquired / lock_released / lock_lost signals sent, as ``(name, kwargs)``."""
    seen: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name in ("lock_acquired", "lock_released", "lock_lost"):

        def receiver(sender: Any = None, signal: Any = None, _n: str = name, **kw: Any) -> None:
            seen.append((_n, kw))

        receivers[name] = receiver
        getattr(lease_signals, name).connect(receiver, weak=False)
    yield seen
    for name, receiver in receivers.items():
        getattr(lease_signals, name).disconnect(receiver)


class Gate:
    """Bodies that report in and wait until the test opens the gate."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.inside: list[tuple[int, int, str]] = []  # (slot, token, lock_key)
        self.open = threading.Event()

    def enter(self, request: Any) -> None:
        with self.cond:
            self.inside.append((request.lock_slot, request.lock_token, request.lock_key))
            self.cond.notify_all()
        assert self.open.wait(REAL_TIMEOUT), "the test never opened the gate"

    def wait_inside(self, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.inside) >= count, REAL_TIMEOUT)


def run_on_threads(call: Any, count: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


class TestTaskLimit:
    def test_three_run_at_once_in_their_own_slots_and_a_fourth_is_refused(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """lock_limit=3: three executions hold slots 0, 1, 2 at once (lock_slot, lock_token
        set); a fourth, not waiting, is refused with LockNotAcquiredError."""
        gate = Gate()

        @app.task(
            shared=False, bind=True, base=LockedTask, lock_key="acct:{account_id}", lock_limit=3
        )
        def pay(self: Any, account_id: int) -> int:
            if account_id:
                gate.enter(self.request)
            return int(self.request.lock_slot)

        pay.apply(kwargs={"account_id": 0})  # Celery sets a task up on first use: not in threads
        results: list[Any] = []
        threads = run_on_threads(lambda: results.append(pay.apply(kwargs={"account_id": 7})), 3)
        gate.wait_inside(3)
        assert sorted(slot for slot, _, _ in gate.inside) == [0, 1, 2]
        assert len({token for _, token, _ in gate.inside}) == 3
        assert {key for _, _, key in gate.inside} == {"acct:7"}
        assert sorted(info.key for info in store.list("acct:7")) == [
            slot_key("acct:7", i) for i in range(3)
        ]
        refused = pay.apply(kwargs={"account_id": 7})
        assert isinstance(refused.result, LockNotAcquiredError)
        gate.open.set()
        for thread in threads:
            thread.join(REAL_TIMEOUT)
        assert sorted(r.get(timeout=1) for r in results) == [0, 1, 2]
        assert store.list("acct:7") == []

    def test_lock_slot_is_0_without_a_limit_and_none_outside(self, app: Celery) -> None:
        seen: list[Any] = []

        @app.task(shared=False, bind=True, base=LockedTask, lock_key="plain")
        def plain(self: Any) -> None:
            seen.append((self.request.lock_slot, self.request.lease.store_key))

        plain.apply()
        assert seen == [(0, "plain")]

        @app.task(shared=False, bind=True)
        def unlocked(self: Any) -> None:
            seen.append(self.request.lock_slot)

        unlocked.apply()
        assert seen[-1] is None

    def test_a_callable_limit_gets_the_arguments_as_a_key_callable(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """The callable is called with the task's arguments by name (positional or keyword);
        returning 1 still uses slots (slot 0's store key)."""
        calls: list[tuple[Any, ...]] = []

        def per_account(account_id: int, region: str = "eu") -> int:
            calls.append((account_id, region))
            return 2 if account_id == 1 else 1

        seen: list[Any] = []

        class Pay(LockedTask):
            name = "limits.pay"
            lock_key = "acct:{account_id}"
            lock_limit = per_account

            def run(self, account_id: int, region: str = "eu") -> None:
                seen.append((self.request.lock_slot, self.request.lease.store_key))

        task = app.register_task(Pay())
        task.apply(args=(1,), kwargs={"region": "us"})
        task.apply(kwargs={"account_id": 5})
        assert calls == [(1, "us"), (5, "eu")]
        assert seen == [(0, slot_key("acct:1", 0)), (0, slot_key("acct:5", 0))]

    def test_a_lambda_limit_on_the_decorator(self, app: Celery) -> None:
        seen: list[Any] = []

        @app.task(shared=False)
        @locked(key="acct:{account_id}", limit=lambda account_id: 3)
        def pay(account_id: int) -> None:
            from celery_lease import current_lease

            held = current_lease()
            assert held is not None
            seen.append(held.store_key)

        pay.apply(args=(4,))
        assert seen == [slot_key("acct:4", 0)]

    @pytest.mark.parametrize("value", [0, -1, MAX_LIMIT + 1, True, 2.0, "2", None])
    def test_a_callable_returning_a_bad_value_names_task_key_and_value(
        self, app: Celery, value: object
    ) -> None:
        @app.task(
            shared=False,
            bind=True,
            base=LockedTask,
            lock_key="acct:{n}",
            lock_limit=lambda n: value,
        )
        def bad(self: Any, n: int) -> None:
            raise AssertionError("the body must not run")

        with pytest.raises(LeaseConfigError) as raised:
            bad(9)
        message = str(raised.value)
        assert bad.name in message and "'acct:9'" in message and repr(value) in message

    def test_a_store_without_slots_is_refused_at_call_time(self, app: Celery) -> None:
        class NoSlots:
            def __init__(self) -> None:
                self.inner = MemoryLockStore()

            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                return self.inner.acquire(key, owner, ttl_ms)

            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                return self.inner.renew(key, owner, ttl_ms)

            def release(self, key: str, owner: str) -> None:
                self.inner.release(key, owner)

        app.conf.lease_store = NoSlots()

        @app.task(shared=False, base=LockedTask, lock_key="k", lock_limit=2)
        def limited() -> None:
            raise AssertionError("the body must not run")

        with pytest.raises(LeaseConfigError, match="acquire_slot"):
            limited()


class TestDefinition:
    @pytest.mark.parametrize("value", [0, -1, MAX_LIMIT + 1, True, 1.5, "3"])
    def test_a_bad_lock_limit_fails_at_class_creation(self, value: object) -> None:
        with pytest.raises(LeaseConfigError) as raised:

            class Bad(LockedTask):
                lock_limit = value

        assert "lock_limit" in str(raised.value) and repr(value) in str(raised.value)

    @pytest.mark.parametrize("value", [0, True, "3"])
    def test_a_bad_decorator_limit_fails_at_decoration(self, value: object) -> None:
        with pytest.raises(LeaseConfigError) as raised:
            locked(key="k", limit=value)(lambda: None)  # type: ignore[arg-type]
        assert "limit of @locked" in str(raised.value) and repr(value) in str(raised.value)

    @pytest.mark.parametrize("limit", [2, lambda n: 2])
    def test_limit_with_unique_fails_at_definition(self, limit: object) -> None:
        with pytest.raises(LeaseConfigError) as raised:

            class Both(LockedTask):
                lock_limit = limit
                lock_unique = "until_done"

        assert "lock_limit" in str(raised.value) and "unique" in str(raised.value)

    @pytest.mark.parametrize("limit", [1, 3, lambda n: 1])
    def test_a_store_object_without_slots_fails_at_definition(self, limit: object) -> None:
        """Any int, or a callable (always slots), with a lock_store that cannot keep slots:
        named at class creation."""

        class NoSlots:
            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None: ...
            def renew(self, key: str, owner: str, ttl_ms: int) -> bool: ...
            def release(self, key: str, owner: str) -> None: ...

        with pytest.raises(LeaseConfigError, match="acquire_slot") as raised:

            class Limited(LockedTask):
                lock_store = NoSlots()
                lock_limit = limit

        assert "lock_limit of task" in str(raised.value)

    def test_limit_1_needs_a_store_with_slots_too(self) -> None:
        """lock_limit = 1 holds the key's slot space (one at a time), so it needs slots."""

        class NoSlots:
            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None: ...
            def renew(self, key: str, owner: str, ttl_ms: int) -> bool: ...
            def release(self, key: str, owner: str) -> None: ...

        with pytest.raises(
            LeaseConfigError, match=r"lock_limit of task .*=1 needs a store with acquire_slot"
        ):

            class One(LockedTask):
                lock_store = NoSlots()
                lock_limit = 1

    def test_a_key_with_the_slot_mark_fails_at_call_time(self, app: Celery) -> None:
        @app.task(shared=False, base=LockedTask, lock_key=lambda name: f"k\x1f{name}")
        def keyed(name: str) -> None:
            raise AssertionError("the body must not run")

        with pytest.raises(LeaseConfigError, match="U\\+001F"):
            keyed("a\x1f1")


class TestPerSlotPaths:
    def test_signals_carry_the_key_and_the_slot(
        self, app: Celery, received: list[tuple[str, dict[str, Any]]]
    ) -> None:
        @app.task(shared=False, base=LockedTask, lock_key="k", lock_limit=2)
        def limited() -> None:
            pass

        @app.task(shared=False, base=LockedTask, lock_key="p")
        def plain() -> None:
            pass

        limited.apply()
        plain.apply()
        assert [(n, kw["key"], kw["slot"]) for n, kw in received] == [
            ("lock_acquired", "k", 0),
            ("lock_released", "k", 0),
            ("lock_acquired", "p", 0),
            ("lock_released", "p", 0),
        ]

    def test_lock_lost_names_the_slot(
        self, app: Celery, store: MemoryLockStore, received: list[tuple[str, dict[str, Any]]]
    ) -> None:
        """A slot taken away while the body runs: lock_lost names that slot."""
        # Slot 0 is held by another holder first, so the task gets slot 1.
        first = threading.Event()
        done = threading.Event()

        def hold_slot_0() -> None:
            with lease("k", store=store, ttl=30, limit=3):
                first.set()
                assert done.wait(REAL_TIMEOUT)

        holder = threading.Thread(target=hold_slot_0, daemon=True)
        holder.start()
        assert first.wait(REAL_TIMEOUT)
        seen: list[Any] = []

        # A short real ttl: the first renewal (ttl/3) finds the slot gone.
        @app.task(
            shared=False, bind=True, base=LockedTask, lock_key="k", lock_limit=3, lock_ttl=0.3
        )
        def loses(self: Any) -> None:
            seen.append(self.request.lock_slot)
            store.force_release(self.request.lease.store_key)
            assert self.request.lease.wait_lost(REAL_TIMEOUT)

        loses.apply()
        done.set()
        holder.join(REAL_TIMEOUT)
        assert seen == [1]
        assert drain(REAL_TIMEOUT)
        lost = [kw for n, kw in received if n == "lock_lost"]
        assert [(kw["key"], kw["slot"]) for kw in lost] == [("k", 1)]

    def test_cooldown_keeps_the_slot_held(self, app: Celery, store: MemoryLockStore) -> None:
        @app.task(shared=False, base=LockedTask, lock_key="k", lock_limit=2, lock_cooldown=60)
        def cools() -> None:
            pass

        cools.apply()
        assert [info.key for info in store.list("k")] == [slot_key("k", 0)]
        cools.apply()
        assert [info.key for info in store.list("k")] == [slot_key("k", 0), slot_key("k", 1)]
        assert isinstance(cools.apply().result, LockNotAcquiredError)

    def test_early_release_frees_the_slot(self, app: Celery, store: MemoryLockStore) -> None:
        """Publishing its own id releases the execution's slot key before the message goes out."""
        seen: list[Any] = []

        @app.task(shared=False, bind=True, base=LockedTask, lock_key="k", lock_limit=2)
        def resends(self: Any) -> None:
            assert store.get(slot_key("k", 0)) is not None
            before_task_publish.send(sender="t", headers={"id": self.request.id}, body=((), {}, {}))
            seen.append((store.get(slot_key("k", 0)), self.request.lease.lost_reason))

        resends.apply()
        assert seen == [(None, "released")]

    def test_the_renewer_holds_the_slot_key(self, app: Celery) -> None:
        """The renewer (what ``inspect leases`` and the reaper's listing read) has the slot's
        store key, so two slots of one key are two leases there."""
        rows: list[Any] = []

        @app.task(shared=False, base=LockedTask, lock_key="k", lock_limit=2)
        def listed() -> None:
            rows.extend(row["key"] for row in renewer.snapshot())

        listed.apply()
        assert rows == [slot_key("k", 0)]


class TestLimitOneAndTheKeyItself:
    def test_a_limit_lowered_to_1_counts_the_executions_running_under_3(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """A rolling deploy lowering lock_limit from 3 to 1: the new code's call is refused
        while the executions taken under 3 run."""
        for i in range(3):
            assert store.acquire_slot("acct", f"old-worker-{i}", 600_000, 3) is not None

        @app.task(shared=False, base=LockedTask, lock_key="acct", lock_limit=1)
        def lowered() -> None:
            raise AssertionError("the body must not run beside three holders")

        assert isinstance(lowered.apply().result, LockNotAcquiredError)

    def test_a_plain_helper_in_a_limited_task_takes_the_key_itself(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """A @locked helper without limit on the same key, called from a limited task's body,
        holds the key on its own (it does not re-enter the task's slot)."""
        seen: list[tuple[str, str]] = []

        @locked(key="acct:{a}")
        def helper(a: int) -> None:
            from celery_lease import current_lease

            held = current_lease()
            assert held is not None
            seen.append(("helper", held.store_key))

        @app.task(shared=False, bind=True, base=LockedTask, lock_key="acct:{a}", lock_limit=3)
        def pay(self: Any, a: int) -> None:
            seen.append(("task", self.request.lease.store_key))
            helper(a)

        result = pay.apply(args=(1,))
        assert result.successful(), result.result
        assert seen == [("task", slot_key("acct:1", 0)), ("helper", "acct:1")]


class TestSkipNamesASlotHolder:
    def test_a_skip_with_a_limit_names_the_holder_whose_slot_frees_soonest(
        self, app: Celery, store: MemoryLockStore
    ) -> None:
        """Every slot in its cooldown: lock_rejected names the execution whose slot frees
        first, with its cooldown's end."""
        rejected: list[dict[str, Any]] = []

        def receiver(sender: Any = None, **kw: Any) -> None:
            rejected.append(kw)

        lease_signals.lock_rejected.connect(receiver, weak=False)
        try:

            @app.task(
                shared=False,
                base=LockedTask,
                lock_key="report",
                lock_limit=2,
                lock_on_held="skip",
                lock_cooldown=60,
            )
            def report() -> None:
                pass

            for i in range(3):
                report.apply(task_id=f"run-{i}")
        finally:
            lease_signals.lock_rejected.disconnect(receiver)
        assert len(rejected) == 1
        (kw,) = rejected
        assert kw["key"] == "report" and kw["reason"] == "cooldown"
        assert kw["holder_task_id"] == "run-0" and kw["until"] is not None
