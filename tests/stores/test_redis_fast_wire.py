"""The bytes the Redis store's fast path writes for each operation: the RESP encoding of the
documented EVALSHA / EVAL command, byte for byte, over odd keys, owners, ttls and a client
encoding that is not UTF-8 (each text item encoded on its own, as redis-py encodes it). A real
throwaway server runs every request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores._redis_common import (
    ACQUIRE_OR_HOLDER_SCRIPT,
    ACQUIRE_SCRIPT,
    RELEASE_SCRIPT,
    RENEW_SCRIPT,
    SIGNAL_TTL_MS,
    TOKEN_TTL_MS,
    Script,
)
from celery_lease.stores._redis_fast import FastConnection
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.slots import MAX_LIMIT, SLOT_MARK

pytestmark = pytest.mark.redis

KEYS = ["k", "ключ-🔑:{x}", "x" * 5000, "a}b{c", "k" + SLOT_MARK + "7"]
OWNERS: list[Any] = ["o", "владелец 🔒", "", "y" * 3000, "0", 2**64]  # an int: as redis-py packs it
TTLS = [1, 999, 2**31 - 1, 2**63 - 1, True, 1500.7]


def _resp(items: list[str | int | bytes], encoding: str) -> bytes:
    """The RESP array of ``items``: text encoded with ``encoding``, ints in decimal."""
    out = [b"*%d\r\n" % len(items)]
    for item in items:
        if isinstance(item, str):
            data = item.encode(encoding)
        elif isinstance(item, bytes):
            data = item
        else:
            data = str(int(item)).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _evalsha(source: str, keys: list[str], args: list[str | int], enc: str) -> bytes:
    return _head("EVALSHA", Script(source).sha, keys, args) + _items(keys, args, enc)


def _eval(source: str, keys: list[str], args: list[str | int], enc: str) -> bytes:
    return _head("EVAL", source, keys, args) + _items(keys, args, enc)


def _head(command: str, body: str, keys: list[str], args: list[str | int]) -> bytes:
    """The array header, the command, the sha or source (UTF-8) and the key count."""
    return _resp([command, body, str(len(keys))], "utf-8").replace(
        b"*3\r\n", b"*%d\r\n" % (3 + len(keys) + len(args)), 1
    )


def _items(keys: list[str], args: list[str | int], enc: str) -> bytes:
    return _resp([*keys, *args], enc).split(b"\r\n", 1)[1]


@pytest.fixture(params=["utf-8", "utf-16"], ids=["utf8", "utf16"])
def encoding(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[0.0, 2.5], ids=["no-grace", "grace"])
def store(redis_url: str, encoding: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    client = redis.Redis.from_url(redis_url, encoding=encoding, socket_timeout=5)
    made = RedisLockStore(client, restart_grace=request.param)
    yield made
    made.close()
    client.close()


def _written(store: RedisLockStore) -> list[bytes]:
    """Every request the store's fast connection writes from now on."""
    fast = store._fast
    assert isinstance(fast, FastConnection)
    sent: list[bytes] = []
    send = fast._send

    def record(sock: Any, request: bytes) -> None:
        sent.append(bytes(request))
        send(sock, request)

    fast._send = record  # type: ignore[method-assign]
    return sent


def _one(store: RedisLockStore, call: Callable[[], object]) -> bytes:
    sent = _written(store)
    try:
        call()
    except StoreUnavailableError:  # a restart grace, an expiry Redis refuses: answered
        pass
    finally:
        store.flush_deferred()
        del store._fast._send  # type: ignore[union-attr]
    assert len(sent) == 1, sent
    return sent[0]


def _acquire_items(store: RedisLockStore, key: str, owner: str, ttl: Any) -> tuple[Any, Any]:
    base = store.lease_key(key)[: -len(":lease")]
    keys = [base + ":lease", base + ":token"]
    args: list[str | int] = [owner, int(ttl), TOKEN_TTL_MS]
    if store.restart_grace:
        keys.append(store.marker_key)
        args.append(round(store.restart_grace * 1_000_000))
    return keys, args


def _release_items(store: RedisLockStore, key: str, owner: str) -> tuple[Any, Any]:
    keep = MAX_LIMIT if SLOT_MARK in key else 1
    return [store.lease_key(key), store.signal_key(key)], [owner, SIGNAL_TTL_MS, keep]


@pytest.mark.parametrize("key", KEYS, ids=range(len(KEYS)))
def test_every_fast_request_is_the_resp_of_its_command(
    store: RedisLockStore, encoding: str, key: str, redis_client: redis.Redis
) -> None:
    for source in (ACQUIRE_SCRIPT, ACQUIRE_OR_HOLDER_SCRIPT, RELEASE_SCRIPT, RENEW_SCRIPT):
        redis_client.script_load(source)  # every EVALSHA answered: one request per call
    for owner in OWNERS:
        for ttl_ms in TTLS:
            _check_acquire_and_renew(store, encoding, key, owner, ttl_ms)
        _check_release(store, encoding, key, owner)


def _check_acquire_and_renew(
    store: RedisLockStore, encoding: str, key: str, owner: Any, ttl_ms: Any
) -> None:
    keys, args = _acquire_items(store, key, owner, ttl_ms)
    expected = _evalsha(ACQUIRE_SCRIPT, keys, args, encoding)
    assert _one(store, lambda: store.acquire(key, owner, ttl_ms)) == expected
    assert _one(store, lambda: _read_sent(store, key, owner, ttl_ms)) == expected
    expected = _evalsha(ACQUIRE_OR_HOLDER_SCRIPT, keys, args, encoding)
    assert _one(store, lambda: store.acquire_or_holder(key, owner, ttl_ms)) == expected
    keys, args = [store.lease_key(key)], [owner, int(ttl_ms)]
    expected = _evalsha(RENEW_SCRIPT, keys, args, encoding)
    assert _one(store, lambda: store.renew(key, owner, ttl_ms)) == expected
    expected = _eval(RENEW_SCRIPT, keys, args, encoding)
    assert _one(store, lambda: store.renew_deferred(key, owner, ttl_ms)) == expected


def _check_release(store: RedisLockStore, encoding: str, key: str, owner: Any) -> None:
    keys, args = _release_items(store, key, owner)
    expected = _evalsha(RELEASE_SCRIPT, keys, args, encoding)
    assert _one(store, lambda: store.release(key, owner)) == expected
    expected = _eval(RELEASE_SCRIPT, keys, args, encoding)
    assert _one(store, lambda: store.release_deferred(key, owner)) == expected


def _read_sent(store: RedisLockStore, key: str, owner: str, ttl_ms: Any) -> None:
    read = store.send_acquire(key, owner, ttl_ms)
    assert read is not None
    read()
