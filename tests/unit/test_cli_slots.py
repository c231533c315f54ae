"""What ``celery lease list/show/release`` show of a key's slots and of a replaced holder.

Slot ``i`` of a key is an ordinary lease on the store key ``slot_key(key, i)``, and a replaced
holder's stored owner id ends with ``REPLACED_MARK``: the leases are written here with the
store's plain ``acquire`` under those names, exactly as ``acquire_slot`` and ``mark_replaced``
leave them, so the CLI is checked on every store whether or not it takes slots itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from celery_lease import LockStore, store_from_url
from celery_lease._core.owners import make_owner
from celery_lease.cli import lease_group
from celery_lease.stores.slots import SLOT_MARK, marked, slot_key

TTL_MS = 60_000


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty shared store: an SQLite file, a throwaway redis-server, or the default table of
    the session's scratch PostgreSQL database (emptied for each test)."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "postgres":
        import psycopg

        dsn = str(request.getfixturevalue("pg_database_dsn"))
        store_from_url(dsn).release("init", "nobody")  # creates the table
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM celery_lease")
        return dsn
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    store_from_url(url).release("init", "nobody")  # creates the file
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[LockStore]:
    """A second client of the same store, as the holding processes have."""
    client = store_from_url(store_url)
    yield client
    close = getattr(client, "close", None)
    if close is not None:
        close()


def run(*args: str) -> Result:
    """Invoke the CLI in-process, keeping stdout and stderr apart."""
    return CliRunner().invoke(lease_group, list(args))


def table(result: Result) -> list[list[str]]:
    """The rows of ``list``'s table (header first), split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines()]


def listed(store_url: str, *args: str) -> list[dict[str, Any]]:
    result = run("list", "--json", *args, "--store", store_url)
    assert result.exit_code == 0, result.output
    records: list[dict[str, Any]] = json.loads(result.stdout)
    return records


def hold_slots(store: LockStore, key: str, *slots: int) -> dict[int, tuple[str, int]]:
    """Hold ``slots`` of ``key`` as ``acquire_slot`` leaves them: slot -> (owner, token)."""
    held = {}
    for slot in slots:
        owner = make_owner(node="w1@h", task="t.pay", task_id=f"id-{slot}")
        token = store.acquire(slot_key(key, slot), owner, TTL_MS)
        assert token is not None
        held[slot] = (owner, token)
    return held


class TestListSlots:
    def test_a_slot_is_listed_as_its_key_and_its_slot(self, store: LockStore, store_url: str):
        """Each live slot is one row: KEY is the key without the store's slot suffix, SLOT its
        slot; a plain key's SLOT is "-" (it is no slot: the key and its slots are separate)."""
        held = hold_slots(store, "pay:7", 0, 2)
        plain = store.acquire("pay:8", make_owner(task="t.pay", task_id="plain"), TTL_MS)
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        header, *rows = table(result)
        assert header[:3] == ["KEY", "SLOT", "STATE"]
        cells = [dict(zip(header, row, strict=True)) for row in rows]
        assert [(c["KEY"], c["SLOT"], c["TOKEN"]) for c in cells] == [
            ("pay:7", "0", str(held[0][1])),
            ("pay:7", "2", str(held[2][1])),
            ("pay:8", "-", str(plain)),
        ]
        assert SLOT_MARK not in result.stdout

    def test_no_slot_column_without_slots(self, store: LockStore, store_url: str):
        """Only plain keys held: the table has no SLOT column (the output of a store without
        slots is as it was)."""
        store.acquire("pay:8", "o", TTL_MS)
        header, _ = table(run("list", "--store", store_url))
        assert "SLOT" not in header

    def test_json_gives_slot_and_replaced(self, store: LockStore, store_url: str):
        """``--json``: ``key`` without the suffix, ``slot`` (``null`` for a plain key) and
        ``replaced`` (false unless the holder was asked to stop)."""
        held = hold_slots(store, "pay:7", 1)
        store.acquire("pay:8", "o", TTL_MS)
        records = listed(store_url)
        assert [(r["key"], r["slot"], r["replaced"], r["owner"]) for r in records] == [
            ("pay:7", 1, False, held[1][0]),
            ("pay:8", None, False, "o"),
        ]
        assert records[0]["task_id"] == "id-1"

    def test_prefix_finds_a_keys_slots(self, store: LockStore, store_url: str):
        """``--prefix KEY`` lists the key's slots (their store keys start with the key)."""
        hold_slots(store, "pay:7", 0, 1)
        hold_slots(store, "other", 0)
        assert [(r["key"], r["slot"]) for r in listed(store_url, "--prefix", "pay:")] == [
            ("pay:7", 0),
            ("pay:7", 1),
        ]


class TestReplacedHolder:
    def test_the_holder_is_shown_without_the_mark_and_replaced(
        self, store: LockStore, store_url: str
    ):
        """A holder asked to stop: its owner's fields read as before the mark (task, task id,
        node, taken at), the state says "replaced", ``--json`` has ``replaced: true`` and the
        owner without the mark."""
        owner = make_owner(node="w1@h", task="t.sync", task_id="old", ttl_ms=TTL_MS)
        token = store.acquire("sync:1", marked(owner), TTL_MS)
        (record,) = listed(store_url)
        assert (record["key"], record["owner"], record["replaced"]) == ("sync:1", owner, True)
        assert (record["task"], record["task_id"], record["node"]) == ("t.sync", "old", "w1@h")
        assert record["taken_at"] is not None and record["ttl"] == 60
        assert record["state"] == "held" and record["token"] == token
        header, row = table(run("list", "--store", store_url))
        cells = dict(zip(header, row, strict=True))
        assert cells["STATE"] == "held, replaced"
        assert cells["TASK ID"] == "old"
        assert SLOT_MARK not in run("list", "--store", store_url).stdout

    def test_task_filter_reads_the_replaced_owner(self, store: LockStore, store_url: str):
        """``--task`` matches a replaced holder by its task, as it did before the mark."""
        store.acquire("sync:1", marked(make_owner(task="t.sync", task_id="old")), TTL_MS)
        assert [r["key"] for r in listed(store_url, "--task", "t.sync")] == ["sync:1"]

    def test_show_says_replaced(self, store: LockStore, store_url: str):
        """``show KEY`` of a replaced holder says so in its first line and its fields."""
        owner = make_owner(node="w1@h", task="t.sync", task_id="old")
        store.acquire("sync:1", marked(owner), TTL_MS)
        result = run("show", "sync:1", "--store", store_url)
        assert result.exit_code == 0, result.output
        first, *fields = result.stdout.splitlines()
        assert first.startswith("sync:1: held (replaced) by task t.sync[old] on w1@h")
        lines = dict(re.split(r":\s+", line.strip(), maxsplit=1) for line in fields)
        assert lines["owner"] == owner
        assert lines["replaced"].startswith("yes")
        shown = json.loads(run("show", "sync:1", "--json", "--store", store_url).stdout)
        assert (shown["held"], shown["replaced"], shown["owner"]) == (True, True, owner)


class TestShowSlots:
    def test_every_live_slot_is_shown(self, store: LockStore, store_url: str):
        """``show KEY`` of a key with slots: one block per live slot (its slot, holder and
        token), none for the free plain key."""
        held = hold_slots(store, "pay:7", 0, 3)
        result = run("show", "pay:7", "--store", store_url)
        assert result.exit_code == 0, result.output
        heads = [line for line in result.stdout.splitlines() if not line.startswith("  ")]
        assert [h.split(": held")[0] for h in heads] == ["pay:7 slot 0", "pay:7 slot 3"]
        assert f"token {held[3][1]}" in heads[1]
        assert "task t.pay[id-3]" in heads[1]
        slots = re.findall(r"^  slot:\s+(\d+)$", result.stdout, re.M)
        assert slots == ["0", "3"]
        assert "free" not in result.stdout
        assert SLOT_MARK not in result.stdout

    def test_json_lists_the_slots_beside_the_plain_key(self, store: LockStore, store_url: str):
        """``show --json``: the plain key as before (here free) and ``slots``, the records
        ``list --json`` gives for each live slot."""
        held = hold_slots(store, "pay:7", 1, 2)
        shown = json.loads(run("show", "pay:7", "--json", "--store", store_url).stdout)
        assert (shown["key"], shown["held"]) == ("pay:7", False)
        assert [(s["key"], s["slot"], s["token"]) for s in shown["slots"]] == [
            ("pay:7", 1, held[1][1]),
            ("pay:7", 2, held[2][1]),
        ]
        assert shown["slots"] == [
            {**r, "held_seconds": s["held_seconds"], "expires_in": s["expires_in"]}
            for r, s in zip(listed(store_url), shown["slots"], strict=True)
        ]

    def test_a_plain_key_and_its_slots_are_both_shown(self, store: LockStore, store_url: str):
        """Held as a plain key and in slots (two uses of one name, which do not exclude each
        other): both are shown, the plain key first."""
        token = store.acquire("pay:7", "plain-owner", TTL_MS)
        hold_slots(store, "pay:7", 0)
        result = run("show", "pay:7", "--store", store_url)
        heads = [line for line in result.stdout.splitlines() if not line.startswith("  ")]
        assert heads[0].startswith(f"pay:7: held by plain-owner, token {token}")
        assert heads[1].startswith("pay:7 slot 0: held by task t.pay[id-0]")

    def test_another_keys_slots_are_not_shown(self, store: LockStore, store_url: str):
        """Slots of ``pay:70`` are not ``pay:7``'s: the key is free and says so."""
        hold_slots(store, "pay:70", 0)
        result = run("show", "pay:7", "--store", store_url)
        assert result.stdout.strip() == "pay:7: free (no token issued yet)"
        shown = json.loads(run("show", "pay:7", "--json", "--store", store_url).stdout)
        assert shown == {"key": "pay:7", "held": False, "last_token": None, "slots": []}


class TestReleaseSlot:
    def test_slot_option_force_releases_that_slot(self, store: LockStore, store_url: str):
        """``release KEY --slot N`` frees slot N of KEY alone."""
        held = hold_slots(store, "pay:7", 0, 1)
        result = run("release", "pay:7", "--slot", "1", "--yes", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"released pay:7 slot 1: owner {held[1][0]}")
        assert [(r["key"], r["slot"]) for r in listed(store_url)] == [("pay:7", 0)]

    def test_the_prompt_names_the_slot(self, store: LockStore, store_url: str):
        """Without ``--yes`` the prompt describes the slot; declining keeps it."""
        hold_slots(store, "pay:7", 2)
        result = run("release", "pay:7", "--slot", "2", "--store", store_url)
        assert "Force-release pay:7 slot 2: held by task t.pay[id-2]" in result.output
        assert [r["slot"] for r in listed(store_url)] == [2]

    def test_a_free_key_with_held_slots_names_them(self, store: LockStore, store_url: str):
        """``release KEY`` of a key held only in slots releases nothing and names the slots
        and the option that frees one."""
        hold_slots(store, "pay:7", 0, 2)
        result = run("release", "pay:7", "--yes", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == (
            "pay:7: free, nothing to release; its slots 0, 2 are held: release one with --slot N"
        )
        assert len(listed(store_url)) == 2

    def test_a_free_slot_releases_nothing(self, store: LockStore, store_url: str):
        hold_slots(store, "pay:7", 0)
        result = run("release", "pay:7", "--slot", "4", "--yes", "--store", store_url)
        assert result.stdout.strip() == "pay:7 slot 4: free, nothing to release"

    def test_a_negative_slot_is_refused(self, store_url: str):
        """A slot is 0 or more: click refuses anything else, naming the option."""
        result = run("release", "pay:7", "--slot", "-1", "--yes", "--store", store_url)
        assert result.exit_code == 2
        assert "--slot" in result.stderr
