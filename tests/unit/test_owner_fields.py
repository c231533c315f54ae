"""Owner ids name their holder (issue 11): ``lease(holder=...)``, the task node, name and id."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LockedTask, MemoryLockStore, lease
from celery_lease.owners import MAX_FIELD_CHARS, parse_owner


class TestLeaseHolder:
    def test_the_label_is_recorded_in_the_owner(self) -> None:
        """``holder="nightly import"`` comes back from the owner id the store records."""
        store = MemoryLockStore()
        with lease("h", store=store, holder="nightly import") as held:
            info = store.get("h")
            assert info is not None and info.owner == held.owner
            assert parse_owner(info.owner).label == "nightly import"

    @pytest.mark.parametrize("bad", ["", 7, "x" * (MAX_FIELD_CHARS + 1)])
    def test_a_bad_label_is_refused_naming_the_parameter(self, bad: Any) -> None:
        """Refused when lease() is called, before anything is acquired."""
        with pytest.raises(LeaseConfigError, match="holder="):
            lease("h", store=MemoryLockStore(), holder=bad)

    def test_each_acquisition_gets_its_own_owner(self) -> None:
        """Two acquisitions of one decorated function use two owner ids."""
        store = MemoryLockStore()
        owners: list[str] = []

        @lease("d", store=store, holder="job")
        def job() -> None:
            info = store.get("d")
            assert info is not None
            owners.append(info.owner)

        job()
        job()
        assert len(set(owners)) == 2
        assert [parse_owner(o).label for o in owners] == ["job", "job"]


class TestTaskOwner:
    def test_a_task_lease_names_its_task_and_id(self) -> None:
        """A LockedTask's owner carries the task name and the execution's id."""
        store = MemoryLockStore()
        app = Celery("t", broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.lease_store = store
        try:

            @app.task(base=LockedTask, lock_key="o", shared=False)
            def task() -> Any:
                return task.request.lease.owner, task.request.id

            result = task.apply()
            owner, task_id = result.result
            holder = parse_owner(owner)
            assert holder.task == task.name and holder.task_id == task_id
        finally:
            app.close()
