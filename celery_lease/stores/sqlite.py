"""SQLite store: the embedded default, shared by every process of one host through one file.

Each operation is one short write transaction on a WAL database; expiry follows the host's
``CLOCK_MONOTONIC`` tagged with the boot id. Clocks, reboots and tokens: docs/stores.md (SQLite);
threads, locks and fork resets: docs/internals.md.

Slots and replace use the same table, with no other column: slot ``i`` of ``k`` is the row of
``slot_key(k, i)`` and ``k``'s slot counter the token of the row ``counter_key(k)`` (owner NULL,
never live). A holder asked to stop (``mark_replaced``) has ``REPLACED_MARK`` appended to its
stored owner, and its own token is copied to the row ``k + U+001F + "holder"``
(``_HOLDER_SUFFIX``; owner NULL, never live): from then on ``k``'s row's token is only the key's
counter, so a ticket drawn while it holds goes there and the next acquire's token (drawn from
that column, as always) exceeds it, with nothing more read on the plain paths. ``get``, ``list``
and ``force_release`` show a marked holder's own token from that row; ``last_token`` is the
larger of the key's last token and the last ticket drawn for it.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from celery_lease import _forking as forking
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores import _sqlite_connections
from celery_lease.stores._sqlite_connections import Connection
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import (
    MAX_LIMIT,
    REPLACED_MARK,
    SLOT_MARK,
    counter_key,
    marked,
    slot_key,
    split_slot,
    unmarked,
)

__all__ = ["SQLiteLockStore"]

logger = logging.getLogger("celery_lease.stores.sqlite")

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS celery_lease (
    key TEXT PRIMARY KEY,
    owner TEXT NULL,
    expires_ms INTEGER NOT NULL,
    token INTEGER NOT NULL,
    boot_id TEXT NULL,
    boot_expires_ms INTEGER NULL
)
"""

# The columns every statement below needs (a table lacking one is not this store's).
_COLUMNS = ("key", "owner", "expires_ms", "token", "boot_id", "boot_expires_ms")

# Statement parameters, written by name and bound by position (a tuple per call): :boot is this
# process's boot id (NULL without one), :mono the monotonic clock (ms), :wall the wall clock (ms
# since the epoch), :expires = :wall + ttl, :boot_expires = :mono + ttl (NULL without a boot
# id), :token the token floor (the wall clock in µs, at least 1).
_PARAMS = ("key", "owner", "boot", "mono", "wall", "expires", "boot_expires", "token")


def _numbered(sql: str) -> str:
    """``sql`` with each ``:name`` of :data:`_PARAMS` replaced by its ``?N`` (done at import)."""
    return re.sub(r":([a-z_]+)\b", lambda match: f"?{_PARAMS.index(match.group(1)) + 1}", sql)


# Whether the boot columns judge the row (else its wall-clock expires_ms does).
_BOOT_VALID = "(:boot IS NOT NULL AND boot_id IS NOT NULL)"

# A live lease: by the monotonic clock in this boot, expired from another boot, else by the wall.
_LIVE = f"""owner IS NOT NULL AND CASE WHEN {_BOOT_VALID}
    THEN boot_id IS :boot AND boot_expires_ms > :mono
    ELSE expires_ms > :wall END"""

# Milliseconds left of a live row's lease, by the clock that judges it.
_LEFT_MS = f"CASE WHEN {_BOOT_VALID} THEN boot_expires_ms - :mono ELSE expires_ms - :wall END"

# Set a live lease's expiry to now + ttl on both clocks (renew; re-acquire without RETURNING).
# In autocommit mode it is its own write transaction, taking the write lock before it reads.
_EXTEND = _numbered(
    f"""UPDATE celery_lease SET expires_ms = :expires, boot_id = :boot,
    boot_expires_ms = :boot_expires
WHERE key = :key AND owner = :owner AND {_LIVE}"""
)


def _sql_text(text: str) -> str:
    """``text`` (printable ASCII, no quote, and control characters) as an SQLite text
    expression."""
    parts = re.findall(r"[ -~]+|[^ -~]", text)
    return " || ".join(f"'{p}'" if p.isprintable() else f"char({ord(p)})" for p in parts)


# The token the row gets: its own while live (the holder again), else the next one.
_NEXT_TOKEN = f"CASE WHEN coalesce({_LIVE}, 0) THEN token ELSE max(token + 1, :token) END"

_HOLDER_SUFFIX = SLOT_MARK + "holder"
"""Appended to a key to name the row keeping the own token of the key's holder while it is
marked as asked to stop (its token column; owner NULL, never a lease)."""

# A row's holder's own token: kept in the holder row while the owner is marked, else its token.
_HOLDER_TOKEN = (
    f"CASE WHEN substr(owner, -{len(REPLACED_MARK)}) = {_sql_text(REPLACED_MARK)}"
    " THEN coalesce((SELECT holder.token FROM celery_lease AS holder"
    f" WHERE holder.key = celery_lease.key || {_sql_text(_HOLDER_SUFFIX)}), token)"
    " ELSE token END"
)

# acquire in one statement: takes a free, expired or new key (a new token) or extends the
# caller's own live lease (its token kept) and returns the token; nothing for another owner's
# live lease. SET and WHERE read the row as it was before the statement.
_ACQUIRE = _numbered(
    f"""INSERT INTO celery_lease (key, owner, expires_ms, token, boot_id, boot_expires_ms)
VALUES (:key, :owner, :expires, :token, :boot, :boot_expires)
ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, expires_ms = excluded.expires_ms,
    token = {_NEXT_TOKEN}, boot_id = excluded.boot_id,
    boot_expires_ms = excluded.boot_expires_ms
WHERE NOT coalesce({_LIVE}, 0) OR owner = :owner
RETURNING token"""
)

# The same in three statements inside BEGIN IMMEDIATE, for SQLite without RETURNING.
_SELECT_FOR_ACQUIRE = _numbered(f"SELECT owner, token, {_LIVE} FROM celery_lease WHERE key = :key")
_TAKE = _numbered(
    """INSERT INTO celery_lease (key, owner, expires_ms, token, boot_id, boot_expires_ms)
VALUES (:key, :owner, :expires, :token, :boot, :boot_expires)
ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, expires_ms = excluded.expires_ms,
    token = excluded.token, boot_id = excluded.boot_id,
    boot_expires_ms = excluded.boot_expires_ms"""
)

# Owner-checked release (?2 the owner, ?3 the owner as marked when asked to stop); the row
# stays (its token is the key's counter).
_RELEASE = "UPDATE celery_lease SET owner = NULL WHERE key = ?1 AND owner IN (?2, ?3)"

# Owner-checked release of every slot row of a key (?1 <= key < ?2, the range of _SLOT_ROWS) that
# ?3 holds; the rows stay (their tokens count).
_RELEASE_SLOTS = "UPDATE celery_lease SET owner = NULL WHERE key >= ?1 AND key < ?2 AND owner = ?3"

# A key's slot rows, its counter and holder rows: ?1 <= key < ?2 (the primary key's range).
_SLOT_ROWS = _numbered(
    f"SELECT key, owner, token, coalesce({_LIVE}, 0) FROM celery_lease"
    " WHERE key >= :key AND key < :owner"
)

# Set the token of a row that is no lease now (a counter, a holder row, a free key's row;
# created when missing).
_SET_COUNTER = """INSERT INTO celery_lease (key, owner, expires_ms, token, boot_id, boot_expires_ms)
VALUES (?1, NULL, 0, ?2, NULL, NULL)
ON CONFLICT (key) DO UPDATE SET token = excluded.token"""

# Ask the holder to stop: ?1 the key, ?2 its stored owner, ?3 that owner marked.
_MARK = "UPDATE celery_lease SET owner = ?3 WHERE key = ?1 AND owner = ?2"

# Inspection (the CLI): ?1 and ?2 are unused placeholders unless named.
_SELECT_LIVE = _numbered(
    f"SELECT key, owner, {_HOLDER_TOKEN}, {_LEFT_MS} FROM celery_lease WHERE {_LIVE}"
)
# The last token of a key: its row's token (a marked holder's row carries the last ticket drawn)
# or, when larger, its holder row's (a ticket set aside while an unmarked holder kept the row).
_LAST_TOKEN = (
    "SELECT max(token, coalesce((SELECT holder.token FROM celery_lease AS holder"
    f" WHERE holder.key = celery_lease.key || {_sql_text(_HOLDER_SUFFIX)}), token))"
    " FROM celery_lease WHERE key = ?1"
)
_LIST = f"{_SELECT_LIVE} AND substr(key, 1, length(?1)) = ?1 ORDER BY key"
_GET = f"{_SELECT_LIVE} AND key = ?1"

# RETURNING on UPSERT is fixed from 3.35.5 (3.35.0-3.35.4 had RETURNING bugs).
_HAS_RETURNING = sqlite3.sqlite_version_info >= (3, 35, 5)

_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_TIMENS_FILE = "/proc/self/timens_offsets"  # the offsets of the *children's* time namespace
_TIMENS_OWN = "/proc/self/ns/time"
_TIMENS_CHILDREN = "/proc/self/ns/time_for_children"
_TIMENS_INITIAL = "time:[4026531834]"  # PROC_TIME_INIT_INO: the host's namespace, no offset


class _Detect:
    """Default of ``_boot_id``: read the boot id (and time-namespace offset) from ``/proc``."""

    def __repr__(self) -> str:
        return "<detect>"


_DETECT = _Detect()


class SQLiteLockStore:
    """A :class:`~celery_lease.LockStore` in an SQLite file; excludes across processes of a host.

    Implements the protocol, :class:`~celery_lease.SupportsBatchRenew` and
    :class:`~celery_lease.SupportsInspection`; it has no ``wait_for_release`` (waiters poll).
    A repeated acquire by the holder of a live lease returns its token and sets its expiry to
    now + ttl (so a retry after a lost reply gets its own lease back).

    Expiry follows the host's monotonic clock of the current boot (a wall-clock step moves no
    expiry; a reboot expires every lease), or the wall clock without a boot id (not Linux).
    Each process opens one connection on first use, shared by its threads under a lock
    (SQLite serialises writers anyway); ``os.fork()`` closes it first. The file is created with
    mode ``0o600`` (and its parent directory when missing); network file systems are not
    supported (WAL needs shared memory). Details: docs/stores.md (SQLite).

    Args:
        path: the database file (``str`` or path-like); ``":memory:"`` is refused, since it would
            not be shared between connections.
        clock: time source (default: the system clock). Its ``monotonic()`` decides expiry and
            must read the host's ``CLOCK_MONOTONIC``, the clock every process of the host
            shares (the system clock's does); its ``time()`` floors tokens and fills the
            wall-clock column. Pass a ``FakeClock`` in tests.
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
        _boot_id: str | _Detect | None = _DETECT,
    ) -> None:
        # _boot_id (private, for tests): the boot id to tag rows with, None for the wall-clock
        # fallback; by default it is read from /proc in each process that opens the file.
        self._path = _validate_path(path)
        if (
            isinstance(busy_timeout, bool)
            or not isinstance(busy_timeout, (int, float))
            or not busy_timeout > 0
        ):
            raise LeaseConfigError(f"busy_timeout={busy_timeout!r} must be a number of seconds > 0")
        self._busy_timeout = float(busy_timeout)
        self._clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        # this process's connection and its lock; a fork waits for a call in flight that long
        self._connection = Connection(self._path, 2 * self._busy_timeout + 1.0)
        self._returning = _HAS_RETURNING  # one-statement acquire (tests may turn it off)
        if not isinstance(_boot_id, (str, _Detect)) and _boot_id is not None:
            raise LeaseConfigError(f"_boot_id={_boot_id!r} must be a str or None")
        self._boot_setting = _boot_id
        self._boot: str | None = None  # set by _open, per process
        self._mono_offset = 0.0  # seconds to subtract from clock.monotonic(); set by _open

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
    def clock(self) -> Clock:
        """The clock this store's expiry is measured on (a lease waiting on it waits on it too)."""
        return self._clock

    # The connection's parts, for tests.
    @property
    def _lock(self) -> threading.Lock:
        return self._connection.lock

    @property
    def _conn(self) -> sqlite3.Connection | None:
        return self._connection.conn

    @_conn.setter
    def _conn(self, conn: sqlite3.Connection | None) -> None:
        self._connection.conn = conn

    @property
    def _cursor(self) -> sqlite3.Cursor | None:
        return self._connection.cursor

    @_cursor.setter
    def _cursor(self, cursor: sqlite3.Cursor | None) -> None:
        self._connection.cursor = cursor

    def _own_connection(self) -> Connection:
        """This process's :class:`Connection`; after a fork that skipped Python's hooks, the
        inherited one is forgotten first (never closed here). Refused in the thread running
        the fork hooks."""
        _sqlite_connections.refuse_in_fork_hooks(self._path)
        connection = self._connection
        if connection.pid != os.getpid():
            forking.generation()  # runs the child resets of a fork without hooks, once
            if connection.pid != os.getpid():  # pragma: no cover - the resets did it
                connection.forget_inherited()
        return connection

    def _open(self, connection: Connection) -> sqlite3.Cursor:
        """Connect, switch to WAL and create the table; retried with a short random pause
        until ``busy_timeout``, since processes racing on a new file can get an immediate
        "database is locked" (deadlock avoidance skips the busy handler). Returns the cursor
        every call runs on (under ``connection.lock``, which the caller holds)."""
        _create_file(self._path)
        if isinstance(self._boot_setting, _Detect):
            self._boot, self._mono_offset = _host_boot()
        else:
            self._boot, self._mono_offset = self._boot_setting, 0.0
        deadline = time.monotonic() + self._busy_timeout
        connect = functools.partial(
            sqlite3.connect,
            self._path,
            timeout=self._busy_timeout,
            isolation_level=None,  # autocommit: transactions are explicit
            check_same_thread=False,  # shared by the threads of this process, under its lock
        )
        while True:
            conn = connection.open(connect)
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
                    _check_columns(conn, self._path)
                cursor = connection.cursor = conn.cursor()
                return cursor
            except sqlite3.OperationalError as exc:
                connection.close_quietly()
                busy = "locked" in str(exc).lower() or "busy" in str(exc).lower()
                if not busy or time.monotonic() >= deadline:
                    raise
                time.sleep(random.uniform(0.005, 0.05))
            except BaseException:
                connection.close_quietly()
                raise

    def _run(self, what: str, fn: Callable[[sqlite3.Cursor], _T]) -> _T:
        """Run ``fn`` on this process's cursor; driver errors raise StoreUnavailableError."""
        connection = self._own_connection()
        with connection.lock:
            try:
                cursor = connection.cursor
                if cursor is None:  # this process's connection and its one cursor
                    cursor = self._open(connection)
                return fn(cursor)
            except BaseException as exc:
                self._after_failure(connection, exc)
                if isinstance(exc, (sqlite3.Error, OSError)):
                    raise StoreUnavailableError(
                        f"SQLite store {self._path!r} failed to {what}: {exc}"
                    ) from exc
                raise

    @staticmethod
    def _after_failure(connection: Connection, exc: BaseException) -> None:
        """After a failed call (under the connection's lock): keep no statement or transaction
        holding the file's write lock. An async exception can land after ``BEGIN IMMEDIATE``
        or before the fetch ending an ``INSERT ... RETURNING`` (holding the lock while
        ``in_transaction`` is False), and a failed ``COMMIT`` leaves the transaction open: the
        cursor is closed (that resets its statement), and the connection too (rolling back)
        unless it is out of a transaction after a plain driver error. The next call
        reconnects."""
        cursor, conn = connection.cursor, connection.conn
        if cursor is None or conn is None:
            return
        connection.cursor = None  # first: even if closing is interrupted, nothing reuses it
        with suppress(sqlite3.Error):
            cursor.close()
        if not conn.in_transaction and isinstance(exc, sqlite3.Error):
            connection.cursor = conn.cursor()  # a plain error: the connection is fine
            return
        connection.close_quietly()

    @staticmethod
    @contextmanager
    def _write(conn: sqlite3.Connection | sqlite3.Cursor) -> Iterator[None]:
        """One write transaction: ``BEGIN IMMEDIATE`` waits (busy timeout) for the write lock."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            connection = conn if isinstance(conn, sqlite3.Connection) else conn.connection
            if connection.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _params(
        self, key: str | None, owner: str | None, ttl_ms: int
    ) -> tuple[str | None, str | None, str | None, int, int, int, int | None, int]:
        """The statements' parameters (see :data:`_PARAMS`), the clocks read now (after _open)."""
        boot = self._boot
        mono = round((self._clock.monotonic() - self._mono_offset) * 1000)
        wall_s = self._clock.time()
        wall = round(wall_s * 1000)
        return (
            key,
            owner,
            boot,
            mono,
            wall,
            wall + ttl_ms,
            None if boot is None else mono + ttl_ms,
            max(1, int(wall_s * 1_000_000)),
        )

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        """Take ``key``; the holder acquiring again gets its own token back, with a new expiry.

        One ``INSERT ... RETURNING`` (SQLite >= 3.35.5), else a ``SELECT`` and a write inside
        ``BEGIN IMMEDIATE``.
        """
        return self._run("acquire", functools.partial(self._acquire, key, owner, ttl_ms))

    def _acquire(self, key: str, owner: str, ttl_ms: int, cursor: sqlite3.Cursor) -> int | None:
        params = self._params(key, owner, ttl_ms)
        if self._returning:
            # fetchall() steps the statement to its end: that ends (commits) its transaction.
            rows = cursor.execute(_ACQUIRE, params).fetchall()
            return int(rows[0][0]) if rows else None
        with self._write(cursor):
            row = cursor.execute(_SELECT_FOR_ACQUIRE, params[:5]).fetchone()
            if row is not None and row[2]:
                if row[0] != owner:
                    return None
                cursor.execute(_EXTEND, params[:7])
                return int(row[1])
            token = max(row[1] + 1 if row is not None else 1, params[7])
            cursor.execute(_TAKE, (*params[:7], token))
            return token

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        """Set the expiry of ``owner``'s live lease to now + ``ttl_ms``; one UPDATE statement."""

        def op(cursor: sqlite3.Cursor) -> bool:
            return cursor.execute(_EXTEND, self._params(key, owner, ttl_ms)[:7]).rowcount == 1

        return self._run("renew", op)

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Renew each ``(key, owner, ttl_ms)`` in one transaction; one result per item, in order."""
        if not items:
            return []

        def op(cursor: sqlite3.Cursor) -> list[bool]:
            with self._write(cursor):
                now = self._params(None, None, 0)
                mono, wall = now[3], now[4]
                return [
                    cursor.execute(
                        _EXTEND,
                        (k, o, now[2], mono, wall, wall + t, None if now[2] is None else mono + t),
                    ).rowcount
                    == 1
                    for k, o, t in items
                ]

        return self._run("renew leases", op)

    def release(self, key: str, owner: str) -> None:
        """Free ``key`` if ``owner`` holds it, also when asked to stop (one UPDATE; the row and
        its token stay)."""
        # The stored owners it deletes: ``unmarked(stored)[0] == owner`` (an owner id ending in
        # REPLACED_MARK: only its marked form).
        stored = (marked(owner) if owner.endswith(REPLACED_MARK) else owner, marked(owner))
        self._run("release", lambda cursor: cursor.execute(_RELEASE, (key, *stored)))

    def release_owned_slots(self, key: str, owner: str) -> None:
        """Release every slot of ``key`` that ``owner`` holds, in one UPDATE (see
        :class:`~celery_lease.stores.base.SupportsOwnedSlotsRelease`; the rows and their
        tokens stay)."""
        span = (counter_key(key), key + chr(ord(SLOT_MARK) + 1), owner)
        self._run("release", lambda cursor: cursor.execute(_RELEASE_SLOTS, span))

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        """Take the lowest free slot of ``key`` below ``limit`` when fewer than ``limit`` of its
        slots are live (see :class:`~celery_lease.stores.base.SupportsSlots`).

        One ``BEGIN IMMEDIATE`` transaction: a read of the key's rows (one range of the primary
        key: its slots, whose highest index gives the width, and its counter), then the slot's
        and the counter's writes. Slot rows follow the boot id as a key's row does.
        """
        _check_slot_request(key, limit)
        return self._run(
            "acquire a slot", functools.partial(self._acquire_slot, key, owner, ttl_ms, limit)
        )

    def _acquire_slot(
        self, key: str, owner: str, ttl_ms: int, limit: int, cursor: sqlite3.Cursor
    ) -> tuple[int, int] | None:
        counter = counter_key(key)
        params = self._params(None, owner, ttl_ms)
        with self._write(cursor):
            rows = cursor.execute(
                _SLOT_ROWS, (counter, key + chr(ord(SLOT_MARK) + 1), *params[2:5])
            ).fetchall()
            last = 0
            live: set[int] = set()
            mine: tuple[int, int] | None = None
            for row_key, row_owner, row_token, row_live in rows:
                slot = _slot_of(key, row_key)
                if row_key == counter or slot is not None:
                    last = max(last, int(row_token))
                if slot is None or not row_live:
                    continue
                live.add(slot)
                if row_owner == owner and (mine is None or slot < mine[0]):
                    mine = (slot, int(row_token))
            if mine is not None:
                cursor.execute(_EXTEND, (slot_key(key, mine[0]), *params[1:7]))
                return mine
            if len(live) >= limit:
                return None
            free = next(slot for slot in range(limit) if slot not in live)
            token = max(last + 1, params[7])
            cursor.execute(_TAKE, (slot_key(key, free), *params[1:7], token))
            cursor.execute(_SET_COUNTER, (counter, token))
            return free, token

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        """Ask the live holder of ``key`` to stop (see
        :class:`~celery_lease.stores.base.SupportsReplace`); one ``BEGIN IMMEDIATE``
        transaction. Marking copies the holder's own token to the key's holder row; a ticket
        is then drawn into the key's row (its counter), as it is while the key is free.

        A ticket drawn while another owner than ``holder`` holds the key unmarked cannot go
        into the key's row (it carries that holder's token): it is set aside in the holder row,
        where ``last_token`` counts it; it is above every token issued so far, and a later
        token is above it once the clock has passed it.
        """
        return self._run(
            "ask a holder to stop",
            functools.partial(self._mark_replaced, key, ticket, holder),
        )

    def _mark_replaced(
        self, key: str, ticket: int | None, holder: str | None, cursor: sqlite3.Cursor
    ) -> tuple[int, str | None, bool]:
        params = self._params(key, None, 0)
        with self._write(cursor):
            row = cursor.execute(_SELECT_FOR_ACQUIRE, params[:5]).fetchone()
            counter = int(row[1]) if row is not None else 0
            drawn = ticket is None
            if ticket is None:
                ticket = max(counter + 1, params[7])
            current: str | None = None
            asked = False
            if row is not None and row[2]:
                current, was_asked = unmarked(str(row[0]))
                asked = holder is None or current == holder
                if asked and not was_asked:
                    cursor.execute(_SET_COUNTER, (key + _HOLDER_SUFFIX, counter))
                    cursor.execute(_MARK, (key, row[0], marked(current)))
                if not was_asked and not asked:
                    # The row keeps its holder's token: a drawn ticket is set aside in the
                    # holder row (unused while the holder is unmarked), for last_token.
                    if drawn:
                        cursor.execute(_SET_COUNTER, (key + _HOLDER_SUFFIX, ticket))
                    return ticket, current, False
            if drawn:
                cursor.execute(_SET_COUNTER, (key, ticket))
            return ticket, current, asked

    @staticmethod
    def _info(row: tuple[str, str, int, int]) -> LeaseInfo:
        key, owner, token, left_ms = row
        return LeaseInfo(key, owner, token, max(0, left_ms) / 1000.0)

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        """Live leases whose key starts with ``prefix``, sorted by key."""

        def op(cursor: sqlite3.Cursor) -> list[LeaseInfo]:
            rows = cursor.execute(_LIST, (prefix, *self._params(None, None, 0)[1:5])).fetchall()
            return [self._info(row) for row in rows]

        return self._run("list leases", op)

    def get(self, key: str) -> LeaseInfo | None:
        """The live lease on ``key``, or ``None`` when it is free."""

        def op(cursor: sqlite3.Cursor) -> LeaseInfo | None:
            row = cursor.execute(_GET, self._params(key, None, 0)[:5]).fetchone()
            return None if row is None else self._info(row)

        return self._run("read a lease", op)

    def last_token(self, key: str) -> int | None:
        """The last fencing token issued for ``key`` (kept after release) or, when larger, the
        last ticket ``mark_replaced`` drew for it; ``None`` when it has neither."""

        def op(cursor: sqlite3.Cursor) -> int | None:
            row = cursor.execute(_LAST_TOKEN, (key,)).fetchone()
            return None if row is None else int(row[0])

        return self._run("read a token", op)

    def force_release(self, key: str) -> LeaseInfo | None:
        """Delete the live lease on ``key`` whoever holds it; returns it. The counter is kept."""

        def op(cursor: sqlite3.Cursor) -> LeaseInfo | None:
            with self._write(cursor):
                row = cursor.execute(_GET, self._params(key, None, 0)[:5]).fetchone()
                if row is None:
                    return None
                cursor.execute("UPDATE celery_lease SET owner = NULL WHERE key = ?", (key,))
                return self._info(row)

        return self._run("force-release", op)

    @property
    def path(self) -> str:
        """The database file, as given."""
        return self._path

    def close(self) -> None:
        """Close this process's connection; a later call opens a new one."""
        connection = self._own_connection()
        with connection.lock:  # a fork waits for it: no child copies SQLite's state mid-close
            connection.close()

    def __del__(self) -> None:
        """A store dropped without :meth:`close` closes its connection here, under its lock (a
        fork in another thread waits for it), never waiting for it; one inherited through a
        fork is parked instead."""
        connection = self.__dict__.get("_connection")
        if connection is not None:
            try:  # noqa: SIM105 - no module global (suppress): at interpreter shutdown it may be None
                connection.close_unless_busy()
            except Exception:  # pragma: no cover - interpreter shutdown: nothing left to tell
                pass

    def __repr__(self) -> str:
        return f"SQLiteLockStore({self._path!r}, clock={self._clock!r})"


def _check_slot_request(key: str, limit: int) -> None:
    """ValueError for a ``limit`` outside 1 .. MAX_LIMIT (or not an int) or a key holding
    U+001F, before any I/O."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"acquire_slot({key!r}, limit={limit!r}): needs 1 <= limit <= {MAX_LIMIT}")
    if SLOT_MARK in key:
        raise ValueError(f"acquire_slot({key!r}, limit={limit!r}): a key may not contain U+001F")


def _slot_of(key: str, store_key: str) -> int | None:
    """The slot of ``key`` that ``store_key`` names (its canonical digits), else None."""
    base, slot = split_slot(store_key)
    if base != key or slot is None or store_key != slot_key(key, slot):
        return None
    return slot


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


def _host_boot() -> tuple[str | None, float]:
    """This boot's id and the monotonic offset (seconds) of this process's time namespace;
    ``(None, 0.0)`` (the wall clock) without a boot id or this process's own offset
    (``timens_offsets`` shows its children's namespace after ``unshare(CLONE_NEWTIME)``)."""
    try:
        with open(_BOOT_ID_FILE, encoding="ascii") as file:
            boot = file.read().strip()
    except (OSError, UnicodeDecodeError):
        return None, 0.0
    if not boot:
        return None, 0.0
    try:
        own, for_children = os.readlink(_TIMENS_OWN), os.readlink(_TIMENS_CHILDREN)
    except OSError:  # a kernel without time namespaces: no offset
        return boot, 0.0
    if own == _TIMENS_INITIAL:
        return boot, 0.0  # the host's namespace, whatever the children's
    if own != for_children:
        logger.warning(
            "celery-lease: this process is in a time namespace whose offset it cannot read "
            "(%s; its children: %s): the SQLite store judges expiry by the wall clock",
            own,
            for_children,
        )
        return None, 0.0
    offset = 0.0
    try:
        with open(_TIMENS_FILE, encoding="ascii") as file:
            for line in file:
                fields = line.split()  # "monotonic <seconds> <nanoseconds>" (or clock id 1)
                if len(fields) == 3 and fields[0] in ("monotonic", "1"):
                    offset = int(fields[1]) + int(fields[2]) / 1e9
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    return boot, offset


def _check_columns(conn: sqlite3.Connection, path: str) -> None:
    """Refuse a file whose ``celery_lease`` table lacks a column this store writes."""
    present = {row[1] for row in conn.execute("PRAGMA table_info(celery_lease)")}
    missing = [name for name in _COLUMNS if name not in present]
    if missing:
        raise LeaseConfigError(
            f"path={path!r} holds a celery_lease table without the column(s)"
            f" {', '.join(missing)}: another program's table, or one an unreleased build of"
            " celery-lease made; point lease_store at another file, or delete this one once no"
            " process uses it (it only holds leases, each gone within its ttl)"
        )


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
