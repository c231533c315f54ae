"""The PostgreSQL store runs the store contract, plus what only a server can show."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores.base import (
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
    store_from_url,
)
from celery_lease.stores.postgres import SCHEMA_SQL, PostgresLockStore
from tests.fixtures_postgres import PgCluster
from tests.stores.contract import DEADLINE, LONG_MS, StoreContract

pytestmark = pytest.mark.postgres


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class TestPostgresStore(StoreContract):
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

    def short_ttl_ms(self) -> int:
        # The suite's 50 ms lets a lease expire between two round trips when the (shared, two
        # core) machine is busy; 250 ms keeps the expiry tests fast and not flaky.
        return 250

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        assert isinstance(store, PostgresLockStore)
        _wait_for(lambda: store.waiting() >= count, f"{count} waiters")


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
        """close() stops the listener thread within a fraction of a second."""
        assert store.wait_for_release("k", 0.01) is False
        started = time.monotonic()
        store.close()
        assert time.monotonic() - started < 0.5
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
