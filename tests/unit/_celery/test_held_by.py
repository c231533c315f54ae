"""Who keeps a key that turned an execution away: read from the store, told apart as a running
execution or a cooldown, described for the skip's log line and reason; never raises."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend

from celery_lease import MemoryLockStore
from celery_lease._celery.held_by import iso_utc, look_up
from celery_lease._core.owners import make_owner
from celery_lease.testing import FakeClock


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


class TestIsoUtc:
    def test_the_time_in_utc_to_the_second(self) -> None:
        assert iso_utc(1796507436.9) == "2026-12-05T21:50:36Z"
