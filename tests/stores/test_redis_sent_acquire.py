"""The Redis store's sent acquire (``send_acquire``): sent now on the fast path, its reply read
later, answered exactly as ``acquire`` answers; a reply another call reads first is kept. Real
throwaway servers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_lease import RestartGraceError, StoreUnavailableError
from celery_lease.stores.base import SupportsSentAcquire
from celery_lease.stores.redis import RedisLockStore
from tests.stores.redis_helpers import CLIENT_ID, command_calls, holder

pytestmark = pytest.mark.redis

TTL_MS = 30_000
DEADLINE = 10.0  # seconds a test waits for another thread before it fails


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisLockStore]:
    made = RedisLockStore(redis_url)
    yield made
    made.close()


class TestSentAcquire:
    def test_the_redis_store_offers_it(self, store: RedisLockStore) -> None:
        assert isinstance(store, SupportsSentAcquire)

    def test_it_takes_the_key_with_one_evalsha(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """The acquire runs when sent; the read gives its token; one EVALSHA, as ``acquire``."""
        assert store.acquire("s:1-warm", "me", TTL_MS) is not None  # the script is loaded
        before = command_calls(redis_client, "evalsha")
        read = store.send_acquire("s:1", "me", TTL_MS)
        assert read is not None
        token = read()
        assert isinstance(token, int)
        assert holder(redis_client, store, "s:1") == b"me"
        assert command_calls(redis_client, "evalsha") - before == 1
        assert store.last_token("s:1") == token

    def test_a_held_key_reads_none(self, store: RedisLockStore) -> None:
        assert store.acquire("s:2", "holder", TTL_MS) is not None
        read = store.send_acquire("s:2", "me", TTL_MS)
        assert read is not None
        assert read() is None

    def test_another_call_first_keeps_the_reply(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A call made before the read reads the sent reply first and keeps it; each call gets
        its own answer."""
        read = store.send_acquire("s:3", "me", TTL_MS)
        assert read is not None
        assert store.renew("s:3-other", "me", TTL_MS) is False
        assert store.acquire("s:3b", "me", TTL_MS) is not None
        token = read()
        assert token is not None
        assert holder(redis_client, store, "s:3") == b"me"

    def test_a_deferred_release_before_it_runs_first(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """The previous holder's unanswered release, then the next owner's sent acquire, on one
        connection: the release has run when the acquire runs."""
        first = store.acquire("s:4", "first", TTL_MS)
        assert first is not None
        assert store.release_deferred("s:4", "first")
        read = store.send_acquire("s:4", "next", TTL_MS)
        assert read is not None
        token = read()
        assert token is not None and token > first
        assert holder(redis_client, store, "s:4") == b"next"

    def test_a_flushed_script_cache_is_asked_again(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """NOSCRIPT: nothing ran; the read asks again (with the source) and gets the key."""
        assert store.acquire("s:5-warm", "me", TTL_MS) is not None
        redis_client.script_flush()
        read = store.send_acquire("s:5", "me", TTL_MS)
        assert read is not None
        assert read() is not None
        assert holder(redis_client, store, "s:5") == b"me"

    def test_a_connection_lost_before_the_reply_is_asked_again_once(
        self, store: RedisLockStore, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The connection dies after the send: the read asks again on a new connection, as
        ``acquire`` retries once (the same owner gets its own lease back)."""
        fast = store._fast
        assert fast is not None
        fast_id = fast.call(CLIENT_ID)
        read = store.send_acquire("s:6", "me", TTL_MS)
        assert read is not None
        redis_client.client_kill_filter(_id=fast_id)
        with caplog.at_level(logging.INFO):
            token = read()
        assert token is not None
        assert holder(redis_client, store, "s:6") == b"me"
        assert store.last_token("s:6") == token

    def test_a_dropped_connection_with_the_reply_unread_is_asked_again(
        self, store: RedisLockStore, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The connection is dropped with the reply unread (an exchange cut short): the
        outcome is unknown, the read asks again once (logged as a retry) and holds the key."""
        fast = store._fast
        assert fast is not None
        read = store.send_acquire("s:6b", "me", TTL_MS)
        assert read is not None
        fast._pending = True  # as an exchange cut short by an interrupt leaves it
        with caplog.at_level(logging.INFO):
            token = read()
        assert token is not None
        assert "retrying acquire 's:6b' once" in caplog.text
        assert holder(redis_client, store, "s:6b") == b"me"

    def test_a_reply_another_thread_is_handing_over_is_waited_for(
        self,
        store: RedisLockStore,
        redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Another thread has read the reply and is handing it over when the read starts (no
        reply left unread): the read waits for it, and asks nothing again."""
        fast = store._fast
        assert fast is not None
        assert store.acquire("s:6c-warm", "me", TTL_MS) is not None
        handing, read_waits = threading.Event(), threading.Event()
        waited: list[bool] = []
        send_deferred, flush = fast.send_deferred, fast.flush

        def send_slowly_handed(request: bytes, on_reply: Callable[[Any], None]) -> bool:
            def hand(reply: Any) -> None:
                handing.set()
                waited.append(read_waits.wait(DEADLINE))
                on_reply(reply)

            return send_deferred(request, hand)

        def flush_seen(*, wait: bool = False) -> None:
            if wait:
                read_waits.set()
            flush(wait=wait)

        monkeypatch.setattr(fast, "send_deferred", send_slowly_handed)
        monkeypatch.setattr(fast, "flush", flush_seen)
        before = command_calls(redis_client, "evalsha")
        read = store.send_acquire("s:6c", "me", TTL_MS)
        assert read is not None
        reader = threading.Thread(target=flush)
        reader.start()
        assert handing.wait(DEADLINE)
        token = read()
        reader.join(DEADLINE)
        assert not reader.is_alive()
        assert waited == [True]
        assert token is not None and store.last_token("s:6c") == token
        assert command_calls(redis_client, "evalsha") - before == 1

    def test_a_reply_that_never_comes_to_this_process_is_asked_again(
        self, store: RedisLockStore, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
    ) -> None:
        """As in a forked child: the parent's unread replies are forgotten and the connection is
        the parent's. The read hears no reply, asks again once (logged as a retry) on a
        connection of its own, and holds the key; never a refusal read from nothing."""
        fast = store._fast
        assert fast is not None
        read = store.send_acquire("s:6d", "me", TTL_MS)
        assert read is not None
        fast._pid = -1  # another process's connection
        fast._unread = []  # as the at-fork hook leaves a child's
        with caplog.at_level(logging.INFO):
            token = read()
        assert token is not None
        assert "retrying acquire 's:6d' once" in caplog.text
        assert holder(redis_client, store, "s:6d") == b"me"

    def test_a_store_error_raises_as_acquire_raises(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A lease key of another type: ``StoreUnavailableError`` naming the key."""
        redis_client.set(store.lease_key("s:7"), "not a hash")
        with pytest.raises(StoreUnavailableError, match="s:7") as direct:
            store.acquire("s:7", "me", TTL_MS)
        read = store.send_acquire("s:7", "me", TTL_MS)
        assert read is not None
        with pytest.raises(StoreUnavailableError, match="s:7") as sent:
            read()
        assert str(sent.value) == str(direct.value)

    def test_a_restart_grace_refusal_raises_as_acquire_raises(self, redis_url: str) -> None:
        """A server without its marker, in a store's restart grace: ``RestartGraceError``. The
        grace (a day) outlasts the session's server, however long the run before this test."""
        graced = RedisLockStore(redis_url, restart_grace=86_400)
        try:
            with pytest.raises(RestartGraceError):
                graced.acquire("s:8", "me", TTL_MS)
            read = graced.send_acquire("s:8", "me", TTL_MS)
            assert read is not None
            with pytest.raises(RestartGraceError):
                read()
        finally:
            graced.close()

    def test_a_busy_connection_sends_nothing(self, store: RedisLockStore) -> None:
        fast = store._fast
        assert fast is not None
        with fast._lock:
            assert store.send_acquire("s:9", "me", TTL_MS) is None

    def test_without_the_fast_path_nothing_is_sent(self, store: RedisLockStore) -> None:
        store._fast = None
        assert store.send_acquire("s:10", "me", TTL_MS) is None
