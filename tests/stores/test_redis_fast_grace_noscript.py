"""The Redis store's fast path with a restart grace set (the acquire scripts take the marker
key and the grace: another request head) after the server's script cache was flushed: acquire,
acquire_or_holder, a sent acquire and a release each fall back to EVAL with the source once and
write what they write with a warm cache; a slot's release (built the general way) too. Real
throwaway servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import redis.cluster

from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.slots import slot_key
from tests.stores.redis_helpers import command_calls, holder

pytestmark = pytest.mark.redis

TTL_MS = 30_000
GRACE = 0.001  # seconds: on, yet long over for a server started before the test


@pytest.fixture(params=["utf-8", "latin-1"])
def graced(redis_url: str, request: pytest.FixtureRequest) -> Iterator[RedisLockStore]:
    made = RedisLockStore(f"{redis_url}?encoding={request.param}", restart_grace=GRACE)
    assert made._fast is not None, "this store must take the fast path"
    yield made
    made.close()


class TestFlushedScriptsWithAGrace:
    def test_acquire_after_a_flush_evaluates_the_source_once_and_takes_the_key(
        self, graced: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert graced.acquire("g:warm", "me", TTL_MS) is not None  # the marker is written
        redis_client.script_flush()
        evals = command_calls(redis_client, "eval")
        token = graced.acquire("g:é1", "me", TTL_MS)
        assert token is not None
        assert holder(graced.client, graced, "g:é1") == b"me"
        assert command_calls(redis_client, "eval") - evals == 1
        assert graced.acquire_or_holder("g:é1", "you", TTL_MS) == (None, "me")

    def test_a_sent_acquire_after_a_flush_takes_the_key(
        self, graced: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert graced.acquire("g:warm", "me", TTL_MS) is not None
        redis_client.script_flush()
        read = graced.send_acquire("g:é2", "me", TTL_MS)
        assert read is not None
        token = read()
        assert token is not None and graced.last_token("g:é2") == token
        assert holder(graced.client, graced, "g:é2") == b"me"
        assert graced.acquire("g:é2", "you", TTL_MS) is None

    def test_a_release_after_a_flush_frees_only_its_owners_key(
        self, graced: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        assert graced.acquire("g:é3", "me", TTL_MS) is not None
        redis_client.script_flush()
        graced.release("g:é3", "you")  # not the holder: nothing freed
        assert holder(graced.client, graced, "g:é3") == b"me"
        graced.release("g:é3", "me")
        assert holder(graced.client, graced, "g:é3") is None
        assert graced.client.lpop(graced.signal_key("g:é3")) is not None

    def test_a_slots_release_after_a_flush_frees_it(
        self, graced: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        taken = graced.acquire_slot("g:s", "me", TTL_MS, 2)
        assert taken is not None
        slot = slot_key("g:s", taken[0])
        redis_client.script_flush()
        graced.release(slot, "me")
        assert graced.acquire_slot("g:s", "you", TTL_MS, 1) is not None
