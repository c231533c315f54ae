"""A row locked by another session (an open transaction, ``SELECT ... FOR UPDATE``) costs the
PostgreSQL stores at most their ``statement_timeout``: the statement that meets it fails with a
``StoreUnavailableError`` saying so, instead of waiting for the other session to end."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores import postgres as postgres_module
from celery_lease.stores import postgres_async as postgres_async_module
from celery_lease.stores.postgres import PostgresLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from celery_lease.stores.slots import slot_key
from tests.stores.contract import DEADLINE, LONG_MS

pytestmark = pytest.mark.postgres

BOUND = 1.0
"""The statement_timeout (seconds) of the stores under test."""

SLACK = 5.0
"""Real seconds past the bound a failing statement may take (a slow, shared CI machine)."""


@pytest.fixture
def store(pg_database_dsn: str, pg_table: str) -> Iterator[PostgresLockStore]:
    store = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=BOUND)
    yield store
    store.close()


@pytest.fixture
def row_locker(pg_database_dsn: str, pg_table: str) -> Iterator[Any]:
    """Another session; ``lock(key)`` takes that row ``FOR UPDATE`` in a transaction kept open
    until the test ends."""
    conn = psycopg.connect(pg_database_dsn)

    def lock(key: str) -> None:
        query = sql.SQL("SELECT key FROM {} WHERE key = %s FOR UPDATE").format(
            sql.Identifier(pg_table)
        )
        assert conn.execute(query, [key]).fetchone() is not None, "the row to lock exists"

    try:
        yield lock
    finally:
        conn.rollback()
        conn.close()


class TestALockedRow:
    def test_a_renewal_batch_meeting_a_locked_row_fails_within_the_bound(
        self, store: PostgresLockStore, row_locker: Any
    ) -> None:
        """One of two rows is locked: the batch raises StoreUnavailableError naming the
        statement_timeout, within the bound (not retried), instead of hanging."""
        assert store.acquire("a", "holder", LONG_MS) is not None
        assert store.acquire("b", "holder", LONG_MS) is not None
        row_locker("a")
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="statement_timeout") as caught:
            store.renew_many([("a", "holder", LONG_MS), ("b", "holder", LONG_MS)])
        took = time.monotonic() - started
        assert took < BOUND + SLACK, f"the batch took {took:.1f} s"
        assert "renew" in str(caught.value)

    def test_the_store_works_again_once_the_row_is_free(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """The timeout ends that statement only: the connection serves the next call."""
        store = PostgresLockStore(
            pg_database_dsn, table=pg_table, statement_timeout=BOUND, max_connections=1
        )
        try:
            assert store.acquire("a", "holder", LONG_MS) is not None
            with psycopg.connect(pg_database_dsn) as other:
                query = sql.SQL("SELECT key FROM {} WHERE key = 'a' FOR UPDATE").format(
                    sql.Identifier(pg_table)
                )
                other.execute(query)
                with pytest.raises(StoreUnavailableError):
                    store.renew("a", "holder", LONG_MS)
                other.rollback()
            assert store.renew_many([("a", "holder", LONG_MS)]) == [True]
        finally:
            store.close()

    def test_the_async_stores_renewals_are_bounded_too(
        self, pg_database_dsn: str, pg_table: str, row_locker: Any
    ) -> None:
        """The async store's leases renew through its sync twin, which gets its
        statement_timeout."""

        async def main() -> None:
            store = AsyncPostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=BOUND)
            try:
                assert await store.acquire("a", "holder", LONG_MS) is not None
                assert store.sync.statement_timeout == BOUND
                row_locker("a")
                started = time.monotonic()
                with pytest.raises(StoreUnavailableError, match="statement_timeout"):
                    await asyncio.get_running_loop().run_in_executor(
                        None, store.sync.renew_many, [("a", "holder", LONG_MS)]
                    )
                assert time.monotonic() - started < BOUND + SLACK
            finally:
                await store.aclose()

        asyncio.run(main())


STALL_BOUND = 2.0
"""The statement_timeout (seconds) of the stores in the stalled-member tests: a stalled
transaction must end well within it."""


class _Stall:
    """Pauses the first plan run through ``module.<name>`` (``slot_plan``, ``replace_plan``)
    after ``steps`` statements, its transaction open and its row locks held, until
    :meth:`resume`; later runs (another member's, its own retry) go through unpaused."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str, steps: int) -> None:
        self.paused, self._go = threading.Event(), threading.Event()
        self._runs = 0
        plan = getattr(module, name)

        def paused(*args: Any) -> Generator[Any, Any, Any]:
            self._runs += 1
            inner = plan(*args)
            rows = None
            for _ in range(steps):
                rows = yield inner.send(rows)
            if self._runs == 1:
                self.paused.set()
                assert self._go.wait(DEADLINE)
            try:
                while True:
                    rows = yield inner.send(rows)
            except StopIteration as stop:
                return stop.value

        monkeypatch.setattr(module, name, paused)

    def resume(self) -> None:
        self._go.set()

    def run_in_thread(self, call: Callable[[], Any]) -> threading.Thread:
        """``call()`` in a thread (its outcome ignored: the server may have ended it); returns
        once the plan is paused."""

        def run() -> None:
            # Its connection may have been closed by the server: that is the point.
            with contextlib.suppress(Exception):
                call()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert self.paused.wait(DEADLINE), "the plan to pause"
        return thread


class TestAStalledMember:
    """A member paused inside a multi-statement transaction (a GC or VM pause, a blocked event
    loop, a partition) holding row locks: the server ends its transaction within half the
    statement_timeout, so the others' statements waiting on those locks go through."""

    def test_a_member_stalled_mid_acquire_slot_does_not_wedge_the_key(
        self, pg_database_dsn: str, pg_table: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Paused after locking the key's slot counter and reading its slots: another member's
        acquire_slot of the key (queued on the counter) takes a slot."""
        healthy = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND)
        stalled = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND)
        assert healthy.acquire_slot("k", "a", LONG_MS, 3) is not None
        stall = _Stall(monkeypatch, postgres_module, "slot_plan", steps=2)
        thread = stall.run_in_thread(lambda: stalled.acquire_slot("k", "b", LONG_MS, 3))
        try:
            got = healthy.acquire_slot("k", "c", LONG_MS, 3)
            assert got is not None and got[0] == 1
        finally:
            stall.resume()
            thread.join(DEADLINE)
            stalled.close()
            healthy.close()

    def test_a_stalled_mark_replaced_does_not_fail_the_holders_renewals(
        self, pg_database_dsn: str, pg_table: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Paused after locking the key's row: the holder's renew and release (waiting on
        that row) succeed."""
        holder = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND)
        stalled = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND)
        assert holder.acquire("p", "h", LONG_MS) is not None
        stall = _Stall(monkeypatch, postgres_module, "replace_plan", steps=1)
        thread = stall.run_in_thread(lambda: stalled.mark_replaced("p"))
        try:
            assert holder.renew("p", "h", LONG_MS) is True
            holder.release("p", "h")
            assert holder.get("p") is None
        finally:
            stall.resume()
            thread.join(DEADLINE)
            stalled.close()
            holder.close()

    def test_a_member_stalled_mid_acquire_slot_on_a_given_pool_does_not_wedge_the_key(
        self, pg_database_dsn: str, pg_table: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The same on a pool the caller passes in (no session settings of the store, not in
        autocommit): the plan's own transaction settings bound the stall."""
        from psycopg_pool import ConnectionPool

        pool: ConnectionPool[Any] = ConnectionPool(
            pg_database_dsn, min_size=1, max_size=2, open=True
        )
        healthy = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND)
        stalled = PostgresLockStore(pool, table=pg_table, statement_timeout=STALL_BOUND)
        assert healthy.acquire_slot("k", "a", LONG_MS, 3) is not None
        stall = _Stall(monkeypatch, postgres_module, "slot_plan", steps=2)
        thread = stall.run_in_thread(lambda: stalled.acquire_slot("k", "b", LONG_MS, 3))
        try:
            got = healthy.acquire_slot("k", "c", LONG_MS, 3)
            assert got is not None and got[0] == 1
        finally:
            stall.resume()
            thread.join(DEADLINE)
            stalled.close()
            healthy.close()
            pool.close()

    def test_an_async_member_whose_loop_stalls_mid_acquire_slot_does_not_wedge_the_key(
        self, pg_database_dsn: str, pg_table: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The async store's event loop blocked between two statements of acquire_slot (its
        client-side timeout cannot fire): another member takes a slot of the key."""
        healthy = PostgresLockStore(pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND)
        assert healthy.acquire_slot("k", "a", LONG_MS, 3) is not None
        stall = _Stall(monkeypatch, postgres_async_module, "slot_plan", steps=2)

        async def stalled_call() -> None:
            store = AsyncPostgresLockStore(
                pg_database_dsn, table=pg_table, statement_timeout=STALL_BOUND
            )
            try:
                await store.acquire_slot("k", "b", LONG_MS, 3)
            finally:
                await store.aclose()

        thread = stall.run_in_thread(lambda: asyncio.run(stalled_call()))
        try:
            got = healthy.acquire_slot("k", "c", LONG_MS, 3)
            assert got is not None and got[0] == 1
            assert healthy.get(slot_key("k", 1)) is not None
        finally:
            stall.resume()
            thread.join(DEADLINE)
            healthy.close()


class TestTheOption:
    def test_the_default_is_five_seconds(self, pg_database_dsn: str) -> None:
        store = PostgresLockStore(pg_database_dsn)
        assert store.statement_timeout == 5.0
        store.close()

    @pytest.mark.parametrize("bad", [0, -1, "5s", True, None, float("nan")])
    def test_a_bad_value_is_refused_at_construction(self, pg_database_dsn: str, bad: Any) -> None:
        with pytest.raises(LeaseConfigError, match=r"statement_timeout=.* must be a number"):
            PostgresLockStore(pg_database_dsn, statement_timeout=bad)
