"""The Redis store's deferred release and the fast path's short poll before a blocking read.

``release_deferred`` sends a release without reading its reply; the reply must be read, in order,
before the reply of the next request on the connection (so it can never be taken for that
request's answer), by ``flush_deferred``, or be reported lost when the connection goes. The
poll (``SPIN_SECONDS``) must never change what is read, only when. Real throwaway servers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_lease.stores import _redis_fast
from celery_lease.stores._redis_fast import _poller
from celery_lease.stores.base import SupportsDeferredRelease
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import RedisServer
from tests.stores.redis_helpers import CLIENT_ID, fast_connection

pytestmark = pytest.mark.redis

TTL_MS = 30_000


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisLockStore]:
    made = RedisLockStore(redis_url)
    yield made
    made.close()


def _holder(client: redis.Redis, store: RedisLockStore, key: str) -> bytes | None:
    value = client.hget(store.lease_key(key), "owner")
    return value if value is None else bytes(value)


class TestDeferredRelease:
    def test_the_redis_store_offers_it(self, store: RedisLockStore) -> None:
        """The standalone Redis store conforms to SupportsDeferredRelease."""
        assert isinstance(store, SupportsDeferredRelease)

    def test_the_next_call_reads_the_release_reply_first(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A deferred release's reply is consumed before the next call's own reply: the next
        acquire gets a token, not the release's ``1``, and the key was freed by the server."""
        token = store.acquire("d:1", "me", TTL_MS)
        assert token is not None
        assert store.release_deferred("d:1", "me") is True
        assert fast_connection(store)._unread, "the reply must still be unread"
        again = store.acquire("d:1", "other", TTL_MS)
        assert again is not None and again > token
        assert not fast_connection(store)._unread
        assert _holder(redis_client, store, "d:1") == b"other"

    def test_flush_reads_it_and_the_key_is_free(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """After flush_deferred the reply was read: the server has freed the key."""
        assert store.acquire("d:2", "me", TTL_MS) is not None
        assert store.release_deferred("d:2", "me")
        store.flush_deferred()
        assert not fast_connection(store)._unread
        assert _holder(redis_client, store, "d:2") is None

    def test_it_is_owner_checked(self, store: RedisLockStore, redis_client: redis.Redis) -> None:
        """A deferred release by another owner frees nothing."""
        assert store.acquire("d:3", "holder", TTL_MS) is not None
        assert store.release_deferred("d:3", "intruder")
        store.flush_deferred()
        assert _holder(redis_client, store, "d:3") == b"holder"

    def test_many_deferred_replies_stay_in_order(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """Several deferred releases, then calls: each call still gets its own reply."""
        for i in range(5):
            assert store.acquire(f"d:m{i}", "me", TTL_MS) is not None
        for i in range(5):
            assert store.release_deferred(f"d:m{i}", "me")
        assert len(fast_connection(store)._unread) == 5
        assert store.renew("d:m0", "me", TTL_MS) is False  # released: the reply is renew's own
        assert store.acquire("d:m1", "new", TTL_MS) is not None
        assert all(_holder(redis_client, store, f"d:m{i}") is None for i in (0, 2, 3, 4))

    def test_a_flushed_script_cache_still_frees_the_key_before_the_next_call(
        self, store: RedisLockStore, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With the server's scripts flushed, a deferred release still runs in its turn: the
        acquire pipelined right behind it finds the key free (an EVALSHA would have answered
        NOSCRIPT after that acquire had already run against the still-held key)."""
        assert store.acquire("d:4", "me", TTL_MS) is not None
        redis_client.script_flush()
        with caplog.at_level(logging.WARNING):
            assert store.release_deferred("d:4", "me")
            assert store.acquire("d:4", "next", TTL_MS) is not None
        assert _holder(redis_client, store, "d:4") == b"next"
        assert "failed" not in caplog.text

    def test_a_connection_killed_before_the_reply_is_reported(
        self,
        store: RedisLockStore,
        redis_client: redis.Redis,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The connection dies after the release was sent and before its reply was read: the
        release is logged as failed (it expires within its ttl), the next call works on a new
        connection and gets its own reply."""
        assert store.acquire("d:5", "me", TTL_MS) is not None
        fast_id = fast_connection(store).call(CLIENT_ID)
        # Pause the connection's reads server-side is not possible; kill it after the send.
        assert store.release_deferred("d:5", "me")
        redis_client.client_kill_filter(_id=fast_id)
        with caplog.at_level(logging.WARNING):
            store.flush_deferred()
        # The reply may have been written before the kill (then it is read and all is well) or
        # not: either the release is applied, or it is reported. Never silently lost.
        if _holder(redis_client, store, "d:5") is not None:
            assert "release 'd:5' got no reply" in caplog.text
        assert store.acquire("d:6", "me", TTL_MS) is not None

    def test_a_dropped_connection_releases_again(
        self, store: RedisLockStore, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A connection dropped with a release's reply unread (an interrupt cut an exchange
        short, so the next call starts afresh): the outcome is unknown, so the release is sent
        again the usual way (owner-checked): the key ends free, nothing is left to its ttl."""
        assert store.acquire("d:7", "me", TTL_MS) is not None
        assert store.release_deferred("d:7", "me")
        with caplog.at_level(logging.WARNING):
            # as an exchange cut short by an interrupt leaves it:
            fast_connection(store)._pending = True
            assert store.acquire("d:7b", "me", TTL_MS) is not None
        assert _holder(redis_client, store, "d:7") is None
        assert not fast_connection(store)._unread
        assert "d:7" not in caplog.text

    def test_a_release_that_fails_twice_is_logged(
        self,
        store: RedisLockStore,
        caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """No reply, and the release sent again fails too: logged, naming the key (it expires
        within its ttl); never silent."""
        assert store.acquire("d:7e", "me", TTL_MS) is not None
        assert store.release_deferred("d:7e", "me")

        def broken(key: str, owner: str) -> None:
            raise redis.exceptions.ConnectionError("server gone")

        monkeypatch.setattr(store, "release", broken)
        with caplog.at_level(logging.WARNING):
            fast_connection(store)._pending = True
            fast_connection(store).flush()
        assert "release 'd:7e' got no reply" in caplog.text
        assert "expires within its ttl" in caplog.text

    def test_close_reads_unread_replies_first(
        self, store: RedisLockStore, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Closing the store reads the deferred replies before it drops the connection."""
        assert store.acquire("d:7c", "me", TTL_MS) is not None
        assert store.release_deferred("d:7c", "me")
        with caplog.at_level(logging.WARNING):
            store.close()
        assert _holder(redis_client, store, "d:7c") is None
        assert "d:7c" not in caplog.text

    def test_a_busy_connection_refuses_to_defer(self, store: RedisLockStore) -> None:
        """While another thread uses the fast connection, release_deferred returns False (the
        caller releases the usual way) instead of queueing behind it."""
        fast = fast_connection(store)
        assert store.acquire("d:8", "me", TTL_MS) is not None
        with fast._lock:
            result: list[bool] = []
            thread = threading.Thread(
                target=lambda: result.append(store.release_deferred("d:8", "me"))
            )
            thread.start()
            thread.join()
        assert result == [False]
        assert not fast._unread

    def test_a_forked_child_leaves_the_parents_replies_alone(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A child forked with a deferred reply unread neither reads it nor reports it: the
        parent reads it; the child's own calls work on its own connection."""
        assert store.acquire("d:9", "me", TTL_MS) is not None
        assert store.release_deferred("d:9", "me")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(60)  # a child that hangs dies instead of outliving the test
            code = 1
            try:
                ok = (
                    not fast_connection(store)._unread
                    and store.acquire("d:9c", "child", TTL_MS) is not None
                )
                code = 0 if ok else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
        os.close(write)
        status = os.read(read, 1)
        os.close(read)
        os.waitpid(pid, 0)
        assert status == b"\x00"
        assert len(fast_connection(store)._unread) == 1
        store.flush_deferred()
        assert _holder(redis_client, store, "d:9") is None


class TestPoll:
    def test_a_late_reply_is_read_by_the_blocking_read(
        self, store: RedisLockStore, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
    ) -> None:
        """A reply slower than the poll (here: a poll of 1 us against a Lua script that takes
        longer) is still read, by the blocking read after the poll gave up."""
        monkeypatch.setattr(_redis_fast, "SPIN_SECONDS", 1e-6)
        assert store.acquire("p:1", "me", TTL_MS) is not None
        assert _holder(redis_client, store, "p:1") == b"me"
        store.release("p:1", "me")
        assert _holder(redis_client, store, "p:1") is None

    def test_poll_and_no_poll_read_the_same(
        self, store: RedisLockStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The same calls give the same answers with the poll on and off."""
        answers = []
        for spin in (0.0, 0.01):
            monkeypatch.setattr(_redis_fast, "SPIN_SECONDS", spin)
            key = f"p:2:{spin}"
            answers.append(
                (
                    store.acquire(key, "me", TTL_MS) is not None,
                    store.acquire(key, "you", TTL_MS),
                    store.renew(key, "me", TTL_MS),
                    store.renew(key, "you", TTL_MS),
                )
            )
            store.release(key, "me")
        assert answers == [(True, None, True, False)] * 2

    def test_a_server_closing_during_the_poll_is_a_connection_error(
        self, redis_server_factory: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """EOF seen by the poll is a ConnectionError, as the blocking read reports it."""
        server: RedisServer = redis_server_factory()
        store = RedisLockStore(server.url)
        try:
            monkeypatch.setattr(_redis_fast, "SPIN_SECONDS", 0.5)
            fast = fast_connection(store)
            assert fast.call(b"*1\r\n$4\r\nPING\r\n") == b"PONG"
            with pytest.raises(redis.exceptions.ConnectionError):
                fast.call(b"*2\r\n$8\r\nSHUTDOWN\r\n$6\r\nNOSAVE\r\n")
        finally:
            store.close()


def _assert_polls(timeout: float | None, reply: bytes) -> None:
    """A plain socket with ``timeout`` gets a poll: nothing to read yet, then ``reply``."""
    a, b = socket.socketpair()
    try:
        a.settimeout(timeout)
        poll = _poller(a)
        assert poll is not None
        with pytest.raises(BlockingIOError):
            poll()
        b.sendall(reply)
        assert poll() == reply
    finally:
        a.close()
        b.close()


class TestPoller:
    def test_plain_sockets_with_a_timeout_poll_their_fd(self) -> None:
        _assert_polls(5, b"+OK\r\n")

    def test_blocking_sockets_poll_without_waiting(self) -> None:
        _assert_polls(None, b":1\r\n")

    def test_tls_sockets_never_poll_the_fd(self) -> None:
        """Bytes on a TLS socket's fd are records, not replies: no poll."""
        raw, other = socket.socketpair()
        context = ssl.create_default_context()
        wrapped = context.wrap_socket(raw, do_handshake_on_connect=False, server_hostname="x")
        try:
            assert _poller(wrapped) is None
        finally:
            wrapped.close()
            other.close()

    def test_cooperative_sockets_never_poll(self) -> None:
        """gevent's socket (not a kernel socket object) must yield to its hub: no poll."""
        from gevent import socket as gsocket

        sock = gsocket.socket()
        try:
            assert _poller(sock) is None
        finally:
            sock.close()

    def test_one_cpu_never_polls(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """On one CPU the server cannot answer while we poll: no poll."""
        monkeypatch.setattr(_redis_fast, "_MULTI_CPU", False)
        a, b = socket.socketpair()
        try:
            a.settimeout(5)
            assert _poller(a) is None
        finally:
            a.close()
            b.close()


# An asynchronous exception, or a connection the server closed, around a deferred release --------


@pytest.fixture
def other(redis_url: str) -> Iterator[RedisLockStore]:
    """A second process's store (its own connections)."""
    made = RedisLockStore(redis_url)
    yield made
    made.close()


class _AppendInterrupted(list):  # type: ignore[type-arg]
    """``_unread`` whose next append is cut short by an asynchronous exception."""

    def append(self, item: Any) -> None:
        raise KeyboardInterrupt("async exception just before _unread.append")


class _SendThenInterrupt:
    """A socket whose ``sendall`` writes everything, then an async exception lands."""

    def __init__(self, sock: Any) -> None:
        self._real = sock

    def sendall(self, data: bytes) -> None:
        self._real.sendall(data)
        raise KeyboardInterrupt("async exception just after sendall returned")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class TestDesync:
    """An asynchronous exception (a soft time limit, our interrupt, Ctrl-C; here a
    KeyboardInterrupt raised from a wrapped list or socket) cut into a deferred release at a
    chosen point: the release's reply is never read as the answer of a later call."""

    def test_an_interrupt_before_the_append_never_hands_the_release_reply_to_the_next_call(
        self, store: RedisLockStore, other: RedisLockStore
    ) -> None:
        assert store.acquire("v:mine", "me", TTL_MS) is not None
        assert other.acquire("v:theirs", "them", TTL_MS) is not None
        fast = fast_connection(store)
        fast._unread = _AppendInterrupted()
        with pytest.raises(KeyboardInterrupt):
            store.release_deferred("v:mine", "me")
        fast._unread = []
        # "v:theirs" is held by another owner: this acquire must be refused (None). With the
        # desync it reads the release's ``1`` and believes it holds the key: two at once.
        assert store.acquire("v:theirs", "me", TTL_MS) is None

    def test_flush_never_clears_a_pending_left_by_an_interrupted_exchange(
        self, store: RedisLockStore, other: RedisLockStore
    ) -> None:
        assert store.acquire("w:a", "me", TTL_MS) is not None
        assert store.acquire("w:b", "me", TTL_MS) is not None
        assert other.acquire("w:theirs", "them", TTL_MS) is not None
        fast = fast_connection(store)
        assert store.release_deferred("w:a", "me")  # one reply unread, properly recorded
        real = fast._sock
        fast._sock = _SendThenInterrupt(real)  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            store.release_deferred("w:b", "me")  # sent; _pending stays set, as designed
        fast._sock = real
        assert fast._pending, "the cut exchange leaves the connection marked unsafe"
        store.flush_deferred()  # e.g. before_task_publish of the retry the handler sends
        # The connection still has w:b's reply in flight: the next call must not take it.
        assert store.acquire("w:theirs", "me", TTL_MS) is None


class TestLostRetry:
    """The server closed the fast connection while the body ran: the deferred release, and the
    release that waits, still free the key."""

    def test_a_connection_closed_during_the_body_still_frees_the_key(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert store.acquire("x:1", "me", TTL_MS) is not None
        fast_id = fast_connection(store).call(CLIENT_ID)
        # The body runs long; renewals go through renew_many (redis-py's pool), so the fast
        # connection sits idle and the server closes it (``timeout``), as CLIENT KILL does.
        redis_client.client_kill_filter(_id=fast_id)
        if not store.release_deferred("x:1", "me"):  # what LeaseContext.send_release does
            store.release("x:1", "me")
        store.flush_deferred()
        # store.release() here frees the key (the fast path reconnects and sends again).
        assert _holder(redis_client, store, "x:1") is None

    def test_control_the_waited_release_recovers_from_the_same_closed_connection(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert store.acquire("x:2", "me", TTL_MS) is not None
        fast_id = fast_connection(store).call(CLIENT_ID)
        redis_client.client_kill_filter(_id=fast_id)
        store.release("x:2", "me")
        assert _holder(redis_client, store, "x:2") is None
