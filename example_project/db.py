"""The example project's database: accounts guarded by fencing tokens, a cache and reports.

The same SQL runs on SQLite (the default: a file) and on PostgreSQL (when
``EXAMPLE_DATABASE_URL`` is a ``postgresql://`` DSN; ``pip install 'celery-lease[postgres]'``).

The point of the ``fence`` column: a writer carries the fencing token of the lease it holds, and
the row only accepts a token at least as high as the last one written. The fenced writes
(:func:`write_balance`, :func:`write_cache`) do not spell that check out by hand: they use
:mod:`celery_lease.fencing.sqlalchemy` (SQLAlchemy Core, on the same tables), which sends::

    UPDATE accounts SET balance = ?, fence = ? WHERE id = ? AND (fence IS NULL OR fence <= ?)

and checks the row count. A holder that stalled past its ttl (a GC pause, a frozen VM, SIGSTOP)
still believes it holds the lease when it wakes up; by then a newer holder has written with a
higher token, so the stale write matches no row and :func:`write_balance` raises
:class:`StaleWriteError`. Checking ``lease.lost`` before writing is not enough: the lease can
expire between the check and the write. The fence in the ``WHERE`` clause is checked atomically
by the database itself.

An equal token is accepted (the helpers' rule, ``<=``): only one acquisition ever gets a given
token, so an equal fence is the same holder writing again, e.g. retrying a write whose reply was
lost. (Until the helpers existed this module used a strict ``fence < ?``, which refused such a
retry.)
"""

from __future__ import annotations

import functools
import os
import sqlite3
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_lease.fencing import MissingRowError, StaleTokenError

if TYPE_CHECKING:
    from sqlalchemy import Engine, Table

# SQLAlchemy (for the fencing helpers) is imported on the first fenced write, not with this
# module: the workers, both beat instances and the demo import it, and on a small machine four
# imports of SQLAlchemy at start-up cost the demo more than one per pool child later.

__all__ = [
    "Account",
    "AccountNotFoundError",
    "StaleWriteError",
    "connect",
    "create_account",
    "database_url",
    "get_account",
    "init_db",
    "list_accounts",
    "read_cache",
    "read_reports",
    "write_balance",
    "write_cache",
    "write_report",
]

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS accounts ("
    " id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, fence BIGINT NOT NULL DEFAULT 0)",
    "CREATE TABLE IF NOT EXISTS cache ("
    " name TEXT PRIMARY KEY, value TEXT NOT NULL, fence BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS reports ("
    " id BIGINT PRIMARY KEY, day TEXT NOT NULL, accounts BIGINT NOT NULL,"
    " total BIGINT NOT NULL, fence BIGINT NOT NULL)",
)
"""Tables, in SQL that SQLite and PostgreSQL both accept. Amounts are integer cents."""


class StaleWriteError(StaleTokenError):
    """A write carried a fencing token lower than the row's: a newer holder wrote first.

    A :class:`~celery_lease.fencing.StaleTokenError` (``key`` ``"account:<id>"``, ``token``,
    ``current``) with the account's own names. The constructor's parameters equal
    ``self.args``, so the error survives Celery's json and pickle result serialisation.

    Attributes:
        account_id: the account written.
        token: the token of the rejected write.
        fence: the row's fence (the token of the last accepted write).
    """

    def __init__(self, account_id: int, token: int, fence: int | None) -> None:
        super().__init__(f"account:{account_id}", token, fence, f"accounts id={account_id}")
        self.args = (account_id, token, fence)
        self.account_id = account_id
        self.fence = fence

    def __str__(self) -> str:
        return (
            f"write to account {self.account_id} with token {self.token} rejected: the row's "
            f"fence is already {self.fence}"
        )


class AccountNotFoundError(LookupError):
    """No account with this id.

    Attributes:
        account_id: the id looked up.
    """

    def __init__(self, account_id: int) -> None:
        super().__init__(account_id)
        self.account_id = account_id

    def __str__(self) -> str:
        return f"no account {self.account_id}"


@dataclass(frozen=True)
class Account:
    """One row of ``accounts``: balance in cents, and the last fencing token written."""

    id: int
    balance: int
    fence: int


def database_url() -> str:
    """``EXAMPLE_DATABASE_URL``, else an SQLite file next to the example's other data.

    Accepted: a ``postgresql://`` / ``postgres://`` DSN, ``sqlite:///path`` or a plain path.
    Read at every call, so tests and the demo can point the tasks elsewhere.
    """
    url = os.environ.get("EXAMPLE_DATABASE_URL", "").strip()
    if url:
        return url
    data_dir = os.environ.get("EXAMPLE_DATA_DIR") or os.path.join(
        tempfile.gettempdir(), f"celery-lease-example-{os.getuid()}"
    )
    return os.path.join(data_dir, "accounts.sqlite3")


def _is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


class _Connection:
    """A thin wrapper that lets the same ``?``-style SQL run on sqlite3 and psycopg 3."""

    def __init__(self, raw: Any, postgres: bool) -> None:
        self.raw = raw
        self.postgres = postgres

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; ``?`` placeholders become ``%s`` on PostgreSQL."""
        if self.postgres:
            sql = sql.replace("?", "%s")
        return self.raw.execute(sql, tuple(params))


@contextmanager
def connect(url: str | None = None) -> Iterator[_Connection]:
    """A connection in one transaction: committed when the block ends, rolled back on error.

    Args:
        url: the database (default: :func:`database_url`).
    """
    url = url or database_url()
    if _is_postgres(url):
        import psycopg

        with psycopg.connect(url) as pg:  # commits on success, rolls back on error
            yield _Connection(pg, postgres=True)
        return
    conn = sqlite3.connect(_sqlite_path(url), timeout=15.0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield _Connection(conn, postgres=False)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()


def init_db(url: str | None = None) -> None:
    """Create the tables if they do not exist (and turn on WAL for an SQLite file)."""
    url = url or database_url()
    if not _is_postgres(url):
        path = _sqlite_path(url)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        raw = sqlite3.connect(path, timeout=15.0)
        try:
            raw.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        finally:
            raw.close()
    with connect(url) as conn:
        for statement in SCHEMA:
            conn.execute(statement)


def _sqlite_path(url: str) -> str:
    """The file of ``sqlite:////abs``, ``sqlite:///rel`` or a plain path."""
    if url.startswith("sqlite:////"):
        return "/" + url.removeprefix("sqlite:////")
    if url.startswith("sqlite:///"):
        return url.removeprefix("sqlite:///")
    return url


def create_account(account_id: int, balance: int, url: str | None = None) -> Account:
    """Insert an account with fence 0 (no token written yet)."""
    with connect(url) as conn:
        conn.execute(
            "INSERT INTO accounts (id, balance, fence) VALUES (?, ?, 0)", (account_id, balance)
        )
    return Account(account_id, balance, 0)


def get_account(account_id: int, url: str | None = None) -> Account:
    """The account's current row.

    Raises:
        AccountNotFoundError: no such account.
    """
    with connect(url) as conn:
        row = conn.execute(
            "SELECT id, balance, fence FROM accounts WHERE id = ?", (account_id,)
        ).fetchone()
    if row is None:
        raise AccountNotFoundError(account_id)
    return Account(int(row[0]), int(row[1]), int(row[2]))


def list_accounts(url: str | None = None) -> list[Account]:
    """Every account, by id."""
    with connect(url) as conn:
        rows = conn.execute("SELECT id, balance, fence FROM accounts ORDER BY id").fetchall()
    return [Account(int(r[0]), int(r[1]), int(r[2])) for r in rows]


def _engine(url: str | None = None) -> Engine:
    """A SQLAlchemy engine on the database, one per process and URL (made on first use)."""
    url = url or database_url()
    key = (os.getpid(), url)  # a forked pool child makes its own: pools do not survive a fork
    engine = _ENGINES.get(key)
    if engine is None:
        from sqlalchemy import create_engine

        if _is_postgres(url):
            rest = url.split("://", 1)[1]
            engine = create_engine(f"postgresql+psycopg://{rest}")
        else:
            path = os.path.abspath(_sqlite_path(url))
            engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 15.0})
        _ENGINES[key] = engine
    return engine


_ENGINES: dict[tuple[int, str], Engine] = {}


@functools.cache
def _tables() -> dict[str, Table]:
    """The fenced tables as SQLAlchemy Core ``Table`` objects (the same columns as SCHEMA)."""
    from sqlalchemy import BigInteger, Column, MetaData, Table, Text

    metadata = MetaData()
    return {
        "accounts": Table(
            "accounts",
            metadata,
            Column("id", BigInteger, primary_key=True, autoincrement=False),
            Column("balance", BigInteger, nullable=False),
            Column("fence", BigInteger, nullable=False, server_default="0"),
        ),
        "cache": Table(
            "cache",
            metadata,
            Column("name", Text, primary_key=True),
            Column("value", Text, nullable=False),
            Column("fence", BigInteger, nullable=False),
        ),
    }


def write_balance(
    account_id: int, balance: int, token: int | None = None, url: str | None = None
) -> Account:
    """Set the balance, fenced: applied only if no higher token wrote the row before.

    Args:
        account_id: the account.
        balance: the new balance (an absolute value: a retry with the same token is harmless).
        token: the fencing token (default: the token of the lease held around the call, e.g.
            inside a task body with a lock).
        url: the database (default: :func:`database_url`).

    Raises:
        StaleWriteError: a write with a higher token was accepted before.
        AccountNotFoundError: no such account.
    """
    from celery_lease.fencing.sqlalchemy import fenced_update

    try:
        written = fenced_update(
            _engine(url),
            _tables()["accounts"],
            where={"id": account_id},
            values={"balance": balance},
            token=token,
        )
    except StaleTokenError as exc:
        raise StaleWriteError(account_id, exc.token, exc.current) from exc
    except MissingRowError:
        raise AccountNotFoundError(account_id) from None
    return Account(account_id, balance, written)


def read_cache(name: str, url: str | None = None) -> tuple[str, int] | None:
    """The cached value of ``name`` and the token that wrote it, or ``None``."""
    with connect(url) as conn:
        row = conn.execute("SELECT value, fence FROM cache WHERE name = ?", (name,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def write_cache(name: str, value: str, token: int | None = None, url: str | None = None) -> bool:
    """Store a rebuilt cache value, fenced like the balance (the row is created on first
    write); returns whether it was accepted (``False``: a higher token wrote it before)."""
    from celery_lease.fencing.sqlalchemy import fenced_upsert

    try:
        fenced_upsert(
            _engine(url),
            _tables()["cache"],
            where={"name": name},
            values={"value": value},
            token=token,
        )
    except StaleTokenError:
        return False
    return True


def write_report(day: str, token: int, url: str | None = None) -> tuple[int, int]:
    """Sum up the accounts into a new ``reports`` row (with the run's token); returns
    (number of accounts, total balance)."""
    with connect(url) as conn:
        count, total = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(balance), 0) FROM accounts"
        ).fetchone()
        next_id = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM reports").fetchone()[0]
        conn.execute(
            "INSERT INTO reports (id, day, accounts, total, fence) VALUES (?, ?, ?, ?, ?)",
            (next_id, day, count, total, token),
        )
    return int(count), int(total)


def read_reports(url: str | None = None) -> list[tuple[int, str, int, int, int]]:
    """Every report row: (id, day, accounts, total, fence)."""
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT id, day, accounts, total, fence FROM reports ORDER BY id"
        ).fetchall()
    return [(int(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows]
