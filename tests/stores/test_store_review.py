"""Findings of the hostile review of the SQLite, memory and PostgreSQL stores (issue 8).

Each test reproduces one way the stores broke a promise ("never two holders at once", "never a
password in a message") and failed before its fix.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores.base import store_from_url
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.stores.contract import DEADLINE, LONG_MS

_CLONE_NEWTIME = 0x80


def _read_line(fd: int) -> str:
    """One line a forked child wrote to ``fd``, within DEADLINE seconds."""
    data = b""
    deadline = time.monotonic() + DEADLINE
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the child said only {data!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 64)
            assert chunk, f"the child ended after saying {data!r}"
            data += chunk
    return data.decode().strip()


class _Child:
    """A forked child driven step by step over two pipes (``go()`` / ``said()``)."""

    def __init__(self) -> None:
        self._to_r, self._to_w = os.pipe()
        self._from_r, self._from_w = os.pipe()
        self.pid = -1

    def say(self, text: str) -> None:  # in the child
        os.write(self._from_w, f"{text}\n".encode())

    def wait_go(self) -> None:  # in the child
        os.read(self._to_r, 1)

    def go(self) -> None:
        os.write(self._to_w, b"g")

    def said(self) -> str:
        return _read_line(self._from_r)

    def in_child(self) -> None:
        os.close(self._to_w)  # so that the parent closing its end ends wait_go() with EOF
        os.close(self._from_r)

    def in_parent(self, pid: int) -> None:
        self.pid = pid
        os.close(self._to_r)
        os.close(self._from_w)

    def finish(self) -> None:
        """Let the child end (EOF on its pipe), reap it; kill it if it does not end in time."""
        os.close(self._to_w)
        os.close(self._from_r)
        deadline = time.monotonic() + DEADLINE
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise AssertionError("the forked child did not end")
            time.sleep(0.01)  # polling a child's exit with a deadline, not synchronising


@contextmanager
def _forked(body: object) -> Iterator[_Child]:
    """Run ``body(child)`` in a forked child; it ends with os._exit (never returns to pytest)."""
    child = _Child()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        child.in_child()
        code = 1
        try:
            body(child)  # type: ignore[operator]
            code = 0
        except BaseException as exc:
            child.say(f"error {exc!r}")
        finally:
            os._exit(code)
    child.in_parent(pid)
    try:
        yield child
    finally:
        child.finish()


class TestSQLiteAcrossFork:
    """A child forked from a process whose store had its connection open (prefork, multiprocessing,
    a daemon that forks and exits)."""

    def test_a_child_still_excludes_after_the_process_that_forked_it_closes(
        self, tmp_path: Path
    ) -> None:
        """The child's lease stays visible after its parent closed the file and another process
        came and went.

        Before the fix the child's new connection shared SQLite's in-process lock records with
        the inherited one, copied by fork() but not owned (POSIX locks are per process): the
        child held no lock on the file at all. Once the parent closed, the next process to close
        its connection believed itself the last one, checkpointed and deleted the WAL and shm
        files; the child went on committing to the deleted WAL, invisible to every other
        process, and a third process acquired the key the child held: two holders.
        """
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path)
        assert store.acquire("warm", "parent", LONG_MS) is not None  # the connection is open

        def child_body(child: _Child) -> None:
            assert store.acquire("child-warm", "child", LONG_MS) is not None
            child.say("ready")
            child.wait_go()
            child.say(str(store.acquire("k", "child", LONG_MS)))
            child.wait_go()

        with _forked(child_body) as child:
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

        def child_body(child: _Child) -> None:
            child.say(str(store.acquire("k", "child", LONG_MS)))

        with _forked(child_body) as child:
            assert child.said() == "None"
        assert store.acquire("k", "parent", LONG_MS) == token
        assert store.acquire("j", "parent", LONG_MS) is not None
        store.close()

    def test_an_unbounded_busy_timeout_still_closes_before_fork(self, tmp_path: Path) -> None:
        """busy_timeout=inf (wait for ever) is accepted; the fork hook must not overflow on it."""
        store = SQLiteLockStore(tmp_path / "leases.db", busy_timeout=float("inf"))
        assert store.acquire("k", "parent", LONG_MS) is not None

        def child_body(child: _Child) -> None:
            child.say(str(store.acquire("k", "child", LONG_MS)))

        with _forked(child_body) as child:
            assert child.said() == "None"
        assert store._conn is None  # closed before the fork, reopened on next use
        store.close()


class TestSQLiteTimeNamespace:
    def test_a_process_that_made_a_time_namespace_for_its_children_still_excludes(
        self, tmp_path: Path
    ) -> None:
        """A process that called unshare(CLONE_NEWTIME) stays in its own namespace.

        /proc/self/timens_offsets shows the offsets of the namespace its *children* will be in;
        before the fix the store subtracted them from the process's own (unshifted) monotonic
        clock: with an offset of +100000 s its 60 s lease read as expired a day ago to every
        other process, which acquired the key while it was held.
        """
        path = tmp_path / "leases.db"

        def child_body(child: _Child) -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(_CLONE_NEWTIME) != 0:
                child.say(f"skip unshare(CLONE_NEWTIME): errno {ctypes.get_errno()}")
                return
            with open("/proc/self/timens_offsets", "w", encoding="ascii") as file:
                file.write("monotonic 100000 0\n")
            store = SQLiteLockStore(path)
            child.say(str(store.acquire("k", "child", LONG_MS)))
            store.close()

        if not Path("/proc/self/timens_offsets").exists():
            pytest.skip("this kernel has no time namespaces")
        with _forked(child_body) as child:
            said = child.said()
        if said.startswith("skip"):
            pytest.skip(said)
        assert said.isdigit(), said
        store = SQLiteLockStore(path)
        try:
            info = store.get("k")
            assert info is not None and info.owner == "child"
            assert 50.0 < info.expires_in <= 60.0
            assert store.acquire("k", "parent", LONG_MS) is None, "two holders of 'k'"
        finally:
            store.close()


# Passwords in error messages ---------------------------------------------------------------------

SECRET = "s3cr3tPW"


class TestNoPasswordInMessages:
    """A store URL or DSN with a password never shows it in an error or a repr."""

    @pytest.mark.parametrize(
        "url",
        [
            f"postgress://app:{SECRET}@db.internal/prod",  # a typo in the scheme
            f"postgresql//app:{SECRET}@db.internal/prod",  # not a URL at all
            f"redis:/app:{SECRET}@cache/0",
        ],
    )
    def test_store_from_url_errors(self, url: str) -> None:
        with pytest.raises(LeaseConfigError) as caught:
            store_from_url(url)
        assert SECRET not in str(caught.value)
        assert "***" in str(caught.value)

    def test_a_lease_store_setting_that_is_not_a_url(self) -> None:
        from celery import Celery

        from celery_lease.config import get_settings

        app = Celery("review", set_as_current=False)
        app.conf.lease_store = f"app:{SECRET}@db.internal/prod"  # the scheme forgotten
        with pytest.raises(LeaseConfigError) as caught:
            get_settings(app)
        assert SECRET not in str(caught.value)

    @pytest.mark.parametrize(
        ("dsn", "secret"),
        [
            # libpq quotes the token it stopped at: part of the password
            ("host=db.internal password=se cretPW1 dbname=prod", "cretPW1"),
            ("host=db.internal password='secretPW2 dbname=prod", "secretPW2"),
            # a broken URL: libpq quotes all of it
            (f"postgresql://app:{SECRET}@[::1/prod", SECRET),
            ("postgresql://app:s%ZZcretPW3@db.internal/prod", "ZZcretPW3"),
            (f"postgresql://app:{SECRET}@db.internal/prod?bogus=1", SECRET),
        ],
    )
    def test_a_bad_dsn(self, dsn: str, secret: str) -> None:
        from celery_lease.stores.postgres import PostgresLockStore

        with pytest.raises(LeaseConfigError) as caught:
            PostgresLockStore(dsn)
        assert secret not in str(caught.value), str(caught.value)
        assert "not a valid PostgreSQL DSN" in str(caught.value)

    @pytest.mark.parametrize(
        "dsn",
        [
            "postgresql://app:pa@ssPW4@db.internal/prod",  # libpq: host 'ssPW4@db.internal'
            "postgresql://app:pa/ssPW4@db.internal/prod",  # libpq: host 'app', dbname 'ssPW4@...'
        ],
    )
    def test_a_url_with_an_unencoded_at_or_slash_in_the_password_is_refused(self, dsn: str) -> None:
        """libpq splits such a URL elsewhere and puts pieces of the password into the host or
        the database name, which every message and the repr then show: refused up front."""
        from celery_lease.stores.postgres import PostgresLockStore

        with pytest.raises(LeaseConfigError, match="percent-encode") as caught:
            PostgresLockStore(dsn)
        assert "ssPW4" not in str(caught.value)

    def test_a_connection_failure(self) -> None:
        """No server on the port: the error (a pool timeout with libpq's reason) hides it."""
        from celery_lease.stores.postgres import PostgresLockStore

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # bound, not listening: connections are refused
            for dsn in (
                f"postgresql://app:{SECRET}@127.0.0.1:{port}/prod",
                f"host=127.0.0.1 port={port} user=app password={SECRET} dbname=prod",
            ):
                store = PostgresLockStore(dsn, connect_timeout=0.5)
                try:
                    assert SECRET not in repr(store)
                    with pytest.raises(StoreUnavailableError) as caught:
                        store.acquire("k", "a", 1000)
                    assert SECRET not in str(caught.value)
                    assert "refused" in str(caught.value) or "no connection" in str(caught.value)
                finally:
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
        in-process lock records said "this process holds the write lock": the child's own
        connection then waited for it forever (``StoreUnavailableError`` after busy_timeout),
        and it held no lock on the file either.
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

        original = SQLiteLockStore._close_for_fork

        def close_for_fork(self: SQLiteLockStore) -> None:
            forking.set()
            original(self)

        monkeypatch.setattr(SQLiteLockStore, "_close_for_fork", close_for_fork)
        caller = threading.Thread(target=store._run, args=("slow call", slow_call))
        caller.start()
        assert inside.wait(DEADLINE)
        releaser = threading.Thread(target=lambda: forking.wait(DEADLINE) and proceed.set())
        releaser.start()

        def child_body(child: _Child) -> None:
            token = store.acquire("child", "child", LONG_MS)
            holds = bool(_locks_of(os.getpid()))
            child.say(f"{token} {holds}")

        try:
            with _forked(child_body) as child:
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
