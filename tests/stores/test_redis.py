"""The Redis store runs the store contract on a throwaway redis-server, plus Redis specifics."""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import PRIMARY, ClusterNode, NodesManager, RedisCluster
from redis.connection import SSLConnection, UnixDomainSocketConnection
from redis.crc import key_slot
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from celery_lease import lease
from celery_lease.errors import LeaseConfigError, RestartGraceError, StoreUnavailableError
from celery_lease.stores import store_from_url
from celery_lease.stores._redis_compat import request_slot_refresh
from celery_lease.stores._redis_fast import BUSY, FastConnection, fast_path_for
from celery_lease.stores.base import LockStore
from celery_lease.stores.redis import (
    ACQUIRE_SCRIPT,
    RELEASE_SCRIPT,
    RENEW_CHUNK,
    RENEW_MANY_SCRIPT,
    RENEW_SCRIPT,
    RedisLockStore,
)
from tests.fixtures_redis import RedisServer, SentinelGroup
from tests.stores.contract import DEADLINE, LONG_MS, StoreContract
from tests.stores.slot_contract import ReplaceContract, SlotContract
from tests.support import free_port

pytestmark = pytest.mark.redis


class TestRedisStore(SlotContract, ReplaceContract, StoreContract):
    """RedisLockStore built from a URL, slots and replace included; each store gets its own
    prefix, so it starts empty."""

    fake_clock = False
    release_wakes_one = True
    stateful_examples = 15

    @pytest.fixture
    def store_backend(self, redis_server: RedisServer, redis_url: str) -> None:
        self.server = redis_server
        self.url = redis_url

    def make_store(self) -> LockStore:
        self.prefix = f"contract-{uuid.uuid4().hex[:8]}:"
        return RedisLockStore(self.url, prefix=self.prefix)

    def store_factory(self) -> Callable[[], LockStore]:
        return functools.partial(RedisLockStore, self.url, prefix=self.prefix)

    def wait_until_waiting(self, store: LockStore, count: int) -> None:
        """Poll the server until ``count`` clients block (in BLPOP)."""
        client = self.server.client()
        try:
            deadline = time.monotonic() + DEADLINE
            while int(client.info("clients")["blocked_clients"]) < count:
                assert time.monotonic() < deadline, f"{count} waiters never blocked"
                time.sleep(0.005)
        finally:
            client.close()


class _CountingConnection(redis.Connection):
    """A connection that counts the packets it sends: one per round trip."""

    sends: list[bytes] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends.append(b"".join(command) if isinstance(command, list) else command)
        super().send_packed_command(command, check_health)


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisLockStore]:
    """A RedisLockStore on the flushed throwaway server, default prefix."""
    store = RedisLockStore(redis_url)
    yield store
    store.close()


def _commandstats(server: RedisServer) -> dict[str, int]:
    client = server.client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name: int(value["calls"]) for name, value in stats.items()}


class TestRoundTrips:
    """Each operation is one round trip."""

    def test_acquire_release_take_two_round_trips_and_renew_many_one(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """Uncontended acquire + release send 2 packets; renew_many of 100 leases sends 1."""
        pool = redis.ConnectionPool(
            connection_class=_CountingConnection, host="127.0.0.1", port=redis_server.port
        )
        client = redis.Redis(connection_pool=pool)
        store = RedisLockStore(client)
        owners = [f"o{i}" for i in range(100)]
        # Warm up: open the connection and load the scripts (NOSCRIPT fallback).
        assert store.acquire("warm", "w", LONG_MS) is not None
        store.release("warm", "w")
        assert store.renew_many([("warm", "w", LONG_MS)]) == [False]
        for i, owner in enumerate(owners):
            assert store.acquire(f"k{i}", owner, LONG_MS) is not None

        _CountingConnection.sends.clear()
        redis_server.client().config_resetstat()
        assert store.acquire("k", "a", LONG_MS) is not None
        store.release("k", "a")
        assert len(_CountingConnection.sends) == 2
        stats = _commandstats(redis_server)
        assert stats.get("cmdstat_evalsha") == 2
        assert "cmdstat_script|exists" not in stats and "cmdstat_script|load" not in stats

        _CountingConnection.sends.clear()
        results = store.renew_many([(f"k{i}", o, LONG_MS) for i, o in enumerate(owners)])
        assert results == [True] * 100
        assert len(_CountingConnection.sends) == 1
        client.close()

    def test_a_refused_acquire_or_holder_is_one_script_call(
        self, redis_server: RedisServer, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """Refused, ``acquire_or_holder`` reads the holder in the same script: one EVALSHA and
        no other command (an acquire and a get would be two), also after SCRIPT FLUSH."""
        assert store.acquire("k", "holder", LONG_MS) is not None
        assert store.acquire_or_holder("k", "b", LONG_MS) == (None, "holder")  # loads it
        redis_client.config_resetstat()
        assert store.acquire_or_holder("k", "b", LONG_MS) == (None, "holder")
        stats = _commandstats(redis_server)
        stats.pop("cmdstat_config|resetstat", None)
        stats.pop("cmdstat_hello", None)  # the stats reader's own connection
        assert stats == {"cmdstat_evalsha": 1, "cmdstat_hmget": 1}  # the script's one read
        redis_client.script_flush()
        assert store.acquire_or_holder("k", "b", LONG_MS) == (None, "holder")
        store.release("k", "holder")
        redis_client.script_flush()
        token, holder = store.acquire_or_holder("k", "b", LONG_MS)
        assert holder is None and token is not None and store.get("k").owner == "b"  # type: ignore[union-attr]

    def test_renew_many_of_thousands_is_one_round_trip_in_order(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """2,500 renewals (3 script chunks) go in one packet, each result at its item's place."""
        pool = redis.ConnectionPool(
            connection_class=_CountingConnection, host="127.0.0.1", port=redis_server.port
        )
        client = redis.Redis(connection_pool=pool)
        store = RedisLockStore(client)
        items = []
        for i in range(2500):
            assert store.acquire(f"k{i}", f"o{i}", LONG_MS) is not None
            # every seventh item names a wrong owner: it must come back False, in its place
            items.append((f"k{i}", f"o{i}" if i % 7 else "intruder", LONG_MS))
        assert len(items) > RENEW_CHUNK
        store.renew_many([("warm", "w", LONG_MS)])  # loads the script
        _CountingConnection.sends.clear()
        results = store.renew_many(items)
        assert len(_CountingConnection.sends) == 1
        assert results == [bool(i % 7) for i in range(2500)]
        assert store.get("k7") is not None, "a failed renewal by a stranger leaves the lease alone"
        client.close()

    def test_client_that_retries_many_times_gets_a_warning(
        self, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A client that retries 10 times (redis-py 8's default) is flagged at construction."""
        client = redis.Redis(
            host="127.0.0.1", port=redis_server.port, retry=Retry(ExponentialBackoff(), 10)
        )
        with caplog.at_level("WARNING", logger="celery_lease.stores.redis"):
            RedisLockStore(client)
        assert "retries failed commands 10 times" in caplog.text
        client.close()

    def test_noscript_falls_back_to_loading_the_script(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """After SCRIPT FLUSH every operation still works: NOSCRIPT loads the script again."""
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        redis_client.script_flush()
        assert store.renew("k", "a", LONG_MS) is True
        redis_client.script_flush()
        assert store.renew_many([("k", "a", LONG_MS), ("k", "b", LONG_MS)]) == [True, False]
        redis_client.script_flush()
        store.release("k", "a")
        redis_client.script_flush()
        again = store.acquire("k", "b", LONG_MS)
        assert again is not None and again > token
        redis_client.script_flush()
        assert [i.key for i in store.list()] == ["k"]


class TestKeysAndValues:
    """What the store writes into Redis."""

    def test_keys_carry_the_prefix_and_a_hash_tag_on_the_user_key(
        self, redis_url: str, redis_client: redis.Redis
    ) -> None:
        """Lease, counter and signal are <prefix>{<key>}:..., all in one cluster slot (without
        a restart grace no marker is written; with one it is <prefix>marker, no expiry)."""
        store = RedisLockStore(redis_url, prefix="app:")
        token = store.acquire("account:42", "worker-1", 5000)
        assert sorted(redis_client.keys("*")) == [
            b"app:{account:42}:lease",
            b"app:{account:42}:token",
        ]
        assert redis_client.hgetall("app:{account:42}:lease") == {
            b"owner": b"worker-1",
            b"token": str(token).encode(),
        }
        assert 0 < redis_client.pttl("app:{account:42}:lease") <= 5000
        assert redis_client.get("app:{account:42}:token") == str(token).encode()
        store.release("account:42", "worker-1")
        assert sorted(redis_client.keys("*")) == [
            b"app:{account:42}:signal",
            b"app:{account:42}:token",
        ]
        assert 0 < redis_client.pttl("app:{account:42}:signal") <= 60_000
        keys = [
            store.lease_key("account:42"),
            store.token_key("account:42"),
            store.signal_key("account:42"),
        ]
        assert {key_slot(k.encode()) for k in keys} == {key_slot(b"account:42")}
        store.close()

    def test_tokens_are_floored_by_the_server_clock_in_microseconds(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A first token is the server's TIME in microseconds, well above a plain counter."""
        seconds, micros = redis_client.time()
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None and token >= seconds * 1_000_000 + micros
        assert token < 2**53

    def test_counter_ahead_of_the_clock_still_increments(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A counter above the clock floor grows by one, exactly, formatted as an integer."""
        big = 2**52 + 12345
        redis_client.set(store.token_key("k"), str(big))
        assert store.acquire("k", "a", LONG_MS) == big + 1
        assert redis_client.get(store.token_key("k")) == str(big + 1).encode()

    def test_list_treats_glob_characters_literally(self, store: RedisLockStore) -> None:
        """Keys with *, ? and [ ] are listed by exact prefix, not as a pattern."""
        for key in ("x*1", "x?2", "x[3]", "xy", "x\\z"):
            assert store.acquire(key, "a", LONG_MS) is not None
        assert [i.key for i in store.list("x*")] == ["x*1"]
        assert [i.key for i in store.list("x[")] == ["x[3]"]
        assert [i.key for i in store.list("x\\")] == ["x\\z"]
        assert len(store.list("x")) == 5

    def test_keys_with_braces_keep_one_slot(self, store: RedisLockStore) -> None:
        """A user key containing braces still maps its three Redis keys to one slot."""
        for key in ("a}b", "{a}", "a{b}c"):
            names = [store.lease_key(key), store.token_key(key), store.signal_key(key)]
            assert len({key_slot(n.encode()) for n in names}) == 1
            assert store.acquire(key, "a", LONG_MS) is not None
            assert store.get(key) is not None and store.get(key).key == key  # type: ignore[union-attr]

    @pytest.mark.parametrize("key", ["", "}x"])
    def test_keys_that_cannot_carry_a_hash_tag_are_refused(
        self, store: RedisLockStore, key: str
    ) -> None:
        """An empty key or one starting with '}' raises LeaseConfigError naming the key."""
        with pytest.raises(LeaseConfigError, match="key="):
            store.acquire(key, "a", LONG_MS)

    def test_client_with_decoded_responses_works(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """A caller's client with decode_responses=True is fine: replies may be str or bytes."""
        client = redis_server.client(decode_responses=True)
        store = RedisLockStore(client)
        token = store.acquire("k", "a", LONG_MS)
        info = store.get("k")
        assert info is not None and (info.owner, info.token) == ("a", token)
        assert store.last_token("k") == token
        assert [i.key for i in store.list()] == ["k"]
        client.close()


class TestFailures:
    """Server restarts, outages and lost replies."""

    def test_tokens_increase_after_a_restart_without_persistence(
        self, redis_server: RedisServer, store: RedisLockStore
    ) -> None:
        """A restart loses the lease and the counter, yet the next token is still higher
        (without a restart grace here: TestRestartGrace and tests/faults cover it)."""
        store = RedisLockStore(store.client, restart_grace=0)
        first = store.acquire("k", "a", LONG_MS)
        assert first is not None
        redis_server.restart()
        assert store.renew("k", "a", LONG_MS) is False  # dropped connection retried once
        assert store.last_token("k") is None  # the counter is gone too
        second = store.acquire("k", "b", LONG_MS)
        assert second is not None and second > first

    def test_server_down_raises_store_unavailable_with_the_cause(
        self, redis_server: RedisServer, store: RedisLockStore
    ) -> None:
        """With the server stopped every operation raises StoreUnavailableError, cause chained
        (the store started without a restart grace: it takes a key at once after the restart)."""
        store = RedisLockStore(store.client, restart_grace=0)
        assert store.acquire("k", "a", LONG_MS) is not None
        redis_server.stop()
        try:
            started = time.monotonic()
            calls: list[Callable[[], object]] = [
                lambda: store.acquire("j", "a", LONG_MS),
                lambda: store.renew("k", "a", LONG_MS),
                lambda: store.renew_many([("k", "a", LONG_MS)]),
                lambda: store.release("k", "a"),
                lambda: store.wait_for_release("k", 0.1),
                lambda: store.list(),
                lambda: store.last_token("k"),
            ]
            for call in calls:
                with pytest.raises(StoreUnavailableError) as caught:
                    call()
                assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
            assert time.monotonic() - started < 5.0  # no long retry loops
        finally:
            redis_server.start()
        assert store.acquire("j", "a", LONG_MS) is not None

    def test_other_redis_errors_raise_store_unavailable(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A wrong-type key (a server-side error) raises StoreUnavailableError, not RedisError."""
        redis_client.set(store.lease_key("k"), "not a hash")
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("k", "a", LONG_MS)
        assert isinstance(caught.value.__cause__, redis.exceptions.ResponseError)
        with pytest.raises(StoreUnavailableError):
            store.release("k", "a")

    def test_dropped_connections_are_retried_once(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """After the server kills every client connection, the next call succeeds on a retry."""
        assert store.acquire("k", "a", LONG_MS) is not None
        redis_client.client_kill_filter(_type="normal", skipme=True)
        assert store.renew("k", "a", LONG_MS) is True


def _sha(source: str) -> bytes:
    return hashlib.sha1(source.encode()).hexdigest().encode()


def _reply_dropping_client(port: int, **kwargs: Any) -> tuple[redis.Redis, Callable[..., None]]:
    """A client whose connections can lose the reply of a chosen command after the server ran it.

    ``drop(marker, times=1)`` arms it: the next ``times`` commands whose packed bytes contain
    ``marker`` (a script's sha1) are sent and executed as usual, then their reply is thrown
    away and the connection closed, so the caller gets ``ConnectionError`` as if the socket died
    between the server's write and the client's read.
    """
    armed: dict[str, Any] = {"marker": None, "times": 0}

    class DropsReplies(redis.Connection):
        dropping = False

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            data = b"".join(command) if isinstance(command, list) else command
            if armed["times"] > 0 and armed["marker"] in data:
                armed["times"] -= 1
                self.dropping = True
            super().send_packed_command(command, check_health)

        def read_response(self, *args: Any, **kw: Any) -> Any:
            response = super().read_response(*args, **kw)
            if self.dropping:
                self.dropping = False
                self.disconnect()
                raise redis.exceptions.ConnectionError("test: reply lost after the server ran it")
            return response

    def drop(marker: bytes, times: int = 1) -> None:
        armed["marker"], armed["times"] = marker, times

    pool = redis.ConnectionPool(
        connection_class=DropsReplies,
        host="127.0.0.1",
        port=port,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=5.0,
        **kwargs,
    )
    return redis.Redis(connection_pool=pool), drop


def _warm(store: RedisLockStore) -> RedisLockStore:
    """Load every script (a first EVALSHA may meet NOSCRIPT and never run: nothing to lose)."""
    assert store.acquire("warm", "w", LONG_MS) is not None
    assert store.renew("warm", "w", LONG_MS) is True
    assert store.renew_many([("warm", "w", LONG_MS), ("warm", "w", LONG_MS)]) == [True, True]
    store.release("warm", "w")
    assert store.wait_for_release("warm", 0) is True
    return store


class TestLostReplies:
    """A reply lost after the server ran the command: the store's one retry must recover."""

    def test_an_acquire_whose_reply_was_lost_returns_the_lease_to_its_owner(
        self, redis_server: RedisServer, redis_url: str, redis_client: redis.Redis
    ) -> None:
        """The retry gets its own lease back (same token, held by that owner); nothing is
        released on the way and the key does not read "held" while it is free."""
        client, drop = _reply_dropping_client(redis_server.port)
        store = _warm(RedisLockStore(client))
        drop(_sha(ACQUIRE_SCRIPT))
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None, "the retried acquire answered 'held' for its own lease"
        info = store.get("k")
        assert info is not None and (info.owner, info.token) == ("a", token)
        assert store.last_token("k") == token  # one token issued, not two
        assert store.acquire("k", "b", LONG_MS) is None
        assert redis_client.exists(store.signal_key("k")) == 0  # no release happened
        client.close()

    def test_an_acquire_that_loses_both_replies_leaves_a_lease_its_owner_gets_back(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """Two lost replies raise StoreUnavailableError; a later acquire by the same owner id
        returns the lease (the contract's idempotent acquire), so no orphan blocks the key."""
        client, drop = _reply_dropping_client(redis_server.port)
        store = _warm(RedisLockStore(client))
        drop(_sha(ACQUIRE_SCRIPT), times=2)
        with pytest.raises(StoreUnavailableError, match="acquire 'k' failed"):
            store.acquire("k", "a", LONG_MS)
        token = store.acquire("k", "a", LONG_MS)
        info = store.get("k")
        assert token is not None and info is not None and info.token == token
        client.close()

    def test_a_renewal_whose_reply_was_lost_reports_renewed(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """renew and renew_many retried after a lost reply answer True (the renewal held)."""
        client, drop = _reply_dropping_client(redis_server.port)
        store = _warm(RedisLockStore(client))
        assert store.acquire("k", "a", 1000) is not None
        assert store.acquire("j", "a", 1000) is not None
        drop(_sha(RENEW_SCRIPT))
        assert store.renew("k", "a", LONG_MS) is True
        drop(_sha(RENEW_MANY_SCRIPT))
        assert store.renew_many([("k", "a", LONG_MS), ("j", "a", LONG_MS)]) == [True, True]
        for key in ("k", "j"):
            info = store.get(key)
            assert info is not None and info.expires_in > 1.0
        client.close()

    def test_a_release_whose_reply_was_lost_frees_the_key_and_signals_once(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """The retried release finds nothing to release and raises nothing; the key is free and
        exactly one release signal waits for a waiter."""
        client, drop = _reply_dropping_client(redis_server.port)
        store = _warm(RedisLockStore(client))
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        drop(_sha(RELEASE_SCRIPT))
        store.release("k", "a")
        assert store.get("k") is None
        assert store.wait_for_release("k", 0) is True
        assert store.wait_for_release("k", 0) is False
        following = store.acquire("k", "b", LONG_MS)
        assert following is not None and following > token
        client.close()


class TestErrorMessages:
    """Every StoreUnavailableError names the store, the operation, the key and the server's
    own message, and never a password."""

    def test_nothing_listening_names_host_port_db_operation_and_key(self) -> None:
        """Each operation against a closed port says where, what and why."""
        port = free_port()
        store = RedisLockStore(f"redis://:hunter2-secret@127.0.0.1:{port}/3")
        where = f"redis://127.0.0.1:{port}/3"
        calls: list[tuple[str, Callable[[], object]]] = [
            ("acquire 'k'", lambda: store.acquire("k", "a", LONG_MS)),
            ("renew 'k'", lambda: store.renew("k", "a", LONG_MS)),
            ("renew 2 leases", lambda: store.renew_many([("k", "a", 1), ("j", "a", 1)])),
            ("release 'k'", lambda: store.release("k", "a")),
            ("wait for a release of 'k'", lambda: store.wait_for_release("k", 0.1)),
            ("poll a release of 'k'", lambda: store.wait_for_release("k", 0)),
            ("list leases", lambda: store.list()),
            ("read the lease 'k'", lambda: store.get("k")),
            ("read the last token of 'k'", lambda: store.last_token("k")),
            ("force-release 'k'", lambda: store.force_release("k")),
        ]
        for operation, call in calls:
            with pytest.raises(StoreUnavailableError) as caught:
                call()
            text = str(caught.value)
            assert text.startswith(f"Redis store {where}: {operation} failed: ConnectionError: ")
            assert "Connection refused" in text, text
            assert "hunter2" not in text
            assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
        store.close()

    def test_a_db_index_out_of_range_says_so(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """db 99 on a server with 16 databases: the server's 'DB index is out of range'."""
        server = redis_server_factory("--databases", "16")
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/99")
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("k", "a", LONG_MS)
        text = str(caught.value)
        assert f"redis://127.0.0.1:{server.port}/99: acquire 'k' failed" in text
        assert "DB index is out of range" in text
        store.close()

    def test_a_wrong_password_says_so_without_the_password(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """The server's WRONGPASS message, the host and port, and neither password."""
        server = redis_server_factory(password="right-secret")
        store = RedisLockStore(f"redis://app:wrong-secret@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreUnavailableError) as caught:
            store.renew("k", "a", LONG_MS)
        text = str(caught.value)
        assert f"redis://127.0.0.1:{server.port}/0: renew 'k' failed: AuthenticationError" in text
        assert "invalid username-password pair" in text
        assert "secret" not in text
        store.close()

    def test_a_server_error_names_the_command_context(
        self, store: RedisLockStore, redis_client: redis.Redis, redis_server: RedisServer
    ) -> None:
        """A wrong-type key: the server's WRONGTYPE message, not 'server:ResponseError'."""
        redis_client.set(store.lease_key("k"), "not a hash")
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("k", "a", LONG_MS)
        text = str(caught.value)
        assert f"redis://127.0.0.1:{redis_server.port}/0: acquire 'k' failed: ResponseError" in text
        assert "WRONGTYPE" in text

    def test_unreachable_sentinels_are_named_with_the_service(self) -> None:
        """No Sentinel answering: both Sentinel addresses, the service, the db and the reason."""
        first, second = free_port(), free_port()
        store = RedisLockStore(
            f"redis+sentinel://:pw-secret@127.0.0.1:{first},127.0.0.1:{second}/svc/2"
            "?socket_connect_timeout=0.5&min_replicas=0"
        )
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("k", "a", LONG_MS)
        text = str(caught.value)
        assert f"redis+sentinel://127.0.0.1:{first},127.0.0.1:{second}/svc/2" in text
        assert "acquire 'k' failed" in text and "No master found for 'svc'" in text
        assert "Connection refused" in text and "secret" not in text
        store.close()

    def test_cluster_errors_name_the_seed_nodes(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """On a cluster the message names the seed nodes."""
        client = RedisCluster(host="127.0.0.1", port=redis_cluster_server.port)
        store = RedisLockStore(client)
        client.set(store.lease_key("k"), "not a hash")
        with pytest.raises(StoreUnavailableError) as caught:
            store.acquire("k", "a", LONG_MS)
        text = str(caught.value)
        assert f"Redis Cluster (nodes 127.0.0.1:{redis_cluster_server.port})" in text
        assert "acquire 'k' failed: ResponseError" in text and "WRONGTYPE" in text
        client.close()


def _fill(client: redis.Redis, until: Callable[[], bool], *, volatile: bool) -> int:
    """Write 1 kB filler keys (with a TTL when ``volatile``) until ``until()``; keys written."""
    written = 0
    value = b"x" * 1024
    while not until():
        assert written < 200_000, "the filler never triggered what the test waits for"
        pipe = client.pipeline(transaction=False)
        for i in range(written, written + 500):
            if volatile:
                pipe.set(f"filler:{i}", value, px=3_600_000)
            else:
                pipe.set(f"filler:{i}", value)
        pipe.execute(raise_on_error=False)
        written += 500
    return written


class TestEviction:
    """What maxmemory eviction does to live leases (the guarantees in docs/stores.md)."""

    @pytest.mark.parametrize("policy", ["volatile-lru", "volatile-ttl", "allkeys-lru"])
    def test_eviction_drops_a_live_lease_and_its_holder_hears_taken(
        self, redis_server_factory: Callable[..., RedisServer], policy: str
    ) -> None:
        """Under volatile-* and allkeys-* the lease hash (it has a TTL) is evicted while held: a
        second owner can take the key at once, and the holder learns "taken" at its next
        renewal. The next token is still higher: the counter is floored by the server's TIME.
        (Under allkeys-* the store's marker may be evicted too, which starts a restart grace:
        turned off here, so that the intruder's acquire does not depend on the LRU's pick.)"""
        server = redis_server_factory("--maxmemory-policy", policy)
        client = server.client()
        store = RedisLockStore(server.url, restart_grace=0)
        with lease("k", store=store, ttl=3.0) as held:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used + 1024 * 1024)
            _fill(client, lambda: client.exists(store.lease_key("k")) == 0, volatile=True)
            assert int(client.info("stats")["evicted_keys"]) > 0
            client.config_set("maxmemory", 0)  # room again, so the intruder's write succeeds
            intruder = store.acquire("k", "intruder", LONG_MS)
            assert intruder is not None and intruder > held.token
            deadline = time.monotonic() + DEADLINE
            while not held.lost:
                assert time.monotonic() < deadline, "the holder was never told"
                time.sleep(0.01)
            assert held.lost_reason == "taken"
        store.close()
        client.close()

    def test_noeviction_keeps_live_leases_and_refuses_new_ones_loudly(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """With noeviction a full server keeps every lease and renews it; a new acquire raises
        StoreUnavailableError with the server's OOM error instead of dropping anything."""
        server = redis_server_factory("--maxmemory-policy", "noeviction")
        client = server.client()
        store = RedisLockStore(server.url)
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 1024 * 1024)
        full = {"oom": False}

        def oom() -> bool:
            try:
                client.set("probe", b"x" * 1024)
            except redis.exceptions.OutOfMemoryError:
                full["oom"] = True
            return full["oom"]

        _fill(client, oom, volatile=False)
        assert store.renew("k", "a", LONG_MS) is True
        with pytest.raises(StoreUnavailableError, match="acquire 'j' failed: OutOfMemoryError"):
            store.acquire("j", "b", LONG_MS)
        info = store.get("k")
        assert info is not None and info.token == token
        client.config_set("maxmemory", 0)
        store.close()
        client.close()


class TestReplicaAcks:
    """min_replicas: every acquire and renewal is confirmed by WAIT before it counts."""

    def _store(self, group: SentinelGroup, **kwargs: Any) -> RedisLockStore:
        master = group.server(group.master_port())
        pool = redis.ConnectionPool(
            connection_class=_CountingConnection,
            host="127.0.0.1",
            port=master.port,
            retry=Retry(NoBackoff(), 0),
        )
        return RedisLockStore(redis.Redis(connection_pool=pool), **kwargs)

    def test_acknowledged_operations_take_one_round_trip_each(
        self, redis_sentinel: SentinelGroup
    ) -> None:
        """With a replica in sync, acquire, renew and renew_many succeed, one packet each
        (EVALSHA and WAIT pipelined)."""
        store = self._store(redis_sentinel, min_replicas=1)
        assert store.acquire("warm", "w", LONG_MS) is not None  # loads the script
        assert store.renew("warm", "w", LONG_MS) is True
        assert store.renew_many([("warm", "w", LONG_MS)]) == [True]
        _CountingConnection.sends.clear()
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        assert store.renew("k", "a", LONG_MS) is True
        assert store.renew_many([("k", "a", LONG_MS), ("warm", "w", LONG_MS)]) == [True, True]
        assert len(_CountingConnection.sends) == 3
        assert all(b"WAIT" in packet for packet in _CountingConnection.sends)
        store.client.close()

    def test_without_a_replica_nothing_is_confirmed_and_no_lease_is_left_behind(
        self, redis_sentinel: SentinelGroup
    ) -> None:
        """Once the replica is gone, acquire raises (and releases what it took), renew and
        renew_many raise; a renewal of a lease not held still answers False."""
        store = self._store(redis_sentinel, min_replicas=1, replica_timeout="50ms")
        assert store.acquire("k", "a", LONG_MS) is not None
        master = redis_sentinel.server(redis_sentinel.master_port())
        replica = next(s for s in redis_sentinel.servers if s is not master)
        detach, check = replica.client(), master.client()
        try:
            detach.replicaof("NO", "ONE")
            deadline = time.monotonic() + DEADLINE
            while int(check.info("replication")["connected_slaves"]) > 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(StoreUnavailableError, match="0 of 1 replicas") as caught:
                store.acquire("j", "b", LONG_MS)
            assert "acquire 'j' not confirmed" in str(caught.value)
            assert check.exists(store.lease_key("j")) == 0, "the unconfirmed lease was left"
            with pytest.raises(StoreUnavailableError, match="renew 'k' not confirmed"):
                store.renew("k", "a", LONG_MS)
            with pytest.raises(StoreUnavailableError, match="renew 1 leases not confirmed"):
                store.renew_many([("k", "a", LONG_MS)])
            assert store.renew("k", "intruder", LONG_MS) is False
        finally:
            detach.close()
            check.close()
            store.client.close()


class TestStoreOptions:
    """min_replicas and replica_timeout: defaults, URL options, validation."""

    @pytest.mark.parametrize(
        ("client_kwargs", "said"),
        [
            ({"encoding": "latin-1"}, "encoding='latin-1'"),
            ({"encoding": "no-such-codec"}, "encoding='no-such-codec'"),
        ],
    )
    def test_a_prefix_the_clients_encoding_cannot_write_is_refused_at_construction(
        self, client_kwargs: dict[str, str], said: str
    ) -> None:
        """Every key of the store starts with the prefix: it fails when the store is built,
        naming the prefix and the encoding, not at the first acquire."""
        client = redis.Redis(port=1, **client_kwargs)  # type: ignore[arg-type]
        with pytest.raises(LeaseConfigError, match=rf"prefix='лиз:'.*{said}"):
            RedisLockStore(client, prefix="лиз:", restart_grace=1)

    def test_defaults_ask_sentinel_stores_for_one_replica_ack_and_others_for_none(self) -> None:
        """Sentinel-managed stores confirm with 1 replica by default; plain ones do not."""
        assert RedisLockStore("redis+sentinel://s1/svc").min_replicas == 1
        assert RedisLockStore("redis://localhost:1/0").min_replicas == 0
        store = RedisLockStore("redis://localhost:1/0?min_replicas=2&replica_timeout=250ms")
        assert (store.min_replicas, store.replica_timeout) == (2, 0.25)
        assert "min_replicas" not in store.client.connection_pool.connection_kwargs
        store = RedisLockStore("redis+sentinel://s1/svc?min_replicas=0", min_replicas=3)
        assert store.min_replicas == 3  # the keyword wins over the URL

    @pytest.mark.parametrize(
        ("url", "kwargs", "match"),
        [
            ("redis://localhost:1/0?min_replicas=x", {}, "min_replicas='x'"),
            ("redis://localhost:1/0", {"min_replicas": -1}, "min_replicas=-1"),
            ("redis://localhost:1/0", {"min_replicas": True}, "min_replicas=True"),
            ("redis://localhost:1/0?replica_timeout=0", {}, "replica_timeout='0'"),
            (
                "redis://localhost:1/0?socket_timeout=1",
                {"replica_timeout": 2, "min_replicas": 1},
                "socket_timeout",
            ),
        ],
    )
    def test_bad_values_are_refused(self, url: str, kwargs: dict[str, Any], match: str) -> None:
        """Bad min_replicas / replica_timeout raise LeaseConfigError naming the value."""
        with pytest.raises(LeaseConfigError, match=match):
            RedisLockStore(url, **kwargs)

    def test_a_cluster_with_min_replicas_is_refused(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """WAIT cannot ride along a cluster's per-node scripts: refused at construction."""
        client = RedisCluster(host="127.0.0.1", port=redis_cluster_server.port)
        with pytest.raises(LeaseConfigError, match="min_replicas=1"):
            RedisLockStore(client, min_replicas=1)
        client.close()


class TestRestartGrace:
    """A server that may have lost leases refuses free keys until ``restart_grace`` after its
    start (restarts: tests/faults/test_redis_restart.py). Every server here is the test's own,
    started moments before, so a grace of an hour is always on unless the marker says
    otherwise."""

    HOUR = 3600

    @staticmethod
    def _run(client: redis.Redis) -> tuple[str, int]:
        """The server's run id and its TIME in whole seconds."""
        info = client.info("server")
        return str(info["run_id"]), int(client.time()[0])

    def test_a_young_server_without_the_marker_refuses_free_keys_saying_why_and_how_to_turn_it_off(
        self,
        redis_server_factory: Callable[..., RedisServer],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Free keys raise RestartGraceError (logged once a grace) whose message names the
        cause, the end and how to turn it off; its end is the grace after the server's start,
        which the marker records with the server's run id. The key stays free."""
        server = redis_server_factory()
        store = RedisLockStore(server.url, restart_grace=self.HOUR)
        try:
            with caplog.at_level("WARNING", logger="celery_lease.stores.redis"):
                with pytest.raises(RestartGraceError) as refused:
                    store.acquire("k", "a", LONG_MS)
                with pytest.raises(RestartGraceError):
                    store.acquire_or_holder("other", "a", LONG_MS)
            message = str(refused.value)
            for part in (
                "acquire 'k'",
                "without this store's marker",
                f"restart_grace={self.HOUR} s",
                "restart_grace=0",
                "lease_restart_grace=0",
            ):
                assert part in message, (part, message)
            marker = store.client.hgetall(store.marker_key)
            run_id, now = self._run(store.client)
            assert marker[b"boot"].decode() == run_id and marker[b"cause"] == b"new"
            started = int(marker[b"started"]) / 1_000_000
            uptime = int(store.client.info("server")["uptime_in_seconds"])
            assert started in (now - uptime, now - uptime - 1)  # TIME and INFO: two reads
            assert refused.value.until == started + self.HOUR
            assert time.strftime("%H:%M:%S", time.gmtime(refused.value.until)) in message
            grace_logs = [r for r in caplog.records if "restart grace" in r.getMessage()]
            assert len(grace_logs) == 1, [r.getMessage() for r in caplog.records]
            assert store.get("k") is None and store.get("other") is None
        finally:
            store.close()

    def test_a_server_that_started_longer_ago_than_the_grace_grants_at_once(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """The grace counts from the server's start: with this run's marker two hours old, an
        hour's grace is over and a free key is granted."""
        server = redis_server_factory()
        store = RedisLockStore(server.url, restart_grace=self.HOUR)
        try:
            run_id, now = self._run(store.client)
            started = (now - 2 * self.HOUR) * 1_000_000
            store.client.hset(
                store.marker_key, mapping={"boot": run_id, "started": started, "cause": "new"}
            )
            assert store.acquire("k", "a", LONG_MS) is not None
        finally:
            store.close()

    def test_a_marker_of_another_server_run_starts_a_grace(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """A marker naming another run (a restart that reloaded a snapshot, which may lack the
        newest leases) is a loss too: the grace counts from this run's start."""
        server = redis_server_factory()
        store = RedisLockStore(server.url, restart_grace=self.HOUR)
        try:
            _, now = self._run(store.client)
            old = {"boot": "0" * 40, "started": (now - 2 * self.HOUR) * 1_000_000, "cause": "new"}
            store.client.hset(store.marker_key, mapping=old)
            with pytest.raises(RestartGraceError, match="a marker of another server run"):
                store.acquire("k", "a", LONG_MS)
            marker = store.client.hgetall(store.marker_key)
            assert marker[b"cause"] == b"restored" and marker[b"boot"] != b"0" * 40
        finally:
            store.close()

    def test_a_held_key_is_still_answered_during_the_grace(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """The grace refuses free keys only: its holder re-takes a live lease, others are
        refused as held (with the holder's name)."""
        server = redis_server_factory()
        grace = RedisLockStore(server.url, restart_grace=self.HOUR)
        off = RedisLockStore(server.url, restart_grace=0)
        try:
            token = off.acquire("k", "a", LONG_MS)
            assert token is not None
            assert grace.acquire("k", "a", LONG_MS) == token
            assert grace.acquire("k", "b", LONG_MS) is None
            assert grace.acquire_or_holder("k", "b", LONG_MS) == (None, "a")
        finally:
            grace.close()
            off.close()

    def test_a_flush_refuses_free_keys_on_a_young_server_and_restart_grace_0_turns_it_off(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """A flush removes the marker: within the grace after the server's start free keys are
        refused, with a message saying how to turn it off; a store with restart_grace=0 (a
        throwaway server between tests) is granted at once, its token above the last one."""
        server = redis_server_factory()
        grace = RedisLockStore(server.url, restart_grace=self.HOUR)
        off = RedisLockStore(server.url, restart_grace=0)
        try:
            first = off.acquire("a", "o", LONG_MS)
            assert first is not None
            off.release("a", "o")
            off.client.flushdb()
            with pytest.raises(RestartGraceError, match="restart_grace=0"):
                grace.acquire("b", "o", LONG_MS)
            second = off.acquire("b", "o", LONG_MS)
            assert second is not None and second > first
        finally:
            grace.close()
            off.close()

    def test_lease_waits_out_the_grace_within_its_wait_and_raises_it_after(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """lease() asks again within its wait and then raises the RestartGraceError itself
        (not a LockNotAcquiredError: nothing holds the key)."""
        server = redis_server_factory()
        store = RedisLockStore(server.url, restart_grace=self.HOUR)
        try:
            with pytest.raises(RestartGraceError), lease("k", store=store, wait=0.05):
                pass
        finally:
            store.close()

    def test_options(self, redis_cluster_server: RedisServer, redis_cluster_url: str) -> None:
        """restart_grace from the keyword, the URL (plain and Sentinel), else 0 (off: the
        Celery settings give a store their own default); a bad value and a Cluster with a
        grace are refused naming the value."""
        assert RedisLockStore("redis://localhost:1/0").restart_grace == 0.0
        assert RedisLockStore("redis://localhost:1/0?restart_grace=5s").restart_grace == 5.0
        assert RedisLockStore("redis://localhost:1/0?restart_grace=0").restart_grace == 0.0
        url = "redis+sentinel://s1/svc?restart_grace=90"
        assert RedisLockStore(url).restart_grace == 90.0
        assert RedisLockStore(url, restart_grace=1).restart_grace == 1.0
        with pytest.raises(LeaseConfigError, match="restart_grace='soon'"):
            RedisLockStore("redis://localhost:1/0?restart_grace=soon")
        with pytest.raises(LeaseConfigError, match="restart_grace=-1"):
            RedisLockStore("redis://localhost:1/0", restart_grace=-1)
        client = RedisCluster(host="127.0.0.1", port=redis_cluster_server.port)
        try:
            assert RedisLockStore(client).restart_grace == 0.0
            with pytest.raises(LeaseConfigError, match="restart_grace=30 is not supported"):
                RedisLockStore(client, restart_grace=30)
        finally:
            client.close()


class TestWaiting:
    """wait_for_release specifics."""

    def test_long_waits_outlast_a_short_socket_timeout(self, redis_url: str) -> None:
        """A wait longer than socket_timeout is cut into BLPOP slices instead of timing out."""
        store = RedisLockStore(f"{redis_url}?socket_timeout=0.3")
        started = time.monotonic()
        assert store.wait_for_release("k", 0.8) is False
        assert 0.75 <= time.monotonic() - started < 3.0
        assert store.acquire("k", "a", LONG_MS) is not None
        timer = threading.Timer(0.5, store.release, ("k", "a"))
        timer.start()
        try:
            assert store.wait_for_release("k", 5.0) is True
        finally:
            timer.join()
        store.close()

    def test_a_zero_timeout_polls(self, store: RedisLockStore) -> None:
        """timeout <= 0 returns at once: True only if a release signal is pending."""
        assert store.wait_for_release("k", 0) is False
        assert store.acquire("k", "a", LONG_MS) is not None
        store.release("k", "a")
        assert store.wait_for_release("k", 0) is True
        assert store.wait_for_release("k", 0) is False  # one signal per release

    def test_force_release_signals_a_waiter(self, store: RedisLockStore) -> None:
        """force_release wakes a waiter like a release does."""
        assert store.acquire("k", "a", LONG_MS) is not None
        assert store.force_release("k") is not None
        assert store.wait_for_release("k", 1.0) is True


def _use_store_in_child(store: RedisLockStore, results: Any) -> None:
    results.put(store.acquire("child", "c", LONG_MS))


def _use_fast_path_in_child(store: RedisLockStore, results: Any) -> None:
    fast = store._fast
    assert fast is not None
    free = fast._lock.acquire(blocking=False)
    if free:
        fast._lock.release()
    answered: list[bool] = []  # one entry per fast-path call the connection itself answered
    real_call = fast.call

    def call(request: bytes) -> Any:
        reply = real_call(request)
        answered.append(reply is not BUSY)
        return reply

    fast.call = call  # type: ignore[method-assign]
    token = store.acquire("child", "c", LONG_MS)
    results.put((free, answered == [True], token))


class TestConnections:
    """URLs, clients and fork."""

    def test_store_used_before_fork_works_in_the_child(self, store: RedisLockStore) -> None:
        """redis-py's pool notices the fork: the child opens its own connection."""
        assert store.acquire("parent", "p", LONG_MS) is not None
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_use_store_in_child, args=(store, results))
        child.start()
        token = results.get(timeout=DEADLINE)
        child.join(DEADLINE)
        assert child.exitcode == 0 and isinstance(token, int)
        assert store.renew("parent", "p", LONG_MS) is True  # the parent's connection is intact

    def test_unix_socket_url(self, redis_server: RedisServer, redis_url: str) -> None:
        """unix:// URLs reach the server over its socket."""
        store = store_from_url(redis_server.unix_url)
        assert isinstance(store, RedisLockStore)
        assert store.client.connection_pool.connection_class is UnixDomainSocketConnection
        assert store.acquire("k", "a", LONG_MS) is not None
        store.close()

    def test_url_clients_get_5s_timeouts_unless_the_url_sets_them(self) -> None:
        """socket_timeout / socket_connect_timeout default to 5 s, the URL's values win."""
        kwargs = RedisLockStore("redis://localhost:1/0").client.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (5.0, 5.0)
        assert kwargs["decode_responses"] is False
        url = "redis://localhost:1/0?socket_timeout=1.5&socket_connect_timeout=0.5"
        kwargs = RedisLockStore(url).client.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (1.5, 0.5)

    def test_rediss_url_builds_a_tls_client_with_acl_credentials(self) -> None:
        """rediss:// selects SSLConnection and keeps the ACL user, password and db."""
        store = RedisLockStore("rediss://app:s%40cret@redis.example.invalid:6380/2")
        pool = store.client.connection_pool
        assert pool.connection_class is SSLConnection
        kwargs = pool.connection_kwargs
        assert (kwargs["username"], kwargs["password"]) == ("app", "s@cret")
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("redis.example.invalid", 6380, 2)
        assert kwargs["socket_timeout"] == 5.0

    def test_sentinel_url_builds_a_master_client(self) -> None:
        """redis+sentinel:// builds Sentinel(...).master_for(service) without connecting."""
        store = RedisLockStore(
            "redis+sentinel://:pw@s1:26379,s2:26380/mymaster/3?sentinel_password=sp"
        )
        pool = store.client.connection_pool
        assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
        assert pool.service_name == "mymaster"
        assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (3, "pw")
        sentinel = store._sentinel
        assert sentinel is not None
        hosts = [s.connection_pool.connection_kwargs for s in sentinel.sentinels]
        assert [(h["host"], h["port"], h["password"]) for h in hosts] == [
            ("s1", 26379, "sp"),
            ("s2", 26380, "sp"),
        ]

    @pytest.mark.parametrize("prefix", ["", "{app}:", "a}b", 3])
    def test_bad_prefixes_are_refused(self, prefix: object) -> None:
        """A prefix must be a non-empty string without braces."""
        with pytest.raises(LeaseConfigError, match="prefix="):
            RedisLockStore("redis://localhost:1/0", prefix=prefix)  # type: ignore[arg-type]

    @pytest.mark.parametrize("value", ["http://localhost/", "redis://localhost:notaport/0", 42])
    def test_bad_clients_and_urls_are_refused(self, value: object) -> None:
        """Anything but a redis-py client or a Redis URL raises LeaseConfigError."""
        with pytest.raises(LeaseConfigError):
            RedisLockStore(value)  # type: ignore[arg-type]

    def test_close_leaves_a_callers_client_open(self, redis_client: redis.Redis) -> None:
        """close() does not close a client the caller passed in."""
        store = RedisLockStore(redis_client)
        assert store.acquire("k", "a", LONG_MS) is not None
        store.close()
        assert redis_client.ping() is True


class TestRedisClusterStore(SlotContract, ReplaceContract, StoreContract):
    """RedisLockStore on a redis.cluster.RedisCluster client (one-node cluster), slots and
    replace included."""

    fake_clock = False
    release_wakes_one = True
    stateful_examples = 10

    @pytest.fixture
    def store_backend(self, redis_cluster_server: RedisServer, redis_cluster_url: str) -> None:
        self.server = redis_cluster_server

    def make_store(self) -> LockStore:
        self.prefix = f"cluster-{uuid.uuid4().hex[:8]}:"
        client = RedisCluster(host="127.0.0.1", port=self.server.port)
        return _ClosingStore(client, prefix=self.prefix)

    def store_factory(self) -> Callable[[], LockStore]:
        return functools.partial(_cluster_store, self.server.port, self.prefix)

    wait_until_waiting = TestRedisStore.wait_until_waiting

    def test_renew_many_and_list_in_one_round_trip_per_node(self, store_backend: None) -> None:
        """Batch renew and list work through cluster pipelines and the all-node SCAN."""
        store = self.make_store()
        assert isinstance(store, RedisLockStore)
        for i in range(20):
            assert store.acquire(f"k{i:02d}", "o", LONG_MS) is not None
        assert store.renew_many([(f"k{i:02d}", "o", LONG_MS) for i in range(20)]) == [True] * 20
        assert [i.key for i in store.list("k")] == [f"k{i:02d}" for i in range(20)]
        store.close()


HAS_REFRESH_REQUESTS = hasattr(NodesManager, "_request_refresh")
"""Whether this redis-py paces the slot-table refreshes errors ask for (``topology_refresh_
min_interval``); older releases (redis-py 5) have no such request, and the store refreshes once
per batch that met a stale route."""

paced_refreshes = pytest.mark.skipif(
    not HAS_REFRESH_REQUESTS,
    reason="this redis-py has no paced refresh requests: every failing batch refreshes",
)


class TestClusterSlotTableGoneStale:
    """The cluster client's slot table names a node that is gone (as after a failover, before
    anything refreshed it): batches and the listing refresh the table the way redis-py's
    command path does (requested by the error, run once due) and go to the node it names now;
    while no refresh is due, the calls keep their error."""

    @staticmethod
    def _store(server: RedisServer, refresh_every: float) -> RedisLockStore:
        client = RedisCluster(
            host="127.0.0.1",
            port=server.port,
            socket_connect_timeout=1.0,
            socket_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
            topology_refresh_min_interval=refresh_every,
        )
        return _ClosingStore(client, prefix=f"stale-{uuid.uuid4().hex[:8]}:")

    @staticmethod
    def _send_slot_to_a_dead_node(store: RedisLockStore, key: str) -> str:
        """Point the client's table entry for the slot of ``key`` at a port nothing listens
        on; the name of that node."""
        client = store.client
        assert isinstance(client, RedisCluster)
        dead = ClusterNode("127.0.0.1", free_port(), server_type=PRIMARY)
        manager = client.nodes_manager
        manager.nodes_cache[dead.name] = dead
        manager.slots_cache[client.keyslot(store.lease_key(key))] = [dead]
        return dead.name

    @staticmethod
    def _node_of(store: RedisLockStore, key: str) -> int:
        client = store.client
        assert isinstance(client, RedisCluster)
        return int(client.get_node_from_key(store.lease_key(key)).port)

    def test_a_batch_follows_the_refreshed_table_in_the_same_call(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        store = self._store(redis_cluster_server, refresh_every=0)
        for key in ("a", "b"):
            assert store.acquire(key, "o", LONG_MS) is not None
        self._send_slot_to_a_dead_node(store, "a")
        assert store.renew_many([("a", "o", LONG_MS), ("b", "o", LONG_MS)]) == [True, True]
        assert self._node_of(store, "a") == redis_cluster_server.port
        info = store.get("a")
        assert info is not None and info.expires_in > LONG_MS / 1000 - DEADLINE
        store.close()

    @paced_refreshes
    def test_a_batch_keeps_the_error_while_no_refresh_is_due(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """The refresh the error asked for is not due for an hour: the dead node's key gets a
        StoreUnavailableError in its place, the other key is renewed."""
        store = self._store(redis_cluster_server, refresh_every=3600)
        for key in ("a", "b"):
            assert store.acquire(key, "o", LONG_MS) is not None
        dead = self._send_slot_to_a_dead_node(store, "a")
        first, second = store.renew_many([("a", "o", LONG_MS), ("b", "o", LONG_MS)])
        assert isinstance(first, StoreUnavailableError) and "renew 'a'" in str(first)
        assert dead.split(":")[1] in str(first)
        assert second is True
        store.close()

    @pytest.mark.parametrize(
        "refresh_every",
        [0, pytest.param(3600, marks=paced_refreshes)],
        ids=["refresh-due", "refresh-not-due"],
    )
    def test_a_slot_without_a_node_fails_its_key_alone_until_refreshed(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str, refresh_every: float
    ) -> None:
        """The table has no node for one key's slot: that key is renewed once the refresh it
        asks for runs, else it gets a StoreUnavailableError in its place; the other key is
        renewed either way."""
        store = self._store(redis_cluster_server, refresh_every=refresh_every)
        for key in ("a", "b"):
            assert store.acquire(key, "o", LONG_MS) is not None
        client = store.client
        assert isinstance(client, RedisCluster)
        del client.nodes_manager.slots_cache[client.keyslot(store.lease_key("a"))]
        first, second = store.renew_many([("a", "o", LONG_MS), ("b", "o", LONG_MS)])
        if refresh_every:
            assert isinstance(first, StoreUnavailableError) and "renew 'a'" in str(first)
            assert "not covered" in str(first)
        else:
            assert first is True
        assert second is True
        store.close()

    def test_the_listing_scans_the_masters_of_the_refreshed_table(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        store = self._store(redis_cluster_server, refresh_every=0)
        assert store.acquire("a", "o", LONG_MS) is not None
        self._send_slot_to_a_dead_node(store, "a")
        assert [info.key for info in store.list()] == ["a"]
        assert self._node_of(store, "a") == redis_cluster_server.port
        store.close()

    @paced_refreshes
    def test_the_listing_fails_while_no_refresh_is_due(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        store = self._store(redis_cluster_server, refresh_every=3600)
        assert store.acquire("a", "o", LONG_MS) is not None
        dead = self._send_slot_to_a_dead_node(store, "a")
        with pytest.raises(StoreUnavailableError, match="list leases failed") as raised:
            store.list()
        assert dead.split(":")[1] in str(raised.value)
        store.close()


WAIT = 30.0
"""Real seconds a test waits for a call that must return before it reports it hung."""


class _ManagerWithoutRequests:
    """A cluster client's nodes manager as redis-py 5 has it: no refresh request API (the
    store then refreshes with ``initialize()``), and an ``initialize`` that counts its calls,
    the most that ran at once, and can fail as redis-py 5's does when no node answers, or
    block until the test lets it go."""

    def __init__(self, manager: NodesManager, fail: bool = False) -> None:
        self._manager = manager
        self._fail = fail
        self._guard = threading.Lock()
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __getattr__(self, name: str) -> Any:
        if name in ("_request_refresh", "_run_requested_refresh"):
            raise AttributeError(name)
        return getattr(self._manager, name)

    def initialize(self) -> None:
        with self._guard:
            self.calls += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.entered.set()
        try:
            self.release.wait(WAIT)
            if self._fail:
                raise RedisClusterException(
                    "Redis Cluster cannot be connected. Please provide at least one reachable node"
                )
            self._manager.initialize()
        finally:
            with self._guard:
                self.running -= 1


def _without_requests(store: RedisLockStore, fail: bool = False) -> _ManagerWithoutRequests:
    client = store.client
    assert isinstance(client, RedisCluster)
    manager = _ManagerWithoutRequests(client.nodes_manager, fail=fail)
    client.nodes_manager = manager  # type: ignore[assignment]
    return manager


def _silent_listener() -> socket.socket:
    """A listening socket that accepts connections and never answers (a stopped node)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    return listener


def _was_asked(listener: socket.socket) -> bool:
    """Whether anything connected to ``listener`` (a connection waits in its backlog)."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


class TestClusterBatchesSendFirstAndRefreshAfter:
    """A batch (and a listing) goes out on the slot table it has before any refresh: a refresh
    runs only after calls of this batch met a stale route, on a thread of its own, one at a
    time, and the batch waits for it (and for the calls it moves) only until one socket
    timeout after the batch began; a refresh that fails, whatever it raises, leaves the keys'
    errors in place. redis-py without the refresh request API (redis-py 5) included."""

    SOCKET_TIMEOUT = 1.0

    def _store(self, server: RedisServer) -> RedisLockStore:
        client = RedisCluster(
            host="127.0.0.1",
            port=server.port,
            socket_connect_timeout=self.SOCKET_TIMEOUT,
            socket_timeout=self.SOCKET_TIMEOUT,
            retry=Retry(NoBackoff(), 0),
            **({"topology_refresh_min_interval": 0} if HAS_REFRESH_REQUESTS else {}),
        )
        return _ClosingStore(client, prefix=f"first-{uuid.uuid4().hex[:8]}:")

    @staticmethod
    def _held(store: RedisLockStore, *keys: str) -> None:
        for key in keys:
            assert store.acquire(key, "o", LONG_MS) is not None

    @staticmethod
    def _with_a_silent_startup_node(store: RedisLockStore) -> socket.socket:
        """A startup node that never answers, queried before the live one by a refresh (the
        live one is named as the failed node, so queried last)."""
        client = store.client
        assert isinstance(client, RedisCluster)
        listener = _silent_listener()
        port = listener.getsockname()[1]
        manager = client.nodes_manager
        live = next(iter(manager.startup_nodes))
        manager.startup_nodes[f"127.0.0.1:{port}"] = ClusterNode("127.0.0.1", port)
        request_slot_refresh(client, live)
        return listener

    def test_renewals_on_answering_nodes_go_out_before_a_pending_refresh(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """A refresh is pending (an earlier error asked for it) and would query a silent node
        first: the batch, whose every key answers, runs no refresh at all, so it asks nothing
        of the silent node and costs no socket timeout."""
        store = self._store(redis_cluster_server)
        self._held(store, "a", "b")
        silent = self._with_a_silent_startup_node(store)
        try:
            assert store.renew_many([("a", "o", LONG_MS), ("b", "o", LONG_MS)]) == [True, True]
            assert not _was_asked(silent), "the batch ran a refresh before its renewals"
        finally:
            silent.close()
            store.close()

    def test_the_listing_goes_out_before_a_pending_refresh(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        store = self._store(redis_cluster_server)
        self._held(store, "a")
        silent = self._with_a_silent_startup_node(store)
        try:
            assert [info.key for info in store.list()] == ["a"]
            assert not _was_asked(silent), "the listing ran a refresh before its scan"
        finally:
            silent.close()
            store.close()

    @pytest.mark.parametrize("fail", [False, True], ids=["refresh-answers", "refresh-fails"])
    def test_without_refresh_requests_a_dead_node_costs_its_keys_alone(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str, fail: bool
    ) -> None:
        """redis-py 5: two dead nodes in the table make one refresh for the batch, never two
        at once; it follows the table it reads, and a refresh that raises (redis-py 5's
        RedisClusterException, no RedisError) leaves StoreUnavailableError in the dead
        nodes' places and the other key renewed: nothing escapes renew_many."""
        store = self._store(redis_cluster_server)
        self._held(store, "a", "b", "c")
        dead = [TestClusterSlotTableGoneStale._send_slot_to_a_dead_node(store, k) for k in "ab"]
        manager = _without_requests(store, fail=fail)
        try:
            results = store.renew_many([(k, "o", LONG_MS) for k in "abc"])
            if fail:
                for key, name, result in zip("ab", dead, results, strict=False):
                    assert isinstance(result, StoreUnavailableError), results
                    assert f"renew {key!r}" in str(result) and name.split(":")[1] in str(result)
            else:
                assert results[:2] == [True, True]
            assert results[2] is True
            assert (manager.calls, manager.most_at_once) == (1, 1)
        finally:
            store.close()

    def test_without_refresh_requests_a_listing_survives_a_failing_refresh(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        store = self._store(redis_cluster_server)
        self._held(store, "a")
        dead = TestClusterSlotTableGoneStale._send_slot_to_a_dead_node(store, "a")
        manager = _without_requests(store, fail=True)
        try:
            with pytest.raises(StoreUnavailableError, match="list leases failed") as raised:
                store.list()
            assert dead.split(":")[1] in str(raised.value)
            assert manager.calls == 1
        finally:
            store.close()

    def test_a_batch_waits_for_a_hung_refresh_only_until_its_deadline(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """The refresh a dead node asked for hangs (it queries a stopped node): the batch
        returns with the dead node's key failed in place and the other key renewed while the
        refresh is still running, and the next failing batch starts no second refresh."""
        store = self._store(redis_cluster_server)
        self._held(store, "a", "b")
        TestClusterSlotTableGoneStale._send_slot_to_a_dead_node(store, "a")
        manager = _without_requests(store)
        manager.release.clear()
        outcome: list[Any] = []
        try:
            for _ in range(2):
                caller = threading.Thread(
                    target=lambda: outcome.append(
                        store.renew_many([("a", "o", LONG_MS), ("b", "o", LONG_MS)])
                    ),
                    daemon=True,
                )
                caller.start()
                caller.join(WAIT)
                assert not caller.is_alive(), "renew_many waited for the hung refresh"
                first, second = outcome.pop()
                assert isinstance(first, StoreUnavailableError) and second is True
            assert manager.entered.is_set() and (manager.calls, manager.running) == (1, 1)
        finally:
            manager.release.set()
            store.close()

    def test_a_batch_to_a_cluster_whose_only_node_died_fails_each_key_in_place(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> None:
        """Every node of the cluster is gone: each key gets a StoreUnavailableError in its
        place (the refresh it asks for reaches no node), under any redis-py."""
        store = self._store(redis_cluster_server)
        self._held(store, "a", "b")
        redis_cluster_server.stop()
        try:
            results = store.renew_many([("a", "o", LONG_MS), ("b", "o", LONG_MS)])
            assert all(isinstance(r, StoreUnavailableError) for r in results), results
        finally:
            redis_cluster_server.ensure_running()
            store.close()


class _ClosingStore(RedisLockStore):
    """A store that also closes the cluster client the test built for it."""

    def close(self) -> None:
        super().close()
        self.client.close()


def _cluster_store(port: int, prefix: str) -> LockStore:
    return _ClosingStore(RedisCluster(host="127.0.0.1", port=port), prefix=prefix)


class TestFastPath:
    """acquire / renew / release of a plain standalone client go over the store's own
    connection (``celery_lease.stores._redis_fast``), never leaving an unread reply behind."""

    @staticmethod
    def _fast(store: RedisLockStore) -> FastConnection:
        fast = store._fast
        assert fast is not None, "a plain redis:// store must take the fast path"
        return fast

    def test_acquire_and_release_send_nothing_through_redis_py(
        self, redis_server: RedisServer, store: RedisLockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After warm-up, a cycle is two EVALSHA on the server and no redis-py request."""
        _warm(store)
        sent: list[bytes] = []
        original = redis.connection.AbstractConnection.send_packed_command

        def counted(self: Any, command: Any, check_health: bool = True) -> None:
            sent.append(b"".join(command) if isinstance(command, list) else command)
            original(self, command, check_health)

        redis_server.client().config_resetstat()
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
        assert store.acquire("k", "a", LONG_MS) is not None
        assert store.renew("k", "a", LONG_MS) is True
        store.release("k", "a")
        monkeypatch.undo()
        assert sent == []
        assert _commandstats(redis_server).get("cmdstat_evalsha") == 3

    def test_a_cold_server_costs_one_more_round_trip_on_the_same_connection(
        self, redis_server: RedisServer, store: RedisLockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After SCRIPT FLUSH (a cold or restarted server) the acquire is EVALSHA (NOSCRIPT)
        then one EVAL on the fast connection: no redis-py connection opened, no SCRIPT LOAD
        round trip (a cold start through a slow link must fit in a ttl)."""
        _warm(store)
        redis_server.client().script_flush()
        sent: list[bytes] = []
        original = redis.connection.AbstractConnection.send_packed_command

        def counted(self: Any, command: Any, check_health: bool = True) -> None:
            sent.append(b"".join(command) if isinstance(command, list) else command)
            original(self, command, check_health)

        redis_server.client().config_resetstat()
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
        assert store.acquire("cold", "a", LONG_MS) is not None
        store.release("cold", "a")  # its own script: NOSCRIPT, EVAL too
        assert store.acquire("cold", "a", LONG_MS) is not None  # cached by the EVAL: EVALSHA
        store.release("cold", "a")
        monkeypatch.undo()
        assert sent == []
        stats = _commandstats(redis_server)
        assert (stats.get("cmdstat_eval"), stats.get("cmdstat_evalsha")) == (2, 4), stats
        assert stats.get("cmdstat_script|load") is None, stats
        assert store.get("cold") is None

    def test_a_lost_acquire_reply_is_retried_and_returns_the_owners_lease(
        self, redis_server: RedisServer, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """The server ran the acquire, its reply is lost with the socket: the retry on a new
        connection gets the same token back, one token issued, nothing released."""
        _warm(store)
        fast = self._fast(store)
        real_read = fast._read
        lost: list[Any] = []

        def read_then_die(sock: Any) -> Any:
            if not lost:
                lost.append(real_read(sock))
                sock.close()
                raise redis.exceptions.ConnectionError("test: reply lost after the server ran it")
            return real_read(sock)

        fast._read = read_then_die  # type: ignore[method-assign]
        token = store.acquire("k", "a", LONG_MS)
        assert lost and token is not None and int(lost[0]) == token
        info = store.get("k")
        assert info is not None and (info.owner, info.token) == ("a", token)
        assert store.last_token("k") == token
        assert store.acquire("k", "b", LONG_MS) is None
        assert redis_client.exists(store.signal_key("k")) == 0

    def test_a_lost_release_reply_still_frees_the_key_and_signals_once(
        self, store: RedisLockStore
    ) -> None:
        """The retried release finds nothing left and raises nothing; the key is free."""
        _warm(store)
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        fast = self._fast(store)
        real_read = fast._read
        lost: list[Any] = []

        def read_then_die(sock: Any) -> Any:
            if not lost:
                lost.append(real_read(sock))
                sock.close()
                raise redis.exceptions.ConnectionError("test: reply lost after the server ran it")
            return real_read(sock)

        fast._read = read_then_die  # type: ignore[method-assign]
        store.release("k", "a")
        assert lost == [1]
        assert store.get("k") is None
        assert store.wait_for_release("k", 0) is True
        assert store.wait_for_release("k", 0) is False
        following = store.acquire("k", "b", LONG_MS)
        assert following is not None and following > token

    def test_an_interrupt_between_write_and_read_never_shifts_a_reply_onto_the_next_call(
        self, store: RedisLockStore
    ) -> None:
        """An asynchronous exception after the acquire was sent leaves its reply unread; the
        next call must not take that token for its own answer (it reconnects instead)."""
        _warm(store)
        fast = self._fast(store)
        real_read = fast._read

        def interrupted(sock: Any) -> Any:
            fast._read = real_read  # type: ignore[method-assign]
            raise KeyboardInterrupt  # as SoftTimeLimitExceeded lands in a task body

        fast._read = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            store.acquire("k", "a", LONG_MS)
        # The server ran it: "k" is held by "a", and its token reply is still on the socket.
        # A renewal of a key nobody holds must answer False, not read that token as "renewed".
        assert store.renew("nobody", "x", LONG_MS) is False
        assert store.acquire("k", "b", LONG_MS) is None
        info = store.get("k")
        assert info is not None and info.owner == "a"

    def test_a_thread_that_finds_the_connection_busy_goes_through_the_pool(
        self, store: RedisLockStore
    ) -> None:
        """While one thread waits for its reply on the fast connection, another thread's
        acquire and release complete (through redis-py's pool), and both get their answers."""
        _warm(store)
        fast = self._fast(store)
        real_read = fast._read
        in_read = threading.Event()
        go_on = threading.Event()

        def slow_read(sock: Any) -> Any:
            if threading.current_thread().name == "first":
                in_read.set()
                assert go_on.wait(DEADLINE)
            return real_read(sock)

        fast._read = slow_read  # type: ignore[method-assign]
        first: list[int | None] = []
        thread = threading.Thread(
            target=lambda: first.append(store.acquire("one", "a", LONG_MS)), name="first"
        )
        thread.start()
        try:
            assert in_read.wait(DEADLINE)
            second = store.acquire("two", "b", LONG_MS)
            assert second is not None
            store.release("two", "b")
            assert store.get("two") is None
            assert thread.is_alive() and not first  # the first call is still waiting
        finally:
            go_on.set()
            thread.join(DEADLINE)
        assert first and first[0] is not None
        info = store.get("one")
        assert info is not None and (info.owner, info.token) == ("a", first[0])

    def test_a_hung_server_times_out_on_the_fast_connection(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """A server that stops answering gives StoreUnavailableError within the socket timeout
        (and the one retry), never a hang; the store works again when the server resumes."""
        server = redis_server_factory()
        store = RedisLockStore(f"{server.url}?socket_timeout=0.3")
        try:
            _warm(store)
            os.kill(server.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            try:
                with pytest.raises(StoreUnavailableError, match="acquire 'k' failed: Timeout"):
                    store.acquire("k", "a", LONG_MS)
            finally:
                os.kill(server.pid, signal.SIGCONT)  # type: ignore[arg-type]
            assert store.acquire("k", "a", LONG_MS) is not None
            assert store.get("k") is not None
        finally:
            store.close()

    def test_a_child_forked_while_another_thread_used_the_connection_gets_its_own(
        self, store: RedisLockStore
    ) -> None:
        """fork() while the fast connection's lock is held: the child's lock is free, the child
        talks over a connection of its own, and the parent's connection keeps working."""
        _warm(store)
        fast = self._fast(store)
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        assert fast._lock.acquire(blocking=False)  # as if another thread were mid-call
        try:
            child = ctx.Process(target=_use_fast_path_in_child, args=(store, results))
            child.start()
        finally:
            fast._lock.release()
        free, used_fast, token = results.get(timeout=DEADLINE)
        child.join(DEADLINE)
        assert child.exitcode == 0
        assert free is True and used_fast is True and isinstance(token, int)
        assert store.renew("warm", "w", LONG_MS) is False  # the parent's socket still answers
        assert store.acquire("parent", "p", LONG_MS) is not None

    def test_only_plain_standalone_clients_take_the_fast_path(
        self, redis_server: RedisServer
    ) -> None:
        """Sentinel, min_replicas (WAIT), subclassed connection classes and client-side
        caching keep redis-py's path for every call."""
        port = redis_server.port
        assert RedisLockStore(f"redis://127.0.0.1:{port}/0")._fast is not None
        assert RedisLockStore(f"redis://127.0.0.1:{port}/0?protocol=2")._fast is not None
        assert RedisLockStore(f"redis://127.0.0.1:{port}/0?min_replicas=1")._fast is None
        assert RedisLockStore("redis+sentinel://127.0.0.1:1/svc")._fast is None
        pool = redis.ConnectionPool(connection_class=_CountingConnection, port=port)
        assert RedisLockStore(redis.Redis(connection_pool=pool))._fast is None
        assert fast_path_for(object()) is None
