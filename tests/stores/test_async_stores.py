"""The async stores (Redis and PostgreSQL): the rules only a coroutine caller meets.

Each store's run of the whole contract is in its own file (``test_redis_async.py``,
``test_postgres_async.py``; the thread adapter's in ``tests/stores/test_threaded.py``).
The async-only tests run on real servers: a cancelled wait, a cancelled acquire whose command
the server already ran, many coroutines of one loop handing a key over, the sync twin and the
async store excluding each other, a hung server, and a reply lost after the server applied it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores import redis_async as redis_async_module
from celery_lease.stores.base import AsyncLockStore, LeaseInfo, LockStore, SupportsInspection
from celery_lease.stores.postgres import PostgresLockStore
from celery_lease.stores.postgres_async import AsyncPostgresLockStore
from celery_lease.stores.redis import ACQUIRE_SCRIPT, RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from tests.faults.tcp_proxy import TcpProxy
from tests.fixtures_redis import RedisServer, blocked_clients
from tests.stores.contract import DEADLINE, LONG_MS
from tests.stores.test_postgres import _ReplyCutter, _server_port

_PASSWORD = "s3cret-pw-H6"


# Both backends, for the async-only tests ------------------------------------------------------


@dataclasses.dataclass
class Backend:
    """How to build the async store, an independent sync store on the same data, and how to
    tell that ``count`` coroutines are blocked waiting for a release."""

    name: str
    make_async: Callable[[], AsyncLockStore]
    make_sync: Callable[[], LockStore]
    waiting: Callable[[AsyncLockStore], int]
    port: int  # the server's port (a proxy forwards there)
    url: str  # the server's URL or DSN
    scope: str  # the Redis prefix or the PostgreSQL table of this test


@pytest.fixture(params=["redis", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "redis":
        request.applymarker(pytest.mark.redis)
        server: RedisServer = request.getfixturevalue("redis_server")
        url: str = request.getfixturevalue("redis_url")
        prefix = f"async-{uuid.uuid4().hex[:8]}:"
        yield Backend(
            "redis",
            lambda: AsyncRedisLockStore(url, prefix=prefix),
            lambda: RedisLockStore(url, prefix=prefix),
            lambda store: blocked_clients(server),
            server.port,
            url,
            prefix,
        )
        return
    request.applymarker(pytest.mark.postgres)
    dsn: str = request.getfixturevalue("pg_database_dsn")
    table: str = request.getfixturevalue("pg_table")

    def waiting(store: AsyncLockStore) -> int:
        assert isinstance(store, AsyncPostgresLockStore)
        return store.waiting()

    yield Backend(
        "postgres",
        lambda: AsyncPostgresLockStore(dsn, table=table),
        lambda: PostgresLockStore(dsn, table=table),
        waiting,
        _server_port(dsn),
        dsn,
        table,
    )


async def _until(predicate: Callable[[], bool], what: str) -> None:
    """Yield to the loop until ``predicate()`` holds (the check runs off the loop thread)."""
    deadline = time.monotonic() + DEADLINE
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def _get(store: LockStore, key: str) -> Any:
    assert isinstance(store, SupportsInspection)
    return store.get(key)


class TestAsyncOnly:
    """What only a coroutine caller can do to a store."""

    def test_cancelling_wait_for_release_stops_the_wait(self, backend: Backend) -> None:
        """A coroutine awaiting a release ends with CancelledError when cancelled, promptly
        and without waiting out its timeout; the store keeps working afterwards."""

        async def main() -> None:
            store = backend.make_async()
            try:
                assert await store.acquire("k", "holder", LONG_MS) is not None
                waiter = asyncio.ensure_future(store.wait_for_release("k", 300.0))
                await _until(lambda: backend.waiting(store) >= 1, "the waiter to block")
                waiter.cancel()
                done, _ = await asyncio.wait({waiter}, timeout=DEADLINE)
                assert waiter in done, "the cancelled wait did not end"
                assert waiter.cancelled()
                await _until(lambda: backend.waiting(store) == 0, "the waiter to go")
                await store.release("k", "holder")
                assert await store.acquire("k", "next", LONG_MS) is not None
            finally:
                await store.aclose()

        asyncio.run(main())

    def test_twenty_coroutines_on_one_loop_hand_a_key_over_without_overlap(
        self, backend: Backend
    ) -> None:
        """20 coroutines of one loop race for one key: each holds it once, never two at a time,
        and every token is larger than the one before."""

        async def main() -> None:
            store = backend.make_async()
            inside: list[str] = []
            tokens: list[int] = []
            overlaps: list[tuple[str, ...]] = []

            async def worker(name: str) -> None:
                while True:
                    token = await store.acquire("hot", name, LONG_MS)
                    if token is None:
                        await store.wait_for_release("hot", 1.0)
                        continue
                    inside.append(name)
                    if len(inside) > 1:
                        overlaps.append(tuple(inside))
                    tokens.append(token)
                    for _ in range(3):
                        await asyncio.sleep(0)  # let the others run while it is held
                    inside.remove(name)
                    await store.release("hot", name)
                    return

            try:
                names = [f"c{i}" for i in range(20)]
                await asyncio.wait_for(asyncio.gather(*(worker(n) for n in names)), 60)
            finally:
                await store.aclose()
            assert overlaps == []
            assert len(tokens) == 20
            assert tokens == sorted(tokens) and len(set(tokens)) == 20

        asyncio.run(main())

    def test_the_sync_twin_and_the_async_store_exclude_each_other(self, backend: Backend) -> None:
        """On one key, a lease taken by the async store blocks a separately built sync store and
        the other way round; tokens grow across both; each releases only its own lease."""

        async def main() -> None:
            store = backend.make_async()
            other = backend.make_sync()
            try:
                t1 = await store.acquire("shared", "async-1", LONG_MS)
                assert t1 is not None
                assert await asyncio.to_thread(other.acquire, "shared", "sync-1", LONG_MS) is None
                assert store.sync.acquire("shared", "sync-twin", LONG_MS) is None
                await asyncio.to_thread(other.release, "shared", "async-2")  # not its owner
                assert await store.renew("shared", "async-1", LONG_MS) is True
                await store.release("shared", "async-1")
                t2 = await asyncio.to_thread(other.acquire, "shared", "sync-1", LONG_MS)
                assert t2 is not None and t2 > t1
                assert await store.acquire("shared", "async-2", LONG_MS) is None
                await store.release("shared", "async-2")  # not the holder: nothing happens
                assert await store.renew("shared", "async-2", LONG_MS) is False
                assert _get(other, "shared").owner == "sync-1"
                await asyncio.to_thread(other.release, "shared", "sync-1")
                t3 = await store.acquire("shared", "async-3", LONG_MS)
                assert t3 is not None and t3 > t2
            finally:
                await store.aclose()
                close = getattr(other, "close", None)
                if callable(close):
                    close()

        asyncio.run(main())

    def test_a_cancelled_acquire_the_server_already_ran_leaves_nothing_held(
        self, backend: Backend
    ) -> None:
        """Cancelled after the server applied it (its reply delayed by a proxy), an acquire
        releases the lease it took: the key is free once the cancellation has propagated.

        The key is watched through a store that bypasses the proxy: through the proxy every
        look takes longer than the reply, and the cancel would come after the acquire ended.
        """

        async def main() -> None:
            warm = backend.make_async()
            await warm.acquire("warm", "w", LONG_MS)  # loads the script / creates the table
            await warm.release("warm", "w")
            await warm.aclose()
            direct = backend.make_sync()
            latency = 0.5
            with TcpProxy(backend.port) as proxy:
                store = _through(backend, proxy.port)
                try:
                    assert await store.renew("k", "nobody", LONG_MS) is False  # connected
                    while True:
                        proxy.set_latency(latency)
                        attempt = asyncio.ensure_future(store.acquire("k", "cancelled", LONG_MS))
                        await _until(lambda: _get(direct, "k") is not None, "the acquire to apply")
                        if attempt.cancel():  # no await since the look: the reply is not in
                            break
                        # The reply came before the look ended (a slow machine): again, slower.
                        assert latency < 8, "the reply always came before the cancel"
                        proxy.set_latency(0.0)
                        await store.release("k", "cancelled")
                        latency *= 2
                    with pytest.raises(asyncio.CancelledError):
                        await attempt
                    assert _get(direct, "k") is None
                finally:
                    proxy.set_latency(0.0)
                    await store.aclose()
                    _close(direct)

        asyncio.run(main())

    @pytest.mark.redis
    def test_a_release_undoing_a_cancelled_acquire_does_not_overtake_it(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """The caller is cancelled while its acquire is still on its way to the server (held
        1 s by a proxy); connections opened from then on go to the server directly, fast. The
        store waits for the acquire's reply before it releases, so once the slow connection is
        done the key is free (a release sent at once, on a new connection, would reach the
        server first and free nothing, and then the acquire would take the key)."""
        prefix = f"overtake-{uuid.uuid4().hex[:8]}:"
        assert asyncio.run(_cancel_an_acquire_on_its_way(redis_server, redis_url, prefix)) is None

    @pytest.mark.redis
    def test_an_acquire_cancelled_with_its_reply_later_than_the_undo_wait_is_still_undone(
        self, redis_server: RedisServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The caller is cancelled while its acquire is on its way (held 1 s by a proxy), and the
        store's wait for the reply is shorter than that (5 s in real life, 0.1 s here). Whatever
        it does then, once the slow connection is done the key is not held: no lease of an
        owner nobody knows stays behind for its ttl."""
        monkeypatch.setattr(redis_async_module, "_UNDO_TIMEOUT", 0.1)
        prefix = f"late-undo-{uuid.uuid4().hex[:8]}:"
        held = asyncio.run(_cancel_an_acquire_on_its_way(redis_server, redis_url, prefix))
        assert held is None, f"{held} stays behind for its ttl"

    def test_an_acquire_whose_reply_was_lost_gets_the_lease_back(self, backend: Backend) -> None:
        """The server ran the acquire and the reply was lost: the store's retry returns the
        lease the first attempt took (same token), not None and not an orphan."""
        if backend.name == "redis":
            _lost_acquire_redis(backend)
        else:
            _lost_acquire_postgres(backend)


def _close(store: LockStore) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()


def _through(backend: Backend, port: int, **options: Any) -> AsyncLockStore:
    """The backend's async store, connected through ``port`` (a proxy), on the same data."""
    if backend.name == "redis":
        url = f"redis://127.0.0.1:{port}/0"
        return AsyncRedisLockStore(url, prefix=backend.scope, **options)
    params = psycopg.conninfo.conninfo_to_dict(backend.url)
    params["port"] = str(port)
    params["host"] = "127.0.0.1"
    return AsyncPostgresLockStore(
        psycopg.conninfo.make_conninfo(**params),
        table=backend.scope,
        **options,
    )


def _lost_acquire_redis(backend: Backend) -> None:
    url, port = backend.url, backend.port
    marker = ACQUIRE_SCRIPT_SHA
    armed = {"times": 0}

    class DropsReplies(redis.asyncio.Connection):
        dropping = False

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            data = b"".join(command) if isinstance(command, list) else command
            if armed["times"] > 0 and marker in data:
                armed["times"] -= 1
                self.dropping = True
            await super().send_packed_command(command, check_health)

        async def read_response(self, *args: Any, **kw: Any) -> Any:
            response = await super().read_response(*args, **kw)
            if self.dropping:
                self.dropping = False
                await self.disconnect()
                raise redis.exceptions.ConnectionError("test: reply lost after the server ran it")
            return response

    async def main() -> None:
        pool = redis.asyncio.ConnectionPool(
            connection_class=DropsReplies,
            host="127.0.0.1",
            port=port,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=5.0,
        )
        client = redis.asyncio.Redis(connection_pool=pool)
        prefix = f"lost-{uuid.uuid4().hex[:8]}:"
        twin = RedisLockStore(url, prefix=prefix)
        store = AsyncRedisLockStore(client, sync=twin)
        try:
            assert await store.acquire("warm", "w", LONG_MS) is not None  # script loaded
            armed["times"] = 1
            token = await store.acquire("k", "owner", LONG_MS)
            assert armed["times"] == 0, "the reply was never dropped"
            info = twin.get("k")
            assert token is not None and info is not None
            assert (info.owner, info.token) == ("owner", token)
            armed["times"] = 2  # both the call and its retry lose their reply
            with pytest.raises(StoreUnavailableError, match="acquire 'k2'"):
                await store.acquire("k2", "owner2", LONG_MS)
            # What it took is its owner's: the same owner gets it back (the contract's retry).
            again = await store.acquire("k2", "owner2", LONG_MS)
            assert again is not None and twin.get("k2").owner == "owner2"  # type: ignore[union-attr]
        finally:
            await store.aclose()
            await client.aclose()
            twin.close()

    asyncio.run(main())


ACQUIRE_SCRIPT_SHA = hashlib.sha1(ACQUIRE_SCRIPT.encode()).hexdigest().encode()


def _lost_acquire_postgres(backend: Backend) -> None:
    async def main() -> None:
        with _ReplyCutter(backend.port) as cutter:
            store = _through(backend, cutter.port)
            try:
                assert await store.renew("k", "nobody", LONG_MS) is False  # table exists now
                cutter.arm(b"INSERT 0 1")
                token = await store.acquire("k", "owner", LONG_MS)
                assert cutter.cut.is_set(), "the reply was never cut"
                info = _get(store.sync, "k")
                assert token is not None and info is not None
                assert (info.owner, info.token) == ("owner", token)
            finally:
                await store.aclose()

    asyncio.run(main())


# Hung servers and error messages ------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_a_hung_redis_is_an_error_naming_store_operation_and_key(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """Behind a proxy that stops passing bytes, acquire fails after the socket timeout (and its
    one retry) with StoreUnavailableError naming the store, the operation and the key, and no
    password."""
    server = redis_server_factory(password=_PASSWORD)

    async def main() -> None:
        with TcpProxy(server.port) as proxy:
            url = f"redis://:{_PASSWORD}@127.0.0.1:{proxy.port}/0?socket_timeout=0.5"
            store = AsyncRedisLockStore(url, prefix="hung:")
            try:
                assert await store.renew("k", "nobody", LONG_MS) is False
                proxy.blackhole()
                with pytest.raises(StoreUnavailableError) as caught:
                    await store.acquire("job:1", "owner", LONG_MS)
            finally:
                proxy.restore()
                await store.aclose()
        message = str(caught.value)
        assert f"redis://127.0.0.1:{proxy.port}/0" in message
        assert "acquire 'job:1'" in message and "Timeout" in message
        assert _PASSWORD not in message and _PASSWORD not in repr(caught.value.__cause__)

    asyncio.run(main())


@pytest.mark.postgres
@pytest.mark.slow
def test_a_hung_postgres_is_an_error_naming_store_operation_and_key(
    pg_database_dsn: str, pg_table: str
) -> None:
    """Behind a proxy that stops passing bytes, a statement fails after ``statement_timeout``
    with StoreUnavailableError naming the store, the operation and the key, never the password
    (trust auth ignores it)."""

    async def main() -> None:
        params = psycopg.conninfo.conninfo_to_dict(pg_database_dsn)
        with TcpProxy(_server_port(pg_database_dsn)) as proxy:
            url = (
                f"postgresql://{params.get('user', 'postgres')}:{_PASSWORD}@127.0.0.1:"
                f"{proxy.port}/{params['dbname']}"
            )
            store = AsyncPostgresLockStore(
                url, table=pg_table, statement_timeout=0.5, connect_timeout=1.0
            )
            try:
                assert await store.renew("k", "nobody", LONG_MS) is False
                proxy.blackhole()
                with pytest.raises(StoreUnavailableError) as caught:
                    await store.renew("job:1", "owner", LONG_MS)
            finally:
                proxy.restore()
                await store.aclose()
        message = str(caught.value)
        assert f"port={proxy.port}" in message and pg_table in message
        assert "renew 'job:1'" in message and "statement_timeout" in message
        assert _PASSWORD not in message

    asyncio.run(main())


# Configuration -----------------------------------------------------------------------------------


class TestConfiguration:
    """Bad options are refused at construction, naming the parameter and the value."""

    @pytest.mark.redis
    def test_a_redis_twin_with_another_prefix_is_refused(self) -> None:
        twin = RedisLockStore("redis://127.0.0.1:1/0", prefix="a:")
        with pytest.raises(LeaseConfigError, match="prefix='b:'"):
            AsyncRedisLockStore("redis://127.0.0.1:1/0", prefix="b:", sync=twin)

    @pytest.mark.redis
    def test_a_redis_client_without_a_twin_is_refused(self) -> None:
        with pytest.raises(LeaseConfigError, match="sync=None"):
            AsyncRedisLockStore(redis.asyncio.Redis(port=1))

    @pytest.mark.redis
    def test_bad_redis_urls_and_prefixes_are_refused(self) -> None:
        with pytest.raises(LeaseConfigError, match="prefix"):
            AsyncRedisLockStore("redis://127.0.0.1:1/0", prefix="x{")
        with pytest.raises(LeaseConfigError, match="client_or_url"):
            AsyncRedisLockStore(42)  # type: ignore[arg-type]

    @pytest.mark.postgres
    @pytest.mark.parametrize("value", [0, -1, "5", True])
    def test_a_bad_statement_timeout_is_refused(self, value: Any) -> None:
        with pytest.raises(LeaseConfigError, match=f"statement_timeout={value!r}"):
            AsyncPostgresLockStore("postgresql://u@127.0.0.1:1/db", statement_timeout=value)

    @pytest.mark.postgres
    def test_a_postgres_twin_on_another_table_is_refused(self) -> None:
        twin = PostgresLockStore("postgresql://u@127.0.0.1:1/db", table="a")
        with pytest.raises(LeaseConfigError, match="table='b'"):
            AsyncPostgresLockStore("postgresql://u@127.0.0.1:1/db", table="b", sync=twin)

    @pytest.mark.postgres
    def test_postgres_options_are_validated_as_the_sync_store_does(self) -> None:
        with pytest.raises(LeaseConfigError, match="table="):
            AsyncPostgresLockStore("postgresql://u@127.0.0.1:1/db", table="1bad")
        with pytest.raises(LeaseConfigError, match="create_table"):
            AsyncPostgresLockStore("postgresql://u@127.0.0.1:1/db?create_table=maybe")


async def _cancel_an_acquire_on_its_way(
    redis_server: RedisServer, redis_url: str, prefix: str
) -> LeaseInfo | None:
    """Cancel ``store.acquire("k", "cancelled")`` while it is on its way through a proxy that
    holds it 1 s (connections opened from then on go to the server directly); once the slow
    connection is done, what the server holds under ``k`` (None: nothing)."""
    direct = RedisLockStore(redis_url, prefix=prefix)
    observer = redis_server.client()
    with TcpProxy(redis_server.port) as proxy:
        sent = asyncio.Event()
        route = {"port": proxy.port}

        class Routed(redis.asyncio.Connection):
            """(Re)connects to ``route["port"]``; tells when the acquire was sent."""

            async def _connect(self) -> None:
                self.port = route["port"]
                await super()._connect()

            async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
                await super().send_packed_command(command, check_health)
                data = b"".join(command) if isinstance(command, list) else command
                if ACQUIRE_SCRIPT_SHA in data:
                    sent.set()

        pool = redis.asyncio.ConnectionPool(
            connection_class=Routed,
            host="127.0.0.1",
            port=proxy.port,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=5.0,
        )
        client = redis.asyncio.Redis(connection_pool=pool)
        store = AsyncRedisLockStore(client, sync=direct)
        try:
            assert await store.renew("warm", "w", LONG_MS) is False  # connected
            direct.acquire("warm", "w", LONG_MS)  # the acquire script is loaded
            direct.release("warm", "w")
            slow_id = await client.client_id()  # the pool's one connection
            proxy.set_latency(1.0)
            attempt = asyncio.ensure_future(store.acquire("k", "cancelled", LONG_MS))
            await sent.wait()  # on its way, through the slow proxy
            route["port"] = redis_server.port  # new connections: straight there
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
        finally:
            await store.aclose()
            await client.aclose()
            await pool.disconnect()

        def gone() -> bool:
            return slow_id not in {int(c["id"]) for c in observer.client_list()}

        # The slow connection is closed: the server ran all it had sent, acquire too.
        await _until(gone, "the slow connection to end")
    try:
        return direct.get("k")
    finally:
        direct.force_release("k")
        direct.close()
        observer.close()
