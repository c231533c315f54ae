"""Owner ids name their holder: ``lease(holder=...)``, the task node, name and id."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LockedTask, LockNotAcquiredError, MemoryLockStore, lease
from celery_lease._core.owners import (
    MAX_OWNER_FIELD_CHARS,
    is_queued_owner,
    make_owner,
    owner_field,
    owner_fields,
    parse_owner,
    queued_owner,
    set_node,
)
from celery_lease.stores.slots import marked
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT


class TestLeaseHolder:
    def test_the_label_is_recorded_in_the_owner(self) -> None:
        """``holder="nightly import"`` comes back from the owner id the store records."""
        store = MemoryLockStore()
        with lease("h", store=store, holder="nightly import") as held:
            info = store.get("h")
            assert info is not None and info.owner == held.owner
            assert parse_owner(info.owner).label == "nightly import"

    @pytest.mark.parametrize("bad", ["", 7, "x" * (MAX_OWNER_FIELD_CHARS + 1)])
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


class TestOwnerIds:
    def test_owner_ids_are_unique_across_threads(self) -> None:
        made: list[list[str]] = [[] for _ in range(8)]
        start = threading.Barrier(8)

        def make(out: list[str]) -> None:
            start.wait(REAL_TIMEOUT)
            out.extend(make_owner(task="t", task_id="same") for _ in range(5000))

        threads = [threading.Thread(target=make, args=(out,)) for out in made]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REAL_TIMEOUT)
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
            thread.join(REAL_TIMEOUT)
            assert len(second) == 1
            assert parse_owner(held.owner).task_id == "same-id"
            info = store.get("k")
            assert info is not None and info.owner == held.owner


class TestQueuedOwner:
    def test_a_label_is_read_back_and_the_owner_stays_a_queued_one(self) -> None:
        """queued_owner(..., label): a queued owner whose label parse_owner reads back; none
        without it; two owners made alike still differ (the nonce)."""
        owner = queued_owner("t.name", "id;1", 1234, "started")
        held = parse_owner(owner)
        assert is_queued_owner(owner)
        assert (held.task, held.task_id, held.label, held.taken_at) == (
            "t.name",
            "id;1",
            "started",
            1.234,
        )
        assert parse_owner(queued_owner("t.name", "id;1", 1234)).label is None
        assert queued_owner("t", "i", 1, "started") != queued_owner("t", "i", 1, "started")


class TestTtlAndCooldownInTheOwner:
    def test_the_ttl_and_the_cooldown_are_recorded(self) -> None:
        """The owner id of a lease records its ttl and cooldown (seconds once parsed): how long
        ago it was renewed is then its ttl minus the time the store says is left."""
        store = MemoryLockStore()
        with lease("t", store=store, ttl="45s", cooldown="250ms") as held:
            holder = parse_owner(held.owner)
        assert (holder.ttl, holder.cooldown) == (45.0, 0.25)

    def test_no_cooldown_is_not_recorded_and_old_owners_have_neither(self) -> None:
        store = MemoryLockStore()
        with lease("t", store=store, ttl="1s") as held:
            assert ";cd=" not in held.owner
            assert parse_owner(held.owner).cooldown is None
        old = parse_owner("host/1/abc;at=1733260000123")
        assert (old.ttl, old.cooldown) == (None, None)
        assert parse_owner(make_owner(ttl_ms=1500)).ttl == 1.5
        assert parse_owner("h/1/a;ttl=x").ttl is None  # never raises on a bad field


class TestReplaceTicket:
    def test_the_ticket_is_written_as_rt_and_read_back(self) -> None:
        """An ``on_held="replace"`` try's ticket is in its owner id (``rt``) and parsed back;
        other owner ids carry none."""
        assert parse_owner(make_owner(replace_ticket=1_700_000_123)).replace_ticket == (
            1_700_000_123
        )
        assert parse_owner(make_owner()).replace_ticket is None
        assert parse_owner("h/1/00;rt=x1").replace_ticket is None


ENCODE = str.maketrans({";": "%3B", "=": "%3D", "%": "%25", "/": "%2F"})


class TestOwnerFormat:
    """The exact text of an owner id, field by field (stores and older readers parse it)."""

    def _tail(self, owner: str) -> str:
        head, _, rest = owner.partition(";")
        host, pid, digits = head.split("/")
        assert (pid, len(digits)) == (str(os.getpid()), 16)
        assert host == socket.gethostname().translate(ENCODE)
        return ";" + rest if rest else ""

    def test_every_field_in_order_encoded(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(time, "time_ns", lambda: 1_733_260_000_123_456_789)
        made = make_owner(
            node="w1@host",
            task="a;b=c",
            task_id="x/y%z",
            label="l=1",
            ttl_ms=30000,
            cooldown_ms=5,
            replace_ticket=3,
        )
        assert self._tail(made) == (
            ";n=w1@host;t=a%3Bb%3Dc;i=x%2Fy%25z;l=l%3D1;ttl=30000;cd=5;rt=3;at=1733260000123"
        )

    @pytest.mark.parametrize(
        ("fields", "tail"),
        [
            ({}, ";at=7"),
            ({"node": "n"}, ";n=n;at=7"),
            ({"task": "t"}, ";t=t;at=7"),
            ({"task_id": "i"}, ";i=i;at=7"),
            ({"node": "n", "task": "t", "cooldown_ms": 0}, ";n=n;t=t;at=7"),
            ({"node": "a/b", "task": "t", "task_id": ""}, ";n=a%2Fb;t=t;i=;at=7"),
        ],
    )
    def test_left_out_fields_are_not_written(
        self, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any], tail: str
    ) -> None:
        monkeypatch.setattr(time, "time_ns", lambda: 7_000_000)
        set_node(None)  # outside a worker
        for _ in range(2):  # a second owner of the same node and task: the same text
            assert self._tail(make_owner(**fields)) == tail

    @pytest.mark.parametrize("name", ["node", "task", "task_id"])
    def test_a_bad_field_is_refused_after_good_ones(self, name: str) -> None:
        make_owner(node="n", task="t", task_id="i")
        with pytest.raises(TypeError, match=f"{name} must be a str"):
            make_owner(**{"node": "n", "task": "t", name: 7})
        with pytest.raises(ValueError, match=f"{name} is"):
            make_owner(**{"node": "n", "task": "t", name: "x" * (MAX_OWNER_FIELD_CHARS + 1)})

    def test_a_str_subclass_is_written_as_its_text(self) -> None:
        class Name(str):
            pass

        assert ";t=a%3Bb;" in make_owner(task=Name("a;b"))


class TestMarkedOwner:
    def test_a_marked_owner_reads_as_its_holder_asked_to_stop(self) -> None:
        """A holder asked to stop is stored as its owner id plus the replace mark: read back,
        every field is its own (``taken_at``, ``ttl`` included), ``raw`` is the owner id it
        holds under (what ``release`` takes) and ``replaced`` says it was asked."""
        owner = make_owner(node="w1@h", task="t", task_id="x", ttl_ms=30_000)
        plain, read = parse_owner(owner), parse_owner(marked(owner))
        assert read.taken_at is not None and read.taken_at == plain.taken_at
        assert (read.node, read.task, read.task_id, read.ttl) == ("w1@h", "t", "x", 30.0)
        assert read.raw == owner
        assert read.replaced and not plain.replaced


class TestOwnerFields:
    def test_short_strings_and_none_come_back_as_they_are(self) -> None:
        fields = ("node@host", None, "id-1")
        assert owner_fields(*fields) == fields

    @pytest.mark.parametrize(
        "fields",
        [
            ("n" * (MAX_OWNER_FIELD_CHARS + 1), "t", "i"),
            ("n", "t" * (MAX_OWNER_FIELD_CHARS + 5), None),
            (None, "t", 12345),
        ],
        ids=["long-node", "long-task", "int-id"],
    )
    def test_any_other_field_is_cut_as_owner_field_cuts_it(self, fields: tuple[Any, ...]) -> None:
        assert owner_fields(*fields) == tuple(owner_field(f) for f in fields)
