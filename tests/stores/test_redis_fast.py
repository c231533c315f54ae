"""The Redis store's fast path (``celery_lease.stores._redis_fast``) keeps the store's guarantees.

Each test tries to make the dedicated connection break one of them: two holders at once, a reply
read as the answer to a later command (desync), a success reported for something that did not
happen (or a failure for something that did), an error class that differs from redis-py's pool
path, a child using its parent's socket. Servers are throwaway (``tests/fixtures_redis.py``) or,
where a real Redis 7.0 cannot produce the bytes (push frames, ``-LOADING``), a small fake RESP3
server in this file.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import redis.backoff
import redis.retry

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores._redis_fast import BUSY, FastConnection
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import RedisServer
from tests.stores.contract import DEADLINE, LONG_MS
from tests.stores.redis_helpers import CLIENT_ID, HELLO_REPLY, FakeRedisServer, fast_connection
from tests.support import free_port

pytestmark = pytest.mark.redis


def _fast_client_id(store: RedisLockStore) -> int:
    """The server's id of the store's fast connection (asked over that connection)."""
    reply = fast_connection(store).call(CLIENT_ID)
    assert isinstance(reply, int), reply
    return reply


def _until(what: str, condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (a server-side state change this test caused) up to DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


@contextlib.contextmanager
def _through_the_pool(store: RedisLockStore) -> Iterator[None]:
    """Every fast-path call in the block finds the connection busy and uses redis-py's pool."""
    fast = fast_connection(store)
    assert fast._lock.acquire(blocking=False)
    try:
        yield
    finally:
        fast._lock.release()


def _cause(call: Callable[[], object]) -> type[BaseException]:
    """The class of the redis-py error a failing store call chains."""
    with pytest.raises(StoreUnavailableError) as info:
        call()
    cause = info.value.__cause__
    assert cause is not None
    return type(cause)


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def protocol(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def own_store(redis_url: str, protocol: int) -> Iterator[RedisLockStore]:
    store = RedisLockStore(f"{redis_url}?protocol={protocol}")
    yield store
    store.close()


# A socket wrapper and a fake server for the byte-level tests ----------------------------------


class _Dribble:
    """A socket whose ``recv`` hands out one byte at a time (replies split across reads)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.reads = 0

    def recv(self, size: int) -> bytes:
        self.reads += 1
        return self._sock.recv(1)

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)


class _FakeRedis(FakeRedisServer):
    """A TCP server that speaks enough RESP3 for redis-py's handshake and the store's scripts.

    ``answer(state, command)`` returns the raw bytes to send for an EVALSHA/EVAL; ``state`` is a
    dict per connection (``"maint"`` is True once the client sent
    ``CLIENT MAINT_NOTIFICATIONS ON``, as Redis Software / Redis Cloud honour it).
    """

    def __init__(self, answer: Callable[[dict[str, Any], list[bytes]], bytes]) -> None:
        self._answer = answer
        super().__init__()

    def answer(self, conn: socket.socket, state: dict[str, Any], command: list[bytes]) -> None:
        name = command[0].upper()
        if name == b"HELLO":
            reply = HELLO_REPLY
        elif name == b"CLIENT":
            if command[1].upper() == b"MAINT_NOTIFICATIONS":
                state["maint"] = True
            reply = b"+OK\r\n"
        elif name in (b"EVALSHA", b"EVAL"):
            reply = self._answer(state, command)
        elif name == b"PING":
            reply = b"+PONG\r\n"
        else:
            reply = b"-ERR unknown command\r\n"
        conn.sendall(reply)


@pytest.fixture
def fake_redis() -> Iterator[Callable[..., _FakeRedis]]:
    """Starts a :class:`_FakeRedis` per call; all closed after the test."""
    with contextlib.ExitStack() as started:
        yield lambda answer: started.enter_context(contextlib.closing(_FakeRedis(answer)))


_PUSH = b">4\r\n$9\r\nMIGRATING\r\n:7\r\n:15\r\n*1\r\n$1\r\n1\r\n"
"""A RESP3 push frame as Redis Software sends it to a client that enabled maintenance
notifications (``MIGRATING <seq> <time> <shards>``)."""


class TestWire:
    """Replies as bytes arrive: split, pushed, or answered with errors Redis 7.0 cannot make."""

    def test_replies_split_into_single_bytes_parse_as_whole_ones(
        self, own_store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """Every reply shape (token, nil, 0/1, NOSCRIPT error then EVAL) read one byte per
        recv() gives the same answers: no reply is cut, merged or left half-read."""
        store = own_store
        assert store.acquire("warm", "w", LONG_MS) is not None
        fast = fast_connection(store)
        assert fast._sock is not None
        dribble = _Dribble(fast._sock)
        fast._sock = dribble  # type: ignore[assignment]
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        assert store.acquire("k", "b", LONG_MS) is None  # nil: '$-1' or RESP3 '_'
        assert store.acquire("k", "a", LONG_MS) == token
        assert store.renew("k", "a", LONG_MS) is True
        assert store.renew("k", "b", LONG_MS) is False
        redis_client.script_flush()  # NOSCRIPT error reply, then EVAL on the same connection
        store.release("k", "b")
        assert store.get("k") is not None
        store.release("k", "a")
        assert store.get("k") is None
        assert fast._sock is cast(Any, dribble), (
            "the connection was dropped: some reply failed to parse"
        )
        assert dribble.reads > 40
        assert not fast._pending and not fast._buf

    def test_a_push_frame_before_the_reply_is_not_taken_for_a_failure(
        self, fake_redis: Callable[..., _FakeRedis]
    ) -> None:
        """RESP3 servers that run maintenance (Redis Software / Cloud) push MIGRATING/MOVING
        frames to connections that asked for them, at any time, also just before a reply.
        redis-py's pool skips them. The fast connection must not turn an acquire the server
        ran into a failure (the lease would stay held by nobody who knows it)."""

        def answer(state: dict[str, Any], command: list[bytes]) -> bytes:
            reply = b"$3\r\n123\r\n" if command[0].upper() == b"EVALSHA" else b":1\r\n"
            return (_PUSH if state["maint"] else b"") + reply

        server = fake_redis(answer)
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/0")
        try:
            fast = fast_connection(store)
            assert store.acquire("k", "a", LONG_MS) == 123
            assert fast._sock is not None
            fast._sock = cast(Any, _Dribble(fast._sock))  # the push and the reply byte by byte
            assert store.acquire("k", "a", LONG_MS) == 123
            assert isinstance(fast._sock, _Dribble) and not fast._buf
        finally:
            store.close()

    def test_loading_is_retried_once_like_redis_pys_busy_loading_error(
        self, fake_redis: Callable[..., _FakeRedis]
    ) -> None:
        """-LOADING (a restarted server reading its dataset) is BusyLoadingError, a
        ConnectionError: the store retries once and the answer of the retry is the one
        returned, not the LOADING line."""
        loading = [True]

        def answer(state: dict[str, Any], command: list[bytes]) -> bytes:
            if loading[0]:
                loading[0] = False
                return b"-LOADING Redis is loading the dataset in memory\r\n"
            return b"$2\r\n42\r\n"

        server = fake_redis(answer)  # no marker to read: no restart grace
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/0?protocol=2&restart_grace=0")
        try:
            assert store.acquire("k", "a", LONG_MS) == 42
            evals = [c for c in server.commands if c[0].upper() == b"EVALSHA"]
            assert len(evals) == 2
        finally:
            store.close()

    def test_an_unknown_reply_type_drops_the_connection_and_fails(
        self, fake_redis: Callable[..., _FakeRedis]
    ) -> None:
        """A reply the parser does not know (here a RESP3 map) must fail the call and drop the
        socket, never leave its rest to be read as the next call's answer."""
        answers = iter([b"%1\r\n$1\r\na\r\n:1\r\n", b"$2\r\n77\r\n"])

        def answer(state: dict[str, Any], command: list[bytes]) -> bytes:
            return next(answers)

        server = fake_redis(answer)  # no marker to read: no restart grace
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/0?protocol=2&restart_grace=0")
        try:
            with pytest.raises(StoreUnavailableError, match="InvalidResponse"):
                store.acquire("k", "a", LONG_MS)
            assert fast_connection(store)._pending  # the rest of the map is unread: never reused
            assert store.acquire("k", "a", LONG_MS) == 77
        finally:
            store.close()


class TestThreads:
    """Many threads of one process on one store: the fast connection and the pool at once."""

    THREADS = 6
    ROUNDS = 300

    def test_threads_contending_for_one_key_never_hold_it_together(
        self, own_store: RedisLockStore
    ) -> None:
        """6 threads race for one key (half the calls meet a busy fast connection and use the
        pool). At most one holds it at any time, a holder's repeated acquire returns its own
        token, renewals answer for the right owner: a shifted reply would break one of these."""
        store = own_store
        assert store.acquire("warm", "w", LONG_MS) is not None
        holder: list[str | None] = [None]
        guard = threading.Lock()
        problems: list[str] = []
        counts: collections.Counter[str] = collections.Counter()
        start = threading.Barrier(self.THREADS)
        real_call = fast_connection(store).call

        def counting_call(request: bytes) -> Any:
            reply = real_call(request)
            counts["busy" if reply is BUSY else "fast"] += 1
            return reply

        fast_connection(store).call = counting_call  # type: ignore[method-assign]

        def work(me: str) -> None:
            start.wait(DEADLINE)
            try:
                for _ in range(self.ROUNDS):
                    token = store.acquire("k", me, LONG_MS)
                    if token is None:
                        if store.renew("k", me, LONG_MS) is not False:
                            problems.append(f"{me} renewed a lease it did not get")
                        continue
                    with guard:
                        if holder[0] is not None:
                            problems.append(f"{me} and {holder[0]} hold 'k' together")
                        holder[0] = me
                    if store.acquire("k", me, LONG_MS) != token:
                        problems.append(f"{me}: a repeated acquire did not return {token}")
                    if store.renew("k", me, LONG_MS) is not True:
                        problems.append(f"{me}: its own renewal failed")
                    with guard:
                        holder[0] = None
                    store.release("k", me)
                    with guard:
                        counts["held"] += 1
            except Exception as exc:  # pragma: no cover - reported below
                problems.append(f"{me}: {exc!r}")

        threads = [threading.Thread(target=work, args=(f"owner-{i}",)) for i in range(self.THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE * 6)
        assert not any(thread.is_alive() for thread in threads)
        assert problems == []
        assert counts["held"] > 0 and counts["fast"] > 0
        assert not fast_connection(store)._pending

    def test_an_async_exception_at_any_point_of_a_call_never_shifts_a_reply(
        self, store_for_interrupts: RedisLockStore
    ) -> None:
        """KeyboardInterrupt (as SoftTimeLimitExceeded) raised inside the fast call at each
        step of it (reconnect, write, each recv): afterwards a renewal of a free key is False
        and the holder's acquire returns its own token."""
        store = store_for_interrupts
        fast = fast_connection(store)
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None
        steps = [("connect", 0), ("send", 0), *(("recv", nth) for nth in range(8))]
        for step, nth in steps:
            fast.close()
            armed = _interrupt_at(fast, step, nth)
            with contextlib.suppress(KeyboardInterrupt):
                store.acquire("other", "x", LONG_MS)
            assert armed == [] or armed[0].fired, (step, nth)
            for wrapped in armed:
                wrapped.disarm()
            assert store.renew("nobody", "n", LONG_MS) is False, (step, nth)
            assert store.acquire("k", "a", LONG_MS) == token, (step, nth)
            assert store.acquire("k", "b", LONG_MS) is None, (step, nth)
            store.release("other", "x")


@pytest.fixture
def store_for_interrupts(redis_url: str) -> Iterator[RedisLockStore]:
    store = RedisLockStore(redis_url)
    yield store
    store.close()


class _Interrupting:
    """A socket that raises KeyboardInterrupt at its ``nth`` send or recv."""

    def __init__(self, sock: socket.socket, step: str, nth: int) -> None:
        self._sock, self._step, self._left = sock, step, nth
        self.fired = False

    def disarm(self) -> None:
        self._step = ""

    def _maybe(self, step: str) -> None:
        if self._step == step:
            if self._left == 0:
                self._step, self.fired = "", True
                raise KeyboardInterrupt
            self._left -= 1

    def sendall(self, data: bytes) -> None:
        self._maybe("send")
        self._sock.sendall(data)

    def recv(self, size: int) -> bytes:
        self._maybe("recv")
        return self._sock.recv(1)


def _interrupt_at(fast: FastConnection, step: str, nth: int) -> list[_Interrupting]:
    """Arm ``fast`` to raise KeyboardInterrupt at a step of its next connection: right after
    the handshake ("connect"), at its first write ("send") or at its ``nth`` one-byte read
    ("recv"). Returns the list the armed socket wrapper is put in when the connection opens."""
    original = type(fast).__dict__["_reconnect"]
    armed: list[_Interrupting] = []

    def reconnect() -> socket.socket:
        del fast._reconnect
        sock = original(fast)
        if step == "connect":  # the server has the connection; the interrupt lands now
            raise KeyboardInterrupt
        wrapped = _Interrupting(sock, step, nth)
        armed.append(wrapped)
        fast._sock = wrapped  # type: ignore[assignment]
        return wrapped  # type: ignore[return-value]

    fast._reconnect = reconnect  # type: ignore[method-assign]
    return armed


class TestServerErrors:
    """Error replies: the class redis-py's pool path raises, and no desync after them."""

    @staticmethod
    def _both_paths(store: RedisLockStore, call: Callable[[], object]) -> type[BaseException]:
        """The chained error class of ``call`` on the fast path, checked equal on the pool."""
        fast_class = _cause(call)
        with _through_the_pool(store):
            pool_class = _cause(call)
        assert fast_class is pool_class
        return fast_class

    @staticmethod
    def _in_sync(store: RedisLockStore, holder: str = "h") -> None:
        """After an error the fast connection's answers still belong to their own calls."""
        token = store.acquire("sync", holder, LONG_MS)
        assert token is not None
        assert store.acquire("sync", holder, LONG_MS) == token
        assert store.renew("sync-free", holder, LONG_MS) is False
        assert store.acquire("sync", "intruder", LONG_MS) is None
        store.release("sync", holder)
        assert store.get("sync") is None

    def test_wrongtype_inside_a_script(
        self, own_store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        store = own_store
        redis_client.set(store.lease_key("k"), "a string, not a hash")
        assert self._both_paths(store, lambda: store.acquire("k", "a", LONG_MS)) is (
            redis.exceptions.ResponseError
        )
        self._in_sync(store)

    def test_out_of_memory(
        self, redis_server_factory: Callable[..., RedisServer], protocol: int
    ) -> None:
        server = redis_server_factory("--maxmemory-policy", "noeviction")
        store = RedisLockStore(f"{server.url}?protocol={protocol}")
        admin = server.client()
        try:
            assert store.acquire("warm", "w", LONG_MS) is not None
            admin.config_set("maxmemory", 1)
            assert self._both_paths(store, lambda: store.acquire("k", "a", LONG_MS)) is (
                redis.exceptions.OutOfMemoryError
            )
            assert store.get("k") is None  # nothing half-written
            admin.config_set("maxmemory", 0)
            self._in_sync(store)
        finally:
            admin.close()
            store.close()

    def test_read_only_replica(
        self, redis_server_factory: Callable[..., RedisServer], protocol: int
    ) -> None:
        """A standalone client left pointing at a node that became a replica: READONLY."""
        server = redis_server_factory()
        store = RedisLockStore(f"{server.url}?protocol={protocol}")
        admin = server.client()
        try:
            assert store.acquire("warm", "w", LONG_MS) is not None
            admin.replicaof("127.0.0.1", free_port())  # a master that is not there
            assert self._both_paths(store, lambda: store.acquire("k", "a", LONG_MS)) is (
                redis.exceptions.ReadOnlyError
            )
            admin.replicaof("NO", "ONE")
            self._in_sync(store)
        finally:
            admin.close()
            store.close()

    def test_busy_script_then_script_kill(
        self, redis_server_factory: Callable[..., RedisServer], protocol: int
    ) -> None:
        """-BUSY while another client's script loops: a failure on both paths, nothing
        queued; after SCRIPT KILL the fast connection answers its own calls."""
        server = redis_server_factory("--busy-reply-threshold", "20")
        store = RedisLockStore(f"{server.url}?protocol={protocol}")
        admin = server.client()
        looping = server.client(socket_timeout=DEADLINE)
        try:
            assert store.acquire("warm", "w", LONG_MS) is not None
            spinner = threading.Thread(
                target=_swallow, args=(lambda: looping.eval("while true do end", 0),)
            )
            spinner.start()
            _until("the server answers BUSY", lambda: _answers_busy(admin))
            try:
                assert self._both_paths(store, lambda: store.acquire("k", "a", LONG_MS)) is (
                    redis.exceptions.ResponseError
                )
            finally:
                admin.script_kill()
                spinner.join(DEADLINE)
            assert store.get("k") is None
            self._in_sync(store)
        finally:
            admin.close()
            looping.close()
            store.close()

    def test_acl_user_without_evalsha(
        self, redis_server_factory: Callable[..., RedisServer], protocol: int
    ) -> None:
        """NOPERM (an ACL user that may not run EVALSHA): NoPermissionError on both paths."""
        server = redis_server_factory()
        admin = server.client()
        admin.acl_setuser("app", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
        store = RedisLockStore(f"redis://app:pw@127.0.0.1:{server.port}/0?protocol={protocol}")
        try:
            assert store.acquire("warm", "w", LONG_MS) is not None
            admin.acl_setuser("app", enabled=True, commands=["-evalsha", "-eval"])
            assert self._both_paths(store, lambda: store.acquire("k", "a", LONG_MS)) is (
                redis.exceptions.NoPermissionError
            )
            admin.acl_setuser("app", enabled=True, commands=["+evalsha", "+eval"])
            self._in_sync(store)
        finally:
            admin.close()
            store.close()


def _swallow(call: Callable[[], object]) -> None:
    with contextlib.suppress(redis.RedisError):
        call()


def _answers_busy(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.exceptions.ResponseError as exc:
        return str(exc).startswith("BUSY")
    except redis.RedisError:
        return False
    return False


def _client_line(admin: redis.Redis, client_id: int) -> dict[str, str]:
    """CLIENT LIST's fields of one connection (``name``, ``db``, ``user``, ``laddr``...)."""
    raw = admin.execute_command(  # type: ignore[no-untyped-call]
        "CLIENT", "LIST", "ID", client_id
    )
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    assert text.strip(), f"no client {client_id} on the server"
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def _self_signed(directory: Path) -> tuple[str, str]:
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


class TestConnectionSettings:
    """The fast connection is opened with every setting of the client: TLS, unix socket, db,
    ACL user, client name, protocol; its keys are the pool path's keys."""

    def test_tls_acl_user_db_and_client_name(
        self,
        redis_server_factory: Callable[..., RedisServer],
        tmp_path: Path,
        protocol: int,
    ) -> None:
        """rediss:// with an ACL user, db 3 and a client name: the fast connection is a TLS
        connection of that user on db 3 with that name; a CLIENT KILL of it is survived."""
        if not shutil.which("openssl"):
            pytest.fail("openssl is needed to make the test's certificate")
        cert, key = _self_signed(tmp_path)
        tls_port = free_port()
        server = redis_server_factory(
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            key,
            "--tls-ca-cert-file",
            cert,
            "--tls-auth-clients",
            "no",
        )
        admin = server.client()
        admin.acl_setuser(
            "app", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"]
        )
        url = (
            f"rediss://app:s3cret@127.0.0.1:{tls_port}/3?ssl_cert_reqs=none"
            f"&client_name=lease-fast&protocol={protocol}"
        )
        store = RedisLockStore(url)
        try:
            token = store.acquire("k", "a", LONG_MS)
            assert token is not None
            fields = _client_line(admin, _fast_client_id(store))
            assert (fields["name"], fields["db"], fields["user"]) == ("lease-fast", "3", "app")
            assert fields["laddr"] == f"127.0.0.1:{tls_port}"  # the TLS port, not the plain one
            assert isinstance(fast_connection(store)._sock, ssl.SSLSocket)
            db3 = server.client(db=3)
            assert db3.exists(store.lease_key("k")) == 1
            assert admin.exists(store.lease_key("k")) == 0
            db3.close()
            admin.client_kill_filter(_id=str(_fast_client_id(store)))
            assert store.acquire("k", "a", LONG_MS) == token  # retried on a new connection
            assert store.renew("k", "a", LONG_MS) is True
            store.release("k", "a")
            assert store.get("k") is None
        finally:
            admin.close()
            store.close()

    def test_unix_socket_with_password_and_db(
        self, redis_server_factory: Callable[..., RedisServer], protocol: int
    ) -> None:
        server = redis_server_factory(password="pw")
        store = RedisLockStore(
            f"unix://:pw@{server.unix_socket}?db=5&protocol={protocol}&client_name=u"
        )
        admin = server.client()
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            fields = _client_line(admin, _fast_client_id(store))
            assert (fields["db"], fields["name"]) == ("5", "u")
            assert fields["laddr"].startswith(server.unix_socket), fields
            sock = fast_connection(store)._sock
            assert sock is not None and sock.family == socket.AF_UNIX
            assert server.client(db=5).exists(store.lease_key("k")) == 1
        finally:
            admin.close()
            store.close()

    def test_non_ascii_and_big_values_write_the_keys_the_pool_path_writes(
        self, own_store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A non-ASCII key and a 1 MiB owner (many sends, a reply after a long request): the
        fast path writes and checks exactly the keys and owner the pool path does."""
        store = own_store
        key, owner = "ключ-✓", "o" * (1 << 20)
        token = store.acquire(key, owner, LONG_MS)
        assert token is not None
        assert redis_client.hget(store.lease_key(key), "owner") == owner.encode()
        with _through_the_pool(store):
            assert store.acquire(key, owner, LONG_MS) == token
            assert store.renew(key, owner, LONG_MS) is True
            assert store.acquire(key, owner + "x", LONG_MS) is None
        assert store.renew(key, owner, LONG_MS) is True
        store.release(key, owner)
        assert store.get(key) is None


def _lose_the_next_answered_reply(fast: FastConnection) -> list[Any]:
    """The next reply the fast connection reads whole is thrown away with its socket
    (ConnectionError, as if the link died after the server ran the command)."""
    real_read = fast._read
    lost: list[Any] = []

    def read(sock: Any) -> Any:
        reply = real_read(sock)
        if not lost:
            lost.append(reply)
            sock.close()
            raise redis.exceptions.ConnectionError("test: reply lost after the server ran it")
        return reply

    fast._read = read  # type: ignore[method-assign]
    return lost


class TestDeadConnections:
    """A fast connection the server closed while it sat idle (``timeout``, CLIENT KILL, a
    restart) must cost what it costs redis-py's pool, which reconnects at checkout: the
    store's one retry stays for a reply lost on the connection that then answers."""

    @staticmethod
    def _gone(admin: redis.Redis, client_id: int) -> Callable[[], bool]:
        def check() -> bool:
            raw = admin.execute_command(  # type: ignore[no-untyped-call]
                "CLIENT", "LIST", "ID", client_id
            )
            return not (raw.decode() if isinstance(raw, bytes) else str(raw)).strip()

        return check

    def test_a_connection_closed_as_idle_keeps_the_stores_retry(
        self,
        redis_server_factory: Callable[..., RedisServer],
        protocol: int,
    ) -> None:
        server = redis_server_factory()
        store = RedisLockStore(f"{server.url}?protocol={protocol}")
        admin = server.client()
        try:
            assert store.acquire("warm", "w", LONG_MS) is not None
            idle = _fast_client_id(store)
            admin.config_set("timeout", 1)
            _until("the server closes the idle fast connection", self._gone(admin, idle))
            admin.config_set("timeout", 0)
            lost = _lose_the_next_answered_reply(fast_connection(store))
            token = store.acquire("k", "a", LONG_MS)
            assert lost and token is not None and int(lost[0]) == token
            assert store.get("k") is not None
        finally:
            admin.close()
            store.close()

    def test_client_kill_of_the_idle_fast_connection_keeps_the_stores_retry(
        self, redis_server: RedisServer, own_store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        store = own_store
        assert store.acquire("k", "a", LONG_MS) is not None
        assert store.renew("k", "a", LONG_MS) is True  # the script is cached: no NOSCRIPT
        redis_client.client_kill_filter(_id=str(_fast_client_id(store)))
        lost = _lose_the_next_answered_reply(fast_connection(store))
        assert store.renew("k", "a", LONG_MS) is True
        assert lost == [1]

    def test_a_server_restart_needs_one_reconnect_and_one_eval(
        self, redis_server_factory: Callable[..., RedisServer], protocol: int
    ) -> None:
        """After a restart the old socket is dead and the script cache empty: the acquire
        reconnects, meets NOSCRIPT, runs EVAL, and gets a lease on the new server (at once:
        no restart grace here)."""
        server = redis_server_factory()
        store = RedisLockStore(f"{server.url}?protocol={protocol}&restart_grace=0")
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            server.restart()
            token = store.acquire("k", "b", LONG_MS)  # the old lease went with the old server
            assert token is not None
            info = store.get("k")
            assert info is not None and (info.owner, info.token) == ("b", token)
            assert store.renew("k", "b", LONG_MS) is True
        finally:
            store.close()


def _child_uses_the_store(store: RedisLockStore, parent_id: int, results: Any) -> None:
    """In a forked child: acquire, report whether the fast connection is the parent's, close
    the store and exit normally (finalisers run)."""
    try:
        token = store.acquire("child", "c", LONG_MS)
        own = _fast_client_id(store)
        store.release("child", "c")
        store.close()
        results.put((token, own != parent_id))
    except BaseException as exc:  # pragma: no cover - reported to the parent
        results.put((repr(exc), False))


class TestTimeouts:
    def test_a_timeout_is_not_sent_again_by_the_connection_itself(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """Only a connection found dead (no reply byte, ConnectionError) is redone inside the
        fast call; a timeout means the server may still be working on it: the request goes
        out once, then the store's one retry reconnects once (its handshake times out on the
        stopped server): one exchange and one reconnect, not a second of each."""
        server = redis_server_factory()
        store = RedisLockStore(f"{server.url}?socket_timeout=0.2")
        fast = fast_connection(store)
        sends: list[bytes] = []
        reconnects: list[bool] = []
        real_exchange, real_reconnect = fast._exchange, fast._reconnect

        def exchange(sock: socket.socket, request: bytes) -> Any:
            sends.append(request)
            return real_exchange(sock, request)

        def reconnect() -> socket.socket:
            reconnects.append(True)
            return real_reconnect()

        try:
            assert store.acquire("warm", "w", LONG_MS) is not None
            fast._exchange = exchange  # type: ignore[method-assign]
            fast._reconnect = reconnect  # type: ignore[method-assign]
            os.kill(server.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            try:
                with pytest.raises(StoreUnavailableError, match="Timeout"):
                    store.renew("warm", "w", LONG_MS)
            finally:
                os.kill(server.pid, signal.SIGCONT)  # type: ignore[arg-type]
            assert (len(sends), len(reconnects)) == (1, 1)
            assert store.renew("warm", "w", LONG_MS) is True
        finally:
            store.close()


class _CountingSocket(socket.socket):
    """A kernel socket counting calls of the methods that, under a timeout, poll the fd
    before the send or receive itself (CPython's socket module): one extra syscall each."""

    calls: collections.Counter[str] = collections.Counter()

    def sendall(self, data: Any, flags: int = 0) -> None:
        self.calls["sendall"] += 1
        super().sendall(data, flags)

    def send(self, data: Any, flags: int = 0) -> int:
        self.calls["send"] += 1
        return super().send(data, flags)

    def recv(self, size: int, flags: int = 0) -> bytes:
        self.calls["recv"] += 1
        return super().recv(size, flags)

    def recv_into(self, buffer: Any, size: int = 0, flags: int = 0) -> int:
        self.calls["recv_into"] += 1
        return super().recv_into(buffer, size, flags)


class TestSyscalls:
    """A socket with a timeout costs CPython a poll() before each send and recv; the fast path
    writes a request, and reads a reply that has already come, without that poll."""

    @staticmethod
    def _counting_store(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> RedisLockStore:
        """A store whose fast connection (opened by its first call) is a _CountingSocket."""
        store = RedisLockStore(f"{redis_url}?socket_timeout=5")
        with monkeypatch.context() as patch:
            patch.setattr(socket, "socket", _CountingSocket)
            assert store.acquire("warm", "w", LONG_MS) is not None
        sock = fast_connection(store)._sock
        assert isinstance(sock, _CountingSocket) and sock.gettimeout() == 5.0
        return store

    @staticmethod
    def _reply_arrived(store: RedisLockStore) -> None:
        sock = fast_connection(store)._sock
        assert sock is not None
        assert select.select([sock], [], [], DEADLINE)[0], "no reply came"

    def test_a_sent_acquire_and_a_deferred_release_poll_nothing_when_the_reply_is_there(
        self, redis_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store = self._counting_store(redis_url, monkeypatch)
        try:
            _CountingSocket.calls.clear()
            read = store.send_acquire("k", "a", LONG_MS)
            assert read is not None
            self._reply_arrived(store)
            token = read()
            assert isinstance(token, int)
            assert store.release_deferred("k", "a")
            self._reply_arrived(store)
            store.flush_deferred()
            assert _CountingSocket.calls == {}
            assert store.acquire("k", "b", LONG_MS) is not None  # the release ran
            assert _CountingSocket.calls["sendall"] == 0  # a plain call writes without a poll
        finally:
            store.close()

    def test_a_request_the_kernel_takes_in_part_goes_out_whole(
        self, redis_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A request larger than the socket's send buffer: the rest is sent after the first
        write, and the reply is the whole request's."""
        store = self._counting_store(redis_url, monkeypatch)
        fast = fast_connection(store)
        value = os.urandom(1 << 23)  # 8 MiB: more than a loopback send buffer takes at once
        try:
            request = b"*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n$%d\r\n%s\r\n" % (len(value), value)
            assert fast.call(request) == b"OK"
            assert fast.call(b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n") == value
        finally:
            store.close()


class TestFork:
    """A forked child never reads, writes or shuts down its parent's fast socket."""

    def test_the_child_neither_uses_nor_closes_the_parents_socket(
        self, own_store: RedisLockStore
    ) -> None:
        store = own_store
        assert store.acquire("parent", "p", LONG_MS) is not None
        fast = fast_connection(store)
        parent_id, parent_sock = _fast_client_id(store), fast._sock
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_child_uses_the_store, args=(store, parent_id, results))
        child.start()
        token, own_connection = results.get(timeout=DEADLINE)
        child.join(DEADLINE)
        assert child.exitcode == 0 and isinstance(token, int) and own_connection
        # Same socket, same server-side connection: the child did not shut it down (a
        # reconnect here would hide that, so it is checked, not just used).
        assert fast._sock is parent_sock and _fast_client_id(store) == parent_id
        assert store.renew("parent", "p", LONG_MS) is True

    def test_a_flush_where_the_at_fork_hook_did_not_run_reads_none_of_the_parents_replies(
        self, own_store: RedisLockStore
    ) -> None:
        """A child whose at-fork hook did not run still holds its parent's unread requests:
        its flush reads nothing from the parent's socket (the pid tells), it reports them as
        unanswered."""
        fast = fast_connection(own_store)
        assert fast.call(CLIENT_ID) is not None  # opens the connection
        got: list[Any] = []
        assert fast.send_deferred(CLIENT_ID, got.append)
        fast._pid = -1  # the connection of another process, as a child sees its parent's
        fast.flush()
        assert len(got) == 1 and isinstance(got[0], redis.exceptions.ConnectionError), got
        assert fast._sock is None  # dropped, to be opened anew by this process

    def test_a_child_forked_mid_call_leaves_the_parents_reply_on_the_parents_socket(
        self, own_store: RedisLockStore
    ) -> None:
        """A thread has sent its acquire and not read the reply yet when another thread forks.
        The reply sits in the socket both processes share: the child must not read it (it
        would take the parent's token for its own answer and rob the parent of it)."""
        store = own_store
        assert store.acquire("warm", "w", LONG_MS) is not None
        fast = fast_connection(store)
        parent_id = _fast_client_id(store)
        real_read = fast._read
        sent, forked = threading.Event(), threading.Event()

        def held_read(sock: Any) -> Any:
            if threading.current_thread().name == "mid-call":
                sent.set()
                assert forked.wait(DEADLINE)
            return real_read(sock)

        fast._read = held_read  # type: ignore[method-assign]
        answer: list[int | None] = []
        thread = threading.Thread(
            target=lambda: answer.append(store.acquire("mid", "m", LONG_MS)), name="mid-call"
        )
        thread.start()
        try:
            assert sent.wait(DEADLINE)
            ctx = multiprocessing.get_context("fork")
            results = ctx.Queue()
            child = ctx.Process(target=_child_uses_the_store, args=(store, parent_id, results))
            child.start()
            token, own_connection = results.get(timeout=DEADLINE)
            child.join(DEADLINE)
        finally:
            forked.set()
            thread.join(DEADLINE)
        assert child.exitcode == 0 and isinstance(token, int) and own_connection
        info = store.get("mid")
        assert answer and info is not None and (info.owner, info.token) == ("m", answer[0])
        assert _fast_client_id(store) == parent_id


_GREEN_SCRIPT = """
import sys
if sys.argv[3] == "gevent":
    from gevent import monkey
    monkey.patch_all()
    import gevent
    pause = gevent.sleep
    def run_all(fns):
        gevent.joinall([gevent.spawn(fn) for fn in fns], raise_error=True)
else:
    import eventlet
    eventlet.monkey_patch()
    pause = eventlet.sleep
    def run_all(fns):
        for green in [eventlet.spawn(fn) for fn in fns]:
            green.wait()
from celery_lease.stores.redis import RedisLockStore

store = RedisLockStore(sys.argv[1] + "?protocol=" + sys.argv[2])
holder = [None]
problems = []
held = [0]

def work(me):
    for _ in range(100):
        token = store.acquire("g", me, 60000)
        if token is None:
            pause(0)
            continue
        if holder[0] is not None:
            problems.append((me, holder[0]))
        holder[0] = me
        pause(0)  # let the others try while it is held
        if store.acquire("g", me, 60000) != token or not store.renew("g", me, 60000):
            problems.append((me, "own lease answered wrongly"))
        holder[0] = None
        store.release("g", me)
        held[0] += 1

run_all([lambda me="o%d" % i: work(me) for i in range(12)])
assert problems == [], problems
assert held[0] > 0
assert store._fast is not None and not store._fast._pending
print("ok", held[0])
"""


class TestGreenThreads:
    @pytest.mark.parametrize("hub", ["gevent", "eventlet"])
    def test_monkeypatched_green_threads(self, redis_url: str, protocol: int, hub: str) -> None:
        """12 green threads of one OS thread on one store (gevent / eventlet patch the lock
        and the socket the fast connection uses): one holder at a time, each its own answers."""
        pytest.importorskip(hub)
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _GREEN_SCRIPT, redis_url, str(protocol), hub],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


class TestClientsPassedIn:
    def test_a_decode_responses_client_gets_int_tokens_on_both_paths(
        self, redis_server: RedisServer, redis_url: str, protocol: int
    ) -> None:
        """decode_responses=True changes what redis-py's parser returns (str), never what the
        fast parser does (bytes): the store's answers are the same either way."""
        client = redis.Redis(
            host="127.0.0.1",
            port=redis_server.port,
            protocol=protocol,
            decode_responses=True,
            socket_timeout=5.0,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        )
        store = RedisLockStore(client)
        try:
            token = store.acquire("k", "a", LONG_MS)
            assert isinstance(token, int)
            with _through_the_pool(store):
                assert store.acquire("k", "a", LONG_MS) == token
                assert store.acquire("k", "b", LONG_MS) is None
                assert store.renew("k", "a", LONG_MS) is True
            assert store.acquire("k", "b", LONG_MS) is None
            assert store.renew("k", "a", LONG_MS) is True
            store.release("k", "a")
            assert store.get("k") is None
        finally:
            store.close()
            client.close()


class TestEachEntryChecksItsConnection:
    """Every entry of the fast connection (a call, a deferred send, a flush) asks for itself
    whether its socket can be used, and hands deferred replies over as documented."""

    @pytest.mark.parametrize(
        "unusable",
        [
            # as an exchange cut short after its write leaves it:
            pytest.param({"_pending": True}, id="after-an-exchange-cut-short"),
            # the connection of another process, as a child sees its parent's:
            pytest.param({"_pid": -1}, id="in-another-process"),
        ],
    )
    def test_a_deferred_send_on_a_connection_it_cannot_use_opens_a_new_one(
        self, own_store: RedisLockStore, unusable: dict[str, Any]
    ) -> None:
        fast = fast_connection(own_store)
        first = fast.call(CLIENT_ID)
        old = fast._sock
        for name, value in unusable.items():
            setattr(fast, name, value)
        got: list[Any] = []
        assert fast.send_deferred(CLIENT_ID, got.append)
        fast.flush()
        assert fast._sock is not old
        assert len(got) == 1 and isinstance(got[0], int) and got[0] != first

    def test_a_deferred_reply_whose_function_raises_is_logged_not_passed_on(
        self, own_store: RedisLockStore, caplog: pytest.LogCaptureFixture
    ) -> None:
        fast = fast_connection(own_store)

        def fails(reply: Any) -> None:
            raise RuntimeError(f"cannot take {reply!r}")

        assert fast.send_deferred(CLIENT_ID, fails)
        fast.flush()
        assert "handling a deferred Redis reply failed" in caplog.text
        assert "cannot take" in caplog.text
        assert isinstance(fast.call(CLIENT_ID), int)  # the stream is still in step

    def test_a_release_whose_call_fails_with_a_dropped_connection_is_retried_once(
        self,
        own_store: RedisLockStore,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        store = own_store
        assert store.acquire("r", "me", LONG_MS) is not None
        store.release("warm", "me")  # the script is loaded: one EVALSHA a try
        fast = fast_connection(store)
        real_call = fast.call
        requests: list[bytes] = []

        def dropped_once(request: bytes) -> Any:
            requests.append(request)
            if len(requests) == 1:
                raise redis.exceptions.ConnectionError("dropped before the reply")
            return real_call(request)

        monkeypatch.setattr(fast, "call", dropped_once)
        with caplog.at_level(logging.INFO):
            store.release("r", "me")
        assert len(requests) == 2 and requests[0] == requests[1]
        assert "retrying release 'r' once" in caplog.text
        assert store.get("r") is None
