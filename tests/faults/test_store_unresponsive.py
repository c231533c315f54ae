"""Fault 4: the store stops answering (server SIGSTOPped, or traffic blackholed by a proxy)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator

import pytest

from celery_lease import lease
from celery_lease.errors import LockLostError, StoreUnavailableError
from celery_lease.stores.redis import RedisLockStore
from tests.faults.harness import now
from tests.faults.tcp_proxy import TcpProxy
from tests.fixtures_redis import RedisServer

pytestmark = pytest.mark.slow

TTL = 2.0
SOCKET_TIMEOUT = 0.5
SLACK = 0.5  # scheduling noise of a loaded 2-core machine


@pytest.fixture(params=["sigstop", "blackhole"])
def outage(
    request: pytest.FixtureRequest, own_redis: RedisServer
) -> Iterator[tuple[RedisLockStore, Callable[[], None]]]:
    """A store with a short socket timeout, and a function that makes its server go silent."""
    proxy: TcpProxy | None = None
    port = own_redis.port
    if request.param == "blackhole":
        proxy = TcpProxy(own_redis.port).start()
        port = proxy.port
    # Built from a URL, the store's client has no redis-py retries of its own (a redis-py 8
    # client built by hand retries 10 times with backoff: ~18 s per call against a silent server).
    store = RedisLockStore(
        f"redis://127.0.0.1:{port}/0"
        f"?socket_timeout={SOCKET_TIMEOUT}&socket_connect_timeout={SOCKET_TIMEOUT}"
    )
    assert store.client.ping()

    def go_silent() -> None:
        if proxy is not None:
            proxy.blackhole()
        else:
            os.kill(own_redis.pid, signal.SIGSTOP)  # type: ignore[arg-type]

    try:
        yield store, go_silent
    finally:
        if proxy is not None:
            proxy.close()
        else:
            os.kill(own_redis.pid, signal.SIGCONT)  # type: ignore[arg-type]
        store.close()


def test_acquire_fails_with_store_unavailable_within_its_timeout(
    outage: tuple[RedisLockStore, Callable[[], None]],
) -> None:
    """Acquiring from a silent store raises StoreUnavailableError within the client's timeout
    (one retry), and the body never runs."""
    store, go_silent = outage
    go_silent()
    ran = False
    started = now()
    with pytest.raises(StoreUnavailableError), lease("silent", store=store, ttl=TTL, wait=5):
        ran = True
    elapsed = now() - started
    assert not ran
    assert elapsed <= 2 * SOCKET_TIMEOUT + SLACK, f"acquire took {elapsed:.3f} s"


def test_holder_is_reported_lost_before_its_ttl_runs_out(
    outage: tuple[RedisLockStore, Callable[[], None]],
) -> None:
    """When the store goes silent under a holder, ``lost`` and ``wait_lost`` say so before the
    ttl runs out, and a body that checks its lease cannot finish as a success."""
    store, go_silent = outage
    recorded: list[float] = []
    with pytest.raises(LockLostError), lease("silent", store=store, ttl=TTL) as held:
        # Timed where the loss is recorded (an immediate listener runs on that thread) and
        # from when the acquire was sent (the lease's own start, on the same monotonic clock):
        # not from this thread, which a loaded machine may wake later than the ttl.
        held.add_loss_listener(lambda _: recorded.append(now()), immediate=True)
        sent = held.acquired_at
        go_silent()
        assert held.wait_lost(timeout=TTL + 5)
        while now() - sent < TTL * 1.5:  # the body keeps working and checking its lease
            held.check()
        pytest.fail("the body finished as if it held the lease")
    (lost_at,) = recorded
    assert lost_at - sent < TTL, f"lost recorded {lost_at - sent:.3f} s after acquiring"


def test_on_lost_is_called_before_the_ttl_runs_out(
    outage: tuple[RedisLockStore, Callable[[], None]],
) -> None:
    """``on_lost`` fires before the ttl runs out even while the renewer waits on a silent store."""
    store, go_silent = outage
    called = threading.Event()
    when: list[float] = []

    def on_lost(_: object) -> None:
        when.append(now())
        called.set()

    sent = now()
    with lease("silent", store=store, ttl=TTL, on_lost=on_lost):
        go_silent()
        assert called.wait(TTL + 4 * SOCKET_TIMEOUT + 2), "on_lost was never called"
    assert when[0] - sent < TTL, f"on_lost called {when[0] - sent:.3f} s after acquiring"
