"""PostgreSQL store for asyncio: the psycopg ``AsyncConnection`` twin of the sync store.

It renders the same statements (:func:`~celery_lease.stores._postgres_common.statements`) on the
same table, so sync and async holders exclude each other. Timeouts and cancellation:
docs/asyncio.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores._postgres_common import (
    ASYNC_POOL_NAME,
    CREATED_CONCURRENTLY,
    DEFAULT_TABLE,
    MISSING_TABLE,
    ConnectFailures,
    ListenerRetry,
    Rows,
    Step,
    StoreBase,
    check_key_order,
    check_slot_request,
    connect_kwargs,
    describe_error,
    log_undo_failed,
    no_connection_detail,
    notify_payload,
    parse_dsn,
    slot_plan,
    token_of,
)
from celery_lease.stores.base import LoopBinding
from celery_lease.stores.postgres import PostgresLockStore

__all__ = ["AsyncPostgresLockStore"]

logger = logging.getLogger("celery_lease.stores.postgres_async")

_T = TypeVar("_T")

_AsyncConn = psycopg.AsyncConnection[Any]
_IN_TRANSACTION = (TransactionStatus.INTRANS, TransactionStatus.INERROR)
_UNDO_TIMEOUT = 5.0  # seconds a release undoing an interrupted acquire may take at most


async def _within(coro: Awaitable[_T], seconds: float) -> _T:
    """``await coro`` for at most ``seconds`` (then ``TimeoutError``), never losing a cancel
    (``asyncio.wait_for`` before 3.12 returns a result landing with its caller's cancel, which
    would hand an acquire's lease to a caller that gave up)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await coro
    task = asyncio.ensure_future(coro)  # pragma: no cover - Python 3.10
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    if not done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise asyncio.TimeoutError()
    return task.result()


def _recording_connection_class(failures: ConnectFailures) -> type[_AsyncConn]:
    """An AsyncConnection class that records why the pool's background connects failed."""

    class _StoreConnection(psycopg.AsyncConnection[Any]):
        celery_lease_own_connection = True  # OWN_CONNECTION: psycopg_pool's records folded

        @classmethod
        async def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
            with failures.recording():
                return await super().connect(conninfo, **kwargs)

    return _StoreConnection


class _Listener:
    """One task holding a ``LISTEN`` connection; wakes the futures of each released key (filed
    under its NOTIFY payload). After a reconnect every waiter is woken, as the sync listener's."""

    def __init__(self, connect: Callable[[], Awaitable[_AsyncConn]], channel: str) -> None:
        self._connect = connect
        self._channel = channel
        self._waiters: dict[str, set[asyncio.Future[bool]]] = {}
        self.ready = asyncio.Event()
        self.blocked = 0  # coroutines awaiting a release with the listener ready
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, key: str, future: asyncio.Future[bool]) -> None:
        self._waiters.setdefault(notify_payload(key), set()).add(future)

    def remove(self, key: str, future: asyncio.Future[bool]) -> None:
        payload = notify_payload(key)
        waiting = self._waiters.get(payload)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._waiters[payload]

    def _wake(self, payload: str) -> None:
        for future in self._waiters.pop(payload, ()):
            if not future.done():
                future.set_result(True)

    def _wake_all(self) -> None:
        for payload in list(self._waiters):
            self._wake(payload)

    async def _run(self) -> None:
        retry = ListenerRetry("async listener", logger)
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(self._channel))
        while True:
            try:
                conn = await self._connect()
            except (psycopg.Error, OSError, asyncio.TimeoutError) as exc:
                await asyncio.sleep(retry.failed(exc))
                continue
            try:
                await conn.execute(listen)
                if retry.connected():
                    self._wake_all()
                self.ready.set()
                async for notify in conn.notifies():
                    self._wake(notify.payload)
            except psycopg.Error as exc:
                logger.warning("celery-lease: async listener connection lost (%s)", exc)
            finally:
                self.ready.clear()
                with contextlib.suppress(psycopg.Error, OSError):
                    await conn.close()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._wake_all()


class AsyncPostgresLockStore(StoreBase):
    """An :class:`~celery_lease.stores.base.AsyncLockStore` (and ``AsyncSupportsSlots``) in a
    PostgreSQL table.

    The same table, statements and semantics as
    :class:`~celery_lease.stores.postgres.PostgresLockStore` (see there and
    :mod:`celery_lease.stores.postgres_async`), on a ``psycopg_pool.AsyncConnectionPool`` of
    autocommit connections (1 to ``max_connections``) opened on first use in the running event
    loop. Use it from one event loop and ``await store.aclose()`` at the end.

    Args:
        dsn: a libpq connection string or URL (``postgresql://`` / ``postgres://``, with
            ``?create_table=`` as the sync store takes it).
        table: the table name, optionally ``schema.table`` (default ``"celery_lease"``).
        connect_timeout: seconds to wait for a connection before raising
            ``StoreUnavailableError`` (default 5.0).
        statement_timeout: seconds one statement may take, measured by the client, before it
            is cancelled and ``StoreUnavailableError`` raised (default 5.0). The sync twin this
            store builds gets the same bound on the server's side, so the renewals of this
            store's leases (which go through it) are bounded too. ``acquire_slot``'s
            transaction also sets the server's ``lock_timeout`` to it and
            ``idle_in_transaction_session_timeout`` to half of it.
        max_connections: the size limit of the pool (default 8), and of the sync twin's.
        create_table: whether a missing table may be created (default: the URL's
            ``?create_table=``, else True).
        sync: the synchronous twin on the same database and table. Default: a
            :class:`PostgresLockStore` built from the same DSN and options (closed by
            :meth:`aclose`); a twin passed in is the caller's to close.

    Raises:
        LeaseConfigError: for a bad DSN, table, timeout, ``max_connections``, ``create_table``
            or twin (as the sync store reports them).
    """

    _logger = logger

    def __init__(
        self,
        dsn: str,
        *,
        table: str = DEFAULT_TABLE,
        sync: PostgresLockStore | None = None,
        connect_timeout: float = 5.0,
        statement_timeout: float = 5.0,
        max_connections: int = 8,
        create_table: bool | None = None,
    ) -> None:
        if not isinstance(dsn, str):
            raise LeaseConfigError(
                f"dsn={type(dsn).__name__} must be a libpq connection string or URL"
            )
        # Every option is validated as the sync store validates it (the same function).
        self._set_options(table, connect_timeout, statement_timeout, max_connections, create_table)
        if sync is not None and not isinstance(sync, PostgresLockStore):
            raise LeaseConfigError(f"sync={sync!r} must be a PostgresLockStore (or None)")
        parsed = parse_dsn(dsn, create_table)
        if sync is not None and sync.table != self._table:
            raise LeaseConfigError(
                f"table={table!r} differs from the table of sync ({sync.table!r}): the two "
                "would not exclude each other"
            )
        self._owns_sync = sync is None
        if sync is None:
            sync = PostgresLockStore(
                dsn,
                table=table,
                connect_timeout=connect_timeout,
                statement_timeout=statement_timeout,
                max_connections=max_connections,
                create_table=create_table,
            )
        self._sync = sync
        self._dsn = parsed.dsn
        self._create_table = True if parsed.create_table is None else parsed.create_table
        self._secrets = parsed.secrets
        self._where = parsed.where
        self._connect_kwargs = connect_kwargs(self._connect_timeout, parsed.application_name)
        self._connect_failures = ConnectFailures(
            f"AsyncPostgresLockStore({self._where}, table={self._table!r})", logger
        )
        self._connection_class = _recording_connection_class(self._connect_failures)
        self._pool: AsyncConnectionPool[Any] | None = None
        self._listener: _Listener | None = None
        self._closed = False
        self._loop = LoopBinding("its connection pool and listener")  # the loop of its first call

    @property
    def sync(self) -> PostgresLockStore:
        """The synchronous :class:`PostgresLockStore` on the same table."""
        return self._sync

    def waiting(self) -> int:
        """Coroutines now awaiting a release with a ready listener (used by tests)."""
        listener = self._listener
        return 0 if listener is None else listener.blocked

    async def _get_pool(self) -> AsyncConnectionPool[Any]:
        if self._closed:
            raise StoreUnavailableError(f"{self!r} is closed")
        self._loop.check(self)
        pool = self._pool
        if pool is None:
            options = self._pool_options(ASYNC_POOL_NAME, self._connect_kwargs)
            pool = self._pool = AsyncConnectionPool(self._dsn, **options)
            await pool.open(wait=False)
        return pool

    async def _listener_connect(self) -> _AsyncConn:
        return await _within(
            psycopg.AsyncConnection.connect(self._dsn, **self._connect_kwargs),
            self._connect_timeout,
        )

    def _get_listener(self) -> _Listener:
        if self._closed:
            raise StoreUnavailableError(f"{self!r} is closed")
        self._loop.check(self)
        if self._listener is None:
            self._listener = _Listener(self._listener_connect, self._channel)
        return self._listener

    async def _run(
        self, what: str, key: str | None, fn: Callable[[_AsyncConn], Awaitable[_T]]
    ) -> _T:
        """``fn`` (one statement) on a pooled connection; a dropped one retried once."""
        pool = await self._get_pool()
        for attempt in (1, 2):
            got_connection = False
            try:
                async with pool.connection(timeout=self._connect_timeout) as conn:
                    got_connection = True
                    return await self._execute(what, key, conn, fn)
            except PoolTimeout as exc:
                last = self._connect_failures.last
                detail = no_connection_detail(self._connect_timeout, last, exc)
                raise self._error(what, key, detail) from exc
            except PoolClosed as exc:
                raise self._error(what, key, describe_error(exc)) from exc
            except asyncio.TimeoutError as exc:
                raise self._error(
                    what,
                    key,
                    f"no reply within {self._statement_timeout:g} s (statement_timeout); the "
                    "statement was cancelled",
                ) from exc
            except psycopg.Error as exc:
                # A statement the server cancelled (CANCELLED_BY_TIMEOUT, an OperationalError)
                # is retried here like a dropped connection, unlike in the sync store.
                error = self._failure(what, key, exc, connected=got_connection, first=attempt == 1)
                if error is not None:
                    raise error from exc
                with contextlib.suppress(Exception):
                    await pool.check()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _execute(
        self,
        what: str,
        key: str | None,
        conn: _AsyncConn,
        fn: Callable[[_AsyncConn], Awaitable[_T]],
    ) -> _T:
        """``fn(conn)`` within the statement timeout, again after creating a missing table."""
        timeout = self._statement_timeout
        try:
            return await _within(fn(conn), timeout)
        except MISSING_TABLE as exc:
            await self._make_table(what, key, conn, exc)
            return await _within(fn(conn), timeout)

    async def _make_table(
        self, what: str, key: str | None, conn: _AsyncConn, missing: psycopg.Error
    ) -> None:
        self._check_may_create(what, key, missing)
        try:
            await _within(conn.execute(self._sql["schema"]), self._statement_timeout)
        except CREATED_CONCURRENTLY:
            pass  # another session created it concurrently
        except psycopg.errors.InsufficientPrivilege as exc:
            raise self._error(what, key, self._denied(exc, creating=True)) from exc
        else:
            logger.info("celery-lease: created table %r", self._table)

    async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        """As :meth:`PostgresLockStore.acquire`; an acquire that timed out or was cancelled
        releases what it may have taken before raising."""
        params = {"key": key, "owner": owner, "ttl_ms": ttl_ms}

        async def run(conn: _AsyncConn) -> int | None:
            cursor = await conn.execute(self._sql["acquire"], params)
            return token_of(await cursor.fetchone())

        try:
            return await self._run("acquire", key, run)
        except asyncio.CancelledError:
            await self._undo_acquire(key, owner, "cancelled")
            raise
        except StoreUnavailableError as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError):
                await self._undo_acquire(key, owner, "timed out")
            self._refuse_long_key(key, exc)
            raise

    async def acquire_slot(
        self, key: str, owner: str, ttl_ms: int, limit: int
    ) -> tuple[int, int] | None:
        """As :meth:`PostgresLockStore.acquire_slot` (the same transaction, ``slot_plan``); a
        call that timed out or was cancelled releases every slot of ``key`` that ``owner`` may
        have taken before raising."""
        check_slot_request(key, limit)
        await self._check_key_order()

        async def run(conn: _AsyncConn) -> tuple[int, int] | None:
            return await self._drive(conn, slot_plan(self._sql, key, owner, ttl_ms, limit))

        try:
            return await self._run("acquire a slot", key, run)
        except asyncio.CancelledError:
            await self._undo_acquire(key, owner, "cancelled", slots=True)
            raise
        except StoreUnavailableError as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError):
                await self._undo_acquire(key, owner, "timed out", slots=True)
            self._refuse_long_key(key, exc)
            raise

    async def _check_key_order(self) -> None:
        """As :meth:`PostgresLockStore._check_key_order`."""
        if self._key_order_checked:
            return

        async def run(conn: _AsyncConn) -> Rows:
            cursor = await conn.execute(self._sql["key_collation"])
            return await cursor.fetchall()

        rows = await self._run("read the key column's collation", None, run)
        check_key_order(repr(self), self._table, rows)
        self._key_order_checked = True

    async def _drive(self, conn: _AsyncConn, plan: Generator[Step, Rows, _T]) -> _T:
        """Run a plan as one transaction opened with its settings (lock and idle timeouts):
        each statement it yields is executed and its rows sent back (as the sync store's
        ``_run_plan``, pipelined the same way)."""
        if not (conn.autocommit and psycopg.Pipeline.is_supported()):
            async with conn.transaction():
                await conn.execute(self._plan_settings)
                return await self._steps(conn, plan, None)
        try:
            async with conn.pipeline() as pipeline:
                await conn.execute(b"BEGIN")  # queued: sent with the settings and 1st statement
                await conn.execute(self._plan_settings)
                result = await self._steps(conn, plan, pipeline)
                await conn.execute(b"COMMIT")  # its reply is read as the pipeline ends
        except psycopg.Error:
            if conn.pgconn.transaction_status in _IN_TRANSACTION:
                with contextlib.suppress(psycopg.Error):
                    await conn.execute(b"ROLLBACK")
            raise
        return result

    @staticmethod
    async def _steps(
        conn: _AsyncConn, plan: Generator[Step, Rows, _T], pipeline: psycopg.AsyncPipeline | None
    ) -> _T:
        """Execute each statement of ``plan`` and send its rows back; its result."""
        step = next(plan)
        while True:
            cursor = await conn.execute(*step)
            if pipeline is not None:
                await pipeline.sync()
            rows = await cursor.fetchall() if cursor.description is not None else []
            try:
                step = plan.send(rows)
            except StopIteration as stop:
                result: _T = stop.value
                return result

    async def _undo_acquire(self, key: str, owner: str, why: str, *, slots: bool = False) -> None:
        """Release ``owner``'s lease (unique per attempt: never anyone else's), shielded from
        cancellation and bounded in time; a failure is logged (it expires within its ttl)."""
        undo = self._release_slots(key, owner) if slots else self.release(key, owner)
        task = asyncio.ensure_future(_within(undo, _UNDO_TIMEOUT))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log_undo_failed(logger, key, why, exc)

    async def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        """As :meth:`PostgresLockStore.renew`."""
        params = {"key": key, "owner": owner, "ttl_ms": ttl_ms}

        async def run(conn: _AsyncConn) -> bool:
            cursor = await conn.execute(self._sql["renew"], params)
            return cursor.rowcount == 1

        return await self._run("renew", key, run)

    async def release(self, key: str, owner: str) -> None:
        """As :meth:`PostgresLockStore.release` (owner checked; notifies waiters)."""
        params = self._release_params(key, owner)

        async def run(conn: _AsyncConn) -> None:
            await conn.execute(self._sql["release"], params)

        if self._closed:  # a holder's exit after aclose() (a shutdown): never left to the ttl
            await self._run_alone("release", key, run)
            return
        await self._run("release", key, run)

    async def release_owned_slots(self, key: str, owner: str) -> None:
        """As :meth:`PostgresLockStore.release_owned_slots` (one statement)."""
        await self._release_slots(key, owner)

    async def _release_slots(self, key: str, owner: str) -> None:
        """Release every slot of ``key`` that ``owner`` holds (notifies waiters)."""
        params = self._release_slots_params(key, owner)

        async def run(conn: _AsyncConn) -> None:
            await conn.execute(self._sql["release_slots"], params)

        await self._run("release", key, run)

    async def _run_alone(
        self, what: str, key: str, fn: Callable[[_AsyncConn], Awaitable[None]]
    ) -> None:
        """``fn`` on a connection of its own, closed after: a release after :meth:`aclose`."""
        try:
            conn = await self._listener_connect()
        except (psycopg.Error, OSError, asyncio.TimeoutError) as exc:
            raise self._error(what, key, f"(store closed) {describe_error(exc)}") from exc
        try:
            await self._execute(what, key, conn, fn)
        except asyncio.TimeoutError as exc:
            raise self._error(
                what, key, f"no reply within {self._statement_timeout:g} s (statement_timeout)"
            ) from exc
        except psycopg.Error as exc:
            raise self._error(what, key, describe_error(exc)) from exc
        finally:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()

    async def wait_for_release(self, key: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a release of ``key`` notified by any process.

        The first call starts the store's listener (one connection) and waits, within
        ``timeout``, for it to ``LISTEN``; a release before that is not seen (the caller's
        retry covers it). Cancelling the awaiting task stops the wait.
        """
        listener = self._get_listener()
        if timeout <= 0:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        listener.add(key, future)
        deadline = time.monotonic() + timeout
        try:
            try:
                await _within(listener.ready.wait(), timeout)
            except asyncio.TimeoutError:
                return future.done()
            listener.blocked += 1
            try:
                left = max(0.0, deadline - time.monotonic())
                return await _within(asyncio.shield(future), left)
            except asyncio.TimeoutError:
                return future.done()
            finally:
                listener.blocked -= 1
        finally:
            listener.remove(key, future)

    async def aclose(self) -> None:
        """Stop the listener, close the pool, and close the sync twin when this store built it."""
        if self._closed:
            return
        self._closed = True
        listener, self._listener = self._listener, None
        pool, self._pool = self._pool, None
        if listener is not None:
            await listener.stop()
        if pool is not None:
            await pool.close()
        if self._owns_sync:
            # Its listener thread may take a moment to stop: off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, self._sync.close)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AsyncPostgresLockStore:
        """``AsyncPostgresLockStore(url, **options)`` (what ``async_store_from_url`` calls)."""
        return cls(url, **options)

    def __repr__(self) -> str:
        return f"AsyncPostgresLockStore({self._where}, table={self._table!r})"
