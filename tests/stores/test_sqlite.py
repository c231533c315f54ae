"""The SQLite store runs the store contract, plus what only a file can show."""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores import store_from_url
from celery_lease.stores.base import (
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
)
from celery_lease.stores.slots import slot_key
from celery_lease.stores.sqlite import SQLiteLockStore
from celery_lease.testing import FakeClock
from tests.stores.contract import DEADLINE, LONG_MS, StoreContract, WallSteppingClock
from tests.stores.forked_child import Child, forked
from tests.stores.slot_contract import ReplaceContract, SlotContract
from tests.stores.sql_slots import SqlSlotChecks


class TestSQLiteStore(SlotContract, ReplaceContract, StoreContract):
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


class TestSQLiteStoreWithoutReturning(TestSQLiteStore):
    """The contract again on the acquire for SQLite older than 3.35.5 (SELECT + write in one
    ``BEGIN IMMEDIATE`` transaction instead of one ``INSERT ... RETURNING``)."""

    stateful_examples = 10

    def make_store(self) -> LockStore:
        store = super().make_store()
        assert isinstance(store, SQLiteLockStore)
        store._returning = False
        return store


def _sql(path: Path, statement: str, params: tuple[object, ...]) -> None:
    with sqlite3.connect(path) as conn:
        assert conn.execute(statement, params).rowcount == 1


class TestSQLiteSlots(SqlSlotChecks):
    """Slots and replace on an SQLite file (a fake clock in this process, real in children)."""

    @pytest.fixture
    def slot_store(self, tmp_path: Path) -> Iterator[SQLiteLockStore]:
        self.path = tmp_path / "leases.db"
        store = SQLiteLockStore(self.path, clock=FakeClock(1000.0))
        try:
            yield store
        finally:
            store.close()

    def make_expired(self, store: Any, store_key: str) -> None:
        _sql(
            self.path,
            "UPDATE celery_lease SET expires_ms = 0, boot_expires_ms = 0 WHERE key = ?",
            (store_key,),
        )

    def set_token(self, store: Any, store_key: str, token: int) -> None:
        _sql(self.path, "UPDATE celery_lease SET token = ? WHERE key = ?", (token, store_key))

    def slot_store_factory(self) -> Callable[[], Any]:
        return functools.partial(SQLiteLockStore, str(self.path))

    def unreachable_store(self, tmp_path: Path) -> Any:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        return SQLiteLockStore(blocker / "leases.db")


class TestSQLiteSlotsWithoutReturning(TestSQLiteSlots):
    """The same on the plain acquire for SQLite older than 3.35.5."""

    @pytest.fixture
    def slot_store(self, tmp_path: Path) -> Iterator[SQLiteLockStore]:
        self.path = tmp_path / "leases.db"
        store = SQLiteLockStore(self.path, clock=FakeClock(1000.0))
        store._returning = False
        try:
            yield store
        finally:
            store.close()


class TestSQLiteHotPath:
    """The plain acquire and release stay one statement each, slots and tickets or not."""

    def test_acquire_and_release_are_one_statement_each(self, tmp_path: Path) -> None:
        """Also on a key with a ticket row: the ticket is read inside the acquire's statement."""
        store = SQLiteLockStore(tmp_path / "leases.db", clock=FakeClock(1000.0))
        try:
            assert store.acquire("k", "h", LONG_MS) is not None
            store.mark_replaced("k")  # a ticket row now exists for k
            store.release("k", "h")
            sent: list[str] = []
            assert store._conn is not None
            store._conn.set_trace_callback(sent.append)
            for owner in ("a", "b"):
                assert store.acquire("k", owner, LONG_MS) is not None
                store.release("k", owner)
            store._conn.set_trace_callback(None)
        finally:
            store.close()
        assert len(sent) == 4, sent
        assert [s.split()[0] for s in sent] == ["INSERT", "UPDATE", "INSERT", "UPDATE"]
        assert not [s for s in sent if "SELECT" in s.upper()], sent  # no other row is read


class TestSQLiteSlotBoots:
    """Slot rows follow the boot id as a key's row does."""

    def test_slots_written_in_another_boot_are_free(self, tmp_path: Path) -> None:
        """After a reboot the old boot's slots count as expired; the slot counter still grows."""
        path = tmp_path / "leases.db"
        before = SQLiteLockStore(path, clock=WallSteppingClock(50_000.0), _boot_id="boot-1")
        held = [before.acquire_slot("k", f"o{i}", LONG_MS, 2) for i in range(2)]
        assert before.acquire_slot("k", "x", LONG_MS, 2) is None
        before.close()
        clock = WallSteppingClock(12.0)
        clock.step_wall(50_000.0 - 12.0 + 5.0)
        after = SQLiteLockStore(path, clock=clock, _boot_id="boot-2")
        got = after.acquire_slot("k", "n", LONG_MS, 2)
        assert got is not None and got[0] == 0
        assert got[1] > max(token for _, token in held)  # type: ignore[misc]
        assert after.get(slot_key("k", 1)) is None
        mine = after.get(slot_key("k", 0))
        assert mine is not None and mine.owner == "n"
        after.close()


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


# Clocks and boot ids -----------------------------------------------------------------------------

_UNSHARE_TIME = ("unshare", "--time", "--fork", "--monotonic", "100000")


class TestSQLiteClocks:
    """Expiry follows the host's monotonic clock of this boot, never the wall clock."""

    def test_the_default_boot_id_is_the_kernels(self, tmp_path: Path) -> None:
        """On Linux the store tags its rows with /proc/sys/kernel/random/boot_id."""
        boot_file = Path("/proc/sys/kernel/random/boot_id")
        if not boot_file.exists():
            pytest.skip("no boot id on this system (the store falls back to the wall clock)")
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path)
        assert store.acquire("k", "a", LONG_MS) is not None
        with sqlite3.connect(path) as conn:
            (boot,) = conn.execute("SELECT boot_id FROM celery_lease WHERE key = 'k'").fetchone()
        assert boot == boot_file.read_text().strip()
        store.close()

    def test_a_lease_written_in_another_boot_is_expired(self, tmp_path: Path) -> None:
        """After a reboot (new boot id, monotonic clock restarted) every old lease is free.

        Its wall-clock expiry is still in the future and the new boot's monotonic clock reads
        less than the old expiry: only the boot id tells. Tokens keep growing (the counter).
        """
        path = tmp_path / "leases.db"
        before = SQLiteLockStore(path, clock=WallSteppingClock(50_000.0), _boot_id="boot-1")
        token = before.acquire("k", "a", LONG_MS)
        assert token is not None
        before.close()
        clock = WallSteppingClock(12.0)  # 12 s after the new boot
        clock.step_wall(50_000.0 - 12.0 + 5.0)  # the wall clock 5 s later than before
        after = SQLiteLockStore(path, clock=clock, _boot_id="boot-2")
        assert after.get("k") is None
        assert after.renew("k", "a", LONG_MS) is False
        again = after.acquire("k", "b", LONG_MS)
        assert again is not None and again > token
        after.close()

    def test_tokens_grow_across_a_reboot_with_the_wall_clock_behind(self, tmp_path: Path) -> None:
        """A new boot whose wall clock reads earlier (bad RTC) still issues larger tokens."""
        path = tmp_path / "leases.db"
        before = SQLiteLockStore(path, clock=WallSteppingClock(90_000.0), _boot_id="boot-1")
        token = before.acquire("k", "a", 1000)
        assert token is not None
        before.close()
        after = SQLiteLockStore(path, clock=WallSteppingClock(3.0), _boot_id="boot-2")
        again = after.acquire("k", "b", LONG_MS)
        assert again == token + 1
        after.close()

    def test_without_a_boot_id_expiry_falls_back_to_the_wall_clock(self, tmp_path: Path) -> None:
        """No boot id (not Linux): the wall clock decides, so a step of it does move expiry."""
        clock = WallSteppingClock(1000.0)
        store = SQLiteLockStore(tmp_path / "leases.db", clock=clock, _boot_id=None)
        token = store.acquire("k", "a", 10_000)
        assert token is not None
        assert store.acquire("k", "b", LONG_MS) is None
        clock.step_wall(120.0)  # the documented limit of the fallback
        following = store.acquire("k", "b", LONG_MS)
        assert following is not None and following > token
        store.close()

    def test_stores_with_and_without_a_boot_id_exclude_each_other(self, tmp_path: Path) -> None:
        """A process that cannot read the boot id and one that can still exclude each other."""
        clock = WallSteppingClock(1000.0)
        path = tmp_path / "leases.db"
        linux = SQLiteLockStore(path, clock=clock, _boot_id="boot-1")
        blind = SQLiteLockStore(path, clock=clock, _boot_id=None)
        assert linux.acquire("a", "l", 1000) is not None
        assert blind.acquire("b", "f", 1000) is not None
        assert blind.acquire("a", "f2", LONG_MS) is None
        assert linux.acquire("b", "l2", LONG_MS) is None
        assert blind.renew("b", "f", 2000) is True
        assert linux.renew("a", "l", 2000) is True
        clock.advance(1.5)
        assert blind.acquire("a", "f2", LONG_MS) is None
        assert linux.acquire("b", "l2", LONG_MS) is None
        clock.advance(0.5)
        assert blind.acquire("a", "f2", LONG_MS) is not None
        assert linux.acquire("b", "l2", LONG_MS) is not None
        linux.close()
        blind.close()

    def test_a_time_namespace_offset_does_not_change_expiry(self, tmp_path: Path) -> None:
        """A process in a time namespace (its CLOCK_MONOTONIC shifted) judges leases like us.

        The child runs under ``unshare --time --monotonic 100000``: read raw, its monotonic clock
        is 100000 s ahead, so our lease would look long expired to it, and its own lease would
        look live to us for a day.
        """
        if not Path("/proc/self/timens_offsets").exists():
            pytest.skip("this kernel has no time namespaces")
        probe = subprocess.run([*_UNSHARE_TIME, "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot create a time namespace here: {probe.stderr!r}")
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path)
        assert store.acquire("ours", "parent", LONG_MS) is not None
        script = (
            "import sys; from celery_lease.stores.sqlite import SQLiteLockStore;"
            "s = SQLiteLockStore(sys.argv[1]);"
            "print(s.acquire('ours', 'child', 60000), s.acquire('theirs', 'child', 3000))"
        )
        child = subprocess.run(
            [*_UNSHARE_TIME, sys.executable, "-c", script, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parents[2],
        )
        assert child.returncode == 0, child.stderr
        refused, theirs = child.stdout.split()
        assert refused == "None"  # our lease is live for the child too
        assert theirs.isdigit()
        info = store.get("theirs")  # 3 s: still live after the child's interpreter and unshare end
        assert info is not None and info.expires_in <= 3.0  # not a day
        deadline = time.monotonic() + 10
        while store.acquire("theirs", "parent", LONG_MS) is None:
            assert time.monotonic() < deadline, "the child's lease never expired for us"
            time.sleep(0.02)
        store.close()


class TestSQLiteFileFormat:
    def test_a_table_without_the_stores_columns_is_refused(self, tmp_path: Path) -> None:
        """A celery_lease table this store did not make is refused, naming what it lacks."""
        path = tmp_path / "leases.db"
        with sqlite3.connect(path) as conn:
            conn.execute(
                "CREATE TABLE celery_lease (key TEXT PRIMARY KEY, owner TEXT NULL,"
                " expires_ms INTEGER NOT NULL, token INTEGER NOT NULL)"
            )
        store = SQLiteLockStore(path, _boot_id="boot-1")
        with pytest.raises(LeaseConfigError, match="boot_id, boot_expires_ms"):
            store.acquire("k", "a", LONG_MS)
        store.close()


# Interrupts inside a store call ------------------------------------------------------------------


class _Interrupt(BaseException):
    """What the Celery layer raises asynchronously in a revoked body (LockLostError's stand-in)."""


def _write_lock_is_free(path: Path) -> bool:
    conn = sqlite3.connect(path, isolation_level=None, timeout=0.2)
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()  # rolls back
    return True


@pytest.fixture(params=[True, False], ids=["one-statement", "transaction"])
def acquire_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test with the one-statement acquire (RETURNING) and with the transaction one."""
    import celery_lease.stores.sqlite as module

    if request.param and not module._HAS_RETURNING:
        pytest.skip(f"SQLite {sqlite3.sqlite_version} has no RETURNING")
    monkeypatch.setattr(module, "_HAS_RETURNING", request.param)
    return bool(request.param)


@pytest.mark.usefixtures("acquire_path")
class TestSQLiteInterrupts:
    """An exception raised asynchronously inside a store call leaves no transaction behind.

    The store waits for another connection's write lock (in ``BEGIN IMMEDIATE``, or in the
    acquire's one ``INSERT ... RETURNING`` statement); while it waits an exception is scheduled
    (a signal handler in the main thread, or ``PyThreadState_SetAsyncExc`` as the threads
    pool's revoke does), then the other connection lets go. Python runs the handler as soon as
    the sqlite3 call returns: between ``BEGIN IMMEDIATE`` and the ``try`` that would roll it
    back, or between the ``INSERT ... RETURNING`` that returned its row and the fetch that
    would end the statement (which until then holds the write lock, ``in_transaction`` False).
    """

    def _blocked_begin(self, store: SQLiteLockStore, path: Path) -> tuple[Any, threading.Event]:
        """Take the write lock elsewhere; return it and an event set when the store call starts."""
        assert store.acquire("warm", "w", LONG_MS) is not None  # opens the connection
        blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")
        begun = threading.Event()

        def trace(statement: str) -> None:
            begun.set()  # the call's first statement (BEGIN or INSERT) starts: it waits

        assert store._conn is not None
        store._conn.set_trace_callback(trace)
        return blocker, begun

    def _check_recovered(self, store: SQLiteLockStore, path: Path) -> None:
        assert store._conn is None or not store._conn.in_transaction
        assert _write_lock_is_free(path), "the interrupted connection still holds the write lock"
        assert not store._lock.locked()
        token = store.acquire("after", "x", LONG_MS)
        assert token is not None
        store.release("after", "x")

    def _signal_during_busy_wait(self, path: Path, key: str) -> bool:
        """One try: SIGUSR2 (handler raising) while the store waits; whether it landed in it."""
        store = SQLiteLockStore(path, busy_timeout=10)
        blocker, begun = self._blocked_begin(store, path)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)

        def handler(signum: int, frame: object) -> None:
            raise _Interrupt

        def interrupt() -> None:
            begun.wait(DEADLINE)
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR2)
            os.read(read_fd, 1)  # the C-level handler ran: the Python one is pending
            blocker.execute("ROLLBACK")

        previous = signal.signal(signal.SIGUSR2, handler)
        old_fd = signal.set_wakeup_fd(write_fd)
        helper = threading.Thread(target=interrupt)
        helper.start()
        try:
            store.acquire(key, "a", LONG_MS)
        except _Interrupt:
            helper.join(DEADLINE)
            self._check_recovered(store, path)
            return True
        finally:
            helper.join(DEADLINE)
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGUSR2, previous)
            os.close(read_fd)
            os.close(write_fd)
            blocker.close()
            store.close()
        return False  # the handler ran inside the trace callback, whose errors sqlite3 drops

    def test_a_signal_during_the_busy_wait_leaves_the_file_unlocked(self, tmp_path: Path) -> None:
        """A signal handler raising in the main thread while the store waits on the busy lock."""
        assert threading.current_thread() is threading.main_thread()
        path = tmp_path / "leases.db"
        landed = any(self._signal_during_busy_wait(path, f"k{i}") for i in range(5))
        assert landed, "the interrupt never landed in the store call"

    def test_an_async_exception_during_the_busy_wait_leaves_the_file_unlocked(
        self, tmp_path: Path
    ) -> None:
        """PyThreadState_SetAsyncExc (the threads pool's revoke) while the store waits."""
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path, busy_timeout=10)
        blocker, begun = self._blocked_begin(store, path)
        outcome: list[BaseException | int | None] = []

        def body() -> None:
            try:
                outcome.append(store.acquire("k", "a", LONG_MS))
            except _Interrupt as exc:
                outcome.append(exc)

        worker = threading.Thread(target=body)
        worker.start()
        assert begun.wait(DEADLINE)
        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
        assert set_async_exc(ctypes.c_ulong(worker.ident or 0), ctypes.py_object(_Interrupt)) == 1
        blocker.execute("ROLLBACK")
        worker.join(DEADLINE)
        blocker.close()
        assert len(outcome) == 1 and isinstance(outcome[0], _Interrupt), outcome
        self._check_recovered(store, path)
        store.close()

    def test_a_failed_commit_leaves_no_transaction_open(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A COMMIT that raises (disk full, I/O error) is rolled back, not left holding the lock."""
        import celery_lease.stores.sqlite as module

        monkeypatch.setattr(module, "_HAS_RETURNING", False)  # the path with a COMMIT
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path)
        assert store.acquire("warm", "w", LONG_MS) is not None
        assert store._conn is not None and store._cursor is not None
        real, real_cursor = store._conn, store._cursor

        class FailingCommit:
            """Delegates to the real cursor but fails every COMMIT."""

            def __getattr__(self, name: str) -> object:
                return getattr(real_cursor, name)

            def execute(self, sql: str, *args: object) -> object:
                if sql == "COMMIT":
                    raise sqlite3.OperationalError("disk I/O error")
                return real_cursor.execute(sql, *args)

        store._cursor = FailingCommit()  # type: ignore[assignment]
        with pytest.raises(StoreUnavailableError, match="disk I/O error"):
            store.acquire("k", "a", LONG_MS)
        assert store._conn is None  # the connection in a transaction was discarded (closed)
        with pytest.raises(sqlite3.ProgrammingError):
            real.execute("SELECT 1")
        assert _write_lock_is_free(path)
        assert store.get("k") is None  # the failed acquire did not take effect
        assert store.acquire("k", "a", LONG_MS) is not None  # on a new connection
        store.close()

    def test_a_driver_error_keeps_a_healthy_connection(self, tmp_path: Path) -> None:
        """A plain error outside a transaction (the busy timeout) keeps the connection open."""
        path = tmp_path / "leases.db"
        store = SQLiteLockStore(path, busy_timeout=0.05)
        assert store.acquire("warm", "w", LONG_MS) is not None
        conn = store._conn
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StoreUnavailableError, match="failed to acquire"):
                store.acquire("k", "a", LONG_MS)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert store._conn is conn and store._cursor is not None
        assert store.acquire("k", "a", LONG_MS) is not None
        store.close()


# Forked children and time namespaces ------------------------------------------------------------


_CLONE_NEWTIME = 0x80


class TestSQLiteTimeNamespace:
    def test_a_process_that_made_a_time_namespace_for_its_children_still_excludes(
        self, tmp_path: Path
    ) -> None:
        """A process that called unshare(CLONE_NEWTIME) stays in its own namespace.

        /proc/self/timens_offsets shows the offsets of the namespace its *children* will be in,
        not its own: subtracted from the process's own (unshifted) monotonic clock, an offset of
        +100000 s would make its 60 s lease read as expired a day ago to every other process,
        which would acquire the key while it is held.
        """
        path = tmp_path / "leases.db"

        def child_body(child: Child) -> None:
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
        with forked(child_body) as child:
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
