"""Loss reasons that say what happened: an operator's force-release reads
``"released"``, another owner's lease ``"taken"``; asked of the store on the loss path only."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import LockedTask, MemoryLockStore, lease
from celery_lease import signals as lease_signals
from celery_lease.stores.slots import slot_key
from celery_lease.stores.sqlite import SQLiteLockStore
from celery_lease.testing import FakeClock

REAL = 10.0


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[SQLiteLockStore]:
    store = SQLiteLockStore(tmp_path / "leases.sqlite3")
    yield store
    store.close()


class _NoInspection:
    """A store with only the three operations (no ``get``): it cannot say who holds a key."""

    def __init__(self, inner: MemoryLockStore) -> None:
        self.inner = inner

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.inner.acquire(key, owner, ttl_ms)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self.inner.renew(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.inner.release(key, owner)


class _FailingGet(MemoryLockStore):
    def get(self, key: str) -> Any:
        raise RuntimeError("inspection is down")


def _lose(store: Any, clock: FakeClock, key: str, *, take: bool) -> str | None:
    """Hold ``key``, free it behind the holder's back (and let another owner take it when
    ``take``), let the next renewal find out; the loss reason the holder reads."""
    with lease(key, store=store, ttl=3, clock=clock) as held:
        inner = getattr(store, "inner", store)
        assert inner.force_release(key) is not None
        if take:
            assert inner.acquire(key, "another-owner", 60_000) is not None
        clock.advance(1.0)
        assert held.wait_lost(REAL)
        reason = held.lost_reason
    return reason


class TestReasons:
    def test_a_force_release_reads_released(self, sqlite: SQLiteLockStore) -> None:
        """SQLite store: the key found free at the refused renewal -> ``"released"``."""
        assert _lose(sqlite, FakeClock(1000.0), "op", take=False) == "released"

    def test_another_owner_reads_taken(self, sqlite: SQLiteLockStore) -> None:
        """SQLite store: the key found held by another owner -> ``"taken"``."""
        assert _lose(sqlite, FakeClock(1000.0), "other", take=True) == "taken"

    def test_taken_and_let_go_since_reads_taken(self, sqlite: SQLiteLockStore) -> None:
        """The key free again but the counter past this lease's token: another owner held it
        in between, so not an operator's release of this lease: ``"taken"``."""
        clock = FakeClock(1000.0)
        with lease("between", store=sqlite, ttl=3, clock=clock) as held:
            assert sqlite.force_release("between") is not None
            assert sqlite.acquire("between", "another-owner", 60_000) is not None
            sqlite.release("between", "another-owner")
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert held.lost_reason == "taken"

    def test_a_store_that_cannot_tell_reads_taken(self) -> None:
        """No ``get``: the old reason, ``"taken"``."""
        clock = FakeClock(1000.0)
        store = _NoInspection(MemoryLockStore(clock=clock))
        assert _lose(store, clock, "blind", take=False) == "taken"

    def test_a_failing_inspection_reads_taken(self) -> None:
        """``get`` raising: ``"taken"``, and the renewer goes on."""
        clock = FakeClock(1000.0)
        assert _lose(_FailingGet(clock=clock), clock, "down", take=False) == "taken"


class _Amnesic(MemoryLockStore):
    """A store that lost everything (a restart without persistence): no lease, no counter."""

    def forget_all(self) -> None:
        with self._lock:
            self._entries.clear()
            self._floor = 0


class TestLostData:
    def test_a_store_that_lost_its_data_reads_expired(self) -> None:
        """The key free and the fencing counter gone (lower than the token): not an operator's
        release but lost data, ``"expired"``."""
        clock = FakeClock(1000.0)
        store = _Amnesic(clock=clock)
        with lease("amnesia", store=store, ttl=3, clock=clock) as held:
            store.forget_all()
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert held.lost_reason == "expired"


class TestTaskSeesTheOperator:
    def test_a_force_released_task_gets_lock_lost_released(self, tmp_path: Path) -> None:
        """A LockedTask whose key an operator force-released: ``lock_lost`` is sent with
        ``"released"`` and ``request.lock_lost`` reads True (an early release of its own sends
        no ``lock_lost``; this one is not its own)."""
        store = SQLiteLockStore(tmp_path / "t.sqlite3")
        app = Celery("t", broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.lease_store = store
        seen: list[dict[str, Any]] = []

        def receiver(sender: Any = None, **kwargs: Any) -> None:
            seen.append(kwargs)

        lease_signals.lock_lost.connect(receiver, weak=False)
        try:
            # A ttl the renewer's next renewal (ttl/3) cannot miss on a loaded machine: with
            # 0.3 s a stall past it made the free key read "expired" before the renewer looked.
            @app.task(base=LockedTask, lock_key="op-task", lock_ttl="3s", shared=False)
            def task() -> Any:
                assert task.request.lease.wait_lost(REAL)
                return task.request.lock_lost, task.request.lease.lost_reason

            def operator() -> None:
                deadline = time.monotonic() + REAL
                while store.get("op-task") is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                store.force_release("op-task")

            threading.Thread(target=operator, daemon=True).start()
            result = task.apply()
            assert result.state == "SUCCESS" and tuple(result.result) == (True, "released")
            deadline = time.monotonic() + REAL
            while not seen and time.monotonic() < deadline:
                time.sleep(0.005)
            assert [s["reason"] for s in seen] == ["released"]
        finally:
            lease_signals.lock_lost.disconnect(receiver)
            app.close()
            store.close()


# The reason of a lease whose data the store lost --------------------------------------------


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


class TestSlotReasons:
    """A slot's last token is the key-wide counter on some stores: a free slot cannot tell
    release from expiry, so it reads ``"expired"``; another owner on the slot: ``"taken"``."""

    def test_a_slot_found_free_reads_expired_whatever_the_other_slots_drew(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with lease("slots", store=store, ttl=3, clock=clock, limit=3) as held:
            beside = store.acquire_slot("slots", "beside", 60_000, 3)  # slot 1, a later token
            assert beside is not None and beside[1] > held.token
            assert store.force_release(held.store_key) is not None
            got = store.acquire_slot("slots", "another-owner", 60_000, 3)
            assert got is not None and slot_key("slots", got[0]) == held.store_key
            store.release(held.store_key, "another-owner")  # slot 0 free again
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert held.lost_reason == "expired"

    def test_a_slot_held_by_another_owner_reads_taken(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with lease("slots", store=store, ttl=3, clock=clock, limit=3) as held:
            assert store.force_release(held.store_key) is not None
            got = store.acquire_slot("slots", "another-owner", 60_000, 3)
            assert got is not None and slot_key("slots", got[0]) == held.store_key
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert held.lost_reason == "taken"
