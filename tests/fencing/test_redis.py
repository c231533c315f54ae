"""Redis fenced SET / HSET against a throwaway redis-server (never the shared one on 6379)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from celery_lease import LeaseConfigError, SQLiteLockStore, lease
from celery_lease.fencing import StaleTokenError
from celery_lease.fencing.redis import fenced_hset, fenced_set
from tests.fencing.conftest import JOIN_TIMEOUT, in_thread, takeover
from tests.fixtures_redis import RedisServer

pytestmark = pytest.mark.redis


class TestTakeover:
    def test_fenced_set_refuses_the_old_holders_late_write(
        self, redis_client: redis.Redis, lease_store: SQLiteLockStore
    ) -> None:
        """SET: the new holder's value stays, the old write raises with .current = new token."""

        def write(who: str) -> None:
            fenced_set(redis_client, "prices", f"by {who}")

        story = takeover(lease_store, "prices", write)
        assert story.old_error is not None
        assert (story.old_error.key, story.old_error.token, story.old_error.current) == (
            "prices",
            story.old_token,
            story.new_token,
        )
        assert redis_client.get("prices") == b"by new"
        assert redis_client.get("prices:fence") == str(story.new_token).encode()

    def test_fenced_hset_refuses_the_old_holders_late_write(
        self, redis_client: redis.Redis, lease_store: SQLiteLockStore
    ) -> None:
        """HSET: the same, with the fence kept in a field of the hash."""

        def write(who: str) -> None:
            fenced_hset(redis_client, "account:1", {"balance": 150 if who == "new" else 90})

        story = takeover(lease_store, "account:1", write)
        assert story.old_error is not None and story.old_error.current == story.new_token
        assert redis_client.hgetall("account:1") == {
            b"balance": b"150",
            b"fence": str(story.new_token).encode(),
        }


class TestRule:
    @pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
    def test_equal_token_is_accepted_and_lower_refused(
        self, redis_server: RedisServer, redis_client: redis.Redis, decode: bool
    ) -> None:
        """The same token writes again; a lower one is refused; replies decoded or not."""
        client = redis_server.client(decode_responses=decode)
        assert fenced_set(client, "k", "a", token=7) == 7
        assert fenced_set(client, "k", "b", token=7) == 7
        assert fenced_hset(client, "h", {"x": "1"}, token=7) == 7
        assert fenced_hset(client, "h", {"x": "2", "y": 3}, token=7) == 7
        with pytest.raises(StaleTokenError) as caught:
            fenced_set(client, "k", "c", token=6)
        assert (caught.value.token, caught.value.current, caught.value.key) == (6, 7, None)
        with pytest.raises(StaleTokenError):
            fenced_hset(client, "h", {"x": "3"}, token=6)
        assert redis_client.get("k") == b"b"
        assert redis_client.hgetall("h") == {b"x": b"2", b"y": b"3", b"fence": b"7"}
        client.close()

    def test_tokens_beyond_double_precision_compare_exactly(
        self, redis_client: redis.Redis
    ) -> None:
        """2**53 + 1 against 2**53 (equal as Lua doubles) is still a newer fence."""
        big = 2**53
        fenced_set(redis_client, "k", "new", token=big + 1)
        fenced_hset(redis_client, "h", {"x": "new"}, token=big + 1)
        with pytest.raises(StaleTokenError) as caught:
            fenced_set(redis_client, "k", "old", token=big)
        assert caught.value.current == big + 1
        with pytest.raises(StaleTokenError) as caught:
            fenced_hset(redis_client, "h", {"x": "old"}, token=big)
        assert caught.value.current == big + 1
        assert redis_client.get("k") == b"new"
        assert fenced_set(redis_client, "k", "newer", token=10**20) == 10**20
        assert redis_client.get("k:fence") == b"100000000000000000000"

    def test_custom_fence_key_and_field(self, redis_client: redis.Redis) -> None:
        """fence_key= / fence_field= choose where the fence is kept; no expiry is set on it."""
        fenced_set(redis_client, "k", "v", token=3, fence_key="fences:k")
        fenced_hset(redis_client, "h", {"x": "1"}, token=3, fence_field="_token")
        assert redis_client.get("fences:k") == b"3"
        assert redis_client.hget("h", "_token") == b"3"
        assert redis_client.ttl("fences:k") == -1

    def test_a_fence_that_is_not_an_integer_is_an_error(self, redis_client: redis.Redis) -> None:
        """A corrupt fence fails the script: nothing written, never a silent success."""
        redis_client.set("k:fence", "abc")
        redis_client.hset("h", "fence", "1.5")
        with pytest.raises(redis.ResponseError, match=r"not hold an integer"):
            fenced_set(redis_client, "k", "v", token=3)
        with pytest.raises(redis.ResponseError, match=r"not hold an integer"):
            fenced_hset(redis_client, "h", {"x": "1"}, token=3)
        assert redis_client.get("k") is None and redis_client.hget("h", "x") is None

    def test_token_of_the_current_lease(
        self, redis_client: redis.Redis, lease_store: SQLiteLockStore
    ) -> None:
        """Without token=, the current lease's token is written."""
        with lease("prices", store=lease_store) as held:
            assert fenced_set(redis_client, "prices", "v") == held.token
        assert redis_client.get("prices:fence") == str(held.token).encode()


class TestFirstWrite:
    def test_racing_first_writes_leave_the_newest(self, redis_client: redis.Redis) -> None:
        """Writers with tokens 1..8 race on a missing key: the value is token 8's, and every
        refusal names a newer fence."""
        start = threading.Barrier(8)

        def writer(token: int) -> Any:
            def call() -> int:
                client = redis.Redis(connection_pool=redis_client.connection_pool)
                start.wait(JOIN_TIMEOUT)
                fenced_hset(client, "h", {"by": str(token)}, token=token)
                return fenced_set(client, "k", str(token), token=token)

            return call

        started = [in_thread(writer(t)) for t in range(1, 9)]
        for thread, _ in started:
            thread.join(JOIN_TIMEOUT)
        for token, (_, outcome) in enumerate(started, start=1):
            assert outcome.done.is_set()
            if outcome.error is not None:
                assert isinstance(outcome.error, StaleTokenError), outcome.error
                assert outcome.error.current is not None and outcome.error.current > token
        assert started[-1][1].error is None
        assert redis_client.get("k") == b"8" and redis_client.get("k:fence") == b"8"
        assert redis_client.hgetall("h") == {b"by": b"8", b"fence": b"8"}


class TestCluster:
    def test_hash_tagged_key_works_on_a_cluster(self, redis_cluster_url: str) -> None:
        """On Redis Cluster the default fence key shares the hash-tagged key's slot."""
        cluster = redis.RedisCluster.from_url(redis_cluster_url)
        try:
            fenced_set(cluster, "{prices}:today", "v", token=4)
            with pytest.raises(StaleTokenError):
                fenced_set(cluster, "{prices}:today", "w", token=3)
            assert cluster.get("{prices}:today") == b"v"
        finally:
            cluster.close()


class TestBadInput:
    """Wrong input fails at call time, before any command, naming the parameter."""

    def test_no_lease_and_no_token(self, redis_client: redis.Redis) -> None:
        """Outside any lease and without token=: LeaseConfigError naming token=."""
        with pytest.raises(LeaseConfigError, match=r"token=None"):
            fenced_set(redis_client, "k", "v")
        with pytest.raises(LeaseConfigError, match=r"token=None"):
            fenced_hset(redis_client, "h", {"x": "1"})
        assert redis_client.keys("*") == []

    @pytest.mark.parametrize(
        ("call", "names"),
        [
            (lambda c: fenced_set(c, "", "v", token=1), r"name=''"),
            (lambda c: fenced_set(c, "k", None, token=1), r"value=None"),
            (lambda c: fenced_set(c, "k", "v", token=1, fence_key="k"), r"fence_key='k'"),
            (lambda c: fenced_set(c, "k", "v", token=1.5), r"token=1.5"),
            (lambda c: fenced_hset(c, "h", {}, token=1), r"mapping=\{\}"),
            (lambda c: fenced_hset(c, "h", {"fence": "1"}, token=1), r"fence field 'fence'"),
            (lambda c: fenced_hset(c, "h", {"x": True}, token=1), r"mapping\['x'\]=True"),
            (lambda c: fenced_hset(c, "h", {"x": "1"}, token=1, fence_field=""), "fence_field"),
        ],
    )
    def test_bad_arguments(self, redis_client: redis.Redis, call: Any, names: str) -> None:
        """Empty names, bad values, the fence in the mapping, a non-int token."""
        with pytest.raises(LeaseConfigError, match=names):
            call(redis_client)
        assert redis_client.keys("*") == []
