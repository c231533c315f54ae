"""The fast path's direct fd I/O (``os.write`` / ``os.read`` on the socket's fd) fails as the
socket methods it replaces fail: partial replies, EOF, refused writes, a socket closed under it.

The byte-level wrappers in test_redis_fast.py replace ``_sock``, which turns the direct path
off: these tests drive the direct path itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_lease.stores.redis import RedisLockStore
from tests.stores.contract import DEADLINE, LONG_MS
from tests.stores.redis_helpers import CLIENT_ID, HELLO_REPLY, FakeRedisServer, fast_connection

pytestmark = pytest.mark.redis


class _ScriptedRedis(FakeRedisServer):
    """A RESP3 server answering redis-py's handshake; each EVAL/EVALSHA is handed to
    ``script(conn, command)``, which writes (or withholds) the reply itself."""

    def __init__(self, script: Callable[[socket.socket, list[bytes]], None]) -> None:
        self._script = script
        super().__init__()

    def answer(self, conn: socket.socket, state: dict[str, Any], command: list[bytes]) -> None:
        name = command[0].upper()
        if name == b"HELLO":
            conn.sendall(HELLO_REPLY)
        elif name in (b"EVALSHA", b"EVAL"):
            self._script(conn, command)
        else:
            conn.sendall(b"+OK\r\n")


@pytest.fixture
def scripted() -> Iterator[Callable[..., _ScriptedRedis]]:
    """Starts a :class:`_ScriptedRedis` per call; all closed after the test."""
    with contextlib.ExitStack() as started:
        yield lambda script: started.enter_context(contextlib.closing(_ScriptedRedis(script)))


class TestDirectReads:
    def test_a_deferred_reply_arriving_in_halves_is_read_whole(
        self, scripted: Callable[..., _ScriptedRedis]
    ) -> None:
        rest = threading.Event()

        def script(conn: socket.socket, command: list[bytes]) -> None:
            conn.sendall(b"$10\r\n12345")
            assert rest.wait(DEADLINE)
            conn.sendall(b"67890\r\n")

        server = scripted(script)
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/0?socket_timeout=5")
        fast = fast_connection(store)
        assert fast.call(CLIENT_ID) == b"OK"  # opens the connection
        got: list[Any] = []
        assert fast.send_deferred(b"*1\r\n$4\r\nEVAL\r\n", got.append)
        direct_read = fast._direct_read
        assert direct_read is not None, "this connection must read its fd directly"

        def read_then_send_the_rest() -> bytes:
            try:
                return direct_read()
            finally:
                rest.set()  # the second half is sent only after a direct read was tried

        fast._direct_read = read_then_send_the_rest
        flusher = threading.Thread(target=fast.flush)
        flusher.start()
        flusher.join(DEADLINE)
        assert not flusher.is_alive()
        assert got == [b"1234567890"]
        assert not fast._pending and not fast._buf
        store.close()

    def test_a_deferred_reply_cut_by_eof_is_reported_unanswered_and_the_next_call_reconnects(
        self, scripted: Callable[..., _ScriptedRedis]
    ) -> None:
        calls = [0]

        def script(conn: socket.socket, command: list[bytes]) -> None:
            calls[0] += 1
            if calls[0] == 1:
                conn.sendall(b"$10\r\n12345")
                conn.shutdown(socket.SHUT_RDWR)
                raise OSError("closed on purpose")
            conn.sendall(b":7\r\n")

        server = scripted(script)
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/0?socket_timeout=5")
        fast = fast_connection(store)
        assert fast.call(CLIENT_ID) == b"OK"
        got: list[Any] = []
        assert fast.send_deferred(b"*1\r\n$4\r\nEVAL\r\n", got.append)
        fast.flush()
        assert len(got) == 1 and isinstance(got[0], RedisConnectionError)
        assert fast.call(b"*1\r\n$4\r\nEVAL\r\n") == 7
        store.close()


class TestDirectWrites:
    @pytest.fixture
    def write_shut(self, redis_url: str) -> Iterator[tuple[RedisLockStore, socket.socket]]:
        """A store holding "k" for "a", its fast connection's write side shut (EPIPE from
        os.write); with that socket."""
        store = RedisLockStore(f"{redis_url}?socket_timeout=5")
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            old = fast_connection(store)._sock
            assert old is not None
            old.shutdown(socket.SHUT_WR)
            yield store, old
        finally:
            store.close()

    def test_a_refused_write_reports_a_deferred_release_unanswered(
        self, write_shut: tuple[RedisLockStore, socket.socket]
    ) -> None:
        """The request may have run, the caller hears a ConnectionError, the next call runs on
        a new connection."""
        store, old = write_shut
        fast = fast_connection(store)
        got: list[Any] = []
        assert fast.send_deferred(b"*1\r\n$4\r\nPING\r\n", got.append) is True
        assert len(got) == 1 and isinstance(got[0], RedisConnectionError)
        assert store.acquire("k2", "a", LONG_MS) is not None
        assert fast._sock is not old

    def test_a_refused_write_in_a_call_is_retried_on_a_new_connection(
        self, write_shut: tuple[RedisLockStore, socket.socket]
    ) -> None:
        store, old = write_shut
        assert store.acquire("k", "b", LONG_MS) is None  # held by a: the script ran
        assert fast_connection(store)._sock is not old


class TestSocketState:
    def test_a_write_after_the_socket_was_closed_does_not_reach_a_socket_reusing_its_fd(
        self, scripted: Callable[..., _ScriptedRedis]
    ) -> None:
        """``sendall`` on a closed socket raises EBADF; the direct write must too, never write
        to the socket the kernel gave the closed number next (here: a socketpair end)."""
        server = scripted(lambda conn, command: conn.sendall(b":1\r\n"))
        store = RedisLockStore(f"redis://127.0.0.1:{server.port}/0?socket_timeout=5")
        fast = fast_connection(store)
        assert fast.call(CLIENT_ID) == b"OK"
        sock = fast._sock
        assert sock is not None
        foreign, peer = socket.socketpair()
        # The socket object closed under the fast connection (not by _drop), its fd number
        # at once given to another socket: detach() leaves the number open and dup2() swaps
        # what it refers to in one step, so no other thread can take the number in between.
        fd = sock.detach()
        os.dup2(foreign.fileno(), fd)
        with foreign, peer, contextlib.closing(socket.socket(fileno=fd)):
            got: list[Any] = []
            fast.send_deferred(b"*1\r\n$4\r\nEVAL\r\n", got.append)
            peer.setblocking(False)
            leaked = b""
            with contextlib.suppress(BlockingIOError):
                leaked = peer.recv(100)
            assert leaked == b"", f"a request went to a foreign socket: {leaked!r}"
            assert len(got) == 1 and isinstance(got[0], RedisConnectionError)
        store.close()
