"""Review of the deferred release on the Redis fast path: each test failed before its fix.

Real throwaway servers (``redis_url``); an asynchronous exception (SoftTimeLimitExceeded, our
interrupt, Ctrl-C) landing at a chosen bytecode is stood in for by a ``KeyboardInterrupt``
raised from a wrapped list or socket at exactly that point. No sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_lease.stores.redis import RedisLockStore
from tests.stores.test_redis_deferred import _CLIENT_ID, TTL_MS, _fast, _holder

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisLockStore]:
    made = RedisLockStore(redis_url)
    yield made
    made.close()


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
    def test_an_interrupt_before_the_append_never_hands_the_release_reply_to_the_next_call(
        self, store: RedisLockStore, other: RedisLockStore
    ) -> None:
        assert store.acquire("v:mine", "me", TTL_MS) is not None
        assert other.acquire("v:theirs", "them", TTL_MS) is not None
        fast = _fast(store)
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
        fast = _fast(store)
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
    def test_a_connection_closed_during_the_body_still_frees_the_key(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert store.acquire("x:1", "me", TTL_MS) is not None
        fast_id = _fast(store).call(_CLIENT_ID)
        # The body runs long; renewals go through renew_many (redis-py's pool), so the fast
        # connection sits idle and the server closes it (``timeout``), as CLIENT KILL does.
        redis_client.client_kill_filter(_id=fast_id)
        if not store.release_deferred("x:1", "me"):  # what _LeaseContext._release does
            store.release("x:1", "me")
        store.flush_deferred()
        # store.release() here frees the key (the fast path reconnects and sends again).
        assert _holder(redis_client, store, "x:1") is None

    def test_control_the_waited_release_recovers_from_the_same_closed_connection(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert store.acquire("x:2", "me", TTL_MS) is not None
        fast_id = _fast(store).call(_CLIENT_ID)
        redis_client.client_kill_filter(_id=fast_id)
        store.release("x:2", "me")
        assert _holder(redis_client, store, "x:2") is None
