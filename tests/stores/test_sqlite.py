"""The SQLite store runs the store contract, plus what only a file can show."""

from __future__ import annotations

import functools
import multiprocessing
import os
import sqlite3
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores.base import (
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
    store_from_url,
)
from celery_lease.stores.sqlite import SQLiteLockStore
from celery_lease.testing import FakeClock
from tests.stores.contract import LONG_MS, StoreContract


class TestSQLiteStore(StoreContract):
    """SQLiteLockStore on a FakeClock, one new file per store."""

    stateful_examples = 20

    @pytest.fixture
    def store_backend(self, tmp_path: Path) -> None:
        self.directory = tmp_path
        self.count = 0

    def make_store(self) -> LockStore:
        self.count += 1
        self.path = self.directory / f"leases-{self.count}.db"
        return SQLiteLockStore(self.path, clock=self.clock)

    def store_factory(self) -> Callable[[], LockStore]:
        return functools.partial(SQLiteLockStore, str(self.path))


def _acquire_in_child(path: str, key: str, results: multiprocessing.Queue[object]) -> None:
    store = SQLiteLockStore(path)
    try:
        results.put(store.acquire(key, f"child-{os.getpid()}", LONG_MS))
    finally:
        store.close()


def _first_acquire_in_child(
    path: str, key: str, barrier: threading.Barrier, results: multiprocessing.Queue[object]
) -> None:
    store = SQLiteLockStore(path)
    barrier.wait()
    try:
        results.put(store.acquire(key, "o", LONG_MS))
    except Exception as exc:
        results.put(repr(exc))


class TestFreshFileRace:
    def test_processes_opening_a_new_file_at_once_all_succeed(self, tmp_path: Path) -> None:
        """Processes whose first acquire hits a brand-new file together never see "locked".

        SQLite answers some collisions of the WAL switch and the schema creation with an
        immediate "database is locked"; before the store retried its set-up, about 2 % of such
        first acquires failed (seen on prefork children starting together).
        """
        ctx = multiprocessing.get_context("fork")
        failures: list[object] = []
        for round_ in range(20):
            path = str(tmp_path / f"fresh-{round_}.db")
            barrier = ctx.Barrier(8)
            results: multiprocessing.Queue[object] = ctx.Queue()
            children = [
                ctx.Process(target=_first_acquire_in_child, args=(path, f"k{i}", barrier, results))
                for i in range(8)
            ]
            for child in children:
                child.start()
            outcomes = [results.get(timeout=30) for _ in children]
            for child in children:
                child.join(30)
            failures += [o for o in outcomes if not isinstance(o, int)]
        assert failures == []


class TestSQLiteFile:
    """Behaviour tied to the database file."""

    def test_capabilities(self, tmp_path: Path) -> None:
        """The store renews in batches and is inspectable, but has no release notification."""
        store = SQLiteLockStore(tmp_path / "x.db")
        assert isinstance(store, SupportsBatchRenew)
        assert isinstance(store, SupportsInspection)
        assert not isinstance(store, SupportsReleaseNotify)

    def test_tokens_persist_across_reopening_the_file(self, tmp_path: Path) -> None:
        """A new store on the same file continues the token counter, even with the clock behind."""
        path = tmp_path / "leases.db"
        first = SQLiteLockStore(path, clock=FakeClock(2000.0))
        token = first.acquire("k", "a", 1000)
        assert token is not None
        first.release("k", "a")
        first.close()
        again = SQLiteLockStore(path, clock=FakeClock(1000.0))  # its clock floor is lower
        assert again.last_token("k") == token
        assert again.acquire("k", "b", 1000) == token + 1
        again.close()

    def test_held_lease_survives_reopening(self, tmp_path: Path) -> None:
        """A lease written by one store is seen, and respected, by a new store on the file."""
        clock = FakeClock(1000.0)
        path = tmp_path / "leases.db"
        first = SQLiteLockStore(path, clock=clock)
        assert first.acquire("k", "a", 5000) is not None
        first.close()
        again = SQLiteLockStore(path, clock=clock)
        assert again.acquire("k", "b", 1000) is None
        assert again.renew("k", "a", 1000) is True

    def test_file_is_created_owner_only_in_a_new_directory(self, tmp_path: Path) -> None:
        """The parent directory is created and the database file gets mode 0o600."""
        path = tmp_path / "new" / "dir" / "leases.db"
        old_umask = os.umask(0)
        try:
            store = SQLiteLockStore(path)
            assert store.acquire("k", "a", 1000) is not None
        finally:
            os.umask(old_umask)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        store.close()

    def test_database_is_in_wal_mode(self, tmp_path: Path) -> None:
        """The store switches the file to WAL so readers never block writers."""
        path = tmp_path / "leases.db"
        SQLiteLockStore(path).acquire("k", "a", 1000)
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    def test_works_across_processes(self, tmp_path: Path) -> None:
        """A lease held by this process blocks a child process, and the child sees the release."""
        path = str(tmp_path / "leases.db")
        store = SQLiteLockStore(path)
        token = store.acquire("k", "parent", LONG_MS)
        assert token is not None
        ctx = multiprocessing.get_context("fork")
        results: multiprocessing.Queue[object] = ctx.Queue()
        child = ctx.Process(target=_acquire_in_child, args=(path, "k", results))
        child.start()
        assert results.get(timeout=10) is None
        child.join(10)
        store.release("k", "parent")
        child = ctx.Process(target=_acquire_in_child, args=(path, "k", results))
        child.start()
        child_token = results.get(timeout=10)
        child.join(10)
        assert isinstance(child_token, int) and child_token > token

    def test_store_used_before_fork_works_in_the_child(self, tmp_path: Path) -> None:
        """A store opened in the parent opens its own connection in a forked child."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        assert store.acquire("parent", "p", LONG_MS) is not None
        ctx = multiprocessing.get_context("fork")
        results: multiprocessing.Queue[object] = ctx.Queue()

        def child() -> None:
            results.put((store.acquire("child", "c", LONG_MS), store.acquire("parent", "c", 1)))

        process = ctx.Process(target=child)
        process.start()
        token, refused = results.get(timeout=10)
        process.join(10)
        assert process.exitcode == 0
        assert isinstance(token, int) and refused is None
        assert store.get("child") is not None  # the parent's connection still works
        store.close()

    def test_threads_share_the_store(self, tmp_path: Path) -> None:
        """Many threads using one store see a consistent counter (no lost updates)."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        tokens: list[int] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            for j in range(10):
                token = store.acquire(f"k{j}", f"t{i}-{j}", LONG_MS)
                if token is not None:
                    store.release(f"k{j}", f"t{i}-{j}")
                    with lock:
                        tokens.append(token)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert len(tokens) == len(set(tokens)) >= 10

    def test_a_locked_file_raises_store_unavailable_after_busy_timeout(
        self, tmp_path: Path
    ) -> None:
        """A writer blocked past busy_timeout gets StoreUnavailableError with sqlite3's error."""
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path, busy_timeout=0.05)
        assert store.acquire("k", "a", 1000) is not None
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StoreUnavailableError) as caught:
                store.acquire("j", "a", 1000)
            assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert store.acquire("j", "a", 1000) is not None

    def test_unwritable_location_raises_store_unavailable(self, tmp_path: Path) -> None:
        """A path under a regular file cannot be created: StoreUnavailableError, cause chained."""
        blocker = tmp_path / "file"
        blocker.write_text("")
        store = SQLiteLockStore(blocker / "leases.db")
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("k", "a", 1000)
        assert isinstance(caught.value.__cause__, OSError)


class TestSQLiteConfig:
    """Construction and URLs."""

    @pytest.mark.parametrize("path", ["", "  ", ":memory:", "file:x.db?mode=memory", 3, None])
    def test_bad_path_is_refused(self, path: object) -> None:
        """A path that is not a shareable file raises LeaseConfigError naming ``path``."""
        with pytest.raises(LeaseConfigError, match="path="):
            SQLiteLockStore(path)  # type: ignore[arg-type]

    def test_directory_path_is_refused(self, tmp_path: Path) -> None:
        """A directory is not a database file."""
        with pytest.raises(LeaseConfigError, match="directory"):
            SQLiteLockStore(tmp_path)

    @pytest.mark.parametrize("value", [0, -1, "5", True])
    def test_bad_busy_timeout_is_refused(self, tmp_path: Path, value: object) -> None:
        """busy_timeout must be a positive number of seconds."""
        with pytest.raises(LeaseConfigError, match="busy_timeout="):
            SQLiteLockStore(tmp_path / "x.db", busy_timeout=value)  # type: ignore[arg-type]

    def test_three_slashes_give_a_relative_path(self) -> None:
        """sqlite:///rel/x.db is relative to the working directory."""
        assert SQLiteLockStore.from_url("sqlite:///rel/x.db").path == "rel/x.db"

    def test_four_slashes_give_an_absolute_path(self, tmp_path: Path) -> None:
        """sqlite:////abs/x.db is absolute, and store_from_url builds the same store."""
        store = store_from_url(f"sqlite:///{tmp_path}/x.db")
        assert isinstance(store, SQLiteLockStore)
        assert store.path == f"{tmp_path}/x.db"
        assert store.acquire("k", "a", 1000) is not None

    def test_url_options(self) -> None:
        """busy_timeout is read from the query; percent-escapes are decoded."""
        store = SQLiteLockStore.from_url("sqlite:////tmp/a%20b.db?busy_timeout=2.5")
        assert store.path == "/tmp/a b.db"
        assert store._busy_timeout == 2.5

    @pytest.mark.parametrize(
        "url",
        [
            "sqlite://host/x.db",
            "sqlite:///",
            "sqlite:///x.db?timeout=1",
            "sqlite:///x.db?busy_timeout=soon",
            "postgresql:///x",
        ],
    )
    def test_bad_urls_are_refused(self, url: str) -> None:
        """Other URL forms raise LeaseConfigError naming the URL."""
        with pytest.raises(LeaseConfigError, match=r"url=|path="):
            SQLiteLockStore.from_url(url)
