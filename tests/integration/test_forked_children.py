"""A forked child (a prefork child, a fork inside a task body) on a store it shares with its parent.

The owner id is what a store compares before it renews or releases: a child that made the same
ids as its parent (a counter or random state inherited by ``fork``) could renew, re-acquire
(the store's idempotent same-owner acquire) or release its parent's lease.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from celery_lease import LockNotAcquiredError, lease
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.stores.sqlite import SQLiteLockStore

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")


def _run_child(child: object) -> object:
    """Fork; run ``child()`` in the child and return what it returned (as JSON) to the parent."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            os.write(write, json.dumps(child()).encode())  # type: ignore[operator]
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    try:
        chunks = []
        while chunk := os.read(read, 65536):  # EOF once the child exited (pytest-timeout bounds it)
            chunks.append(chunk)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        return json.loads(b"".join(chunks))
    finally:
        os.close(read)


def test_a_forked_child_makes_owner_ids_its_parent_never_made(tmp_path: Path) -> None:
    before = [make_owner() for _ in range(1000)]  # the parent's counter has moved on
    report = _run_child(lambda: [make_owner() for _ in range(1000)])
    after = [make_owner() for _ in range(1000)]
    assert isinstance(report, list)
    heads = {owner.split(";")[0] for owner in (*before, *after)}
    child_heads = {owner.split(";")[0] for owner in report}
    assert len(child_heads) == 1000 and not heads & child_heads
    assert {parse_owner(o).pid for o in report} != {os.getpid()}
    # Not only the pid differs: the 64-bit part starts from fresh randomness in the child.
    assert {h.rsplit("/", 1)[1] for h in heads}.isdisjoint(h.rsplit("/", 1)[1] for h in child_heads)


def test_a_forked_child_can_neither_take_over_nor_free_its_parents_lease(tmp_path: Path) -> None:
    path = tmp_path / "leases.sqlite3"
    store = SQLiteLockStore(path)
    try:
        with lease("job:1", store=store, ttl=30) as parent:

            def child() -> list[object]:
                mine = SQLiteLockStore(path)
                try:
                    seen: list[object] = [parent.lost_reason]
                    try:
                        with lease("job:1", store=mine, ttl=30, wait=0):
                            seen.append("acquired")  # would be the parent's key: a bug
                    except LockNotAcquiredError:
                        seen.append("held")
                    mine.release("job:1", make_owner())  # a fresh id of the child's
                    info = mine.get("job:1")
                    seen.append(None if info is None else info.owner)
                    return seen
                finally:
                    mine.close()

            report = _run_child(child)
            assert report == ["forked", "held", parent.owner]
            info = store.get("job:1")
            assert info is not None and info.owner == parent.owner and not parent.lost
        assert store.get("job:1") is None
    finally:
        store.close()


def test_a_child_forked_inside_a_locked_task_is_refused_the_same_key(tmp_path: Path) -> None:
    """A task body forks (multiprocessing with ``fork``); the child runs the same locked task
    with the same key. The child inherits the parent's running execution and lease frame, but
    must neither re-enter nor free them: it is refused, and the parent still holds the key."""
    from celery import Celery

    from celery_lease import LockedTask
    from celery_lease._celery import settings as config

    path = tmp_path / "leases.sqlite3"
    app = Celery("fork", set_as_current=False)
    app.conf.lease_store = f"sqlite:///{path}"
    outcome: dict[str, object] = {}

    @app.task(bind=True, base=LockedTask, lock_key="job:{n}", shared=False)
    def job(self: object, n: int, fork: bool) -> str:
        if not fork:
            return "child ran"  # reached only if the child got the key
        owner = self.request.lease.owner  # type: ignore[attr-defined]

        def child() -> list[object]:
            result = job.apply(args=(n, False))
            store = SQLiteLockStore(path)
            try:
                info = store.get(f"job:{n}")
                return [result.state, type(result.result).__name__, info and info.owner]
            finally:
                store.close()

        outcome["child"] = _run_child(child)
        outcome["owner"] = owner
        store = SQLiteLockStore(path)
        try:
            info = store.get(f"job:{n}")
            outcome["after"] = info and info.owner
        finally:
            store.close()
        return "parent ran"

    try:
        assert job.apply(args=(7, True)).get() == "parent ran"
    finally:
        config.reset(app)
    owner = outcome["owner"]
    assert outcome["child"] == ["FAILURE", "LockNotAcquiredError", owner]
    assert outcome["after"] == owner
