"""The reaper frees the queued key of a unique copy that dies with its pool child.

``celery_lease._celery.reaper._Reaper.release`` without a worker, on a memory store: when it
releases the
run lease of a dead child's task, it releases that copy's ``queued:<key>`` too (owner-checked,
that very copy's owner), only when the copy is known to end FAILURE (``_ends_failed_ids``:
a request the worker tracks whose task Celery neither requeues nor retries; ``_runs_again``
mirrors Celery's decision). The real prefork worker is in
``tests/integration/test_killed_pool_child.py``.
"""

from __future__ import annotations

import socket
from typing import Any

from celery_lease import MemoryLockStore
from celery_lease._celery.reaper import _Death, _ends_failed_ids, _Reaper, _runs_again
from celery_lease._core.dispatch import drain
from celery_lease._core.owners import make_owner, queued_owner

TTL_MS = 30_000
NODE = "w1@host"
DEAD = 4242  # the dead child's pid (never signalled: only written into owner ids)


class FakeBackend:
    def __init__(self, states: dict[str, str]) -> None:
        self.states = states

    def as_uri(self) -> str:
        return "redis://fake"

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        return {"status": self.states.get(task_id, "PENDING")}


class FakeApp:
    def __init__(self, prefix: str = "", states: dict[str, str] | None = None) -> None:
        self.tasks: dict[str, Any] = {}
        self.backend = FakeBackend(states or {})
        self.conf = {"lease_key_prefix": prefix} if prefix else {}


def run_owner(task_id: str) -> str:
    """The run lease's owner id, as dead pool child ``DEAD`` made it for ``task_id``."""
    made = make_owner(node=NODE, task="t.unique", task_id=task_id)
    head, _, fields = made.partition(";")
    return f"{socket.gethostname()}/{DEAD}/{head.split('/')[2]};{fields}"


def copy(store: MemoryLockStore, key: str, task_id: str, prefix: str = "") -> str:
    """A running unique copy: its run lease on ``key`` and its queued lease; the queued owner."""
    queued = queued_owner("t.unique", task_id, 1)
    assert store.acquire(key, run_owner(task_id), TTL_MS) is not None
    qkey = prefix + "queued:" + key[len(prefix) :]
    assert store.acquire(qkey, queued, TTL_MS) is not None
    return queued


def release(store: MemoryLockStore, death: _Death, app: FakeApp | None = None) -> None:
    reaper = _Reaper(app or FakeApp(), NODE, pool=None)
    reaper._stores = lambda: [store]  # type: ignore[method-assign]
    reaper.release(death)
    assert drain()


class TestQueuedKey:
    def test_a_failed_copys_queued_key_goes_with_its_run_lease(self) -> None:
        """The copy ends FAILURE with its child: both of its keys are free."""
        store = MemoryLockStore()
        copy(store, "k", "t1")
        release(store, _Death(DEAD, -9, {"t1": "t.unique"}, fails={"t1"}))
        assert store.get("k") is None
        assert store.get("queued:k") is None

    def test_under_a_key_prefix(self) -> None:
        """``lease_key_prefix`` comes first in the queued key too (``p:queued:k``)."""
        store = MemoryLockStore()
        copy(store, "p:k", "t1", prefix="p:")
        release(store, _Death(DEAD, -9, {"t1": "t.unique"}, fails={"t1"}), FakeApp(prefix="p:"))
        assert store.get("p:queued:k") is None

    def test_a_copy_not_known_to_fail_keeps_it(self) -> None:
        """Celery may run the copy again (requeued, retried, or cancelled and redelivered: not
        in ``fails``): its run lease goes, its queued key stays."""
        store = MemoryLockStore()
        queued = copy(store, "k", "t1")
        release(store, _Death(DEAD, -9, {"t1": "t.unique"}))
        assert store.get("k") is None
        info = store.get("queued:k")
        assert info is not None and info.owner == queued

    def test_another_copys_queued_key_is_untouched(self) -> None:
        """The queued key is held by a newer copy (another task id): it is not the dead one's."""
        store = MemoryLockStore()
        assert store.acquire("k", run_owner("t1"), TTL_MS) is not None
        newer = queued_owner("t.unique", "t2", 1)
        assert store.acquire("queued:k", newer, TTL_MS) is not None
        release(store, _Death(DEAD, -9, {"t1": "t.unique"}, fails={"t1"}))
        assert store.get("k") is None
        info = store.get("queued:k")
        assert info is not None and info.owner == newer

    def test_a_copy_whose_success_is_stored_keeps_both(self) -> None:
        """Killed after storing SUCCESS: the keys are its cooldown, both kept."""
        store = MemoryLockStore()
        copy(store, "k", "t1")
        death = _Death(DEAD, -9, {"t1": "t.unique"}, fails={"t1"})
        release(store, death, FakeApp(states={"t1": "SUCCESS"}))
        assert store.get("k") is not None
        assert store.get("queued:k") is not None


class Task:
    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


class TestRunsAgain:
    def test_only_what_celery_requeues_or_retries_runs_again(self) -> None:
        """As Celery's ``Request.on_failure`` / ``on_timeout`` decide."""
        assert not _runs_again(Task(acks_late=False))
        assert not _runs_again(Task(acks_late=True, reject_on_worker_lost=False))
        assert _runs_again(Task(acks_late=True, reject_on_worker_lost=True))
        assert _runs_again(Task(acks_late=False, retry_on_worker_lost=True, max_retries=3), 2)
        assert not _runs_again(Task(acks_late=False, retry_on_worker_lost=True, max_retries=3), 3)
        assert _runs_again(Task(acks_late=True, acks_on_timeout=False), timed_out=True)
        assert not _runs_again(Task(acks_late=True, acks_on_timeout=True), timed_out=True)
        assert not _runs_again(None)


class Request:
    def __init__(self, task_id: str, task: Task, *, cancelled: bool = False) -> None:
        self.id = task_id
        self.task = task
        self.request_dict = {"retries": 0}
        self._already_cancelled = cancelled


class TestEndsFailed:
    def test_only_tracked_requests_that_are_not_run_again(self, monkeypatch: Any) -> None:
        """A request cancelled at shutdown or on a lost connection is redelivered (its message
        stays unacknowledged), so it is no evidence of a failed copy; neither is a requeue."""
        from celery.worker import state as worker_state

        monkeypatch.setattr(
            worker_state,
            "active_requests",
            {
                Request("fails", Task(acks_late=False)),
                Request("requeued", Task(acks_late=True, reject_on_worker_lost=True)),
                Request("cancelled", Task(acks_late=True), cancelled=True),
            },
        )
        monkeypatch.setattr(worker_state, "reserved_requests", set())
        assert _ends_failed_ids() == {"fails"}
