"""The PostgreSQL store runs the store contract, plus what only a server can show."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar
from unittest import mock

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores import postgres as postgres_module
from celery_lease.stores import store_from_url
from celery_lease.stores.base import (
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
)
from celery_lease.stores.postgres import SCHEMA_SQL, PostgresLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from celery_lease.stores.slots import counter_key, slot_key
from tests.fixtures_postgres import PgCluster, PgRole
from tests.stores.contract import DEADLINE, LONG_MS, StoreContract
from tests.stores.slot_contract import ReplaceContract, SlotContract
from tests.stores.sql_slots import SqlSlotChecks

pytestmark = pytest.mark.postgres


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class TestPostgresStore(SlotContract, ReplaceContract, StoreContract):
    """PostgresLockStore on the shared server, one new table per store (real clock)."""

    fake_clock = False
    stateful_examples = 15

    @pytest.fixture
    def store_backend(self, pg_database_dsn: str, pg_table: str) -> None:
        self.dsn = pg_database_dsn
        self.base_table = pg_table
        self.count = 0

    def make_store(self) -> LockStore:
        self.count += 1
        self.table = f"{self.base_table}_{self.count}"
        return PostgresLockStore(self.dsn, table=self.table)

    def store_factory(self) -> Callable[[], LockStore]:
        return functools.partial(PostgresLockStore, self.dsn, table=self.table)

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        assert isinstance(store, PostgresLockStore)
        _wait_for(lambda: store.waiting() >= count, f"{count} waiters")


class TestPostgresSlots(SqlSlotChecks):
    """Slots and replace on the shared server, one new table per test (real clock)."""

    @pytest.fixture
    def slot_store(self, pg_database_dsn: str, pg_table: str) -> Iterator[PostgresLockStore]:
        self.dsn = pg_database_dsn
        self.table = pg_table
        store = PostgresLockStore(pg_database_dsn, table=pg_table)
        try:
            yield store
        finally:
            store.close()

    def _update(self, statement: str, params: list[Any]) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            query = sql.SQL(statement).format(sql.Identifier(self.table))
            assert conn.execute(query, params).rowcount == 1

    def make_expired(self, store: Any, store_key: str) -> None:
        self._update(
            "UPDATE {} SET expires = clock_timestamp() - interval '1 second' WHERE key = %s",
            [store_key],
        )

    def set_token(self, store: Any, store_key: str, token: int) -> None:
        self._update("UPDATE {} SET token = %s WHERE key = %s", [token, store_key])

    def slot_store_factory(self) -> Callable[[], Any]:
        return functools.partial(PostgresLockStore, self.dsn, table=self.table)

    def unreachable_store(self, tmp_path: Any) -> Any:
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return PostgresLockStore(f"postgresql://postgres@127.0.0.1:{port}/x", connect_timeout=1)

    def wait_until_waiting(self, store: PostgresLockStore, count: int) -> None:
        _wait_for(lambda: store.waiting() >= count, f"{count} waiters")

    def test_an_interrupted_acquire_slot_releases_what_it_took(
        self, slot_store: PostgresLockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An exception raised once the transaction committed (a signal handler, an async
        exception): the slot the call took is released before the exception goes on."""
        run_plan = slot_store._run_plan
        taken: list[object] = []

        def run_then_interrupt(what: str, make: Any) -> Any:
            taken.append(run_plan(what, make))
            raise _Interrupt

        monkeypatch.setattr(slot_store, "_run_plan", run_then_interrupt)
        with pytest.raises(_Interrupt):
            slot_store.acquire_slot("k", "a", LONG_MS, 2)
        monkeypatch.undo()
        assert taken and taken[0] is not None
        assert slot_store.list("k") == []
        assert slot_store.acquire_slot("k", "b", LONG_MS, 1) is not None

    def test_an_acquire_queued_behind_a_mark_gets_a_token_above_its_ticket(
        self, slot_store: PostgresLockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A plain acquire that began while mark_replaced held the key's row, and that takes
        the key because the marked lease expired meanwhile, still gets a token above the
        ticket (the counter ahead of the clock, so only the row's counter can order them)."""
        assert slot_store.acquire("k", "h", 400) is not None
        self.set_token(slot_store, "k", 2**60)
        locked, go = threading.Event(), threading.Event()
        plan = postgres_module.replace_plan

        def paused(*args: Any) -> Any:  # holds the key's row between its first two statements
            inner = plan(*args)
            rows = yield next(inner)
            locked.set()
            assert go.wait(DEADLINE)
            try:
                while True:
                    rows = yield inner.send(rows)
            except StopIteration as stop:
                return stop.value

        monkeypatch.setattr(postgres_module, "replace_plan", paused)
        marks: list[Any] = []
        marker = threading.Thread(target=lambda: marks.append(slot_store.mark_replaced("k")))
        marker.start()
        assert locked.wait(DEADLINE)
        other = PostgresLockStore(self.dsn, table=self.table)
        taken: list[Any] = []
        taker = threading.Thread(target=lambda: taken.append(other.acquire("k", "b", LONG_MS)))
        try:
            taker.start()
            _wait_for(lambda: len(_backends_waiting_on_a_lock(self.dsn)) >= 1, "the acquire")
            expired = sql.SQL("SELECT expires < clock_timestamp() FROM {} WHERE key = 'k'")
            _wait_for(
                lambda: (
                    _query(self.dsn, expired.format(sql.Identifier(self.table)).as_string())
                    == [(True,)]
                ),
                "the marked lease to expire",
            )
            go.set()
            marker.join(DEADLINE)
            taker.join(DEADLINE)
        finally:
            go.set()
            other.close()
        ((ticket, holder, asked),) = marks
        assert (holder, asked) == ("h", True) and ticket > 2**60
        assert taken[0] is not None and taken[0] > ticket

    def test_a_slot_release_after_a_refused_acquire_slot_wakes_the_next_wait(
        self, slot_store: PostgresLockStore
    ) -> None:
        """A refused acquire_slot registers interest in the key first: a slot released before
        the caller starts waiting (the listener saw it already) still ends that wait."""
        other = PostgresLockStore(self.dsn, table=self.table)
        try:
            assert other.acquire_slot("k", "holder", LONG_MS, 1) is not None
            assert slot_store.wait_for_release("warm-up", 0.01) is False  # starts the listener
            listener = slot_store._listener
            assert listener is not None
            _wait_for(listener.ready.is_set, "the listener")
            assert slot_store.acquire_slot("k", "me", LONG_MS, 1) is None
            parked = getattr(slot_store._local, "parked", None)
            assert parked is not None and parked[0] == "k"
            other.release(slot_key("k", 0), "holder")
            _wait_for(parked[1].event.is_set, "the notification")  # seen before any wait
            assert slot_store.wait_for_release("k", DEADLINE) is True
        finally:
            other.close()

    def test_a_slot_whose_renewal_commits_after_the_read_is_not_counted_free(
        self, slot_store: PostgresLockStore
    ) -> None:
        """Limit lowered to 2 with slots 1 and 5 held: slot 1's renewal, made just before its
        old expiry, commits only after that expiry passed. acquire_slot waits for it, sees the
        slot held and refuses, instead of taking slot 0 as a third holder."""
        for i in range(6):
            got = slot_store.acquire_slot("k", f"o{i}", LONG_MS, 6)
            assert got is not None and got[0] == i
        for i in (0, 2, 3, 4):
            slot_store.release(slot_key("k", i), f"o{i}")
        self._update(
            "UPDATE {} SET expires = clock_timestamp() + interval '300 milliseconds'"
            " WHERE key = %s",
            [slot_key("k", 1)],
        )
        renew = sql.SQL(
            "UPDATE {} SET expires = clock_timestamp() + interval '60 seconds'"
            " WHERE key = %s AND owner = %s AND expires > clock_timestamp()"
        ).format(sql.Identifier(self.table))
        result: list[Any] = []
        with psycopg.connect(self.dsn) as renewal:  # its transaction stays open until commit()
            assert renewal.execute(renew, [slot_key("k", 1), "o1"]).rowcount == 1
            _wait_for(lambda: slot_store.get(slot_key("k", 1)) is None, "the old expiry")
            taker = threading.Thread(
                target=lambda: result.append(slot_store.acquire_slot("k", "n", LONG_MS, 2))
            )
            taker.start()
            try:
                _wait_for(lambda: len(_backends_waiting_on_a_lock(self.dsn)) >= 1, "a row lock")
            finally:
                renewal.commit()
                taker.join(DEADLINE)
        assert result == [None]
        assert [info.key for info in slot_store.list("k")] == [slot_key("k", 1), slot_key("k", 5)]

    def test_slots_of_dead_holders_are_cleared_once_and_not_locked_again(
        self, slot_store: PostgresLockStore
    ) -> None:
        """Slots whose holders died without releasing (expired rows at high indices): the
        acquire_slot reading them clears them (owner NULL, token kept), so a later acquire_slot
        neither locks nor writes them (their row versions stay as they are)."""
        for i in range(6):
            assert slot_store.acquire_slot("k", f"o{i}", LONG_MS, 6) is not None
        dead = [slot_key("k", i) for i in range(2, 6)]
        tokens = [slot_store.last_token(key) for key in dead]
        for key in dead:
            self.make_expired(slot_store, key)
        versions = sql.SQL(
            "SELECT key, owner, ctid::text, xmin::text, xmax::text FROM {}"
            " WHERE key = ANY(%s) ORDER BY key"
        ).format(sql.Identifier(self.table))

        def rows() -> list[tuple[Any, ...]]:
            return _query(self.dsn, versions.as_string(), [dead[1:]])

        assert slot_store.acquire_slot("k", "n", LONG_MS, 6) == (2, mock.ANY)
        cleared = rows()
        assert [row[1] for row in cleared] == [None, None, None]
        assert [slot_store.last_token(key) for key in dead[1:]] == tokens[1:]
        slot_store.release(slot_key("k", 2), "n")
        assert slot_store.acquire_slot("k", "m", LONG_MS, 6) == (2, mock.ANY)
        assert rows() == cleared

    def test_slot_keys_announce_their_key_on_release_and_force_release(
        self, slot_store: PostgresLockStore
    ) -> None:
        """The NOTIFY payload of a slot's release names the key its waiters wait on."""
        params = slot_store._release_params(slot_key("k", 3), "a")
        assert params["payload"] == "k" and params["marked"] == "a\x1freplaced"
        assert slot_store._release_params(slot_key("k", 3))["payload"] == "k"
        assert slot_store._release_params("k2")["payload"] == "k2"


@pytest.fixture
def store(pg_database_dsn: str, pg_table: str) -> Iterator[PostgresLockStore]:
    store = PostgresLockStore(pg_database_dsn, table=pg_table)
    try:
        yield store
    finally:
        store.close()


def _query(dsn: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(query, params)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description is not None else []


def _race_first_acquire(stores: list[PostgresLockStore]) -> list[object]:
    """Each store acquires "k" from its own thread, all released together; results or errors."""
    barrier = threading.Barrier(len(stores))
    results: list[object] = []

    def run(store: PostgresLockStore, name: str) -> None:
        barrier.wait(DEADLINE)
        try:
            results.append(store.acquire("k", name, LONG_MS))
        except StoreUnavailableError as exc:
            results.append(exc)

    threads = [
        threading.Thread(target=run, args=(store, f"s{i}")) for i, store in enumerate(stores)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)
    return results


def _collation_exists(dsn: str, name: str) -> bool:
    return bool(_query(dsn, "SELECT 1 FROM pg_collation WHERE collname = %s", [name]))


def _make_table_with_key_collation(dsn: str, table: str, collation: str) -> None:
    """The store's table made by hand, its key column in ``collation``."""
    ddl = sql.SQL(
        "CREATE TABLE {} (key text COLLATE {} PRIMARY KEY, owner text NULL,"
        " expires timestamptz NOT NULL, token bigint NOT NULL)"
    ).format(sql.Identifier(table), sql.Identifier(collation))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)


class TestTheKeyColumnsCollation:
    """Slots read a key's slot rows as a range of the primary key, which holds them all only
    in byte order: a key column in another collation is refused at the first slot acquire,
    naming the table, the collation and the statement fixing it."""

    LINGUISTIC = "en-US-x-icu"

    def test_slots_on_a_table_whose_key_is_not_collate_c_are_refused_with_the_fix(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """LeaseConfigError before any row is written; once the given ALTER TABLE ran, limit 2
        gives two slots and a retry gets its own slot back."""
        if not _collation_exists(pg_database_dsn, self.LINGUISTIC):
            pytest.skip(f"the server has no collation {self.LINGUISTIC!r} (no ICU)")
        _make_table_with_key_collation(pg_database_dsn, pg_table, self.LINGUISTIC)
        store = PostgresLockStore(pg_database_dsn, table=pg_table, create_table=False)
        try:
            with pytest.raises(LeaseConfigError) as caught:
                store.acquire_slot("k", "a", LONG_MS, 2)
            message = str(caught.value)
            assert pg_table in message and self.LINGUISTIC in message
            fix = f'ALTER TABLE "{pg_table}" ALTER COLUMN key TYPE text COLLATE "C"'
            assert fix in message
            assert _query(pg_database_dsn, f'SELECT count(*) FROM "{pg_table}"') == [(0,)]
            _query(pg_database_dsn, fix)
            first = store.acquire_slot("k", "a", LONG_MS, 2)
            assert first is not None and first[0] == 0
            assert store.acquire_slot("k", "a", LONG_MS, 2) == first
            second = store.acquire_slot("k", "b", LONG_MS, 2)
            assert second is not None and second[0] == 1
        finally:
            store.close()

    def test_the_async_store_refuses_that_table_too(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        if not _collation_exists(pg_database_dsn, self.LINGUISTIC):
            pytest.skip(f"the server has no collation {self.LINGUISTIC!r} (no ICU)")
        _make_table_with_key_collation(pg_database_dsn, pg_table, self.LINGUISTIC)

        async def main() -> None:
            store = AsyncPostgresLockStore(pg_database_dsn, table=pg_table, create_table=False)
            try:
                with pytest.raises(LeaseConfigError, match=self.LINGUISTIC):
                    await store.acquire_slot("k", "a", LONG_MS, 2)
            finally:
                await store.aclose()

        asyncio.run(main())

    @pytest.mark.parametrize("collation", ["C", "POSIX", "ucs_basic"])
    def test_a_key_column_in_byte_order_is_accepted(
        self, pg_database_dsn: str, pg_table: str, collation: str
    ) -> None:
        _make_table_with_key_collation(pg_database_dsn, pg_table, collation)
        store = PostgresLockStore(pg_database_dsn, table=pg_table, create_table=False)
        try:
            got = [store.acquire_slot("k", owner, LONG_MS, 2) for owner in "abc"]
            assert [None if g is None else g[0] for g in got] == [0, 1, None]
        finally:
            store.close()


class TestSchemaAndConfiguration:
    """Table naming, the exposed DDL, and the ways to build a store."""

    def test_capabilities(self, store: PostgresLockStore) -> None:
        """The store notifies releases, renews in batches and is inspectable."""
        assert isinstance(store, SupportsReleaseNotify)
        assert isinstance(store, SupportsBatchRenew)
        assert isinstance(store, SupportsInspection)

    @pytest.mark.parametrize(
        "table", ["", "1abc", "a-b", 'x"; DROP TABLE y; --', "a.b.c", "x" * 64, None, "é"]
    )
    def test_bad_table_names_are_refused(self, table: Any) -> None:
        """A table name that is not a plain (optionally schema-qualified) identifier is refused."""
        with pytest.raises(LeaseConfigError, match="table="):
            PostgresLockStore("postgresql://localhost/x", table=table)

    def test_bad_options_are_refused(self) -> None:
        """connect_timeout, max_connections and the DSN/pool argument are validated up front."""
        with pytest.raises(LeaseConfigError, match="connect_timeout="):
            PostgresLockStore("postgresql://localhost/x", connect_timeout=0)
        with pytest.raises(LeaseConfigError, match="max_connections="):
            PostgresLockStore("postgresql://localhost/x", max_connections=0)
        with pytest.raises(LeaseConfigError, match="dsn_or_pool"):
            PostgresLockStore(42)  # type: ignore[arg-type]

    def test_schema_sql_quotes_the_table_and_creates_a_usable_table(
        self, pg_database_dsn: str
    ) -> None:
        """schema_sql() is the DDL the store runs itself; a table made with it is usable."""
        assert PostgresLockStore.schema_sql() == SCHEMA_SQL
        assert '"celery_lease"' in SCHEMA_SQL and "IF NOT EXISTS" in SCHEMA_SQL
        ddl = PostgresLockStore.schema_sql("public.managed_leases")
        assert '"public"."managed_leases"' in ddl
        with pytest.raises(LeaseConfigError, match="table="):
            PostgresLockStore.schema_sql("bad name")
        _query(pg_database_dsn, "DROP TABLE IF EXISTS public.managed_leases")
        with psycopg.connect(pg_database_dsn, autocommit=True) as conn:
            conn.execute(ddl.encode())
        store = PostgresLockStore(pg_database_dsn, table="public.managed_leases")
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
        finally:
            store.close()

    def test_stores_racing_to_create_the_table_all_succeed(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """Stores whose first operations race on a missing table all succeed, one acquires."""
        for round_ in range(4):
            table = f"{pg_table}_{round_}"
            stores = [PostgresLockStore(pg_database_dsn, table=table) for _ in range(4)]
            try:
                results = _race_first_acquire(stores)
            finally:
                for store in stores:
                    store.close()
            assert not [r for r in results if isinstance(r, Exception)], results
            assert len(results) == 4 and sum(r is not None for r in results) == 1, results

    def test_table_is_created_on_first_use(self, store: PostgresLockStore) -> None:
        """The first operation creates the table; nothing exists before it."""
        dsn = store._dsn
        assert dsn is not None
        exists = "SELECT to_regclass(%s) IS NOT NULL"
        assert _query(dsn, exists, [store.table]) == [(False,)]
        assert store.get("k") is None
        assert _query(dsn, exists, [store.table]) == [(True,)]

    def test_store_from_url_builds_a_postgres_store(self, pg_database_dsn: str) -> None:
        """store_from_url accepts postgresql:// and postgres:// URLs."""
        urls = [pg_database_dsn, pg_database_dsn.replace("postgresql://", "postgres://", 1)]
        assert urls[1].startswith("postgres://")
        for i, url in enumerate(urls):
            store = store_from_url(url)
            try:
                assert isinstance(store, PostgresLockStore)
                assert store.table == "celery_lease"
                assert store.acquire(f"url-{i}", "a", LONG_MS) is not None
            finally:
                store.close()

    def test_user_supplied_pool_is_used_and_left_open(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """A store on a caller's ConnectionPool works fully, and close() leaves the pool open."""
        with ConnectionPool(
            pg_database_dsn, min_size=1, max_size=2, open=True, kwargs={"autocommit": True}
        ) as pool:
            store = PostgresLockStore(pool, table=pg_table)
            token = store.acquire("k", "a", LONG_MS)
            assert token is not None
            woke: list[bool] = []
            waiter = threading.Thread(target=lambda: woke.append(store.wait_for_release("k", 10)))
            waiter.start()
            _wait_for(lambda: store.waiting() == 1, "the waiter")
            store.release("k", "a")
            waiter.join(DEADLINE)
            assert woke == [True]
            assert store.renew_many([("k", "a", LONG_MS)]) == [False]
            store.close()
            with pool.connection() as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)

    def test_repr_shows_no_password(self) -> None:
        """repr() names host, database and table, never the password."""
        store = PostgresLockStore("postgresql://u:s3cret@db.example:5433/leases", table="t")
        assert "s3cret" not in repr(store)
        assert "db.example" in repr(store) and "'t'" in repr(store)


class TestServerTime:
    """Expiry and tokens come from the server's clock, never the client's."""

    def test_expiry_is_set_by_the_database_clock(self, store: PostgresLockStore) -> None:
        """The stored expiry is the server's clock_timestamp() plus the ttl."""
        assert store.acquire("k", "a", 30_000) is not None
        dsn = store._dsn
        assert dsn is not None
        ((remaining,),) = _query(
            dsn,
            f'SELECT extract(epoch FROM expires - clock_timestamp())::float8 FROM "{store.table}"',
        )
        assert 29.0 < remaining <= 30.0

    def test_client_clock_is_ignored(
        self, store: PostgresLockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With client clocks a day ahead, a live lease stays live and tokens follow the DB."""
        dsn = store._dsn
        assert dsn is not None
        now_us = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
        ((before,),) = _query(dsn, now_us)
        assert store.acquire("k", "a", LONG_MS) is not None
        real_time, real_monotonic = time.time, time.monotonic
        monkeypatch.setattr(time, "time", lambda: real_time() + 86_400)
        monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + 86_400)
        assert store.acquire("k", "b", LONG_MS) is None
        token = store.acquire("k2", "b", LONG_MS)
        monkeypatch.undo()
        ((after,),) = _query(dsn, now_us)
        assert token is not None and before <= token <= after

    def test_a_lease_expired_by_the_database_clock_is_free(self, store: PostgresLockStore) -> None:
        """Moving a lease's expiry into the server's past frees it for the next acquirer."""
        first = store.acquire("k", "a", LONG_MS)
        assert first is not None and store.acquire("k", "b", LONG_MS) is None
        dsn = store._dsn
        assert dsn is not None
        _query(
            dsn,
            f"UPDATE \"{store.table}\" SET expires = clock_timestamp() - interval '1 ms'"
            " RETURNING key",
        )
        assert store.get("k") is None and store.renew("k", "a", LONG_MS) is False
        second = store.acquire("k", "b", LONG_MS)
        assert second is not None and second > first


class TestTokensAndStatements:
    """The counter outlives leases; batch renewal is a single statement."""

    def test_tokens_keep_increasing_after_release(self, store: PostgresLockStore) -> None:
        """Each acquire after a release returns a larger token and the row is kept."""
        tokens = []
        for i in range(20):
            token = store.acquire("k", f"o{i}", LONG_MS)
            assert token is not None
            tokens.append(token)
            store.release("k", f"o{i}")
        assert tokens == sorted(set(tokens))
        assert store.last_token("k") == tokens[-1]

    def test_tokens_exceed_a_counter_ahead_of_the_clock(self, store: PostgresLockStore) -> None:
        """A stored counter far ahead of the clock still grows by one per acquire."""
        assert store.acquire("k", "a", LONG_MS) is not None
        store.release("k", "a")
        dsn = store._dsn
        assert dsn is not None
        ahead = 2**62
        _query(dsn, f'UPDATE "{store.table}" SET token = %s RETURNING key', [ahead])
        assert store.acquire("k", "b", LONG_MS) == ahead + 1

    def test_renew_many_is_one_statement(self, pg_database_dsn: str, pg_table: str) -> None:
        """renew_many sends one statement for the whole batch and answers in input order."""
        statements: list[bytes] = []

        class CountingConnection(psycopg.Connection[Any]):
            def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
                statements.append(query if isinstance(query, bytes) else str(query).encode())
                return super().execute(query, *args, **kwargs)

        with ConnectionPool(
            pg_database_dsn,
            connection_class=CountingConnection,
            min_size=1,
            max_size=1,
            open=True,
            kwargs={"autocommit": True},
        ) as pool:
            store = PostgresLockStore(pool, table=pg_table)
            for i in range(0, 50, 2):
                assert store.acquire(f"k{i}", "me", LONG_MS) is not None
            items = [(f"k{i}", "me", LONG_MS) for i in range(50)]
            statements.clear()
            assert store.renew_many(items) == [i % 2 == 0 for i in range(50)]
            assert len(statements) == 1 and b"unnest" in statements[0]
            store.close()

    def test_release_is_one_statement_that_notifies(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """release clears the owner and sends the key on the store's channel in one statement."""
        store = PostgresLockStore(pg_database_dsn, table=pg_table)
        try:
            assert store.acquire("job:1", "a", LONG_MS) is not None
            with psycopg.connect(pg_database_dsn, autocommit=True) as listener:
                listener.execute(
                    psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(store.channel))
                )
                store.release("job:1", "b")  # not the owner: no notification
                store.release("job:1", "a")
                got = [(n.channel, n.payload) for n in listener.notifies(timeout=2, stop_after=1)]
            assert got == [(store.channel, "job:1")]
            assert store.get("job:1") is None
        finally:
            store.close()

    def test_list_treats_like_wildcards_literally(self, store: PostgresLockStore) -> None:
        """A prefix containing % or _ matches only keys starting with those characters."""
        for key in ("a%b", "a_c", "axb", "a\\d"):
            assert store.acquire(key, "o", LONG_MS) is not None
        assert [i.key for i in store.list("a%")] == ["a%b"]
        assert [i.key for i in store.list("a_")] == ["a_c"]
        assert [i.key for i in store.list("a\\")] == ["a\\d"]
        assert [i.key for i in store.list("a")] == sorted(["a%b", "a_c", "axb", "a\\d"])


class TestWaiting:
    """wait_for_release across threads and stores, on one listener connection."""

    def test_many_threads_wait_on_one_listener_connection(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """Twenty waiters on five keys all wake on their key's release, sharing one listener."""
        store = PostgresLockStore(pg_database_dsn, table=pg_table, max_connections=2)
        other = PostgresLockStore(pg_database_dsn, table=pg_table)  # another "process"
        try:
            keys = [f"k{i}" for i in range(5)]
            for key in keys:
                assert other.acquire(key, "holder", LONG_MS) is not None
            woke: dict[int, bool] = {}

            def wait(i: int) -> None:
                woke[i] = store.wait_for_release(keys[i % 5], 15)

            threads = [threading.Thread(target=wait, args=(i,)) for i in range(20)]
            for thread in threads:
                thread.start()
            _wait_for(lambda: store.waiting() == 20, "20 waiters")
            ((backends,),) = _query(
                pg_database_dsn,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND query LIKE 'LISTEN%'",
            )
            assert backends == 1
            for key in keys:
                other.release(key, "holder")
            for thread in threads:
                thread.join(DEADLINE)
            assert woke == dict.fromkeys(range(20), True)
        finally:
            store.close()
            other.close()

    def test_a_release_between_a_failed_acquire_and_the_wait_is_not_lost(
        self, store: PostgresLockStore, pg_database_dsn: str, pg_table: str
    ) -> None:
        """Once the listener runs, a release right after a failed acquire still wakes the wait."""
        other = PostgresLockStore(pg_database_dsn, table=pg_table)
        try:
            assert other.acquire("k", "holder", LONG_MS) is not None
            assert store.wait_for_release("warm-up", 0.01) is False  # starts the listener
            listener = store._listener
            assert listener is not None
            _wait_for(listener.ready.is_set, "the listener")
            assert store.acquire("k", "me", LONG_MS) is None
            other.release("k", "holder")
            _wait_for(lambda: other.last_token("k") is not None, "the release")
            started = time.monotonic()
            assert store.wait_for_release("k", 5.0) is True
            assert time.monotonic() - started < 2.0
        finally:
            other.close()

    def test_a_foreign_notify_wakes_only_the_waiters_of_the_key_it_names(
        self, store: PostgresLockStore, pg_database_dsn: str
    ) -> None:
        """Another session sends garbage payloads (empty, a bogus digest, 7000 bytes, a key
        nobody waits for), then one naming "x": x's waiter wakes, y's waits on."""
        assert store.acquire("x", "holder", LONG_MS) is not None
        assert store.acquire("y", "holder", LONG_MS) is not None
        woke: dict[str, bool] = {}
        waiters = {
            key: threading.Thread(
                target=lambda k=key: woke.__setitem__(k, store.wait_for_release(k, 15))
            )
            for key in ("x", "y")
        }
        for waiter in waiters.values():
            waiter.start()
        _wait_for(lambda: store.waiting() == 2, "two waiters")
        with psycopg.connect(pg_database_dsn, autocommit=True) as foreign:
            for payload in ("", "sha256:zz", "\x01" * 7000, "nobody-waits", "x"):
                foreign.execute("SELECT pg_notify(%s, %s)", [store.channel, payload])
        waiters["x"].join(DEADLINE)
        assert woke == {"x": True}, "only x's waiter woke (notifications arrive in order)"
        assert waiters["y"].is_alive() and store.waiting() == 1
        store.release("y", "holder")
        waiters["y"].join(DEADLINE)
        assert woke == {"x": True, "y": True}

    def test_force_release_wakes_waiters(self, store: PostgresLockStore) -> None:
        """force_release notifies like release does."""
        assert store.acquire("k", "a", LONG_MS) is not None
        woke: list[bool] = []
        waiter = threading.Thread(target=lambda: woke.append(store.wait_for_release("k", 10)))
        waiter.start()
        _wait_for(lambda: store.waiting() == 1, "the waiter")
        removed = store.force_release("k")
        waiter.join(DEADLINE)
        assert removed is not None and removed.owner == "a"
        assert woke == [True]

    def test_close_wakes_and_stops_promptly(self, store: PostgresLockStore) -> None:
        """close() wakes the listener thread instead of letting it wait out its 1 s tick."""
        assert store.wait_for_release("k", 0.01) is False  # starts the listener
        listener = store._listener
        assert listener is not None
        _wait_for(listener.ready.is_set, "the listener")  # listening: only a wake-up stops it now
        started = time.monotonic()
        store.close()
        took = time.monotonic() - started
        assert took < 0.9, f"close() took {took:.2f} s: it waited for the listener's tick"
        with pytest.raises(StoreUnavailableError):
            store.acquire("k", "a", LONG_MS)


def _acquire_in_child(store: PostgresLockStore, results: Any) -> None:
    try:
        results.put(("ok", store.acquire("child-key", "child", LONG_MS)))
    except BaseException as exc:
        results.put(("error", repr(exc)))


class TestForkSafety:
    """A forked child never uses the sockets it inherited."""

    def test_forked_child_uses_its_own_connections(self, store: PostgresLockStore) -> None:
        """A store used before fork works in the child, and still in the parent afterwards."""
        assert store.acquire("parent-key", "parent", LONG_MS) is not None
        assert store.wait_for_release("nothing", 0.01) is False  # the listener runs too
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_acquire_in_child, args=(store, results))
        child.start()
        status, token = results.get(timeout=DEADLINE)
        child.join(DEADLINE)
        assert (status, child.exitcode) == ("ok", 0), token
        assert isinstance(token, int)
        assert store.renew("parent-key", "parent", LONG_MS) is True
        assert store.acquire("child-key", "parent", LONG_MS) is None
        woke: list[bool] = []
        waiter = threading.Thread(
            target=lambda: woke.append(store.wait_for_release("child-key", 10))
        )
        waiter.start()
        _wait_for(lambda: store.waiting() == 1, "the waiter")
        store.force_release("child-key")
        waiter.join(DEADLINE)
        assert woke == [True]


class TestServerFailures:
    """Restarts and outages of a throwaway cluster."""

    def test_tokens_keep_increasing_across_a_restart(self, pg_cluster: PgCluster) -> None:
        """Tokens issued after a server restart exceed those issued before it."""
        store = PostgresLockStore(pg_cluster.dsn, table="restart_tokens", connect_timeout=5)
        try:
            before = store.acquire("k", "a", LONG_MS)
            assert before is not None
            pg_cluster.restart("immediate")
            assert store.acquire("k", "b", LONG_MS) is None  # the lease survived the crash
            store.release("k", "a")
            after = store.acquire("k", "b", LONG_MS)
            assert after is not None and after > before
            assert store.last_token("k") == after
        finally:
            store.close()

    def test_a_connection_dropped_by_a_restart_is_retried_once(
        self, pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        """After a restart the pooled connection is dead; the call is retried once and succeeds."""
        store = PostgresLockStore(pg_cluster.dsn, table="restart_retry", max_connections=1)
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            pg_cluster.restart("fast")
            with caplog.at_level(logging.INFO, logger="celery_lease.stores.postgres"):
                assert store.renew("k", "a", LONG_MS) is True
            retries = [
                r for r in caplog.records if r.getMessage().startswith("celery-lease: retrying")
            ]
            assert len(retries) == 1, caplog.records
        finally:
            store.close()

    def test_an_outage_is_one_line_of_ours_not_the_pools_messages(
        self, pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Two outages, several failing calls each: psycopg_pool's own warnings about the
        store's pool ("discarding broken connection", "error connecting in 'celery-lease'")
        are folded into one WARNING of ours per outage, and one line when it connects again."""
        store = PostgresLockStore(pg_cluster.dsn, table="outage_lines", connect_timeout=1)
        try:
            with caplog.at_level(logging.INFO):
                assert store.acquire("k", "a", LONG_MS) is not None
                for _ in range(2):
                    pg_cluster.stop("fast")
                    for _ in range(3):
                        with pytest.raises(StoreUnavailableError):
                            store.renew("k", "a", LONG_MS)
                    pg_cluster.start()
                    assert store.renew("k", "a", LONG_MS) is True
        finally:
            store.close()
        pools = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("psycopg.pool") and r.levelno >= logging.WARNING
        ]
        assert pools == []
        down = [r for r in caplog.records if "cannot connect" in r.getMessage()]
        back = [r for r in caplog.records if "connected again" in r.getMessage()]
        assert len(down) == 2, [r.getMessage() for r in caplog.records]
        assert all(r.levelno == logging.WARNING for r in down)
        assert "127.0.0.1" in down[0].getMessage() or "localhost" in down[0].getMessage()
        assert len(back) == 2, [r.getMessage() for r in caplog.records]

    def test_a_stopped_server_raises_store_unavailable_quickly(self, pg_cluster: PgCluster) -> None:
        """With the server down, calls fail with StoreUnavailableError within connect_timeout."""
        store = PostgresLockStore(pg_cluster.dsn, table="stopped", connect_timeout=1)
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            pg_cluster.stop("fast")
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as info:
                store.renew("k", "a", LONG_MS)
            assert time.monotonic() - started < 3.0
            assert isinstance(info.value.__cause__, psycopg.OperationalError)
            assert store.wait_for_release("k", 0.2) is False
            pg_cluster.start()
            assert store.renew("k", "a", LONG_MS) is True
        finally:
            store.close()

    def test_the_listeners_failed_reconnects_are_one_line_per_outage(
        self, pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        """While the server is down the listener retries (50 ms, doubling): its first failure is
        one WARNING, the others say nothing, and connecting again is one INFO line."""
        store = PostgresLockStore(pg_cluster.dsn, table="outage_listen")
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            assert store.wait_for_release("k", 0.01) is False  # starts the listener
            listener = store._listener
            assert listener is not None
            _wait_for(listener.ready.is_set, "the listener")
            with caplog.at_level(logging.INFO, logger="celery_lease.stores.postgres"):
                pg_cluster.stop("fast")
                failed = lambda: [  # noqa: E731
                    r for r in caplog.records if "listener failed to connect" in r.getMessage()
                ]
                _wait_for(lambda: len(failed()) >= 1, "the listener's first failure")
                store.wait_for_release("k", 1.6)  # the listener retries 5 times meanwhile
                pg_cluster.start()
                _wait_for(listener.ready.is_set, "the listener, connected again")
            assert len(failed()) == 1, [r.getMessage() for r in caplog.records]
            again = [r for r in caplog.records if "listener connected again" in r.getMessage()]
            assert len(again) == 1
        finally:
            store.close()

    def test_the_listener_reconnects_after_a_restart(self, pg_cluster: PgCluster) -> None:
        """After a server restart, waiters are woken again by releases."""
        store = PostgresLockStore(pg_cluster.dsn, table="restart_listen")
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            assert store.wait_for_release("k", 0.01) is False  # starts the listener
            listener = store._listener
            assert listener is not None
            _wait_for(listener.ready.is_set, "the listener")
            pg_cluster.restart("fast")
            # Like a real caller, the waiter waits again after each (possibly spurious) wake-up:
            # a reconnect wakes everyone, since releases may have gone unheard meanwhile.
            woke: list[tuple[float, bool]] = []
            stop = threading.Event()

            def wait() -> None:
                while not stop.is_set():
                    ok = store.wait_for_release("k", 0.5)
                    woke.append((time.monotonic(), ok))

            waiter = threading.Thread(target=wait)
            waiter.start()
            try:
                _wait_for(lambda: store.waiting() == 1, "the waiter, on a reconnected listener")
                released_at = time.monotonic()
                store.release("k", "a")
                _wait_for(lambda: any(at > released_at and ok for at, ok in woke), "a wake-up")
            finally:
                stop.set()
                waiter.join(DEADLINE)
            first = min(at for at, ok in woke if at > released_at and ok)
            assert first - released_at < 2.0
        finally:
            store.close()

    def test_no_server_at_all_fails_fast(self) -> None:
        """A store pointed at a closed port raises StoreUnavailableError, not a hang."""
        from tests.support import free_port

        store = PostgresLockStore(
            f"postgresql://postgres@127.0.0.1:{free_port()}/x", connect_timeout=0.5
        )
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="acquire"):
                store.acquire("k", "a", LONG_MS)
            assert time.monotonic() - started < 2.0
        finally:
            store.close()


# Least privilege and schema creation ---------------------------------------------------------


def _as_dba_create_table(dsn: str, table: str, role: str) -> None:
    """What docs/stores.md tells a DBA to run: the DDL, then the grants the store needs."""
    schema = table.rpartition(".")[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        if schema:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            conn.execute(
                sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                    sql.Identifier(schema), sql.Identifier(role)
                )
            )
        conn.execute(PostgresLockStore.schema_sql(table).encode())
        conn.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(
                sql.Identifier(*table.split(".")), sql.Identifier(role)
            )
        )


def _table_exists(dsn: str, table: str) -> bool:
    ((exists,),) = _query(dsn, "SELECT to_regclass(%s) IS NOT NULL", [table])
    return bool(exists)


class _CountingConnection(psycopg.Connection[Any]):
    """Records every statement sent through ``execute`` (class-wide, cleared by the test)."""

    statements: ClassVar[list[bytes]] = []

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        statement = query if isinstance(query, bytes) else str(query).encode()
        type(self).statements.append(statement)
        return super().execute(query, *args, **kwargs)


def _exercise_every_operation(store: PostgresLockStore) -> None:
    """acquire, repeated acquire, renew, renew_many, get, list, last_token, release (notified),
    wait_for_release and force_release, each checked."""
    token = store.acquire("k", "a", LONG_MS)
    assert token is not None
    assert store.acquire("k", "a", LONG_MS) == token  # the owner's retry: the same lease
    assert store.acquire("k", "b", LONG_MS) is None
    assert store.renew("k", "a", LONG_MS) is True
    assert store.renew_many([("k", "a", LONG_MS), ("k", "b", LONG_MS)]) == [True, False]
    info = store.get("k")
    assert info is not None and (info.owner, info.token) == ("a", token)
    assert [i.key for i in store.list()] == ["k"]
    assert store.last_token("k") == token
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(store.wait_for_release("k", 10)))
    waiter.start()
    _wait_for(lambda: store.waiting() == 1, "the waiter")
    store.release("k", "a")
    waiter.join(DEADLINE)
    assert woke == [True] and store.get("k") is None
    assert store.acquire("k", "b", LONG_MS) is not None
    removed = store.force_release("k")
    assert removed is not None and removed.owner == "b"
    assert store.get("k") is None


class TestLeastPrivilege:
    """A role with only SELECT/INSERT/UPDATE on a DBA-made table; DDL off the hot path."""

    @pytest.mark.parametrize("create_table", [True, False], ids=["create_table", "no_ddl"])
    def test_a_role_without_create_uses_a_dba_created_table(
        self, pg_database_dsn: str, pg_app_role: PgRole, create_table: bool
    ) -> None:
        """Every operation works for a role with only the documented grants, whatever the option.

        The role has no CREATE on any schema (PostgreSQL 15's default on ``public``).
        """
        table = f"ops_{secrets.token_hex(3)}.celery_lease"
        _as_dba_create_table(pg_database_dsn, table, pg_app_role.name)
        store = PostgresLockStore(pg_app_role.dsn, table=table, create_table=create_table)
        try:
            _exercise_every_operation(store)
        finally:
            store.close()

    def test_the_url_option_turns_ddl_off(
        self, pg_database_dsn: str, pg_app_role: PgRole, pg_table: str
    ) -> None:
        """``?create_table=false`` in a store URL is taken by the store, not sent to libpq.

        The URL's store uses the default table name, found first in the schema named after the
        role (``search_path`` starts with ``"$user"``), which the DBA made for it.
        """
        _as_dba_create_table(pg_database_dsn, f"{pg_app_role.name}.celery_lease", pg_app_role.name)
        store = store_from_url(f"{pg_app_role.dsn}?create_table=false&connect_timeout=3")
        try:
            assert isinstance(store, PostgresLockStore)
            assert store.create_table is False
            _exercise_every_operation(store)
        finally:
            store.close()
        store = PostgresLockStore(f"{pg_app_role.dsn}?create_table=false", table=pg_table)
        try:
            with pytest.raises(StoreUnavailableError, match="create_table=False"):
                store.acquire("k", "a", LONG_MS)
        finally:
            store.close()

    def test_a_missing_table_with_ddl_off_is_a_clear_error(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """With create_table=False a missing table is reported (table, option, DDL), never made."""
        store = PostgresLockStore(pg_database_dsn, table=pg_table, create_table=False)
        try:
            for call in (
                lambda: store.acquire("k", "a", LONG_MS),
                lambda: store.renew("k", "a", LONG_MS),
                lambda: store.release("k", "a"),
                lambda: store.list(),
            ):
                with pytest.raises(StoreUnavailableError) as info:
                    call()
                message = str(info.value)
                assert f"table {pg_table!r} does not exist" in message, message
                assert "create_table=False" in message, message
                assert f"PostgresLockStore.schema_sql({pg_table!r})" in message, message
                assert "42P01" in message, message
                assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)
            assert not _table_exists(pg_database_dsn, pg_table)
        finally:
            store.close()

    def test_a_table_without_grants_names_the_grants(
        self, pg_database_dsn: str, pg_app_role: PgRole, pg_table: str
    ) -> None:
        """A table the role may not write: the server's message, and the grants it needs."""
        _query(pg_database_dsn, PostgresLockStore.schema_sql(pg_table))
        store = PostgresLockStore(pg_app_role.dsn, table=pg_table)
        try:
            with pytest.raises(StoreUnavailableError) as info:
                store.acquire("k", "a", LONG_MS)
        finally:
            store.close()
        message = str(info.value)
        assert f"permission denied for table {pg_table}" in message, message
        assert "SELECT, INSERT, UPDATE" in message and "42501" in message, message

    def test_a_missing_table_the_role_may_not_create_is_a_clear_error(
        self, pg_app_role: PgRole, pg_table: str
    ) -> None:
        """create_table=True without CREATE privilege: the error says so and points at the DDL."""
        store = PostgresLockStore(pg_app_role.dsn, table=pg_table)
        try:
            with pytest.raises(StoreUnavailableError) as info:
                store.acquire("k", "a", LONG_MS)
            message = str(info.value)
            assert f"table {pg_table!r} does not exist" in message, message
            assert "permission denied for schema public" in message, message
            assert "42501" in message, message
            assert f"PostgresLockStore.schema_sql({pg_table!r})" in message, message
            assert "failed to acquire" in message, message
        finally:
            store.close()

    def test_the_hot_path_sends_one_statement_and_no_ddl(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """On an existing table even the first operation of a store is its one statement."""
        with psycopg.connect(pg_database_dsn, autocommit=True) as conn:
            conn.execute(PostgresLockStore.schema_sql(pg_table).encode())
        with ConnectionPool(
            pg_database_dsn,
            connection_class=_CountingConnection,
            min_size=1,
            max_size=1,
            open=True,
            kwargs={"autocommit": True},
        ) as pool:
            store = PostgresLockStore(pool, table=pg_table)
            _CountingConnection.statements.clear()
            assert store.acquire("k", "a", LONG_MS) is not None
            assert store.renew("k", "a", LONG_MS) is True
            store.release("k", "a")
            sent = list(_CountingConnection.statements)
            store.close()
        assert len(sent) == 3, sent
        assert not [s for s in sent if b"CREATE" in s.upper()], sent
        assert b"SELECT" not in sent[0].upper()  # the acquire reads the key's row only

    def test_a_table_dropped_after_first_use_is_created_again(
        self, store: PostgresLockStore
    ) -> None:
        """With create_table=True a missing table is made whenever it is found missing."""
        assert store.acquire("k", "a", LONG_MS) is not None
        dsn = store._dsn
        assert dsn is not None
        _query(dsn, f'DROP TABLE "{store.table}"')
        assert store.acquire("k", "b", LONG_MS) is not None
        assert _table_exists(dsn, store.table)

    @pytest.mark.parametrize("value", ["yes", 1, 0.0, "false"])
    def test_a_bad_create_table_keyword_is_refused(self, value: Any) -> None:
        """create_table= must be a bool; the error names the parameter and the value."""
        with pytest.raises(LeaseConfigError, match=r"create_table=.*must be True or False"):
            PostgresLockStore("postgresql://localhost/x", create_table=value)

    @pytest.mark.parametrize(
        "query", ["create_table=maybe", "create_table=", "create_table=1&create_table=0"]
    )
    def test_a_bad_create_table_url_value_is_refused(self, query: str) -> None:
        """The URL value must be true/false (or 1/0, yes/no, on/off), given once."""
        with pytest.raises(LeaseConfigError, match="create_table"):
            PostgresLockStore(f"postgresql://localhost/x?{query}")

    def test_url_and_keyword_must_agree(self) -> None:
        """A URL saying one thing and the keyword the other is refused, not silently resolved."""
        with pytest.raises(LeaseConfigError, match="create_table"):
            PostgresLockStore("postgresql://localhost/x?create_table=false", create_table=True)
        store = PostgresLockStore("postgresql://u:pw@localhost/x?sslmode=disable&create_table=off")
        assert store.create_table is False
        assert "create_table" not in (store._dsn or "") and "sslmode=disable" in (store._dsn or "")


# Replies lost after the server committed -------------------------------------------------------

_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"  # a ReadyForQuery message; its status byte follows


class _ReplyCutter:
    """A loopback TCP proxy to PostgreSQL that loses one reply after the server sent it.

    Bytes pass unchanged until :meth:`arm` ``(tag)``. Then the first server->client data holding
    the CommandComplete ``tag`` (``b"INSERT 0 1"``, ``b"UPDATE 1"``...) is swallowed, and so is
    everything after it up to and including the ReadyForQuery that ends the reply: the server has
    finished the statement (in autocommit: committed it) and says so. ``on_cut`` runs, then both
    sides of that connection are closed: the client sees its connection drop with the reply
    unread. :attr:`swallowed` holds what the client never got; :attr:`cut` is set afterwards.
    """

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._tag: bytes | None = None
        self._on_cut: Callable[[], object] | None = None
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.swallowed = b""
        self.cut = threading.Event()
        self._spawn(self._accept)

    def arm(self, tag: bytes, on_cut: Callable[[], object] | None = None) -> None:
        """Lose the next reply carrying CommandComplete ``tag``; run ``on_cut`` before cutting."""
        with self._lock:
            self._tag, self._on_cut = tag + b"\x00", on_cut
            self.swallowed = b""
            self.cut.clear()

    def close(self) -> None:
        self._shut(self._listener)  # shutdown() wakes the thread blocked in accept()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            self._shut(sock)
        for thread in self._threads:
            thread.join(DEADLINE)

    def __enter__(self) -> _ReplyCutter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self._target_port))
            with self._lock:
                self._sockets += [client, upstream]
            self._spawn(self._forward, client, upstream)
            self._spawn(self._reply, upstream, client)

    def _forward(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        self._shut(sink)

    def _reply(self, server: socket.socket, client: socket.socket) -> None:
        held = b""  # the reply being swallowed, once the tag was seen on this connection
        mine = b""  # the tag this connection took
        try:
            while data := server.recv(65536):
                with self._lock:
                    tag = self._tag
                    if not held and tag is not None and tag in data:
                        self._tag, mine, held = None, tag, data  # this connection takes it
                    elif held:
                        held += data
                if not held:
                    client.sendall(data)
                    continue
                end = held.find(_READY_FOR_QUERY, held.index(mine))
                if end < 0 or len(held) < end + 6:
                    continue  # the reply goes on: keep swallowing up to its ReadyForQuery
                self.swallowed = held
                if self._on_cut is not None:
                    self._on_cut()
                break
        except OSError:
            pass
        self._shut(client)
        self._shut(server)
        if held:
            self.cut.set()


def _server_port(dsn: str) -> int:
    port = psycopg.conninfo.conninfo_to_dict(dsn).get("port", 5432)
    return int(port)


def _via(dsn: str, port: int) -> str:
    return psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(port))


@pytest.fixture
def cutter(pg_database_dsn: str) -> Iterator[_ReplyCutter]:
    with _ReplyCutter(_server_port(pg_database_dsn)) as proxy:
        yield proxy


class TestLostReplies:
    """A statement the server committed whose reply never reaches the store (a real cut socket).

    Retried once on a new connection: acquire, renew and release are safe to redo (the retried
    acquire by the same owner returns that owner's lease); force_release is not, and says so.
    """

    @pytest.fixture
    def pair(
        self, pg_database_dsn: str, pg_table: str, cutter: _ReplyCutter
    ) -> Iterator[tuple[PostgresLockStore, PostgresLockStore]]:
        """(a store talking through the cutter, a store talking to the server directly)."""
        proxied = PostgresLockStore(
            _via(pg_database_dsn, cutter.port), table=pg_table, max_connections=2
        )
        direct = PostgresLockStore(pg_database_dsn, table=pg_table)
        try:
            assert direct.get("warm-up") is None  # creates the table
            yield proxied, direct
        finally:
            proxied.close()
            direct.close()

    def assert_committed_then_cut(self, cutter: _ReplyCutter, tag: bytes) -> None:
        assert cutter.cut.wait(DEADLINE), "no reply was cut"
        assert tag + b"\x00" in cutter.swallowed
        # ReadyForQuery status "I": the server left the (implicit) transaction: it committed.
        assert _READY_FOR_QUERY + b"I" in cutter.swallowed, cutter.swallowed

    def test_a_lost_acquire_reply_returns_the_owners_lease(
        self,
        pair: tuple[PostgresLockStore, PostgresLockStore],
        cutter: _ReplyCutter,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The retry gets the token of the lease it took, the lease is its own, and it frees."""
        proxied, direct = pair
        cutter.arm(b"INSERT 0 1")
        with caplog.at_level(logging.INFO, logger="celery_lease.stores.postgres"):
            token = proxied.acquire("k", "a", LONG_MS)
        self.assert_committed_then_cut(cutter, b"INSERT 0 1")
        assert any("retrying acquire" in r.getMessage() for r in caplog.records)
        assert token is not None
        info = direct.get("k")
        assert info is not None and (info.owner, info.token) == ("a", token)
        assert direct.last_token("k") == token  # no second token was issued
        proxied.release("k", "a")
        assert direct.get("k") is None
        assert direct.acquire("k", "b", LONG_MS) is not None  # nothing blocks the key

    def test_a_lost_acquire_slot_commit_reply_returns_the_owners_slot(
        self, pair: tuple[PostgresLockStore, PostgresLockStore], cutter: _ReplyCutter
    ) -> None:
        """The transaction committed, its COMMIT's reply was lost: the retry by the same owner
        gets that slot and token back; no second slot, no second token."""
        proxied, direct = pair
        first = direct.acquire_slot("k", "other", LONG_MS, 3)
        assert first is not None and first[0] == 0
        cutter.arm(b"COMMIT")
        got = proxied.acquire_slot("k", "a", LONG_MS, 3)
        self.assert_committed_then_cut(cutter, b"COMMIT")
        assert got is not None and got[0] == 1
        info = direct.get(slot_key("k", 1))
        assert info is not None and (info.owner, info.token) == ("a", got[1])
        assert direct.last_token(counter_key("k")) == got[1]
        assert [i.owner for i in direct.list("k")] == ["other", "a"]
        proxied.release(slot_key("k", 1), "a")
        again = direct.acquire_slot("k", "b", LONG_MS, 2)
        assert again is not None and again[0] == 1 and again[1] > got[1]

    def test_a_lost_renew_reply_still_reports_renewed(
        self, pair: tuple[PostgresLockStore, PostgresLockStore], cutter: _ReplyCutter
    ) -> None:
        """The renew took effect; the retry renews again and answers True."""
        proxied, direct = pair
        token = proxied.acquire("k", "a", 2_000)
        assert token is not None
        cutter.arm(b"UPDATE 1")
        assert proxied.renew("k", "a", LONG_MS) is True
        self.assert_committed_then_cut(cutter, b"UPDATE 1")
        info = direct.get("k")
        assert info is not None and (info.owner, info.token) == ("a", token)
        assert info.expires_in > 50.0

    def test_a_lost_release_reply_does_not_free_the_next_holder(
        self, pair: tuple[PostgresLockStore, PostgresLockStore], cutter: _ReplyCutter
    ) -> None:
        """Another owner takes the key between the commit and the retry; the retry leaves it."""
        proxied, direct = pair
        assert proxied.acquire("k", "a", LONG_MS) is not None
        taken: list[int | None] = []
        cutter.arm(b"SELECT 1", on_cut=lambda: taken.append(direct.acquire("k", "b", LONG_MS)))
        proxied.release("k", "a")  # must not raise
        self.assert_committed_then_cut(cutter, b"SELECT 1")
        assert taken and taken[0] is not None
        info = direct.get("k")
        assert info is not None and (info.owner, info.token) == ("b", taken[0])

    def test_a_lost_force_release_reply_is_not_redone(
        self, pair: tuple[PostgresLockStore, PostgresLockStore], cutter: _ReplyCutter
    ) -> None:
        """Redoing it would remove whoever took the key meanwhile: it fails, saying so."""
        proxied, direct = pair
        assert proxied.acquire("k", "a", LONG_MS) is not None
        taken: list[int | None] = []
        cutter.arm(b"SELECT 1", on_cut=lambda: taken.append(direct.acquire("k", "b", LONG_MS)))
        with pytest.raises(StoreUnavailableError, match="may have taken effect"):
            proxied.force_release("k")
        self.assert_committed_then_cut(cutter, b"SELECT 1")
        info = direct.get("k")
        assert taken and info is not None and (info.owner, info.token) == ("b", taken[0])


# Errors name the store, the operation and the server's own words -------------------------------


class TestErrorMessages:
    """Every StoreUnavailableError says where (never the password), what, and why."""

    def test_a_database_that_does_not_exist(self, pg_database_dsn: str) -> None:
        """The server's "database ... does not exist" reaches the error, not only the log."""
        parts = psycopg.conninfo.conninfo_to_dict(pg_database_dsn)
        host, port = parts.get("host", "127.0.0.1"), int(parts.get("port", 5432))
        name = f"no_such_db_{secrets.token_hex(3)}"
        store = PostgresLockStore(
            f"postgresql://postgres:s3cret@{host}:{port}/{name}", table="t1", connect_timeout=1
        )
        try:
            with pytest.raises(StoreUnavailableError) as info:
                store.acquire("k", "a", LONG_MS)
        finally:
            store.close()
        message = str(info.value)
        for part in (f"host={host!r}", f"port={port}", f"dbname={name!r}", "table='t1'"):
            assert part in message, message
        assert "failed to acquire" in message, message
        assert f'database "{name}" does not exist' in message, message
        assert "s3cret" not in message and "s3cret" not in repr(info.value.args)

    def test_a_port_with_nothing_listening(self) -> None:
        """Connection refused, with the host and port, within connect_timeout."""
        from tests.support import free_port

        port = free_port()
        store = PostgresLockStore(
            f"postgresql://postgres:s3cret@127.0.0.1:{port}/leases", connect_timeout=0.5
        )
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as info:
                store.renew("k", "a", LONG_MS)
            assert time.monotonic() - started < 2.0
        finally:
            store.close()
        message = str(info.value)
        for part in ("host='127.0.0.1'", f"port={port}", "dbname='leases'", "celery_lease"):
            assert part in message, message
        assert "failed to renew" in message, message
        assert "Connection refused" in message, message
        assert "s3cret" not in message

    def test_a_server_error_carries_its_sqlstate(self, pg_database_dsn: str, pg_table: str) -> None:
        """A statement the server rejects: its message and SQLSTATE, and the operation."""
        store = PostgresLockStore(pg_database_dsn, table=pg_table)
        try:
            assert store.get("k") is None  # creates the table
            _query(pg_database_dsn, f'ALTER TABLE "{pg_table}" ADD CHECK (length(key) < 3)')
            with pytest.raises(StoreUnavailableError) as info:
                store.acquire("long-key", "a", LONG_MS)
        finally:
            store.close()
        message = str(info.value)
        assert "failed to acquire" in message and f"table={pg_table!r}" in message, message
        assert "violates check constraint" in message and "SQLSTATE 23514" in message, message
        assert isinstance(info.value.__cause__, psycopg.errors.CheckViolation)

    def test_a_callers_pool_is_described_by_its_conninfo(
        self, pg_database_dsn: str, pg_table: str
    ) -> None:
        """With a pool passed in, the error names the pool's host, port and database."""
        parts = psycopg.conninfo.conninfo_to_dict(pg_database_dsn)
        dsn = psycopg.conninfo.make_conninfo(pg_database_dsn, password="s3cret")
        with ConnectionPool(dsn, min_size=1, open=True, kwargs={"autocommit": True}) as pool:
            store = PostgresLockStore(pool, table=pg_table, create_table=False)
            with pytest.raises(StoreUnavailableError) as info:
                store.get("k")
            store.close()
        message = str(info.value)
        assert f"dbname={parts['dbname']!r}" in message and "failed to get" in message, message
        assert "s3cret" not in message


# Interrupts inside a store call --------------------------------------------------------------


class _Interrupt(Exception):
    """What the Celery layer raises asynchronously in a body (like LockLostError)."""


def _backends_waiting_on_a_lock(dsn: str) -> list[int]:
    rows = _query(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'",
    )
    return [int(pid) for (pid,) in rows]


def _statements_still_running(dsn: str, table: str) -> int:
    ((count,),) = _query(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND state = 'active' AND pid <> pg_backend_pid() AND query LIKE %s",
        [f'%"{table}"%'],
    )
    return int(count)


class TestInterrupts:
    """An exception raised asynchronously while a statement waits on the server.

    Forced: another session holds the key's row lock, so the store's statement blocks; the
    exception is raised once the server reports the statement waiting on that lock.
    """

    @pytest.fixture
    def blocked(self, store: PostgresLockStore) -> Iterator[psycopg.Connection[Any]]:
        """A session holding the row lock of key "k" (the row exists, free) until it ends."""
        assert store.acquire("k", "x", LONG_MS) is not None
        store.release("k", "x")
        dsn = store._dsn
        assert dsn is not None
        conn = psycopg.connect(dsn)
        conn.execute(f'SELECT * FROM "{store.table}" WHERE key = %s FOR UPDATE', ["k"])
        try:
            yield conn
        finally:
            conn.close()

    def check_after(self, store: PostgresLockStore, blocker: psycopg.Connection[Any]) -> None:
        """The interrupted acquire left no lease; the store and its pool work on."""
        dsn = store._dsn
        assert dsn is not None
        blocker.rollback()  # the row lock goes: a statement still queued on it would now run
        deadline = time.monotonic() + DEADLINE
        while _statements_still_running(dsn, store.table):
            assert time.monotonic() < deadline, "the interrupted statement never ended"
            time.sleep(0.005)
        assert store.get("k") is None, "the interrupted acquire left a lease nobody knows of"
        token = store.acquire("k", "b", LONG_MS)
        assert token is not None and store.renew("k", "b", LONG_MS) is True
        store.release("k", "b")
        pool = store._pool
        assert pool is not None
        with pool.connection() as conn:
            assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert conn.execute("SELECT 1").fetchone() == (1,)

    def test_a_signal_handler_raising_during_acquire(
        self, store: PostgresLockStore, blocked: psycopg.Connection[Any]
    ) -> None:
        """A handler raising in the main thread (as on_lost="revoke" does) mid-statement."""
        dsn = store._dsn
        assert dsn is not None

        def raise_interrupt(signum: int, frame: object) -> None:
            raise _Interrupt("lease lost")

        main = threading.main_thread().ident
        assert main is not None and threading.get_ident() == main

        def kick() -> None:
            _wait_for(lambda: bool(_backends_waiting_on_a_lock(dsn)), "a blocked statement")
            signal.pthread_kill(main, signal.SIGUSR1)

        previous = signal.signal(signal.SIGUSR1, raise_interrupt)
        kicker = threading.Thread(target=kick)
        try:
            kicker.start()
            with pytest.raises(_Interrupt):
                store.acquire("k", "a", LONG_MS)
            kicker.join(DEADLINE)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        self.check_after(store, blocked)

    def test_an_async_exception_in_a_thread_during_acquire(
        self, store: PostgresLockStore, blocked: psycopg.Connection[Any]
    ) -> None:
        """PyThreadState_SetAsyncExc (the threads pool's interrupt) lands once the reply comes."""
        dsn = store._dsn
        assert dsn is not None
        outcome: list[object] = []

        def body() -> None:
            try:
                outcome.append(store.acquire("k", "a", LONG_MS))
            except _Interrupt as exc:
                outcome.append(exc)

        worker = threading.Thread(target=body)
        worker.start()
        _wait_for(lambda: bool(_backends_waiting_on_a_lock(dsn)), "a blocked statement")
        assert worker.ident is not None
        hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(worker.ident), ctypes.py_object(_Interrupt)
        )
        assert hit == 1
        blocked.rollback()  # the statement now completes on the server, then the exception lands
        worker.join(DEADLINE)
        assert len(outcome) == 1 and isinstance(outcome[0], _Interrupt), outcome
        self.check_after(store, blocked)
