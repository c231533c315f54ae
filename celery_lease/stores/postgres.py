"""PostgreSQL store: one table, one statement per operation, time from the database's clock.

The SQL: :mod:`~celery_lease.stores._postgres_common`; the table, grants, tokens and clock:
docs/stores.md (PostgreSQL); threads, locks and fork: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from celery_lease import _forking as forking
from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores._postgres_common import (
    CANCELLED_BY_TIMEOUT,
    CREATED_CONCURRENTLY,
    DEFAULT_TABLE,
    MISSING_TABLE,
    POOL_NAME,
    SCHEMA_SQL,
    ConnectFailures,
    ListenerRetry,
    Rows,
    Step,
    StoreBase,
    check_key_order,
    check_slot_request,
    connect_kwargs,
    describe_error,
    lease_info,
    log_undo_failed,
    no_connection_detail,
    notify_payload,
    parse_dsn,
    replace_plan,
    schema_sql,
    slot_plan,
    statements,
    target,
    token_of,
)
from celery_lease.stores.base import LeaseInfo

__all__ = ["DEFAULT_TABLE", "SCHEMA_SQL", "PostgresLockStore", "statements"]

logger = logging.getLogger("celery_lease.stores.postgres")

_T = TypeVar("_T")


def _recording_connection_class(failures: ConnectFailures) -> type[psycopg.Connection[Any]]:
    """A connection class that records why connecting failed: psycopg_pool connects in
    background threads, and a caller that times out would otherwise never learn the cause."""

    class _StoreConnection(psycopg.Connection[Any]):
        celery_lease_own_connection = True  # OWN_CONNECTION: psycopg_pool's records folded

        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
            with failures.recording():
                return super().connect(conninfo, **kwargs)

    return _StoreConnection


_SETTLE_TIMEOUT = 5.0  # seconds an interrupted statement gets to end after its cancellation


def _settle_interrupted(conn: psycopg.Connection[Any]) -> None:
    """After an async exception inside a statement: cancel it (else it may commit later, e.g.
    an acquire queued on a row lock; psycopg cancels only for KeyboardInterrupt and SystemExit),
    read its end and close ``conn`` (its client state is unknown: never back to the pool)."""
    pgconn = conn.pgconn
    try:
        if pgconn.transaction_status == TransactionStatus.ACTIVE:
            cancel_safe = getattr(conn, "cancel_safe", None)  # psycopg >= 3.2
            if cancel_safe is not None:
                cancel_safe(timeout=_SETTLE_TIMEOUT)
            else:  # pragma: no cover - psycopg 3.1
                conn.cancel()
            deadline = time.monotonic() + _SETTLE_TIMEOUT
            while True:
                pgconn.consume_input()
                while not pgconn.is_busy():
                    if pgconn.get_result() is None:
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("celery-lease: an interrupted statement did not end in time")
                    return
                select.select([pgconn.socket], [], [], remaining)
    except Exception as exc:
        logger.warning("celery-lease: ending an interrupted statement failed (%s)", exc)
    finally:
        conn.close()


_IN_TRANSACTION = (TransactionStatus.INTRANS, TransactionStatus.INERROR)


def _steps(
    conn: psycopg.Connection[Any],
    plan: Generator[Step, Rows, _T],
    pipeline: psycopg.Pipeline | None,
) -> _T:
    """Execute each statement of ``plan`` (after a pipeline sync, when pipelined) and send its
    rows back; the plan's result."""
    step = next(plan)
    while True:
        cursor = conn.execute(*step)
        if pipeline is not None:
            pipeline.sync()
        rows = cursor.fetchall() if cursor.description is not None else []
        try:
            step = plan.send(rows)
        except StopIteration as stop:
            result: _T = stop.value
            return result


def _pool_target(pool: ConnectionPool[Any]) -> str:
    """Where a caller's pool connects (from its conninfo and kwargs), plus its name."""
    name = f"pool={getattr(pool, 'name', None)!r}"
    conninfo, kwargs = pool.conninfo, pool.kwargs
    if callable(conninfo) or callable(kwargs):
        return name  # resolved per connection: do not call user code from repr()
    try:
        params = conninfo_to_dict(conninfo or "")
    except psycopg.Error:
        return name
    for option in ("host", "port", "dbname"):
        if isinstance(kwargs, dict) and kwargs.get(option) is not None:
            params[option] = kwargs[option]
    return f"{target(params)}, {name}"


_STORES: weakref.WeakSet[PostgresLockStore] = weakref.WeakSet()

# Pools and connections inherited through fork(), kept referenced and never closed in the child:
# closing would send Terminate on the parent's socket and end its session.
_INHERITED: list[object] = []


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forget_inherited()


forking.on_fork_child(_after_fork_in_child, name="postgres stores: inherited pools parked")


@dataclass(eq=False)
class _Interest:
    """Waiters of one key: all of them wake when a release of the key (or of one of its slots)
    is notified."""

    event: threading.Event = field(default_factory=threading.Event)
    refs: int = 0


class _Listener:
    """One thread holding a ``LISTEN`` connection, waking per-key slots (filed under the key's
    NOTIFY payload); ``ready`` is set while it listens. A reconnect wakes every slot (spurious
    wake-ups are allowed, lost ones would cost a waiter a poll interval)."""

    _TICK = 1.0  # seconds between checks of the stop flag while no notification arrives

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], channel: str) -> None:
        self._connect = connect
        self._channel = channel
        # A private channel: a NOTIFY on it wakes the thread at once when the store closes.
        self.stop_channel = f"celery_lease_stop_{uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._slots: dict[str, _Interest] = {}
        self._blocked = 0  # threads blocked in wait() with the listener ready
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"celery-lease-listen[{channel}]", daemon=True
        )
        self._thread.start()

    def register(self, key: str) -> _Interest:
        payload = notify_payload(key)
        with self._lock:
            slot = self._slots.get(payload)
            if slot is None:
                slot = self._slots[payload] = _Interest()
            slot.refs += 1
            return slot

    def unregister(self, key: str, slot: _Interest) -> None:
        payload = notify_payload(key)
        with self._lock:
            slot.refs -= 1
            if slot.refs <= 0 and self._slots.get(payload) is slot:
                del self._slots[payload]

    def wait(self, key: str, slot: _Interest, deadline_in: float) -> bool:
        """Block on ``slot`` for up to ``deadline_in`` seconds; True when it was woken."""
        started = time.monotonic()
        if not self.ready.wait(deadline_in):
            return slot.event.is_set()
        remaining = deadline_in - (time.monotonic() - started)
        with self._lock:
            self._blocked += 1
        try:
            return slot.event.wait(max(0.0, remaining))
        finally:
            with self._lock:
                self._blocked -= 1

    def blocked(self) -> int:
        with self._lock:
            return self._blocked

    def _wake(self, payload: str) -> None:
        with self._lock:
            slot = self._slots.pop(payload, None)
        if slot is not None:
            slot.event.set()

    def _wake_all(self) -> None:
        with self._lock:
            slots = list(self._slots.values())
            self._slots.clear()
        for slot in slots:
            slot.event.set()

    def _run(self) -> None:
        retry = ListenerRetry("listener", logger)
        listen = sql.SQL("LISTEN {}; LISTEN {}").format(
            sql.Identifier(self._channel), sql.Identifier(self.stop_channel)
        )
        while not self._stop.is_set():
            try:
                conn = self._connect()
            except psycopg.Error as exc:
                self._stop.wait(retry.failed(exc))
                continue
            self._conn = conn
            try:
                conn.execute(listen)
                if retry.connected():
                    self._wake_all()
                self.ready.set()
                while not self._stop.is_set():
                    for notify in conn.notifies(timeout=self._TICK):
                        if notify.channel != self._channel:
                            break  # the stop channel: the loop condition decides
                        self._wake(notify.payload)
            except psycopg.Error as exc:
                if not self._stop.is_set():
                    logger.warning("celery-lease: listener connection lost (%s)", exc)
            finally:
                self.ready.clear()
                self._conn = None
                with contextlib.suppress(psycopg.Error):
                    conn.close()

    def request_stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._wake_all()

    def forget(self) -> None:
        """In a forked child: the thread is gone; keep its connection unclosed and unused."""
        self._stop.set()
        if self._conn is not None:
            _INHERITED.append(self._conn)


class PostgresLockStore(StoreBase):
    """A :class:`~celery_lease.LockStore` in a PostgreSQL table; excludes across hosts.

    Implements the protocol, :class:`~celery_lease.SupportsReleaseNotify`,
    :class:`~celery_lease.SupportsBatchRenew`, :class:`~celery_lease.SupportsInspection`,
    ``SupportsSlots`` and ``SupportsReplace`` (rows and tickets:
    :mod:`~celery_lease.stores._postgres_common`).

    Given a DSN, the store opens its own pool of autocommit connections on first use (rebuilt
    in a forked child); a pool passed in is used as is, never closed, and not rebuilt after a
    fork. :meth:`wait_for_release` holds one extra ``LISTEN`` connection per process. A dropped
    connection is retried once (not for ``force_release``); other failures raise
    ``StoreUnavailableError`` naming the store (never the password), the operation and the
    server's message with its SQLSTATE. An interrupt inside a statement cancels it (waiting up
    to 5 s) and an interrupted acquire releases what it may have taken. Details:
    docs/stores.md (PostgreSQL).

    Args:
        dsn_or_pool: a libpq connection string or URL (``postgresql://`` or ``postgres://``), or
            a ``psycopg_pool.ConnectionPool`` (autocommit connections recommended: otherwise each
            operation also pays a ``COMMIT``).
        table: the table name, optionally ``schema.table`` (default ``"celery_lease"``).
        connect_timeout: seconds to wait for a connection (new or from the pool) before raising
            ``StoreUnavailableError`` (default 5.0).
        statement_timeout: seconds one statement of the store may run on the server, waits for
            waits for locked rows included (default 5.0; PostgreSQL's ``statement_timeout``, set
            on each connection of the internal pool). Exceeding it raises
            ``StoreUnavailableError`` naming the bound, without a retry. With a pool passed in,
            that pool's own settings apply. The multi-statement transactions (``acquire_slot``,
            ``mark_replaced``) set, locally, ``lock_timeout`` to it and
            ``idle_in_transaction_session_timeout`` to half of it, also on a pool passed in.
        max_connections: the size limit of the internal pool (default 8); ignored with a pool.
        create_table: whether the store may create a missing table (default: the URL's
            ``?create_table=true|false`` when given, else True). When False, or when the role
            may not create it, a missing table raises ``StoreUnavailableError`` naming the table
            and :meth:`schema_sql`.

    Raises:
        LeaseConfigError: for a bad ``table``, ``dsn_or_pool``, ``connect_timeout``,
            ``statement_timeout`` (not a number of seconds > 0), ``max_connections`` or
            ``create_table`` (also a URL value that is not a boolean, or one that contradicts
            the keyword).
    """

    _logger = logger

    def __init__(
        self,
        dsn_or_pool: str | ConnectionPool[Any],
        *,
        table: str = DEFAULT_TABLE,
        connect_timeout: float = 5.0,
        statement_timeout: float = 5.0,
        max_connections: int = 8,
        create_table: bool | None = None,
    ) -> None:
        self._set_options(table, connect_timeout, statement_timeout, max_connections, create_table)
        self._where = ""
        self._secrets: tuple[str, ...] = ()  # passwords of the DSN, masked in every message
        if isinstance(dsn_or_pool, ConnectionPool):
            self._dsn: str | None = None
            self._given_pool: ConnectionPool[Any] | None = dsn_or_pool
            self._application_name = False
        elif isinstance(dsn_or_pool, str):
            parsed = parse_dsn(dsn_or_pool, create_table)
            create_table = parsed.create_table
            self._secrets = parsed.secrets
            self._dsn = parsed.dsn
            self._given_pool = None
            self._where = parsed.where
            self._application_name = parsed.application_name
        else:
            raise LeaseConfigError(
                f"dsn_or_pool={type(dsn_or_pool).__name__} must be a DSN string or a "
                "psycopg_pool.ConnectionPool"
            )
        self._create_table = True if create_table is None else create_table
        self._connect_failures = ConnectFailures(
            f"PostgresLockStore({self._where}, table={self._table!r})", logger
        )
        self._connection_class = _recording_connection_class(self._connect_failures)
        self._init_process_state()
        _STORES.add(self)

    def _init_process_state(self) -> None:
        """State that belongs to one process: rebuilt in a forked child."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = self._given_pool
        self._owns_pool = self._given_pool is None
        self._schema_lock = threading.Lock()
        self._listener: _Listener | None = None
        self._pool_for_close: ConnectionPool[Any] | None = None
        self._local = threading.local()
        self._closed = False

    @classmethod
    def schema_sql(cls, table: str = DEFAULT_TABLE) -> str:
        """The ``CREATE TABLE IF NOT EXISTS`` statement for ``table`` (validated and quoted).

        Raises:
            LeaseConfigError: for a bad ``table``.
        """
        return schema_sql(table)

    def _connect_kwargs(self) -> dict[str, Any]:
        return connect_kwargs(self._connect_timeout, self._application_name)

    def _forget_inherited(self) -> None:
        """In a forked child: abandon (without closing) the parent's pool and listener."""
        if self._owns_pool and self._pool is not None:
            _INHERITED.append(self._pool)
        if self._listener is not None:
            self._listener.forget()
        closed = self._closed
        self._init_process_state()
        self._closed = closed

    def _once(self, read: Callable[[], _T | None], make: Callable[[], _T]) -> _T:
        """``read()``, else ``make()`` under the lock (it keeps what it made) unless the store
        is closed; state inherited through a fork is abandoned first."""
        if self._pid != os.getpid():  # forked without os.register_at_fork (e.g. by C code)
            self._forget_inherited()
        value = read()
        if value is not None:
            return value
        with self._lock:
            if self._closed:
                raise StoreUnavailableError(f"{self!r} is closed")
            value = read()
            return make() if value is None else value

    def _get_pool(self) -> ConnectionPool[Any]:
        return self._once(lambda: self._pool, self._new_pool)

    def _new_pool(self) -> ConnectionPool[Any]:
        assert self._dsn is not None
        options = self._pool_options(POOL_NAME, self._connect_kwargs())
        pool = ConnectionPool(self._dsn, configure=self._configure_connection, **options)
        pool.open(wait=False)
        self._pool = pool
        return pool

    def _configure_connection(self, conn: psycopg.Connection[Any]) -> None:
        """``SET statement_timeout`` on a new pooled connection (a session setting, not
        libpq's ``options``, which poolers such as PgBouncer refuse)."""
        millis = max(1, round(self._statement_timeout * 1000))
        conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(f"{millis}ms")))

    def _listener_connect(self) -> psycopg.Connection[Any]:
        if self._dsn is not None:
            return psycopg.Connection.connect(self._dsn, **self._connect_kwargs())
        pool = self._given_pool
        assert pool is not None
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = dict(pool.kwargs() if callable(pool.kwargs) else (pool.kwargs or {}))
        kwargs["autocommit"] = True
        kwargs.setdefault("connect_timeout", max(1, round(self._connect_timeout)))
        return psycopg.Connection.connect(conninfo, **kwargs)

    def _get_listener(self) -> _Listener:
        return self._once(lambda: self._listener, self._new_listener)

    def _new_listener(self) -> _Listener:
        self._listener = _Listener(self._listener_connect, self._channel)
        return self._listener

    def _run(
        self, what: str, fn: Callable[[psycopg.Connection[Any]], _T], *, redo: bool = True
    ) -> _T:
        """``fn`` (one statement) on a pooled connection; a dropped one retried once if ``redo``."""
        pool = self._get_pool()
        for attempt in (1, 2):
            got_connection = False
            try:
                with pool.connection(timeout=self._connect_timeout) as conn:
                    got_connection = True
                    return self._execute(what, conn, fn)
            except PoolTimeout as exc:
                last = self._connect_failures.last if self._owns_pool else None
                detail = no_connection_detail(self._connect_timeout, last, exc)
                raise self._error(what, None, detail) from exc
            except CANCELLED_BY_TIMEOUT as exc:
                # Cancelled by the server's statement or lock timeout: not retried (that would
                # double the bound), unlike the async store (whose bound is the client's).
                bound = f" (statement_timeout {self._statement_timeout:g} s)"
                raise self._error(
                    what,
                    None,
                    f"no answer within the server's statement or lock timeout"
                    f"{bound if self._owns_pool else ''}; a row or the table may be locked by "
                    f"another session: {describe_error(exc)}",
                ) from exc
            except psycopg.Error as exc:
                error = self._failure(
                    what, None, exc, connected=got_connection, first=attempt == 1, redo=redo
                )
                if error is not None:
                    raise error from exc
                # Test the idle connections, so the retry gets a live one.
                with contextlib.suppress(Exception):
                    pool.check()
        raise AssertionError("unreachable")  # pragma: no cover

    def _execute(
        self, what: str, conn: psycopg.Connection[Any], fn: Callable[[psycopg.Connection[Any]], _T]
    ) -> _T:
        """``fn(conn)``; a missing table is created (if allowed) and ``fn`` run again."""
        try:
            try:
                return fn(conn)
            except MISSING_TABLE as exc:
                if not conn.autocommit:
                    conn.rollback()
                self._make_table(what, conn, exc)
                return fn(conn)
        except (psycopg.Error, StoreUnavailableError):
            raise
        except BaseException:
            # An interrupt raised inside the statement: end it before anyone goes on.
            _settle_interrupted(conn)
            raise

    def _make_table(self, what: str, conn: psycopg.Connection[Any], missing: psycopg.Error) -> None:
        """Create the missing table, or raise ``StoreUnavailableError`` saying how to."""
        self._check_may_create(what, None, missing)
        with self._schema_lock:  # threads of this process queue instead of racing the DDL
            try:
                conn.execute(self._sql["schema"])
            except CREATED_CONCURRENTLY:  # another session created it concurrently
                if not conn.autocommit:
                    conn.rollback()
            except psycopg.errors.InsufficientPrivilege as exc:
                if not conn.autocommit:
                    conn.rollback()
                raise self._error(what, None, self._denied(exc, creating=True)) from exc
            else:
                if not conn.autocommit:
                    conn.commit()
                logger.info("celery-lease: created table %r", self._table)

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        slot = self._interest_before_acquire(key)
        params = {"key": key, "owner": owner, "ttl_ms": ttl_ms}

        def run(conn: psycopg.Connection[Any]) -> int | None:
            return token_of(conn.execute(self._sql["acquire"], params).fetchone())

        try:
            token = self._run("acquire", run)
        except StoreUnavailableError as exc:
            self._drop_interest(key, slot)
            self._refuse_long_key(key, exc)
            raise
        except BaseException:
            self._drop_interest(key, slot)
            try:  # release what it may have taken (``owner`` is unique per attempt)
                self.release(key, owner)
            except Exception as undo_failed:
                log_undo_failed(logger, key, "was interrupted", undo_failed)
            raise
        if token is None and slot is not None:
            self._park_interest(key, slot)
        else:
            self._drop_interest(key, slot)
        return token

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        """Take the lowest free slot of ``key`` below ``limit`` when fewer than ``limit`` of its
        slots are live (see :class:`~celery_lease.stores.base.SupportsSlots`).

        One transaction of three statements (lock the key's slot counter, read its slot rows,
        write the slot and the counter; see ``slot_plan``). An interrupted call releases every
        slot of ``key`` that ``owner`` may have taken.
        """
        check_slot_request(key, limit)
        self._check_key_order()
        interest = self._interest_before_acquire(key)
        try:
            got = self._run_plan(
                "acquire a slot", lambda: slot_plan(self._sql, key, owner, ttl_ms, limit)
            )
        except StoreUnavailableError as exc:
            self._drop_interest(key, interest)
            self._refuse_long_key(key, exc)
            raise
        except BaseException:
            self._drop_interest(key, interest)
            try:  # release what it may have taken (``owner`` is unique per attempt)
                params = self._release_slots_params(key, owner)
                self._run("release", lambda conn: conn.execute(self._sql["release_slots"], params))
            except Exception as undo_failed:
                log_undo_failed(logger, key, "was interrupted", undo_failed)
            raise
        if got is None and interest is not None:
            self._park_interest(key, interest)
        else:
            self._drop_interest(key, interest)
        return got

    def _check_key_order(self) -> None:
        """Once per store: ``LeaseConfigError`` if the table's key column is not in byte order
        (``check_key_order``), before any slot row is written."""
        if self._key_order_checked:
            return
        rows = self._run(
            "read the key column's collation",
            lambda conn: conn.execute(self._sql["key_collation"]).fetchall(),
        )
        check_key_order(repr(self), self._table, rows)
        self._key_order_checked = True

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        """Ask the live holder of ``key`` to stop (see
        :class:`~celery_lease.stores.base.SupportsReplace`): one transaction (``replace_plan``).
        Marking copies the holder's own token to the key's holder row
        (:data:`~celery_lease.stores._postgres_common.HOLDER_SUFFIX`); a ticket is drawn into
        the key's row (its counter). A ticket drawn while another owner than ``holder`` holds
        the key unmarked is set aside in the holder row (``last_token`` counts it): above every
        token issued so far, and below later ones once the clock has passed it."""
        return self._run_plan(
            "ask the holder to stop", lambda: replace_plan(self._sql, key, ticket, holder)
        )

    def _run_plan(self, what: str, make: Callable[[], Generator[Step, Rows, _T]]) -> _T:
        """Run a plan (``slot_plan``, ``replace_plan``) as one transaction: each statement it
        yields is executed and its rows sent back; a dropped connection is retried once with a
        new plan (both plans are safe to repeat). On an autocommit connection, in pipeline mode
        (libpq >= 14), ``BEGIN`` and the transaction's settings (``plan_settings``: its lock and
        idle timeouts) go out with the first statement: one round trip per statement, plus
        ``COMMIT``. An interrupt leaves the transaction to ``_settle_interrupted`` (which closes
        the connection)."""

        def run(conn: psycopg.Connection[Any]) -> _T:
            plan = make()
            if not (conn.autocommit and psycopg.Pipeline.is_supported()):
                with conn.transaction():  # psycopg's BEGIN, then the settings: one trip more
                    conn.execute(self._plan_settings)
                    return _steps(conn, plan, None)
            try:
                with conn.pipeline() as pipeline:
                    conn.execute(b"BEGIN")  # queued: sent with the settings and 1st statement
                    conn.execute(self._plan_settings)
                    result = _steps(conn, plan, pipeline)
                    conn.execute(b"COMMIT")  # its reply is read as the pipeline ends
            except psycopg.Error:
                if conn.pgconn.transaction_status in _IN_TRANSACTION:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute(b"ROLLBACK")
                raise
            return result

        return self._run(what, run)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        params = {"key": key, "owner": owner, "ttl_ms": ttl_ms}
        return self._run(
            "renew", lambda conn: conn.execute(self._sql["renew"], params).rowcount == 1
        )

    def release(self, key: str, owner: str) -> None:
        params = self._release_params(key, owner)
        self._run("release", lambda conn: conn.execute(self._sql["release"], params))

    def release_owned_slots(self, key: str, owner: str) -> None:
        """Release every slot of ``key`` that ``owner`` holds, in one statement (see
        :class:`~celery_lease.stores.base.SupportsOwnedSlotsRelease`; notifies waiters)."""
        params = self._release_slots_params(key, owner)
        self._run("release", lambda conn: conn.execute(self._sql["release_slots"], params))

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Renew every ``(key, owner, ttl_ms)`` in one statement; results in input order."""
        if not items:
            return []
        params = {
            "keys": [key for key, _, _ in items],
            "owners": [owner for _, owner, _ in items],
            "ttls": [ttl_ms for _, _, ttl_ms in items],
        }

        def run(conn: psycopg.Connection[Any]) -> set[tuple[str, str]]:
            rows = conn.execute(self._sql["renew_many"], params).fetchall()
            return {(str(key), str(owner)) for key, owner in rows}

        renewed = self._run("renew_many", run)
        return [(key, owner) in renewed for key, owner, _ in items]

    def wait_for_release(self, key: str, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a release of ``key`` in any process; True when
        one was notified (rarely spuriously), False on timeout.

        The first call starts the listener and waits, within ``timeout``, for it to ``LISTEN``.
        Then a release after this thread's last failed :meth:`acquire` of ``key`` is never
        missed: that acquire registered interest before asking the server.
        """
        listener = self._get_listener()
        parked = self._take_parked(key)
        slot = parked if parked is not None else listener.register(key)
        try:
            if slot.event.is_set():
                return True
            return listener.wait(key, slot, max(0.0, timeout))
        finally:
            listener.unregister(key, slot)

    def waiting(self) -> int:
        """Threads now blocked in :meth:`wait_for_release` with a ready listener (for tests)."""
        listener = self._listener
        return 0 if listener is None else listener.blocked()

    def _interest_before_acquire(self, key: str) -> _Interest | None:
        """With a ready listener, register interest in ``key`` before trying to acquire it."""
        listener = self._listener
        if listener is None or not listener.ready.is_set() or self._pid != os.getpid():
            return None
        return listener.register(key)

    def _drop_interest(self, key: str, slot: _Interest | None) -> None:
        listener = self._listener
        if slot is not None and listener is not None:
            listener.unregister(key, slot)

    def _park_interest(self, key: str, slot: _Interest) -> None:
        """Keep the slot of a failed acquire for this thread's next wait (one per thread)."""
        previous: tuple[str, _Interest] | None = getattr(self._local, "parked", None)
        self._local.parked = (key, slot)
        if previous is not None:
            self._drop_interest(*previous)

    def _take_parked(self, key: str) -> _Interest | None:
        parked: tuple[str, _Interest] | None = getattr(self._local, "parked", None)
        if parked is None:
            return None
        self._local.parked = None
        if parked[0] == key:
            return parked[1]
        self._drop_interest(*parked)
        return None

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        """Live leases whose key starts with ``prefix``, sorted by key (code point order)."""
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        params = {"pattern": escaped + "%"}
        rows = self._run("list", lambda conn: conn.execute(self._sql["list"], params).fetchall())
        return [lease_info(row) for row in rows]

    def get(self, key: str) -> LeaseInfo | None:
        """The live lease on ``key`` (``expires_in`` by the server's clock), or None."""
        params = {"key": key}
        row = self._run("get", lambda conn: conn.execute(self._sql["get"], params).fetchone())
        return None if row is None else lease_info(row)

    def last_token(self, key: str) -> int | None:
        """The last token issued for ``key`` (kept after release and expiry), or None."""
        params = {"key": key}
        row = self._run(
            "last_token", lambda conn: conn.execute(self._sql["last_token"], params).fetchone()
        )
        return None if row is None else int(row[0])

    def force_release(self, key: str) -> LeaseInfo | None:
        """Clear the live lease on ``key`` whoever holds it, notify waiters, return it."""
        params = self._release_params(key)
        # Not redone: if the first attempt took effect, a redo could remove a newer lease.
        row = self._run(
            "force_release",
            lambda conn: conn.execute(self._sql["force_release"], params).fetchone(),
            redo=False,
        )
        return None if row is None else lease_info(row)

    def close(self) -> None:
        """Stop the listener and close the internal pool (a pool passed in is left open)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
            pool = self._pool if self._owns_pool else None
            self._pool_for_close = pool
            self._pool = None
        if self._pid != os.getpid():
            return  # forked: everything here belongs to the parent
        if listener is not None:
            listener.request_stop()
            self._notify_stop(listener)
            listener.join(timeout=_Listener._TICK + 1.0)
        if pool is not None:
            pool.close()

    def _notify_stop(self, listener: _Listener) -> None:
        """Best effort: wake the listener thread now rather than at its next tick."""
        if not listener.ready.is_set():
            return
        pool = self._given_pool if self._given_pool is not None else self._pool_for_close
        query = "SELECT pg_notify(%s, '')"
        try:
            if pool is not None:
                with pool.connection(timeout=1.0) as conn:
                    conn.execute(query, [listener.stop_channel])
            else:
                with self._listener_connect() as conn:
                    conn.execute(query, [listener.stop_channel])
        except (psycopg.Error, PoolClosed) as exc:
            logger.debug("celery-lease: could not wake the listener to stop (%s)", exc)

    def __repr__(self) -> str:
        where = self._where
        if not where and self._given_pool is not None:
            where = _pool_target(self._given_pool)
        return f"PostgresLockStore({where}, table={self._table!r})"
