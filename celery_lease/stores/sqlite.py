"""SQLite store: the embedded default, shared by every process of one host through one file.

Each operation is one short write transaction (``BEGIN IMMEDIATE``) on a database in WAL mode, so
readers never block and writers queue on SQLite's file lock for up to ``busy_timeout`` seconds.
Expiry uses the wall clock (``clock.time()``, in milliseconds) because the file outlives the
processes and reboots that wrote it; the host's clock is assumed not to jump back by more than a
lease's ttl.

The table keeps one row per key ever locked: releasing or expiring a lease clears ``owner`` but
keeps the row, so the token counter persists in the file and tokens keep growing across restarts.
Every new token is also floored by the clock in microseconds, like the memory store.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores.base import LeaseInfo

__all__ = ["SQLiteLockStore"]

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS celery_lease (
    key TEXT PRIMARY KEY,
    owner TEXT NULL,
    expires_ms INTEGER NOT NULL,
    token INTEGER NOT NULL
)
"""

# Connections inherited through fork(): never used and never closed in the child (closing a
# connection another process still uses can drop that process's POSIX locks on the file), only
# kept alive so that garbage collection does not close them either.
_INHERITED: list[sqlite3.Connection] = []

# Every open store, so that a forked child can drop the connections and locks it inherited.
_STORES: weakref.WeakSet[SQLiteLockStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forget_inherited()


if hasattr(os, "register_at_fork"):  # pragma: no branch - absent on Windows only
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SQLiteLockStore:
    """A :class:`~celery_lease.LockStore` in an SQLite file; excludes across processes of a host.

    Implements the protocol, :class:`~celery_lease.SupportsBatchRenew` and
    :class:`~celery_lease.SupportsInspection`; it has no ``wait_for_release`` (waiters poll).

    Each process opens its own connection on first use (after ``fork()`` the child opens a new
    one; the inherited connection is never touched), shared by the threads of that process under
    a lock: SQLite serialises writers on the file anyway, so a connection per thread would buy
    nothing but file descriptors.

    The database file is created with mode ``0o600`` (owner only), and its parent directory
    when missing. A file on a network file system is not supported (WAL needs shared memory).

    Args:
        path: the database file (``str`` or path-like); ``":memory:"`` is refused, since it would
            not be shared between connections.
        clock: time source (default: the system clock); its ``time()`` (wall clock) is used.
        busy_timeout: seconds an operation waits for another writer's lock before it raises
            ``StoreUnavailableError`` (default 5.0).

    Raises:
        LeaseConfigError: for a bad ``path`` or ``busy_timeout``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        busy_timeout: float = 5.0,
    ) -> None:
        self._path = _validate_path(path)
        if (
            isinstance(busy_timeout, bool)
            or not isinstance(busy_timeout, (int, float))
            or not busy_timeout > 0
        ):
            raise LeaseConfigError(f"busy_timeout={busy_timeout!r} must be a number of seconds > 0")
        self._busy_timeout = float(busy_timeout)
        self._clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        _STORES.add(self)

    @classmethod
    def from_url(cls, url: str) -> SQLiteLockStore:
        """Build a store from ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``.

        Three slashes give a path relative to the working directory, four an absolute one (as in
        SQLAlchemy). The query may set ``busy_timeout`` in seconds: ``?busy_timeout=10``.

        Raises:
            LeaseConfigError: for a URL of another form.
        """
        parts = urlsplit(url) if isinstance(url, str) else None
        if (
            parts is None
            or parts.scheme.lower() != "sqlite"
            or not url.lower().startswith("sqlite:///")
        ):
            raise LeaseConfigError(
                f"url={url!r} is not an SQLite URL: use sqlite:///relative/path.db or "
                "sqlite:////absolute/path.db"
            )
        path = unquote(parts.path[1:])
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        busy_timeout = 5.0
        for name, value in options.items():
            if name != "busy_timeout":
                raise LeaseConfigError(
                    f"url={url!r} has an unknown option {name!r}; supported: busy_timeout"
                )
            try:
                busy_timeout = float(value)
            except ValueError:
                raise LeaseConfigError(
                    f"url={url!r}: busy_timeout={value!r} must be a number of seconds"
                ) from None
        return cls(path, busy_timeout=busy_timeout)

    @property
    def path(self) -> str:
        """The database file, as given."""
        return self._path

    # Connection ---------------------------------------------------------------------------------

    def _forget_inherited(self) -> None:
        """In a forked child: drop (without closing) the parent's connection and lock."""
        self._lock = threading.Lock()
        if self._conn is not None:
            _INHERITED.append(self._conn)
            self._conn = None
        self._pid = os.getpid()

    def _open(self) -> sqlite3.Connection:
        """Connect, switch to WAL and create the table; retried while another process does.

        Several processes opening a new file at once race on the journal-mode switch and the
        schema: SQLite answers some of those collisions with an immediate "database is locked"
        (deadlock avoidance skips the busy handler), so the set-up is retried, with a short
        random pause, until ``busy_timeout`` runs out.
        """
        _create_file(self._path)
        deadline = time.monotonic() + self._busy_timeout
        while True:
            conn = sqlite3.connect(
                self._path,
                timeout=self._busy_timeout,
                isolation_level=None,  # autocommit: transactions are explicit
                check_same_thread=False,  # shared by the threads of this process, under _lock
            )
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL in WAL mode: a power loss may lose the last commits, never corrupt; a
                # token lost that way is still exceeded by the clock floor after the reboot.
                conn.execute("PRAGMA synchronous=NORMAL")
                # IMMEDIATE takes the write lock up front (with the busy handler) instead of
                # upgrading a read lock, which SQLite refuses at once when another writer waits.
                with self._write(conn):
                    conn.execute(_SCHEMA)
                return conn
            except sqlite3.OperationalError as exc:
                conn.close()
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(random.uniform(0.005, 0.05))
            except BaseException:
                conn.close()
                raise

    def _run(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` on this process's connection; driver errors raise StoreUnavailableError."""
        if self._pid != os.getpid():  # forked without os.register_at_fork (e.g. by C code)
            self._forget_inherited()
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = self._open()
                return fn(self._conn)
            except (sqlite3.Error, OSError) as exc:
                raise StoreUnavailableError(
                    f"SQLite store {self._path!r} failed to {what}: {exc}"
                ) from exc

    @staticmethod
    @contextmanager
    def _write(conn: sqlite3.Connection) -> Iterator[None]:
        """One write transaction: ``BEGIN IMMEDIATE`` waits (busy timeout) for the write lock."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _now_ms(self) -> int:
        return round(self._clock.time() * 1000)

    # Protocol -----------------------------------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        def op(conn: sqlite3.Connection) -> int | None:
            with self._write(conn):
                now = self._clock.time()
                now_ms = round(now * 1000)
                row = conn.execute(
                    "SELECT owner, expires_ms, token FROM celery_lease WHERE key = ?", (key,)
                ).fetchone()
                if row is not None and row[0] is not None and row[1] > now_ms:
                    return None
                last = row[2] if row is not None else 0
                token = max(last + 1, int(now * 1_000_000))
                conn.execute(
                    "INSERT INTO celery_lease (key, owner, expires_ms, token) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (key) DO UPDATE SET owner = excluded.owner,"
                    " expires_ms = excluded.expires_ms, token = excluded.token",
                    (key, owner, now_ms + ttl_ms, token),
                )
                return token

        return self._run("acquire", op)

    @staticmethod
    def _renew_one(
        conn: sqlite3.Connection, key: str, owner: str, ttl_ms: int, now_ms: int
    ) -> bool:
        cursor = conn.execute(
            "UPDATE celery_lease SET expires_ms = ? WHERE key = ? AND owner = ? AND expires_ms > ?",
            (now_ms + ttl_ms, key, owner, now_ms),
        )
        return cursor.rowcount == 1

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            with self._write(conn):
                return self._renew_one(conn, key, owner, ttl_ms, self._now_ms())

        return self._run("renew", op)

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Renew each ``(key, owner, ttl_ms)`` in one transaction; one result per item, in order."""
        if not items:
            return []

        def op(conn: sqlite3.Connection) -> list[bool]:
            with self._write(conn):
                now_ms = self._now_ms()
                return [self._renew_one(conn, k, o, t, now_ms) for k, o, t in items]

        return self._run("renew leases", op)

    def release(self, key: str, owner: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            with self._write(conn):
                conn.execute(
                    "UPDATE celery_lease SET owner = NULL WHERE key = ? AND owner = ?",
                    (key, owner),
                )

        self._run("release", op)

    # Inspection ---------------------------------------------------------------------------------

    def _info(self, row: tuple[str, str, int, int], now_ms: int) -> LeaseInfo:
        key, owner, token, expires_ms = row
        return LeaseInfo(key, owner, token, max(0, expires_ms - now_ms) / 1000.0)

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        """Live leases whose key starts with ``prefix``, sorted by key."""

        def op(conn: sqlite3.Connection) -> list[LeaseInfo]:
            now_ms = self._now_ms()
            rows = conn.execute(
                "SELECT key, owner, token, expires_ms FROM celery_lease"
                " WHERE owner IS NOT NULL AND expires_ms > ? AND substr(key, 1, ?) = ?"
                " ORDER BY key",
                (now_ms, len(prefix), prefix),
            ).fetchall()
            return [self._info(row, now_ms) for row in rows]

        return self._run("list leases", op)

    def get(self, key: str) -> LeaseInfo | None:
        """The live lease on ``key``, or ``None`` when it is free."""

        def op(conn: sqlite3.Connection) -> LeaseInfo | None:
            now_ms = self._now_ms()
            row = conn.execute(
                "SELECT key, owner, token, expires_ms FROM celery_lease"
                " WHERE key = ? AND owner IS NOT NULL AND expires_ms > ?",
                (key, now_ms),
            ).fetchone()
            return None if row is None else self._info(row, now_ms)

        return self._run("read a lease", op)

    def last_token(self, key: str) -> int | None:
        """The last fencing token issued for ``key`` (kept after release), or ``None``."""

        def op(conn: sqlite3.Connection) -> int | None:
            row = conn.execute("SELECT token FROM celery_lease WHERE key = ?", (key,)).fetchone()
            return None if row is None else int(row[0])

        return self._run("read a token", op)

    def force_release(self, key: str) -> LeaseInfo | None:
        """Delete the live lease on ``key`` whoever holds it; returns it. The counter is kept."""

        def op(conn: sqlite3.Connection) -> LeaseInfo | None:
            with self._write(conn):
                now_ms = self._now_ms()
                row = conn.execute(
                    "SELECT key, owner, token, expires_ms FROM celery_lease"
                    " WHERE key = ? AND owner IS NOT NULL AND expires_ms > ?",
                    (key, now_ms),
                ).fetchone()
                if row is None:
                    return None
                conn.execute("UPDATE celery_lease SET owner = NULL WHERE key = ?", (key,))
                return self._info(row, now_ms)

        return self._run("force-release", op)

    def close(self) -> None:
        """Close this process's connection; a later call opens a new one."""
        if self._pid != os.getpid():
            self._forget_inherited()
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __repr__(self) -> str:
        return f"SQLiteLockStore({self._path!r}, clock={self._clock!r})"


def _validate_path(path: object) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise LeaseConfigError(f"path={path!r} must be a non-empty file path (str or path-like)")
    if path == ":memory:" or path.startswith("file:"):
        raise LeaseConfigError(
            f"path={path!r} is not a file path; an in-memory or URI database is not shared "
            "between processes (use MemoryLockStore for one process)"
        )
    if "\x00" in path:
        raise LeaseConfigError(f"path={path!r} must not contain NUL characters")
    if os.path.isdir(path):
        raise LeaseConfigError(f"path={path!r} is a directory, expected a database file")
    return path


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" / "busy" (another process has the lock)."""
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _create_file(path: str) -> None:
    """Create the parent directory when missing and the file with mode 0o600 when missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
