"""An SQLite store's connection across fork(): a child never copies SQLite's records of a file
in use or half closed (a call in flight, a close, a store the garbage collector drops, one made
while the fork runs)."""

from __future__ import annotations

import gc
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores import _sqlite_connections as connections_module
from celery_lease.stores._sqlite_connections import Connection
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.stores.contract import DEADLINE, LONG_MS
from tests.stores.forked_child import Child, forked
from tests.support import REPO_ROOT


class TestSQLiteAcrossFork:
    """A child forked from a process whose store had its connection open (prefork, multiprocessing,
    a daemon that forks and exits)."""

    def test_a_child_still_excludes_after_the_process_that_forked_it_closes(
        self, tmp_path: Path
    ) -> None:
        """The child's lease stays visible after its parent closed the file and another process
        came and went.

        A child's new connection must not share SQLite's in-process lock records with the
        inherited one, copied by fork() but not owned (POSIX locks are per process): the child
        would hold no lock on the file at all. Once the parent closed, the next process to close
        its connection would believe itself the last one, checkpoint and delete the WAL and shm
        files; the child would go on committing to the deleted WAL, invisible to every other
        process, and a third process would acquire the key the child held: two holders.
        """
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path)
        assert store.acquire("warm", "parent", LONG_MS) is not None  # the connection is open

        def child_body(child: Child) -> None:
            assert store.acquire("child-warm", "child", LONG_MS) is not None
            child.say("ready")
            child.wait_go()
            child.say(str(store.acquire("k", "child", LONG_MS)))
            child.wait_go()

        with forked(child_body) as child:
            assert child.said() == "ready"
            store.close()  # the parent is done with the file (or exits)
            # Another process (here: this one, with no connection left) opens and closes it.
            other = SQLiteLockStore(path)
            assert other.acquire("other", "other", LONG_MS) is not None
            other.close()
            child.go()
            token = child.said()
            assert token.isdigit(), token
            third = SQLiteLockStore(path)
            try:
                info = third.get("k")
                assert info is not None and info.owner == "child", "the child's lease is invisible"
                assert third.acquire("k", "third", LONG_MS) is None, "two holders of 'k'"
            finally:
                third.close()

    def test_the_parent_reopens_after_a_fork(self, tmp_path: Path) -> None:
        """The parent keeps working after a fork (its connection is reopened on next use)."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        token = store.acquire("k", "parent", LONG_MS)
        assert token is not None

        def child_body(child: Child) -> None:
            child.say(str(store.acquire("k", "child", LONG_MS)))

        with forked(child_body) as child:
            assert child.said() == "None"
        assert store.acquire("k", "parent", LONG_MS) == token
        assert store.acquire("j", "parent", LONG_MS) is not None
        store.close()

    def test_an_unbounded_busy_timeout_still_closes_before_fork(self, tmp_path: Path) -> None:
        """busy_timeout=inf (wait for ever) is accepted; the fork hook must not overflow on it."""
        store = SQLiteLockStore(tmp_path / "leases.db", busy_timeout=float("inf"))
        assert store.acquire("k", "parent", LONG_MS) is not None

        def child_body(child: Child) -> None:
            child.say(str(store.acquire("k", "child", LONG_MS)))

        with forked(child_body) as child:
            assert child.said() == "None"
        assert store._conn is None  # closed before the fork, reopened on next use
        store.close()


def _locks_of(pid: int) -> list[str]:
    """The POSIX locks ``pid`` holds (from /proc/locks)."""
    with open("/proc/locks", encoding="ascii") as file:
        return [line for line in file if line.split()[4] == str(pid)]


class TestSQLiteForkDuringACall:
    def test_a_fork_while_another_thread_is_inside_a_transaction_waits_for_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """fork() waits for a call in flight on another thread, then the child works normally.

        Forked in the middle of that thread's write transaction, the child's copy of SQLite's
        in-process lock records would say "this process holds the write lock": the child's own
        connection would wait for it forever (``StoreUnavailableError`` after busy_timeout), and
        it would hold no lock on the file either.
        """
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path, busy_timeout=1.0)
        assert store.acquire("warm", "parent", LONG_MS) is not None
        inside, proceed, forking = threading.Event(), threading.Event(), threading.Event()

        def slow_call(conn: sqlite3.Connection) -> None:
            with store._write(conn):
                conn.execute("UPDATE celery_lease SET token = token + 1 WHERE key = 'warm'")
                inside.set()
                assert proceed.wait(DEADLINE)

        original = Connection.close_for_fork

        def close_for_fork(self: Connection) -> bool:
            forking.set()
            return original(self)

        monkeypatch.setattr(Connection, "close_for_fork", close_for_fork)
        caller = threading.Thread(target=store._run, args=("slow call", slow_call))
        caller.start()
        assert inside.wait(DEADLINE)
        releaser = threading.Thread(target=lambda: forking.wait(DEADLINE) and proceed.set())
        releaser.start()

        def child_body(child: Child) -> None:
            token = store.acquire("child", "child", LONG_MS)
            holds = bool(_locks_of(os.getpid()))
            child.say(f"{token} {holds}")

        try:
            with forked(child_body) as child:
                said = child.said()
        finally:
            proceed.set()
            caller.join(DEADLINE)
            releaser.join(DEADLINE)
        token, _, holds = said.partition(" ")
        assert token.isdigit(), said
        assert holds == "True", "the child holds no lock on the file"
        assert store.get("child") is not None
        store.close()


class _ClosingRecorder:
    """Stands in for a store's connection: ``close()`` records whether the store's lock (the one a
    fork waits for) was held, then closes the real connection."""

    def __init__(self, store: SQLiteLockStore, real: sqlite3.Connection) -> None:
        self._lock, self._real = store._lock, real  # not the store: dropping it must drop it
        self.closed_under_lock: bool | None = None

    def close(self) -> None:
        self.closed_under_lock = self._lock.locked()
        self._real.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class TestSQLiteForkDuringAClose:
    """A fork while another thread closes a connection: the child must not copy SQLite's records
    of a file half closed, or its own connections find the file locked for ever."""

    def test_close_closes_the_connection_under_the_lock_a_fork_waits_for(
        self, tmp_path: Path
    ) -> None:
        store = SQLiteLockStore(tmp_path / "leases.db")
        assert store.get("k") is None  # the connection is open
        recorder = _ClosingRecorder(store, store._conn)  # type: ignore[arg-type]
        store._conn = recorder  # type: ignore[assignment]
        store.close()
        assert recorder.closed_under_lock is True, "closed after the lock was let go"

    def test_a_store_dropped_open_closes_its_connection_under_its_lock(
        self, tmp_path: Path
    ) -> None:
        store = SQLiteLockStore(tmp_path / "leases.db")
        assert store.get("k") is None
        recorder = _ClosingRecorder(store, store._conn)  # type: ignore[arg-type]
        store._conn = recorder  # type: ignore[assignment]
        del store  # the last reference: the connection closes when the store goes
        assert recorder.closed_under_lock is True, "the connection was not closed by the store"

    def test_children_forked_while_another_thread_closes_a_store_can_write(
        self, tmp_path: Path
    ) -> None:
        """Each round: a thread reads through a new store and closes it while this thread forks;
        the child writes through a store of its own. The unlucky timing is left to chance; on a
        close made outside the store's lock about one child in ten found the file locked."""
        path = tmp_path / "leases.db"
        holder = SQLiteLockStore(path, busy_timeout=1.0)
        assert holder.acquire("k", "holder", LONG_MS) is not None
        failures: list[str] = []
        for round_ in range(100):
            store = SQLiteLockStore(path, busy_timeout=1.0)
            answered = threading.Event()

            def read_then_close(
                store: SQLiteLockStore = store, answered: threading.Event = answered
            ) -> None:
                store.get("k")
                answered.set()
                store.close()

            closer = threading.Thread(target=read_then_close)
            closer.start()
            assert answered.wait(DEADLINE)

            def child_body(child: Child, round_: int = round_) -> None:
                own = SQLiteLockStore(path, busy_timeout=1.0)
                child.say(str(own.acquire(f"child-{round_}", "child", LONG_MS)))

            with forked(child_body) as child:
                said = child.said()
            closer.join(DEADLINE)
            if not said.isdigit():
                failures.append(f"round {round_}: {said}")
        holder.close()
        assert not failures, failures

    def test_a_fork_waits_for_a_store_in_a_reference_cycle_closing_in_the_garbage_collector(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The garbage collector clears a cycle's weak references before it calls ``__del__``:
        the fork must still find the store's open connection (it is held strongly while open)
        and wait for its close."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        assert store.get("k") is None  # the connection is open
        store.me = store  # type: ignore[attr-defined]  # e.g. an app object pointing back at it
        blocking = _BlockingClose(store._conn)  # type: ignore[arg-type]
        store._conn = blocking  # type: ignore[assignment]
        wanted = id(store._connection)  # no reference: only its open connection may keep it
        box = [store]
        del store
        reached = threading.Event()
        original = Connection.close_for_fork

        def close_for_fork(self: Connection) -> bool:
            if id(self) == wanted:
                reached.set()  # the fork is about to wait for this store's lock
            return original(self)

        monkeypatch.setattr(Connection, "close_for_fork", close_for_fork)

        def drop() -> None:
            box.clear()  # only the cycle is left: __del__ runs in gc.collect(), in this thread
            gc.collect()

        releaser = threading.Thread(target=lambda: reached.wait(DEADLINE) and blocking.go.set())
        dropper = threading.Thread(target=drop)
        enabled = gc.isenabled()
        gc.disable()  # the collection runs in the dropper, not at some allocation of this test
        try:
            dropper.start()
            assert blocking.in_close.wait(DEADLINE), "the dropped store never closed"
            releaser.start()

            def child_body(child: Child) -> None:
                child.say(str(blocking.closed))

            with forked(child_body) as child:
                said = child.said()
        finally:
            blocking.go.set()
            dropper.join(DEADLINE)
            if releaser.is_alive() or releaser.ident is not None:
                releaser.join(DEADLINE)
            if enabled:
                gc.enable()
        assert said == "True", "the fork copied the process in the middle of the close"

    def test_a_store_made_while_the_fork_closes_the_others_waits_for_the_fork(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Another thread makes and opens a store while the before-fork hook closes the known
        ones: it waits until the child exists, so the child copies none of its connection."""
        path = tmp_path / "leases.db"
        first = SQLiteLockStore(path)
        assert first.get("k") is None
        settled = threading.Condition()
        events: list[str] = []

        def note(event: str) -> None:
            with settled:
                events.append(event)
                settled.notify_all()

        monkeypatch.setattr(
            connections_module,
            "_CREATING",
            _NotingLock(connections_module._CREATING, lambda: note("waits to be made")),
        )
        made: list[SQLiteLockStore] = []

        def make_and_open() -> None:
            made.append(SQLiteLockStore(path))
            made[0].get("k")
            note("opened")

        opener = threading.Thread(target=make_and_open)
        original = Connection.close_for_fork

        def close_for_fork(self: Connection) -> bool:
            if self is first._connection and opener.ident is None:
                opener.start()  # a store the hook has not seen
                with settled:
                    assert settled.wait_for(lambda: events, DEADLINE)
            return original(self)

        monkeypatch.setattr(Connection, "close_for_fork", close_for_fork)

        def child_body(child: Child) -> None:
            child.say(",".join(events))

        try:
            with forked(child_body) as child:
                said = child.said()
        finally:
            opener.join(DEADLINE)
        assert said == "waits to be made", said
        assert events == ["waits to be made", "opened"]
        first.close()
        made[0].close()

    def test_the_garbage_collector_closing_a_store_inside_the_fork_hook_does_not_block_it(
        self, tmp_path: Path
    ) -> None:
        """A collection can run at any allocation, also in the forking thread while it holds a
        store's lock: the ``__del__`` of that store (in a cycle) must not wait for the lock.
        In a fresh interpreter: a hook that does wait would hold its locks for ever."""
        done = subprocess.run(
            [sys.executable, "-c", _COLLECTED_IN_THE_HOOK, str(tmp_path)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=DEADLINE * 3,
            check=False,
        )
        assert done.returncode == 0 and "forked" in done.stdout, done.stdout + done.stderr

    def test_a_store_used_by_the_thread_running_the_fork_hooks_is_refused(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Another before-fork hook (or a ``__del__``) using a store while ours runs: refused,
        instead of opening a connection the child would copy or waiting for a lock the hook
        holds."""
        path = tmp_path / "leases.db"
        first = SQLiteLockStore(path)
        assert first.get("k") is None
        outcomes: list[str] = []
        original = Connection.close_for_fork

        def close_for_fork(self: Connection) -> bool:
            if self is first._connection and not outcomes:
                try:
                    SQLiteLockStore(path).get("k")
                    outcomes.append("opened")
                except StoreUnavailableError as exc:
                    outcomes.append(str(exc))
            return original(self)

        monkeypatch.setattr(Connection, "close_for_fork", close_for_fork)

        def child_body(child: Child) -> None:
            child.say("forked")

        with forked(child_body) as child:
            assert child.said() == "forked"
        assert len(outcomes) == 1 and "fork hooks" in outcomes[0], outcomes
        assert first.get("k") is None  # after the fork, the same thread may use stores again
        first.close()

    def test_a_close_whose_cursor_raises_still_closes_the_connection(self, tmp_path: Path) -> None:
        store = SQLiteLockStore(tmp_path / "leases.db")
        assert store.get("k") is None
        real = store._conn
        assert real is not None
        store._cursor = _RaisingClose()  # type: ignore[assignment]
        with pytest.raises(sqlite3.ProgrammingError):
            store.close()
        assert store._conn is None
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            real.execute("SELECT 1")


class _BlockingClose:
    """Stands in for a store's connection: ``close()`` says it started, waits to be let go, then
    closes the real connection and says so."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self._real = real
        self.in_close, self.go = threading.Event(), threading.Event()
        self.closed = False

    def close(self) -> None:
        self.in_close.set()
        assert self.go.wait(DEADLINE)
        self._real.close()
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _NotingLock:
    """Stands in for a lock: an acquire that would wait calls ``noted()`` first."""

    def __init__(self, real: Any, noted: Callable[[], None]) -> None:
        self._real, self._noted = real, noted

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._real.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self._noted()
        return bool(self._real.acquire(True, timeout))

    def release(self) -> None:
        self._real.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _RaisingClose:
    def close(self) -> None:
        raise sqlite3.ProgrammingError("Cannot operate on a closed cursor.")


# Runs in a fresh interpreter with a directory as its argument; prints "forked" when the fork
# completed although the garbage collector closed a store in the hook's thread.
_COLLECTED_IN_THE_HOOK = textwrap.dedent(
    """
    import gc, os, sys
    from celery_lease.stores._sqlite_connections import Connection
    from celery_lease.stores.sqlite import SQLiteLockStore

    store = SQLiteLockStore(os.path.join(sys.argv[1], "leases.db"))
    assert store.get("k") is None
    store.me = store  # a cycle: only the garbage collector frees it
    wanted = id(store._connection)
    del store
    original = Connection.close

    def close(self):
        if id(self) == wanted and self.lock.locked():
            gc.collect()  # the store's __del__ runs here, in the thread holding its lock
        original(self)

    Connection.close = close
    gc.disable()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    print("forked")
    """
)
