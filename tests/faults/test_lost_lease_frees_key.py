"""A lease lost by expiry while its renewal's reply was held frees its key on a real Redis.

The renewal reaches the server and extends the key; its reply is held by a proxy until the lease
has been recorded lost ("expired"). Nothing renews the key any more, yet without a release it
would keep every other holder out until it expires. The test then stretches the key's expiry
far past the test and turns the server's active expiry off, so the key can only go by a ``DEL``:
it sees whether the key was released while the body still runs, with no race against expiry.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from celery_lease import lease
from celery_lease.stores.redis import RedisLockStore
from tests.faults.tcp_proxy import TcpProxy
from tests.fixtures_redis import RedisServer
from tests.unit.core_faults import poll_until

pytestmark = pytest.mark.slow

TTL = 1.5  # seconds: renewals leave every ttl/3, the loss is recorded at the validity
WAIT = 10.0  # real seconds a step may take on a loaded machine before the test fails
KEY = "celery-lease:{k}:lease"


@contextlib.contextmanager
def keyspace_events(client: redis.Redis, key: str) -> Iterator[queue.Queue[str]]:
    """The keyspace events of ``key`` (``del``, ``expire``, ...), in order, from a thread that
    stops (and closes its connection) when the block ends, before the server does."""
    events: queue.Queue[str] = queue.Queue()
    pubsub = client.pubsub()
    pubsub.subscribe(f"__keyspace@0__:{key}")
    subscribed = threading.Event()
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            message = pubsub.get_message(timeout=0.05)
            if message is None:
                continue
            if message["type"] == "subscribe":
                subscribed.set()
            elif message["type"] == "message":
                events.put(message["data"].decode())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        assert subscribed.wait(WAIT), "the keyspace subscription was not confirmed"
        yield events
    finally:
        stop.set()
        listener.join(WAIT)
        pubsub.close()


def renewal_landed(client: redis.Redis) -> None:
    """Wait (real time) until the lease's expiry goes up again: a renewal reached the server."""
    deadline = time.monotonic() + WAIT
    last = client.pttl(KEY)
    while time.monotonic() < deadline:
        left = client.pttl(KEY)
        if left > last:
            return
        last = left
        time.sleep(0.005)
    raise AssertionError(f"no renewal of {KEY!r} reached the server in {WAIT} s")


def first_of(events: queue.Queue[str], wanted: set[str]) -> str | None:
    """The first event in ``wanted`` within ``WAIT`` real seconds, else None."""
    try:
        while True:
            event = events.get(timeout=WAIT)
            if event in wanted:
                return event
    except queue.Empty:
        return None


def test_a_lease_lost_while_its_renewal_reply_is_held_is_released(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory("--enable-debug-command", "local")
    direct = server.client()
    direct.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0")
    direct.config_set("notify-keyspace-events", "Kg")
    with TcpProxy(server.port) as proxy:
        store = RedisLockStore(
            f"redis://127.0.0.1:{proxy.port}/0?socket_timeout=30&socket_connect_timeout=5"
        )
        try:
            with (
                keyspace_events(direct, KEY) as events,
                lease("k", store=store, ttl=TTL) as held,
            ):
                # One renewal answered first: its connection is open, so the next renewal's
                # request needs no reply before it reaches the server.
                entry = held._entry
                assert entry is not None
                poll_until(lambda: entry.renewals >= 1, timeout=WAIT, what="a first renewal")
                proxy.hold_replies()  # the next renewal lands; its reply waits in the proxy
                renewal_landed(direct)
                # As if that renewal had a long ttl: the key can then only go by a DEL, however
                # long this machine takes between the steps below.
                direct.pexpire(KEY, 600_000)
                assert held.wait_lost(WAIT), "the lease was not recorded lost at its validity"
                reason = held.lost_reason
                proxy.restore()  # the renewal's late answer reaches the renewer
                freed = first_of(events, {"del"})
        finally:
            proxy.restore()
            store.close()
    assert reason == "expired"
    assert freed == "del", f"no DEL of the lost lease's key in {WAIT} s while the body ran"
