"""Who keeps a key that turned an execution away: read from the store, told apart as a running
execution or a cooldown, described for the skip's log line and reason; never raises."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend

from celery_lease import MemoryLockStore
from celery_lease._celery import held_by
from celery_lease._celery.held_by import iso_utc, look_up
from celery_lease._core.owners import make_owner
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT


class Task:
    name = "proj.report"

    def __init__(self, backend: Any = None) -> None:
        self.backend = backend


class ReadsCounted:
    """A result backend that counts its reads and says every task succeeded."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        self.reads.append(task_id)
        return {"status": "SUCCESS"}


def _store(*, owner: str, keep_ms: int) -> MemoryLockStore:
    store = MemoryLockStore(clock=FakeClock(1796507436.0))
    assert store.acquire("k", owner, keep_ms) is not None
    return store


class TestLookUp:
    def test_a_free_key_and_a_store_without_get_tell_nothing(self) -> None:
        assert look_up(MemoryLockStore(), "k", Task(), 30.0) is None
        assert look_up(object(), "k", Task(), 30.0) is None

    def test_a_lease_longer_than_the_tasks_ttl_is_a_cooldown_without_asking_the_backend(
        self,
    ) -> None:
        """A running copy renews to at most its ttl: longer is the kept key of a success."""
        backend = ReadsCounted()
        owner = make_owner(node="w1@vm", task="proj.report", task_id="t-0")
        found = look_up(_store(owner=owner, keep_ms=600_000), "k", Task(backend), 30.0)
        assert found is not None and found.cooldown and found.reason == "cooldown"
        assert (found.until, found.left, found.holder.task_id) == (1796507436.0 + 600, 600.0, "t-0")
        assert backend.reads == []

    def test_another_tasks_long_lease_is_held_unless_the_backend_says_it_succeeded(
        self,
    ) -> None:
        """The ttl rule holds for the same task only; then the result backend decides."""
        owner = make_owner(task="proj.other", task_id="t-9")
        store = _store(owner=owner, keep_ms=600_000)
        found = look_up(store, "k", Task(), 30.0)
        assert found is not None and not found.cooldown
        assert found.describe() == "held by another execution, proj.other[t-9]"
        backend = ReadsCounted()
        found = look_up(store, "k", Task(backend), 30.0)
        assert found is not None and found.cooldown and backend.reads == ["t-9"]

    def test_a_holder_that_records_no_cooldown_is_running_whatever_the_backend_says(
        self,
    ) -> None:
        """Its owner id records its ttl and no cooldown: a running execution, also when the
        backend already shows it succeeded (it ended between the refusal and this read), and
        the backend is not asked."""
        backend = ReadsCounted()
        owner = make_owner(task="proj.report", task_id="t-0", ttl_ms=30_000)
        found = look_up(_store(owner=owner, keep_ms=30_000), "k", Task(backend), 30.0)
        assert found is not None and not found.cooldown and found.reason == "held"
        assert backend.reads == []

    def test_a_holder_asked_to_stop_is_read_as_the_running_execution_it_is(self) -> None:
        """Marked by a newer ``on_held="replace"`` call, its owner id still records its ttl and
        no cooldown: running, named by its task, the backend not asked."""
        backend = ReadsCounted()
        owner = make_owner(task="proj.report", task_id="t-0", ttl_ms=30_000)
        store = _store(owner=owner, keep_ms=30_000)
        store.mark_replaced("k")
        found = look_up(store, "k", Task(backend), 30.0)
        assert found is not None and not found.cooldown and found.reason == "held"
        assert found.holder.task_id == "t-0" and backend.reads == []

    def test_a_holder_that_records_its_cooldown_is_in_it_once_it_succeeded(self) -> None:
        backend = ReadsCounted()
        owner = make_owner(task="proj.other", task_id="t-9", ttl_ms=30_000, cooldown_ms=600_000)
        found = look_up(_store(owner=owner, keep_ms=500_000), "k", Task(backend), 30.0)
        assert found is not None and found.cooldown and backend.reads == ["t-9"]

    def test_an_rpc_or_disabled_backend_is_not_read(self) -> None:
        """rpc:// results live on the caller's queue: reading one there would take it; a
        disabled backend stores nothing."""
        reads: list[str] = []

        class Rpc(RPCBackend):
            def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
                reads.append(task_id)
                return {"status": "SUCCESS"}

        class Disabled(DisabledBackend):
            def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
                reads.append(task_id)
                return {"status": "SUCCESS"}

        app = Celery("rpc", broker="memory://", set_as_current=False)
        owner = make_owner(task="proj.report", task_id="t-0")
        store = _store(owner=owner, keep_ms=10_000)
        for backend in (Rpc(app=app), Disabled(app=app)):
            found = look_up(store, "k", Task(backend), 30.0)
            assert found is not None and not found.cooldown
        assert reads == []

    def test_a_holder_outside_celery_is_named_by_its_label(self) -> None:
        found = look_up(
            _store(owner=make_owner(label="nightly import"), keep_ms=5_000), "k", None, 30.0
        )
        assert (
            found is not None and found.describe() == "held by another execution, 'nightly import'"
        )


class Hung:
    """A result backend whose reads block until the test opens ``gate`` (a Redis result
    backend that stopped answering: a read then lasts the client's socket timeout)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.reads: list[str] = []
        self.entered = threading.Event()
        self.finished = threading.Event()

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        self.reads.append(task_id)
        self.entered.set()
        try:
            assert self.gate.wait(REAL_TIMEOUT)
            return {"status": "SUCCESS"}
        finally:
            self.finished.set()


def _join_readers() -> None:
    """Wait until the backend reads of the skips have ended (their threads too)."""
    for thread in threading.enumerate():
        if thread.name == "celery-lease-held-by":
            thread.join(REAL_TIMEOUT)
            assert not thread.is_alive()


class TestAHungResultBackend:
    """The skip reads the holder's state from the result backend for at most
    ``BACKEND_WAIT`` seconds, and never while an earlier read still hangs: a backend that
    stopped answering holds no worker slot."""

    def test_a_skip_behind_a_hung_backend_ends_without_its_answer(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(held_by, "BACKEND_WAIT", 0.01)
        backend = Hung()
        owner = make_owner(node="w1@vm", task="proj.report", task_id="t-0")
        store = _store(owner=owner, keep_ms=20_000)
        try:
            found = look_up(store, "k", Task(backend), 30.0)
            assert backend.entered.is_set(), "the backend was not asked"
            assert not backend.finished.is_set(), "the skip waited for the hung read"
            assert found is not None and not found.cooldown and found.reason == "held"
            assert found.describe() == (
                "held by another execution, proj.report[t-0] on w1@vm"
                " (its state unknown: the result backend did not answer)"
            )
            # A second skip while the first read still hangs does not ask again.
            again = look_up(store, "k", Task(backend), 30.0)
            assert again is not None and again.describe() == found.describe()
            assert backend.reads == ["t-0"]
        finally:
            backend.gate.set()
            _join_readers()
        assert backend.finished.is_set()

    def test_the_backend_is_asked_again_once_the_hung_read_ended(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(held_by, "BACKEND_WAIT", 0.01)
        backend = Hung()
        owner = make_owner(task="proj.report", task_id="t-0")
        store = _store(owner=owner, keep_ms=20_000)
        first = look_up(store, "k", Task(backend), 30.0)
        assert first is not None and not first.state_known
        backend.gate.set()
        _join_readers()
        monkeypatch.setattr(held_by, "BACKEND_WAIT", REAL_TIMEOUT)
        found = look_up(store, "k", Task(backend), 30.0)
        assert found is not None and found.cooldown  # the backend answered SUCCESS
        assert backend.reads == ["t-0", "t-0"]


class TestIsoUtc:
    def test_the_time_in_utc_to_the_second(self) -> None:
        assert iso_utc(1796507436.9) == "2026-12-05T21:50:36Z"


def _slots_store(*holders: tuple[str, int]) -> MemoryLockStore:
    """Slots 0, 1, ... of ``k`` held by each ``(owner, keep_ms)`` in turn (limit 3)."""
    store = MemoryLockStore(clock=FakeClock(1796507436.0))
    for owner, keep_ms in holders:
        assert store.acquire_slot("k", owner, keep_ms, 3) is not None
    return store


class TestLookUpSlots:
    """A key with a limit is kept by its slots' holders: the one whose slot frees soonest."""

    def test_the_holder_whose_slot_frees_soonest_is_named(self) -> None:
        later = make_owner(task="proj.report", task_id="t-0", ttl_ms=30_000)
        soonest = make_owner(task="proj.report", task_id="t-1", ttl_ms=30_000)
        store = _slots_store((later, 30_000), (soonest, 12_000))
        found = look_up(store, "k", Task(), 30.0, limited=True)
        assert found is not None and found.key == "k" and found.reason == "held"
        assert (found.holder.task_id, found.left) == ("t-1", 12.0)
        assert found.until == 1796507436.0 + 12

    def test_a_slot_in_its_cooldown_freeing_soonest_is_a_cooldown(self) -> None:
        running = make_owner(task="proj.report", task_id="t-0", ttl_ms=30_000)
        kept = make_owner(task="proj.report", task_id="t-1", ttl_ms=30_000, cooldown_ms=20_000)
        backend = ReadsCounted()
        found = look_up(
            _slots_store((running, 30_000), (kept, 20_000)), "k", Task(backend), 30.0, limited=True
        )
        assert found is not None and found.cooldown and found.reason == "cooldown"
        assert (found.holder.task_id, found.left) == ("t-1", 20.0)
        assert backend.reads == ["t-1"]

    def test_the_key_itself_is_not_a_slot_holder(self) -> None:
        """Only the key's slots count: the key's own lease and another key's slots do not."""
        store = _store(owner=make_owner(task_id="plain"), keep_ms=1_000)
        assert store.acquire_slot("k2", make_owner(task_id="other key"), 1_000, 3) is not None
        assert look_up(store, "k", Task(), 30.0, limited=True) is None

    def test_a_store_without_inspection_tells_nothing(self) -> None:
        assert look_up(object(), "k", Task(), 30.0, limited=True) is None
