"""``celery_lease._celery.control``: the ``inspect leases`` command. Each process lists the leases
it holds; pool children serve theirs on a socket in a private directory, and a child that cannot
answer is listed as unanswered, never as holding nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from celery_lease import MemoryLockStore, lease
from celery_lease._celery import control


@pytest.fixture
def worker_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The socket directory as a worker's main process makes it; removed afterwards, and the
    module's globals put back."""
    monkeypatch.setattr(control, "_dir", None)
    monkeypatch.setattr(control, "_dir_pid", None)
    monkeypatch.setattr(control, "_server", None)
    control.prepare_main()
    assert control._dir is not None
    yield control._dir
    if control._server is not None:
        control._server.close()
    control.cleanup_main()


class TestSocketDirectory:
    def test_no_socket_outside_a_prepared_worker(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Before the main process prepared a directory there is no socket path, and a child
        serves nothing."""
        monkeypatch.setattr(control, "_dir", None)
        monkeypatch.setattr(control, "_server", None)
        assert control.socket_path(1234) is None
        control.serve_in_child()
        assert control._server is None

    def test_the_directory_is_private_and_removed_at_cleanup(self, worker_dir: str) -> None:
        """Mode 0700, one ``<pid>.sock`` per child in it, gone after cleanup_main()."""
        assert stat.S_IMODE(os.stat(worker_dir).st_mode) == 0o700
        assert control.socket_path(42) == os.path.join(worker_dir, "42.sock")
        control.cleanup_main()
        assert not os.path.exists(worker_dir) and control.socket_path(42) is None


class TestChildSnapshots:
    def test_a_serving_process_answers_with_its_leases(self, worker_dir: str) -> None:
        """A process serving on its socket answers with the rows of local_rows(): key, token
        and its pid."""
        control.serve_in_child()
        with lease("inspected", store=MemoryLockStore(), ttl=30) as held:
            rows, unanswered = control.child_snapshots([os.getpid()], timeout=10.0)
        assert unanswered == []
        (row,) = [r for r in rows if r["key"] == "inspected"]
        assert (row["token"], row["pid"], row["owner"]) == (held.token, os.getpid(), held.owner)

    def test_a_child_without_a_socket_is_unanswered(self, worker_dir: str) -> None:
        """A pid with no socket (a child that never served) is listed with the reason."""
        rows, unanswered = control.child_snapshots([999_999], timeout=1.0)
        assert rows == []
        assert [u["pid"] for u in unanswered] == [999_999]
        assert "cannot connect" in unanswered[0]["error"]

    def test_no_directory_is_unanswered_per_child(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a socket directory every child is unanswered, saying why."""
        monkeypatch.setattr(control, "_dir", None)
        rows, unanswered = control.child_snapshots([1, 2], timeout=1.0)
        assert rows == []
        assert unanswered == [
            {"pid": 1, "error": "no socket directory in this worker"},
            {"pid": 2, "error": "no socket directory in this worker"},
        ]

    def test_forget_child_removes_a_stale_socket_file(self, worker_dir: str) -> None:
        """A SIGKILLed child leaves its socket file; forgetting the child removes it."""
        path = control.socket_path(31337)
        assert path is not None
        open(path, "w").close()
        control.forget_child(31337)
        assert not os.path.exists(path)


class TestInspectCommand:
    def test_a_worker_running_tasks_in_process_answers_from_its_own_leases(self) -> None:
        """No prefork pool: the rows are this process's, sorted by key, none unanswered."""
        state = SimpleNamespace(consumer=SimpleNamespace(pool=None))
        store = MemoryLockStore()
        with lease("b-key", store=store, ttl=30), lease("a-key", store=store, ttl=30):
            answer = control.leases(state)
        keys = [row["key"] for row in answer["leases"]]
        assert keys.index("a-key") < keys.index("b-key")
        assert answer["unanswered"] == [] and answer["pool"] == ""


class TestSlotRows:
    def test_a_slot_is_its_key_and_its_slot(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A lease renewed under a slot's store key is listed as the key and its slot (the
        store's suffix never shown); a lease taken without a limit has slot ``None``."""
        from celery_lease._core.owners import make_owner
        from celery_lease.stores.slots import slot_key

        owner = make_owner(node="w1@h", task="t.pay", task_id="id-2")
        snapshot = [
            {"key": slot_key("pay:7", 2), "token": 12, "owner": owner, "held_seconds": 1.0},
            {"key": "pay:8", "token": 5, "owner": "o", "held_seconds": 1.0},
        ]
        monkeypatch.setattr(control.renewer, "snapshot", lambda: snapshot)
        rows = control.local_rows()
        assert [(r["key"], r["slot"], r["token"]) for r in rows] == [
            ("pay:7", 2, 12),
            ("pay:8", None, 5),
        ]
        assert (rows[0]["task"], rows[0]["task_id"]) == ("t.pay", "id-2")

    def test_rows_of_one_key_sort_by_slot(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``inspect leases`` sorts rows by key, then slot (a plain key before its slots), then
        pid: slot 10 after slot 9."""
        state = SimpleNamespace(consumer=SimpleNamespace(pool=None))
        rows: list[control.LeaseRow] = [
            _row("pay:7", 10, 1), _row("pay:7", 9, 2), _row("pay:7", None, 3), _row("pay:6", 0, 4),
        ]  # fmt: skip
        monkeypatch.setattr(control, "local_rows", lambda: rows)
        answer = control.leases(state)
        assert [(r["key"], r["slot"]) for r in answer["leases"]] == [
            ("pay:6", 0), ("pay:7", None), ("pay:7", 9), ("pay:7", 10),
        ]  # fmt: skip


def _row(key: str, slot: int | None, token: int) -> control.LeaseRow:
    return {
        "key": key, "slot": slot, "token": token, "task": None, "task_id": None, "label": None,
        "node": None, "pid": 1, "held_seconds": 0.0, "valid_for_seconds": 0.0, "renewals": 0,
        "last_renewal_error": None, "owner": None,
    }  # fmt: skip


def _serve_once(path: str, reply: bytes) -> threading.Thread:
    """A fake child: listens on ``path``, answers one client with ``reply`` and closes."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def answer() -> None:
        with server:
            conn, _ = server.accept()
            # The reader may close first (a reply too large).
            with conn, contextlib.suppress(OSError):
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


class TestAFaultyChild:
    """One child's bad answer is listed in ``unanswered``; the others' rows still come."""

    @pytest.mark.parametrize(
        ("reply", "why"),
        [
            pytest.param(b"\x00not json at all", "bad reply", id="not-json"),
            pytest.param(b"42", "bad reply", id="json-not-a-list"),
            pytest.param(b'["a row that is not an object"]', "bad reply", id="rows-not-objects"),
            pytest.param(b"[" + b" " * 2048 + b"]", "reply larger than", id="too-large"),
        ],
    )
    def test_a_bad_reply_is_unanswered_and_the_others_answer(
        self, worker_dir: str, monkeypatch: pytest.MonkeyPatch, reply: bytes, why: str
    ) -> None:
        monkeypatch.setattr(control, "_MAX_REPLY", 1024)
        control.serve_in_child()  # this process answers as a healthy child
        bad_pid = 777_777
        path = control.socket_path(bad_pid)
        assert path is not None
        fake = _serve_once(path, reply)
        with lease("inspected", store=MemoryLockStore(), ttl=30):
            rows, unanswered = control.child_snapshots([bad_pid, os.getpid()], timeout=10.0)
        fake.join(10.0)
        assert [r["key"] for r in rows] == ["inspected"]
        assert [u["pid"] for u in unanswered] == [bad_pid]
        assert why in unanswered[0]["error"]


class TestASlotHeldHere:
    def test_a_lease_held_in_a_slot_is_listed_with_its_key_and_slot(self) -> None:
        """``lease(key, limit=2)`` held in this process while another holder has slot 0: the
        row names the key, slot 1, its token and owner."""
        store = MemoryLockStore()
        store.acquire_slot("pay:7", "another-worker", 30_000, 2)
        state = SimpleNamespace(consumer=SimpleNamespace(pool=None))
        with lease("pay:7", store=store, ttl=30, limit=2) as held:
            answer = control.leases(state)
        (row,) = [r for r in answer["leases"] if r["key"] == "pay:7"]
        assert (row["slot"], row["token"], row["owner"]) == (1, held.token, held.owner)
