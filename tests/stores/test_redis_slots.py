"""Slots and replace on the Redis stores (standalone, fast path and pool path, Cluster, Sentinel,
asyncio): one script per slot acquire whatever the limit, every Redis key of a key's slots in one
Cluster hash slot, and a replaced holder's lease marked, refused its renewals and still released
by its owner."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from celery_lease import lease
from celery_lease.errors import ReplicaLagError, RestartGraceError, StoreUnavailableError
from celery_lease.stores._redis_common import (
    ACQUIRE_SLOT_SCRIPT,
    RELEASE_OWNERS_SLOT,
    TOKEN_TTL_MS,
)
from celery_lease.stores.base import (
    AsyncSupportsSlots,
    SupportsReplace,
    SupportsSlots,
    conforms,
)
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.redis_async import AsyncRedisLockStore
from celery_lease.stores.slots import (
    MAX_LIMIT,
    REPLACED_MARK,
    SLOT_MARK,
    counter_key,
    marked,
    slot_key,
)
from tests.fixtures_redis import ClusterNodes, RedisServer, SentinelGroup, blocked_clients
from tests.stores.async_contract import wait_for
from tests.stores.contract import DEADLINE, LONG_MS
from tests.stores.test_redis import _CountingConnection, _reply_dropping_client, _sha, _warm
from tests.stores.test_redis_fast import _through_the_pool

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisLockStore]:
    """A RedisLockStore on the flushed throwaway server (the fast path)."""
    store = RedisLockStore(redis_url)
    yield store
    store.close()


@pytest.fixture
def counted(redis_server: RedisServer, redis_url: str) -> Iterator[RedisLockStore]:
    """A RedisLockStore through redis-py's pool whose connections count the packets they send
    (a subclassed connection class: no fast path)."""
    pool = redis.ConnectionPool(
        connection_class=_CountingConnection, host="127.0.0.1", port=redis_server.port
    )
    client = redis.Redis(connection_pool=pool)
    store = RedisLockStore(client)
    assert store._fast is None
    yield store
    client.close()


def _evalsha_calls(server: RedisServer) -> dict[str, int]:
    """The server's command counts of script calls sent by clients (the commands a script runs
    inside are counted under their own names)."""
    client = server.client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    names = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script|load", "cmdstat_script|exists")
    return {name: int(stats[name]["calls"]) for name in names if name in stats}


def _reset_stats(server: RedisServer) -> None:
    client = server.client()
    try:
        client.config_resetstat()
    finally:
        client.close()


def _holders(store: RedisLockStore, key: str) -> dict[int, str]:
    """``slot -> stored owner`` of the live slots of ``key`` (via ``list``)."""
    held: dict[int, str] = {}
    for info in store.list(key + SLOT_MARK):
        held[int(info.key.rpartition(SLOT_MARK)[2])] = info.owner
    return held


class TestConformance:
    def test_both_stores_offer_slots_and_the_sync_store_replace(self, redis_url: str) -> None:
        """The sync store conforms to SupportsSlots and SupportsReplace, the async store to
        AsyncSupportsSlots (the Celery layer checks these before it uses them)."""
        sync = RedisLockStore(redis_url)
        assert conforms(sync, SupportsSlots) and conforms(sync, SupportsReplace)
        async_store = AsyncRedisLockStore(redis_url, sync=sync)
        assert conforms(async_store, AsyncSupportsSlots)
        sync.close()


class TestOneRoundTrip:
    @pytest.mark.parametrize("limit", [1, 50])
    def test_a_slot_acquire_sends_one_script_call_whatever_the_limit(
        self, redis_server: RedisServer, counted: RedisLockStore, limit: int
    ) -> None:
        """Granted or refused, ``acquire_slot`` sends one packet holding one EVALSHA: the slots
        are read by the script on the server, not by the client."""
        assert counted.acquire_slot("warm", "w", LONG_MS, 2) is not None  # loads the script
        answers = []
        for owner in ("first", "refused"):
            if owner == "refused":  # fill the key's other slots: this call is refused
                for i in range(1, limit):
                    assert counted.acquire_slot("k", f"h{i}", LONG_MS, limit) is not None
            _CountingConnection.sends.clear()
            _reset_stats(redis_server)
            answers.append(counted.acquire_slot("k", owner, LONG_MS, limit))
            assert len(_CountingConnection.sends) == 1
            assert _CountingConnection.sends[0].count(b"EVALSHA") == 1
            assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": 1}
        assert answers[0] is not None and answers[0][0] == 0 and answers[1] is None

    @pytest.mark.parametrize("limit", [1, 50])
    def test_the_fast_path_sends_one_request(
        self, redis_server: RedisServer, store: RedisLockStore, limit: int
    ) -> None:
        """On the fast path too: one request on the store's own connection, one EVALSHA."""
        fast = store._fast
        assert fast is not None
        assert store.acquire_slot("warm", "w", LONG_MS, limit) is not None
        sent: list[bytes] = []
        call = fast.call

        def counting(request: bytes) -> Any:
            sent.append(request)
            return call(request)

        fast.call = counting  # type: ignore[method-assign]
        _reset_stats(redis_server)
        got = store.acquire_slot("k", "a", LONG_MS, limit)
        assert got is not None and got[0] == 0
        assert len(sent) == 1 and sent[0].count(b"EVALSHA") == 1
        assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": 1}

    def test_a_flushed_script_cache_is_loaded_again(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """After SCRIPT FLUSH a slot acquire and mark_replaced still work (NOSCRIPT fallback)."""
        redis_client.script_flush()
        assert store.acquire_slot("k", "a", LONG_MS, 2) is not None
        redis_client.script_flush()
        assert store.mark_replaced("other")[1:] == (None, False)


class TestReplies:
    @pytest.mark.parametrize("protocol", [2, 3])
    @pytest.mark.parametrize("decode", [False, True])
    def test_both_paths_read_slot_and_replace_replies_in_resp2_and_resp3(
        self, redis_server: RedisServer, redis_url: str, protocol: int, decode: bool
    ) -> None:
        """The fast path and redis-py's pool path read a granted slot, a refusal and the
        ``mark_replaced`` triple the same way, whatever the protocol and decoding."""
        client = redis_server.client(protocol=protocol, decode_responses=decode)
        fast = RedisLockStore(client)
        try:
            assert fast._fast is not None
            first = fast.acquire_slot("k", "a", LONG_MS, 2)
            assert first is not None and first[0] == 0
            assert fast.acquire_slot("k", "b", LONG_MS, 1) is None
            assert fast.acquire("r", "h", LONG_MS) is not None
            ticket, holder, asked = fast.mark_replaced("r")
            assert type(ticket) is int and (holder, asked) == ("h", True)
            assert fast.mark_replaced("free")[1:] == (None, False)
            with _through_the_pool(fast):
                second = fast.acquire_slot("k", "b", LONG_MS, 2)
                assert second is not None and second[0] == 1 and second[1] > first[1]
                assert fast.acquire_slot("k", "c", LONG_MS, 2) is None
                assert fast.mark_replaced("r", ticket, "h") == (ticket, "h", True)
                assert fast.mark_replaced("free")[1:] == (None, False)
        finally:
            fast.close()
            client.close()


class TestKeys:
    @pytest.mark.parametrize("key", ["k", "account:42", "a}b", "{a}", "a{b}c", "ü"])
    def test_every_redis_key_of_a_keys_slots_is_in_the_keys_hash_slot(
        self, store: RedisLockStore, redis_client: redis.Redis, key: str
    ) -> None:
        """Slot leases, the slot counter and the signal list carry the key's hash tag, so one
        script reaches them all on a Cluster; nothing else is written."""
        for i in range(3):
            assert store.acquire_slot(key, f"o{i}", LONG_MS, 3) is not None
        store.release(slot_key(key, 1), "o1")
        names = {k.decode() for k in redis_client.keys("*")}
        assert names == {
            store.lease_key(slot_key(key, 0)),
            store.lease_key(slot_key(key, 2)),
            store.slots_key(key),
            store.signal_key(key),
        }
        assert store.signal_key(slot_key(key, 1)) == store.signal_key(key)
        assert {key_slot(n.encode()) for n in names} == {key_slot(store.lease_key(key).encode())}

    def test_slot_leases_are_plain_lease_hashes_with_the_counter_beside_them(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A slot lease is ``{owner, token}`` expiring with its ttl; the counter keeps the last
        token and the width (1 + the highest slot given), expiring after TOKEN_TTL_MS idle."""
        slot, token = store.acquire_slot("k", "a", 5000, 4) or (None, None)
        assert (slot, token) == (0, store.last_token(slot_key("k", 0)))
        lease = redis_client.hgetall(store.lease_key(slot_key("k", 0)))
        assert lease == {b"owner": b"a", b"token": str(token).encode()}
        assert 0 < redis_client.pttl(store.lease_key(slot_key("k", 0))) <= 5000
        assert redis_client.hgetall(store.slots_key("k")) == {
            b"token": str(token).encode(),
            b"width": b"1",
        }
        assert TOKEN_TTL_MS - 60_000 < redis_client.pttl(store.slots_key("k")) <= TOKEN_TTL_MS
        assert store.last_token(counter_key("k")) == token

    def test_a_key_and_its_slots_are_separate(self, store: RedisLockStore) -> None:
        """A lease on the key itself neither counts against its slots nor they against it."""
        assert store.acquire("k", "plain", LONG_MS) is not None
        assert store.acquire_slot("k", "s", LONG_MS, 1) is not None
        assert store.acquire("k", "other", LONG_MS) is None
        assert store.acquire_slot("k", "other", LONG_MS, 1) is None

    def test_slot_keys_renew_release_list_get_and_force_release_as_leases(
        self, store: RedisLockStore
    ) -> None:
        """Every LockStore and inspection call works on a slot's store key."""
        got = [store.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        assert [g[0] for g in got if g] == [0, 1, 2]
        keys = [slot_key("k", i) for i in range(3)]
        assert store.renew(keys[0], "o0", LONG_MS) is True
        assert store.renew(keys[0], "o1", LONG_MS) is False
        assert store.renew_many([(keys[1], "o1", LONG_MS), (keys[2], "x", LONG_MS)]) == [
            True,
            False,
        ]
        assert [i.key for i in store.list("k")] == keys
        assert [(i.owner, i.token) for i in store.list("k")] == [
            (f"o{i}", g[1]) for i, g in enumerate(got) if g
        ]
        info = store.get(keys[1])
        assert info is not None and info.owner == "o1"
        forced = store.force_release(keys[1])
        assert forced is not None and forced.owner == "o1" and store.get(keys[1]) is None
        store.release(keys[2], "o2")
        assert [i.key for i in store.list("k")] == [keys[0]]
        assert store.last_token(keys[0]) == got[2][1]  # type: ignore[index]  # the key's counter

    def test_list_tells_slot_keys_from_keys_ending_in_digits_or_the_mark(
        self, store: RedisLockStore
    ) -> None:
        """Keys holding U+001F that are no slot, and keys ending in digits, list as themselves."""
        plain = ["k1", "k" + SLOT_MARK + "x", "k" + SLOT_MARK, "k}" + SLOT_MARK + "y"]
        for key in plain:
            assert store.acquire(key, "p", LONG_MS) is not None
        assert store.acquire_slot("k", "s", LONG_MS, 2) == (0, store.last_token(counter_key("k")))
        assert store.acquire_slot("k}", "s", LONG_MS, 2) is not None
        listed = [i.key for i in store.list()]
        assert listed == sorted([*plain, slot_key("k", 0), slot_key("k}", 0)])
        assert all(store.get(key) is not None for key in listed)


class TestAcquireSlot:
    def test_the_lowest_free_slot_below_the_limit_with_growing_tokens(
        self, store: RedisLockStore
    ) -> None:
        """Slots 0, 1, 2 in turn, then refused; a freed slot is the next given; every token is
        larger than every earlier one of the key, in any slot."""
        got = [store.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        assert [g and g[0] for g in got] == [0, 1, 2]
        tokens = [g[1] for g in got if g]
        assert tokens == sorted(set(tokens))
        assert store.acquire_slot("k", "late", LONG_MS, 3) is None
        store.release(slot_key("k", 1), "o1")
        again = store.acquire_slot("k", "late", LONG_MS, 3)
        assert again is not None and again[0] == 1 and again[1] > tokens[-1]

    def test_the_same_owner_gets_its_slot_and_token_back_and_its_expiry_set(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A repeated call by a holder returns its slot and token (no new token) and sets its
        expiry to the new ttl (set, not added), whatever the limit now."""
        assert store.acquire_slot("k", "a", LONG_MS, 3) is not None
        mine = store.acquire_slot("k", "b", LONG_MS, 3)
        assert mine is not None and mine[0] == 1
        assert store.acquire_slot("k", "b", 2000, 3) == mine
        assert 0 < redis_client.pttl(store.lease_key(slot_key("k", 1))) <= 2000
        assert store.acquire_slot("k", "b", 2000, 1) == mine  # over a lowered limit: still its
        assert store.last_token(counter_key("k")) == mine[1]

    def test_a_lowered_limit_refuses_until_the_count_is_below_it_and_frees_nobody(
        self, store: RedisLockStore
    ) -> None:
        """Five held under limit 5; with limit 3 nobody new gets in until only two are held,
        and every holder keeps renewing meanwhile."""
        for i in range(5):
            assert store.acquire_slot("k", f"o{i}", LONG_MS, 5) is not None
        for freed in (0, 1, 2):
            assert store.acquire_slot("k", "new", LONG_MS, 3) is None
            store.release(slot_key("k", freed), f"o{freed}")
        got = store.acquire_slot("k", "new", LONG_MS, 3)
        assert got is not None and got[0] == 0
        assert store.acquire_slot("k", "newer", LONG_MS, 3) is None
        for i in (3, 4):
            assert store.renew(slot_key("k", i), f"o{i}", LONG_MS) is True

    def test_a_lost_counter_still_floors_the_next_token_and_counts_the_slots_below_the_limit(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """With the counter gone (idle expiry, eviction) the next token is still above every
        earlier one (floored by the server clock) and the live slots below the limit count."""
        got = [store.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        store.release(slot_key("k", 0), "o0")
        redis_client.delete(store.slots_key("k"))
        again = store.acquire_slot("k", "a", LONG_MS, 3)
        assert again is not None and again[0] == 0 and again[1] > got[-1][1]  # type: ignore[index]
        assert store.acquire_slot("k", "b", LONG_MS, 3) is None
        assert redis_client.hget(store.slots_key("k"), "width") == b"3"

    def test_the_width_shrinks_to_the_highest_live_slot_at_a_grant(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """Once the slots taken under a larger limit are gone, a grant records a smaller width,
        so later acquires read fewer slots."""
        for i in range(6):
            assert store.acquire_slot("k", f"o{i}", LONG_MS, 6) is not None
        for i in range(1, 6):
            store.release(slot_key("k", i), f"o{i}")
        assert redis_client.hget(store.slots_key("k"), "width") == b"6"
        assert store.acquire_slot("k", "a", LONG_MS, 2) is not None
        assert redis_client.hget(store.slots_key("k"), "width") == b"2"

    def test_a_counter_ahead_of_the_clock_grows_by_one(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """Token = max(counter + 1, server TIME in µs), the counter formatted as an integer."""
        seconds, micros = redis_client.time()
        got = store.acquire_slot("k", "a", LONG_MS, 2)
        assert got is not None and got[1] >= seconds * 1_000_000 + micros
        big = 2**52 + 7
        redis_client.hset(store.slots_key("k"), "token", str(big))
        assert store.acquire_slot("k", "b", LONG_MS, 2) == (1, big + 1)
        assert redis_client.hget(store.slots_key("k"), "token") == str(big + 1).encode()

    def test_threads_racing_never_hold_more_slots_than_the_limit(self, redis_url: str) -> None:
        """Twelve threads (their own stores, all released at once by a barrier) race for a key
        of limit 3, for several rounds: exactly three win each round, in distinct slots."""
        stores = [RedisLockStore(redis_url) for _ in range(12)]
        barrier = threading.Barrier(len(stores), timeout=DEADLINE)
        rounds = 5
        won: list[list[tuple[int, int, int]]] = [[] for _ in range(rounds)]
        lock = threading.Lock()

        def race(index: int) -> None:
            store = stores[index]
            for round_ in range(rounds):
                barrier.wait()
                got = store.acquire_slot(f"race-{round_}", f"t{index}", LONG_MS, 3)
                if got is not None:
                    with lock:
                        won[round_].append((index, *got))

        threads = [threading.Thread(target=race, args=(i,)) for i in range(len(stores))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE)
        try:
            for winners in won:
                assert len(winners) == 3
                assert sorted(slot for _, slot, _ in winners) == [0, 1, 2]
                assert len({token for _, _, token in winners}) == 3
        finally:
            for store in stores:
                store.close()

    @pytest.mark.parametrize("limit", [0, -1, MAX_LIMIT + 1, True, 2.0, "3", None])
    def test_a_bad_limit_raises_value_error_before_any_io(self, limit: object) -> None:
        """Refused before a byte is sent: the store points at a port nothing listens on."""
        store = RedisLockStore("redis://127.0.0.1:1/0")
        with pytest.raises(ValueError, match="limit"):
            store.acquire_slot("k", "a", LONG_MS, limit)  # type: ignore[arg-type]

    @pytest.mark.parametrize("key", ["k" + SLOT_MARK, slot_key("k", 1), "", "}k", 7])
    def test_a_bad_key_raises_value_error_before_any_io(self, key: object) -> None:
        """A key holding U+001F, or one that cannot carry a hash tag, is refused at once."""
        store = RedisLockStore("redis://127.0.0.1:1/0")
        with pytest.raises(ValueError, match="key"):
            store.acquire_slot(key, "a", LONG_MS, 2)  # type: ignore[arg-type]

    def test_a_slot_holding_another_type_is_refused_and_left_alone(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A foreign value under a slot's lease key fails the acquire (StoreUnavailableError
        naming it) and is never overwritten."""
        name = store.lease_key(slot_key("k", 0))
        redis_client.set(name, "not a lease")
        with pytest.raises(StoreUnavailableError, match="another type"):
            store.acquire_slot("k", "a", LONG_MS, 2)
        assert redis_client.get(name) == b"not a lease"


class TestWidth:
    """The slots a script reads are the keys the client declares: the larger of the limit and
    the width it last saw for the key; a wider stored width costs one more call, once."""

    def test_a_width_another_client_widened_costs_a_second_call_once(
        self, redis_server: RedisServer, store: RedisLockStore, counted: RedisLockStore
    ) -> None:
        """Five slots held under limit 5 by one store; another store asking with limit 3 is told
        the width and asks again (two script calls), then asks once per acquire."""
        for i in range(5):
            assert store.acquire_slot("k", f"o{i}", LONG_MS, 5) is not None
        assert counted.acquire_slot("warm", "w", LONG_MS, 2) is not None  # loads the script
        for calls in (2, 1, 1):
            _reset_stats(redis_server)
            assert counted.acquire_slot("k", "new", LONG_MS, 3) is None
            assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": calls}
        store.release(slot_key("k", 4), "o4")
        store.release(slot_key("k", 3), "o3")
        store.release(slot_key("k", 0), "o0")
        _reset_stats(redis_server)
        assert counted.acquire_slot("k", "new", LONG_MS, 3) == (
            0,
            counted.last_token(counter_key("k")),
        )
        assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": 1}

    def test_calls_under_two_limits_in_turn_ask_once_each_after_the_first(
        self, redis_server: RedisServer, counted: RedisLockStore
    ) -> None:
        """One store, a key four wide, calls under limit 2 and limit 4 in turn: once the first
        call under limit 2 learned the width, every call is one script call (a grant under
        limit 4 does not make the store forget the width)."""
        for i in range(4):
            assert counted.acquire_slot("k", f"o{i}", LONG_MS, 4) is not None
        counted.release(slot_key("k", 1), "o1")
        calls = []
        for owner, limit in (("x", 2), ("y", 4), ("z", 2)):
            _reset_stats(redis_server)
            got = counted.acquire_slot("k", owner, LONG_MS, limit)
            assert (got is None) == (limit == 2)
            calls.append(_evalsha_calls(redis_server))
        assert calls == [{"cmdstat_evalsha": 2}, {"cmdstat_evalsha": 1}, {"cmdstat_evalsha": 1}]

    def test_a_lowered_limit_is_answered_after_one_more_call(self, store: RedisLockStore) -> None:
        """On the fast path too: a limit lowered below the stored width refuses, then grants
        once enough slots are released (the holders above the new limit still count)."""
        for i in range(4):
            assert store.acquire_slot("k", f"o{i}", LONG_MS, 4) is not None
        fresh = RedisLockStore(store.client)
        assert fresh.acquire_slot("k", "new", LONG_MS, 2) is None
        fresh.release(slot_key("k", 0), "o0")
        fresh.release(slot_key("k", 1), "o1")
        assert fresh.acquire_slot("k", "new", LONG_MS, 2) is None  # slots 2 and 3 still count
        fresh.release(slot_key("k", 3), "o3")
        got = fresh.acquire_slot("k", "new", LONG_MS, 2)
        assert got is not None and got[0] == 0

    @pytest.mark.parametrize("width", [str(10**6), "1e9", "inf", "nan", "abc", "-3", "2.5", ""])
    def test_a_stored_width_is_capped_at_max_limit_and_a_foreign_one_read_as_zero(
        self,
        redis_server: RedisServer,
        store: RedisLockStore,
        redis_client: redis.Redis,
        width: str,
    ) -> None:
        """Whatever another writer left as the width, an acquire reads at most MAX_LIMIT slots
        (a number above it counts as MAX_LIMIT, anything not a number as 0), is granted and
        writes a width it can read."""
        redis_client.hset(store.slots_key("k"), mapping={"token": "5", "width": width})
        _reset_stats(redis_server)
        got = store.acquire_slot("k", "a", LONG_MS, 2)
        assert got is not None and got[0] == 0
        stats = redis_client.info("commandstats")
        assert int(stats["cmdstat_hmget"]["calls"]) <= MAX_LIMIT + 2
        assert redis_client.hget(store.slots_key("k"), "width") == b"1"


class TestLostReplies:
    def test_a_slot_acquire_whose_reply_was_lost_returns_the_same_slot_and_token(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """The reply is lost after the script ran: the store's retry (the same owner) gets the
        slot and token it took; no second slot is taken, no second token drawn."""
        client, drop = _reply_dropping_client(redis_server.port)
        store = _warm(RedisLockStore(client))
        assert store.acquire_slot("warm", "w", LONG_MS, 2) is not None  # loads the script
        assert store.acquire_slot("k", "first", LONG_MS, 3) is not None
        drop(_sha(ACQUIRE_SLOT_SCRIPT))
        got = store.acquire_slot("k", "a", LONG_MS, 3)
        assert got is not None and got[0] == 1
        assert _holders(store, "k") == {0: "first", 1: "a"}
        assert store.last_token(counter_key("k")) == got[1]
        client.close()


class TestReplicaAcks:
    def test_a_slot_no_replica_confirmed_is_given_up_and_free_again(self, redis_url: str) -> None:
        """With ``min_replicas=1`` and no replica, the slot acquire is asked again within the
        confirm window, then its slot is released and ReplicaLagError raised."""
        store = RedisLockStore(redis_url, min_replicas=1, replica_timeout="20ms")
        other = RedisLockStore(redis_url)
        try:
            assert other.acquire_slot("k", "first", LONG_MS, 3) is not None
            with pytest.raises(ReplicaLagError, match="acquire 'k' not confirmed"):
                store.acquire_slot("k", "a", LONG_MS, 3)
            assert _holders(other, "k") == {0: "first"}
        finally:
            store.close()
            other.close()


class TestReleaseSignals:
    @pytest.mark.parametrize("how", ["release", "force_release", "release_deferred"])
    def test_freeing_a_slot_wakes_a_waiter_blocked_on_the_key(
        self, redis_server: RedisServer, store: RedisLockStore, how: str
    ) -> None:
        """A thread blocked in ``wait_for_release(key)`` wakes when any slot of the key is
        released, force-released or released without waiting for the reply."""
        for i in range(2):
            assert store.acquire_slot("k", f"o{i}", LONG_MS, 2) is not None
        waiter = RedisLockStore(store.client)
        woke: list[bool] = []
        thread = threading.Thread(
            target=lambda: woke.append(waiter.wait_for_release("k", DEADLINE))
        )
        thread.start()
        wait_for(lambda: blocked_clients(redis_server) >= 1, "the waiter to block")
        if how == "release":
            store.release(slot_key("k", 1), "o1")
        elif how == "force_release":
            assert store.force_release(slot_key("k", 1)) is not None
        else:
            assert store.release_deferred(slot_key("k", 1), "o1") is True
            store.flush_deferred()
        thread.join(DEADLINE)
        assert woke == [True]
        assert store.acquire_slot("k", "next", LONG_MS, 2) is not None

    def test_two_slot_releases_leave_two_wake_ups(self, store: RedisLockStore) -> None:
        """Two slots freed: two waiters of the key wake (a slot's release adds a wake-up, it does
        not replace the one waiting)."""
        for owner in "ab":
            assert store.acquire_slot("k", owner, LONG_MS, 2) is not None
        store.release(slot_key("k", 0), "a")
        store.release(slot_key("k", 1), "b")
        assert [store.wait_for_release("k", 0) for _ in range(3)] == [True, True, False]

    def test_slot_releases_keep_at_most_max_limit_wake_ups(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """Nobody waiting, MAX_LIMIT + 3 slot releases (by release and force_release) leave
        MAX_LIMIT wake-ups in the key's signal list."""
        for i in range(MAX_LIMIT + 3):
            assert store.acquire_slot("k", f"o{i}", LONG_MS, 2) == (
                0,
                store.last_token(counter_key("k")),
            )
            if i % 2:
                assert store.force_release(slot_key("k", 0)) is not None
            else:
                store.release(slot_key("k", 0), f"o{i}")
        assert redis_client.llen(store.signal_key("k")) == MAX_LIMIT

    def test_a_plain_keys_releases_leave_exactly_one_wake_up(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A key without slots has one holder: however often it is released, one waiter wakes."""
        for owner in "abc":
            assert store.acquire("k", owner, LONG_MS) is not None
            store.release("k", owner)
        assert redis_client.llen(store.signal_key("k")) == 1
        assert store.acquire("k", "d", LONG_MS) is not None
        assert store.force_release("k") is not None
        assert redis_client.llen(store.signal_key("k")) == 1

    def test_a_plain_keys_release_empties_the_list_instead_of_trimming_it(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """One wake-up kept with one command fewer: the list is deleted with the lease before
        the push (release and force_release); a slot's release trims the shared list."""
        assert store.acquire("k", "a", LONG_MS) is not None
        assert store.acquire_slot("s", "a", LONG_MS, 2) is not None
        redis_client.config_resetstat()
        store.release("k", "a")
        assert store.acquire("k", "b", LONG_MS) is not None
        assert store.force_release("k") is not None
        plain = redis_client.info("commandstats")
        store.release(slot_key("s", 0), "a")
        slots = redis_client.info("commandstats")
        calls = {
            name: (
                plain.get(f"cmdstat_{name}", {}).get("calls", 0),
                slots[f"cmdstat_{name}"]["calls"],
            )
            for name in ("rpush", "ltrim", "del")
        }
        assert calls == {"rpush": (2, 3), "ltrim": (0, 1), "del": (2, 3)}
        assert redis_client.llen(store.signal_key("k")) == 1


class TestRestartGrace:
    HOUR = 3600

    def test_a_free_slot_is_refused_during_the_grace_as_a_free_key_is(
        self, redis_server_factory: Callable[..., RedisServer]
    ) -> None:
        """On a young server without the marker a free slot raises RestartGraceError (nothing
        taken); a holder gets its slot back, and a full key is answered "held"."""
        server = redis_server_factory()
        grace = RedisLockStore(server.url, restart_grace=self.HOUR)
        off = RedisLockStore(server.url, restart_grace=0)
        try:
            with pytest.raises(RestartGraceError, match="acquire 'k'"):
                grace.acquire_slot("k", "a", LONG_MS, 2)
            assert off.list() == []
            mine = off.acquire_slot("k", "a", LONG_MS, 1)
            assert mine is not None
            assert grace.acquire_slot("k", "a", LONG_MS, 1) == mine
            assert grace.acquire_slot("k", "b", LONG_MS, 1) is None
            with pytest.raises(RestartGraceError):
                grace.acquire_slot("k", "b", LONG_MS, 2)
        finally:
            grace.close()
            off.close()


class TestMarkReplaced:
    def test_the_holder_is_marked_refused_its_renewals_and_still_releases(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """The ticket is above the holder's token; the stored owner gets the mark; renewals are
        refused; others are still refused (and told the marked owner); the owner's release
        deletes it; the next token exceeds the ticket."""
        token = store.acquire("k", "h", LONG_MS)
        assert token is not None
        ticket, holder, asked = store.mark_replaced("k")
        assert ticket > token and (holder, asked) == ("h", True)
        assert redis_client.hget(store.lease_key("k"), "owner") == marked("h").encode()
        info = store.get("k")
        assert info is not None and (info.owner, info.token) == (marked("h"), token)
        assert store.renew("k", "h", LONG_MS) is False
        assert store.renew_many([("k", "h", LONG_MS)]) == [False]
        assert store.acquire("k", "n", LONG_MS) is None
        assert store.acquire_or_holder("k", "n", LONG_MS) == (None, marked("h"))
        assert store.mark_replaced("k", ticket) == (ticket, "h", True)  # already asked
        assert redis_client.hget(store.lease_key("k"), "owner") == marked("h").encode()
        store.release("k", "h")
        assert store.get("k") is None
        assert store.wait_for_release("k", 0) is True
        following = store.acquire("k", "n", LONG_MS)
        assert following is not None and following > ticket

    def test_a_drawn_ticket_makes_every_later_token_greater(self, store: RedisLockStore) -> None:
        """Tickets drawn on a free key grow and bound the next token from below."""
        first, holder, asked = store.mark_replaced("k")
        assert (holder, asked) == (None, False)
        second = store.mark_replaced("k")[0]
        assert second > first
        token = store.acquire("k", "a", LONG_MS)
        assert token is not None and token > second
        assert store.mark_replaced("k")[0] > token

    def test_a_given_ticket_is_returned_as_is_and_draws_nothing(
        self, store: RedisLockStore
    ) -> None:
        """With ``ticket`` the counter is untouched."""
        token = store.acquire("k", "h", LONG_MS)
        assert token is not None
        assert store.mark_replaced("k", 7, holder="h") == (7, "h", True)
        assert store.last_token("k") == token

    def test_another_holder_than_the_one_named_is_left_alone(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """``holder=`` names whom to ask: another owner's lease is not marked."""
        assert store.acquire("k", "h", LONG_MS) is not None
        ticket = 1
        assert store.mark_replaced("k", ticket, holder="other") == (ticket, "h", False)
        assert redis_client.hget(store.lease_key("k"), "owner") == b"h"
        assert store.renew("k", "h", LONG_MS) is True
        assert store.mark_replaced("k", ticket, holder="h") == (ticket, "h", True)
        assert store.renew("k", "h", LONG_MS) is False

    def test_a_marked_lease_is_released_by_every_release_path_and_only_its_owner(
        self, store: RedisLockStore, counted: RedisLockStore
    ) -> None:
        """Plain (fast path), deferred, pool-path and force releases all delete a marked lease
        of the owner; a stranger's release (marked or not) leaves it."""
        for key, how in (("a", "fast"), ("b", "deferred"), ("c", "pool"), ("d", "force")):
            assert store.acquire(key, "h", LONG_MS) is not None
            store.mark_replaced(key)
            store.release(key, "stranger")
            store.release(key, marked("stranger"))
            counted.release(key, "stranger")
            assert store.get(key) is not None
            if how == "fast":
                store.release(key, "h")
            elif how == "deferred":
                assert store.release_deferred(key, "h") is True
                store.flush_deferred()
            elif how == "pool":
                counted.release(key, "h")
            else:
                forced = store.force_release(key)
                assert forced is not None and forced.owner == marked("h")
            assert store.get(key) is None, how

    def test_a_marked_slot_lease_is_released_by_its_owner(self, store: RedisLockStore) -> None:
        """The release of a slot accepts the mark too (a holder of a slot marked by hand)."""
        got = store.acquire_slot("k", "h", LONG_MS, 2)
        assert got is not None
        store.client.hset(store.lease_key(slot_key("k", 0)), "owner", marked("h"))
        assert store.renew(slot_key("k", 0), "h", LONG_MS) is False
        store.release(slot_key("k", 0), "h")
        assert store.get(slot_key("k", 0)) is None

    def test_a_lease_key_of_another_type_is_never_marked(
        self, store: RedisLockStore, redis_client: redis.Redis
    ) -> None:
        """A foreign value under the lease key fails mark_replaced, left as it was."""
        redis_client.set(store.lease_key("k"), "foreign")
        with pytest.raises(StoreUnavailableError, match="another type"):
            store.mark_replaced("k")
        assert redis_client.get(store.lease_key("k")) == b"foreign"
        assert store.last_token("k") is None  # no ticket drawn either

    def test_a_slot_key_is_refused(self) -> None:
        """mark_replaced asks the holder of a key, never of a slot: ValueError before I/O."""
        store = RedisLockStore("redis://127.0.0.1:1/0")
        with pytest.raises(ValueError, match="key"):
            store.mark_replaced(slot_key("k", 0))

    def test_the_mark_is_the_shared_suffix(self) -> None:
        """The stored mark is slots.REPLACED_MARK (what every store writes)."""
        assert marked("h") == "h" + REPLACED_MARK


class TestCluster:
    """The slot scripts through a cluster client on the one-node Redis Cluster (routing,
    fan-out batches, the all-node scan); TestThreeMasters proves one hash slot per key."""

    @pytest.fixture
    def cluster_store(
        self, redis_cluster_server: RedisServer, redis_cluster_url: str
    ) -> Iterator[RedisLockStore]:
        client = RedisCluster(host="127.0.0.1", port=redis_cluster_server.port)
        store = RedisLockStore(client, prefix=f"slots-{uuid.uuid4().hex[:8]}:")
        yield store
        client.close()

    def test_slots_acquire_renew_list_release_and_wake_on_a_cluster(
        self, redis_cluster_server: RedisServer, cluster_store: RedisLockStore
    ) -> None:
        """Slots of keys with and without braces: acquire under a limit, renew in a batch,
        list, release waking a waiter on the key."""
        store = cluster_store
        for key in ("k", "a}b", "{x}y"):
            got = [store.acquire_slot(key, f"o{i}", LONG_MS, 2) for i in range(3)]
            assert [g and g[0] for g in got] == [0, 1, None]
            items = [(slot_key(key, i), f"o{i}", LONG_MS) for i in range(2)]
            assert store.renew_many(items) == [True, True]
            assert [i.key for i in store.list(key + SLOT_MARK)] == [
                slot_key(key, 0),
                slot_key(key, 1),
            ]
        woke: list[bool] = []
        thread = threading.Thread(target=lambda: woke.append(store.wait_for_release("k", DEADLINE)))
        thread.start()
        wait_for(lambda: blocked_clients(redis_cluster_server) >= 1, "the waiter to block")
        store.release(slot_key("k", 0), "o0")
        thread.join(DEADLINE)
        assert woke == [True]
        assert store.force_release(slot_key("k", 1)) is not None
        assert store.acquire_slot("k", "new", LONG_MS, 2) is not None

    def test_mark_replaced_on_a_cluster(self, cluster_store: RedisLockStore) -> None:
        """Marking, the refused renewal and the owner's release on a cluster."""
        store = cluster_store
        token = store.acquire("k", "h", LONG_MS)
        assert token is not None
        ticket, holder, asked = store.mark_replaced("k")
        assert ticket > token and (holder, asked) == ("h", True)
        assert store.renew("k", "h", LONG_MS) is False
        store.release("k", "h")
        following = store.acquire("k", "n", LONG_MS)
        assert following is not None and following > ticket


class TestThreeMasters:
    """On a cluster of three masters a script touching a key of a hash slot another node serves
    fails ("non local key"): slots of keys spread over every node prove that a key's slot
    leases, counter and signal list share its hash slot."""

    @pytest.fixture
    def store(self, redis_three_masters: ClusterNodes) -> Iterator[RedisLockStore]:
        redis_three_masters.flush()
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in redis_three_masters.seeds]
        )
        store = RedisLockStore(client)
        yield store
        client.close()

    def test_slots_of_keys_on_every_node(
        self, redis_three_masters: ClusterNodes, store: RedisLockStore
    ) -> None:
        """Thirty keys (on all three masters): two slots each, a third refused, a batch renewal,
        the listing, a release and a slot acquire after a lost counter (every slot read)."""
        client = store.client
        assert isinstance(client, RedisCluster)
        keys = [f"acct:{i}" for i in range(30)]
        nodes = {client.get_node_from_key(store.slots_key(k)).name for k in keys}
        assert len(nodes) == 3
        for key in keys:
            for slot, owner in enumerate("ab"):
                got = store.acquire_slot(key, owner, LONG_MS, 2)
                assert got == (slot, store.last_token(counter_key(key)))
            assert store.acquire_slot(key, "c", LONG_MS, 2) is None
        items = [(slot_key(k, i), o, LONG_MS) for k in keys for i, o in enumerate("ab")]
        assert store.renew_many(items) == [True] * len(items)
        assert len(store.list("acct:")) == 2 * len(keys)
        for key in keys:
            store.release(slot_key(key, 1), "b")
            client.delete(store.slots_key(key))
            assert store.acquire_slot(key, "c", LONG_MS, 2) == (
                1,
                store.last_token(counter_key(key)),
            )
            assert store.mark_replaced(key)[1:] == (None, False)

    def test_a_reshard_moving_the_counter_first_never_lets_a_second_holder_in(
        self, redis_three_masters: ClusterNodes, store: RedisLockStore
    ) -> None:
        """While a reshard moves the key's hash slot key by key (IMPORTING/MIGRATING, MIGRATE),
        the counter already moved and slot 0 not yet: a second acquire under limit 1 fails
        (TRYAGAIN) or is refused, never granted; the holder still renews."""
        key = "job"
        assert store.acquire_slot(key, "holder-1", LONG_MS, 1) is not None
        with _resharding(redis_three_masters, store, key, [store.slots_key(key)]):
            try:
                second = store.acquire_slot(key, "holder-2", LONG_MS, 1)
            except StoreUnavailableError:
                second = None
            assert second is None
            assert store.renew(slot_key(key, 0), "holder-1", LONG_MS) is True

    def test_a_reshard_never_makes_the_owners_slot_release_miss_a_held_slot(
        self, redis_three_masters: ClusterNodes, store: RedisLockStore
    ) -> None:
        """The release of the slot an owner holds (the undo of a slot acquire whose reply was
        lost), mid-reshard with the counter and the signal list moved: TRYAGAIN, never "no slot
        held" while the owner's slot stays held."""
        key = "job"
        assert store.acquire_slot(key, "holder-1", LONG_MS, 1) is not None
        store.release(slot_key(key, 0), "holder-1")  # leaves a wake-up: the signal list exists
        assert store.acquire_slot(key, "holder-1", LONG_MS, 1) is not None
        moved = [store.slots_key(key), store.signal_key(key)]
        keys, args, _ = store._owners_slot_call(key, "holder-1", 1)
        with _resharding(redis_three_masters, store, key, moved):
            try:
                released = store._eval(RELEASE_OWNERS_SLOT, keys, args)
            except redis.exceptions.RedisError as exc:
                released = exc
            assert not isinstance(released, int) or released == 0, released
            assert isinstance(released, Exception) or store.get(slot_key(key, 0)) is None

    def test_a_script_reaching_another_nodes_key_would_fail(
        self, redis_three_masters: ClusterNodes, store: RedisLockStore
    ) -> None:
        """The check the test above relies on: a script touching an undeclared key served by
        another node is refused by the server."""
        client = store.client
        assert isinstance(client, RedisCluster)
        here, there = (
            "{a}",
            next(
                f"{{{i}}}"
                for i in range(100)
                if client.get_node_from_key(f"{{{i}}}") != client.get_node_from_key("{a}")
            ),
        )
        with pytest.raises(redis.exceptions.ResponseError, match="non local key"):
            client.eval(f"return redis.call('EXISTS', '{there}')", 1, here)


@contextmanager
def _resharding(
    cluster: ClusterNodes, store: RedisLockStore, key: str, moved: list[str]
) -> Iterator[None]:
    """The hash slot of ``key`` halfway through a reshard, as ``redis-cli --cluster reshard``
    leaves it between two MIGRATEs: its node MIGRATING to another, that one IMPORTING, the
    Redis keys ``moved`` already there. Afterwards the moved keys are dropped and the slot is
    stable on its node again."""
    nodes = {port: redis.Redis(port=port) for _, port in cluster.seeds}
    hash_slot = key_slot(store.slots_key(key).encode())
    source = next(c for c in nodes.values() if c.cluster("COUNTKEYSINSLOT", hash_slot))
    target = next(c for c in nodes.values() if c is not source)
    source_id, target_id = (c.execute_command("CLUSTER MYID").decode() for c in (source, target))
    target.execute_command("CLUSTER SETSLOT", hash_slot, "IMPORTING", source_id)
    source.execute_command("CLUSTER SETSLOT", hash_slot, "MIGRATING", target_id)
    port = target.connection_pool.connection_kwargs["port"]
    source.execute_command("MIGRATE", "127.0.0.1", port, "", 0, 5000, "KEYS", *moved)
    try:
        yield
    finally:
        conn = target.connection_pool.get_connection()
        try:
            conn.send_command("ASKING")
            conn.read_response()
            conn.send_command("DEL", *moved)
            conn.read_response()
        finally:
            target.connection_pool.release(conn)
        for c in (source, target):
            c.execute_command("CLUSTER SETSLOT", hash_slot, "STABLE")
        for c in nodes.values():
            c.close()


def test_slots_and_replace_through_sentinel(redis_sentinel: SentinelGroup) -> None:
    """Through a Sentinel-managed master (each write confirmed by a replica): slots up to the
    limit, the same owner's retry, a mark and the marked owner's release."""
    store = RedisLockStore(redis_sentinel.url)
    try:
        assert store.min_replicas == 1
        first = store.acquire_slot("k", "a", LONG_MS, 2)
        second = store.acquire_slot("k", "b", LONG_MS, 2)
        assert first is not None and second is not None and second[1] > first[1]
        assert store.acquire_slot("k", "c", LONG_MS, 2) is None
        assert store.acquire_slot("k", "a", LONG_MS, 2) == first
        assert store.acquire("r", "h", LONG_MS) is not None
        assert store.mark_replaced("r")[1:] == ("h", True)
        assert store.renew("r", "h", LONG_MS) is False
        store.release("r", "h")
        assert store.get("r") is None
    finally:
        store.close()


class TestAsync:
    def test_async_slots_share_the_sync_stores_data(self, redis_url: str) -> None:
        """The async store's slots are the sync twin's: one excludes the other, tokens grow
        across both, the same owner gets its slot back, a bad limit raises ValueError."""

        async def main() -> None:
            store = AsyncRedisLockStore(redis_url, prefix="aslots:")
            twin = store.sync
            assert isinstance(twin, RedisLockStore)
            try:
                first = await store.acquire_slot("k", "a", LONG_MS, 2)
                second = twin.acquire_slot("k", "b", LONG_MS, 2)
                assert first is not None and second is not None
                assert (first[0], second[0]) == (0, 1) and second[1] > first[1]
                assert await store.acquire_slot("k", "c", LONG_MS, 2) is None
                assert await store.acquire_slot("k", "a", LONG_MS, 2) == first
                with pytest.raises(ValueError, match="limit"):
                    await store.acquire_slot("k", "a", LONG_MS, 0)
                assert twin.acquire("r", "h", LONG_MS) is not None
                ticket, holder, asked = await store.mark_replaced("r")
                assert (holder, asked) == ("h", True)
                assert await store.renew("r", "h", LONG_MS) is False
                await store.release("r", "h")
                assert twin.get("r") is None
                await store.release(slot_key("k", 0), "a")
                got = twin.acquire_slot("k", "d", LONG_MS, 2)
                assert got is not None and got[0] == 0 and got[1] > ticket
            finally:
                await store.aclose()

        asyncio.run(main())

    @pytest.mark.parametrize("limit", [1, 50])
    def test_an_async_slot_acquire_is_one_script_call(
        self, redis_server: RedisServer, redis_url: str, limit: int
    ) -> None:
        """The async store sends one EVALSHA per slot acquire, whatever the limit."""

        async def main() -> None:
            store = AsyncRedisLockStore(redis_url, prefix="aone:")
            try:
                assert await store.acquire_slot("warm", "w", LONG_MS, 2) is not None
                _reset_stats(redis_server)
                assert await store.acquire_slot("k", "a", LONG_MS, limit) == (
                    0,
                    store.sync.last_token(counter_key("k")),  # type: ignore[attr-defined]
                )
                assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": 1}
            finally:
                await store.aclose()

        asyncio.run(main())

    def test_an_async_store_asks_again_when_the_key_is_wider(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """A fresh async store under a limit below the width the sync store left: its slot
        acquire and its release of the slot an owner holds each take one more script call,
        then one."""

        async def main() -> None:
            store = AsyncRedisLockStore(redis_url, prefix="awide:")
            twin = store.sync
            assert isinstance(twin, RedisLockStore)
            try:
                for i in range(4):
                    assert twin.acquire_slot("k", f"o{i}", LONG_MS, 4) is not None
                for i in range(3):
                    twin.release(slot_key("k", i), f"o{i}")
                assert await store.acquire_slot("warm", "w", LONG_MS, 2) is not None
                for calls, owner in ((2, "a"), (1, "b")):
                    _reset_stats(redis_server)
                    got = await store.acquire_slot("k", owner, LONG_MS, 2)
                    assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": calls}
                    assert got == ((0, twin.last_token(counter_key("k"))) if calls == 2 else None)
                fresh = AsyncRedisLockStore(redis_url, prefix="awide:")
                try:
                    await fresh._release_owners_slot(2, "warm", "nobody")  # loads the script
                    _reset_stats(redis_server)
                    await fresh._release_owners_slot(2, "k", "a")
                    assert _evalsha_calls(redis_server) == {"cmdstat_evalsha": 2}
                finally:
                    await fresh.aclose()
                assert _holders(twin, "k") == {3: "o3"}
            finally:
                await store.aclose()

        asyncio.run(main())

    def test_a_cancelled_slot_acquire_releases_what_it_took(
        self, redis_server: RedisServer, redis_url: str
    ) -> None:
        """Cancelled while its script runs, the acquire waits for the reply and releases the
        slot it took before the cancellation propagates."""

        async def main() -> None:
            store = AsyncRedisLockStore(redis_url, prefix="acancel:")
            twin = store.sync
            assert isinstance(twin, RedisLockStore)
            try:
                assert await store.acquire_slot("warm", "w", LONG_MS, 2) is not None
                started = asyncio.Event()
                real = store._client.evalsha

                async def slow_evalsha(*args: Any) -> Any:
                    started.set()
                    await asyncio.sleep(0)  # let the cancel land while the call is in flight
                    return await real(*args)

                store._client.evalsha = slow_evalsha  # type: ignore[method-assign]
                attempt = asyncio.ensure_future(store.acquire_slot("k", "a", LONG_MS, 3))
                await started.wait()
                attempt.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await attempt
                assert twin.list("k") == []
            finally:
                await store.aclose()

        asyncio.run(main())

    def test_a_cancelled_slot_acquire_without_a_reply_releases_the_owners_slot(
        self, redis_url: str
    ) -> None:
        """Cancelled while its script runs and then left without a reply (the script ran, the
        connection failed twice), the acquire releases whatever slot its owner holds."""

        async def main() -> None:
            store = AsyncRedisLockStore(redis_url, prefix="alost:")
            twin = store.sync
            assert isinstance(twin, RedisLockStore)
            try:
                assert twin.acquire_slot("k", "first", LONG_MS, 3) is not None
                assert await store.acquire_slot("warm", "w", LONG_MS, 2) is not None
                started = asyncio.Event()
                real = store._client.evalsha

                async def lost_reply(*args: Any) -> Any:
                    started.set()
                    await asyncio.sleep(0)
                    await real(*args)
                    raise redis.exceptions.ConnectionError("test: reply lost after it ran")

                store._client.evalsha = lost_reply  # type: ignore[method-assign]
                attempt = asyncio.ensure_future(store.acquire_slot("k", "a", LONG_MS, 3))
                await started.wait()
                attempt.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await attempt
                store._client.evalsha = real  # type: ignore[method-assign]
                assert [i.owner for i in twin.list("k")] == ["first"]
            finally:
                await store.aclose()

        asyncio.run(main())


class TestSlotLossReasons:
    """The renewer's reason for a lost slot, read from Redis (whose slot keys keep no token of
    their own: a free slot reads the key-wide counter)."""

    def test_a_slot_found_free_reads_expired(self, store: RedisLockStore) -> None:
        with lease("why", store=store, ttl=1, limit=3) as held:
            assert store.force_release(held.store_key) is not None
            got = store.acquire_slot("why", "another", LONG_MS, 3)  # slot 0, a later token
            assert got is not None and slot_key("why", got[0]) == held.store_key
            store.release(held.store_key, "another")
            assert store.acquire_slot("why", "in-slot-0", LONG_MS, 3) is not None
            assert store.acquire_slot("why", "in-slot-1", LONG_MS, 3) is not None
            store.release(held.store_key, "in-slot-0")  # slot 0 free, the counter moved on
            assert held.wait_lost(DEADLINE)
            assert held.lost_reason == "expired"

    def test_a_slot_held_by_another_owner_reads_taken(self, store: RedisLockStore) -> None:
        with lease("why", store=store, ttl=1, limit=3) as held:
            assert store.force_release(held.store_key) is not None
            got = store.acquire_slot("why", "another", LONG_MS, 3)
            assert got is not None and slot_key("why", got[0]) == held.store_key
            assert held.wait_lost(DEADLINE)
            assert held.lost_reason == "taken"
