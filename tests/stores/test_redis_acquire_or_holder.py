"""``RedisLockStore.acquire_or_holder``: a refusal names the holder exactly, on both paths.

Owners in any encoding a client uses, odd owners, the fast connection and redis-py's pool, races,
server errors, ``WAIT`` answering 0 (min_replicas), NOSCRIPT and deferred replies read first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.backoff
import redis.retry

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores.redis import RedisLockStore
from tests.fixtures_redis import RedisServer

LONG_MS = 60_000

pytestmark = pytest.mark.redis


@contextlib.contextmanager
def _through_the_pool(store: RedisLockStore) -> Iterator[None]:
    fast = store._fast
    assert fast is not None
    assert fast._lock.acquire(blocking=False)
    try:
        yield
    finally:
        fast._lock.release()


def _client(server: RedisServer, **kwargs: Any) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=server.port,
        socket_timeout=5.0,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        **kwargs,
    )


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def protocol(request: pytest.FixtureRequest) -> int:
    return int(request.param)


class TestEncodings:
    @pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
    @pytest.mark.parametrize("owner", ["é", "Ã©", "!é"])
    def test_latin1_client_names_the_holder_exactly(
        self, redis_server: RedisServer, redis_url: str, protocol: int, decode: bool, owner: str
    ) -> None:
        """A client with encoding='latin-1': the holder comes back as it was given (the store
        encodes owners with the client's encoding, so it must decode them with it too)."""
        client = _client(
            redis_server, protocol=protocol, encoding="latin-1", decode_responses=decode
        )
        store = RedisLockStore(client)
        try:
            assert store.acquire("k", owner, LONG_MS) is not None
            assert store.acquire_or_holder("k", "b", LONG_MS) == (None, owner)  # fast path
            with _through_the_pool(store):
                assert store.acquire_or_holder("k", "b", LONG_MS) == (None, owner)
        finally:
            client.close()

    @pytest.mark.parametrize("owner", ["é", "Ã©"])
    def test_latin1_decode_responses_fast_and_pool_paths_agree(
        self, redis_server: RedisServer, redis_url: str, owner: str
    ) -> None:
        """decode_responses=True, latin-1: the pool path (redis-py decodes) is right; the fast
        path must give the same answer, whichever path a contended call takes."""
        client = _client(redis_server, encoding="latin-1", decode_responses=True)
        store = RedisLockStore(client)
        try:
            assert store.acquire("k", owner, LONG_MS) is not None
            with _through_the_pool(store):
                pooled = store.acquire_or_holder("k", "b", LONG_MS)
            assert pooled == (None, owner)
            assert store.acquire_or_holder("k", "b", LONG_MS) == pooled
        finally:
            client.close()


class TestReplies:
    @pytest.mark.parametrize("owner", ["", "!", "!!", "0", "-1", "1e3", " 7", "a\r\nb", "\x00"])
    def test_odd_owners_round_trip_on_both_paths(
        self, redis_server: RedisServer, redis_url: str, protocol: int, owner: str
    ) -> None:
        client = _client(redis_server, protocol=protocol)
        store = RedisLockStore(client)
        try:
            token = store.acquire("k", owner, LONG_MS)
            assert token is not None
            assert store.acquire_or_holder("k", "b", LONG_MS) == (None, owner)
            with _through_the_pool(store):
                assert store.acquire_or_holder("k", "b", LONG_MS) == (None, owner)
            assert store.acquire_or_holder("k", owner, LONG_MS) == (token, None)
        finally:
            client.close()

    def test_a_lease_hash_without_owner_is_taken_like_acquire(
        self, redis_url: str, redis_client: redis.Redis
    ) -> None:
        store = RedisLockStore(redis_url)
        try:
            redis_client.hset(store.lease_key("k"), "token", "5")
            token, holder = store.acquire_or_holder("k", "a", LONG_MS)
            assert holder is None and token is not None and token > 5
            assert store.get("k").owner == "a"  # type: ignore[union-attr]
        finally:
            store.close()

    def test_deferred_release_is_read_first(self, redis_url: str) -> None:
        """A deferred release on the fast connection, then acquire_or_holder: the release's
        reply is consumed first, and the key it freed is taken."""
        store = RedisLockStore(redis_url)
        other = RedisLockStore(redis_url)
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            assert other.acquire_or_holder("k", "b", LONG_MS) == (None, "a")
            store.release_deferred("k", "a")
            token, holder = store.acquire_or_holder("k", "c", LONG_MS)
            assert holder is None and token is not None
            assert store.acquire_or_holder("k", "d", LONG_MS) == (None, "c")
        finally:
            store.close()
            other.close()


class TestRaces:
    def test_fifty_threads_one_winner_all_others_name_it(self, redis_url: str) -> None:
        store = RedisLockStore(redis_url)
        barrier = threading.Barrier(50)
        results: list[tuple[str, tuple[int | None, str | None]]] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            barrier.wait()
            got = store.acquire_or_holder("k", f"o{i}", LONG_MS)
            with lock:
                results.append((f"o{i}", got))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.close()
        winners = [o for o, (tok, _) in results if tok is not None]
        assert len(winners) == 1
        assert all(h == winners[0] for _, (tok, h) in results if tok is None)


class TestErrors:
    def test_a_server_error_is_store_unavailable(
        self, redis_url: str, redis_client: redis.Redis
    ) -> None:
        """WRONGTYPE on the lease key: StoreUnavailableError, never a value."""
        store = RedisLockStore(redis_url)
        try:
            redis_client.set(store.lease_key("k"), "x")
            with pytest.raises(StoreUnavailableError):
                store.acquire_or_holder("k", "a", LONG_MS)
        finally:
            store.close()


class TestUnconfirmed:
    """min_replicas=1 on a server without replicas: WAIT always answers 0."""

    @pytest.mark.parametrize("holder", ["h", "!h", "12345", "!"])
    def test_a_refusal_is_not_taken_for_an_unconfirmed_take(
        self, redis_server: RedisServer, redis_url: str, holder: str
    ) -> None:
        plain = RedisLockStore(redis_url)
        waiting = RedisLockStore(_client(redis_server), min_replicas=1, replica_timeout="10ms")
        try:
            token = plain.acquire("k", holder, LONG_MS)
            assert token is not None
            assert waiting.acquire_or_holder("k", "b", LONG_MS) == (None, holder)
            info = plain.get("k")
            assert info is not None and (info.owner, info.token) == (holder, token)
            plain.release("k", holder)
            with pytest.raises(StoreUnavailableError, match="not confirmed"):
                waiting.acquire_or_holder("k", "b", LONG_MS)
            assert plain.get("k") is None  # its own unconfirmed lease was given up
            nxt, _ = plain.acquire_or_holder("k", "c", LONG_MS)
            assert nxt is not None and nxt > token
        finally:
            plain.close()
            waiting.client.close()


class TestNoScriptAndDeferred:
    def test_noscript_on_the_pool_path(
        self, redis_server: RedisServer, redis_url: str, redis_client: redis.Redis, protocol: int
    ) -> None:
        client = _client(redis_server, protocol=protocol)
        store = RedisLockStore(client)
        try:
            assert store.acquire("k", "h", LONG_MS) is not None
            redis_client.script_flush()
            with _through_the_pool(store):
                assert store.acquire_or_holder("k", "b", LONG_MS) == (None, "h")
                redis_client.script_flush()
                store.release("k", "h")
                redis_client.script_flush()
                token, holder = store.acquire_or_holder("k", "b", LONG_MS)
            assert holder is None and token is not None
        finally:
            client.close()

    def test_deferred_renew_then_refusal_in_order(self, redis_url: str) -> None:
        store = RedisLockStore(redis_url)
        try:
            assert store.acquire("k", "a", LONG_MS) is not None
            assert store.acquire("j", "x", LONG_MS) is not None
            store.renew_deferred("j", "x", LONG_MS)
            store.release_deferred("j", "x")
            assert store.acquire_or_holder("k", "b", LONG_MS) == (None, "a")
            assert store.acquire_or_holder("j", "y", LONG_MS)[1] is None
        finally:
            store.close()
