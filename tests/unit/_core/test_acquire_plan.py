"""One table of acquire scenarios, run through ``with`` and through ``async with``.

Each scenario scripts the store's answers to the tries and how far its clock jumps during a
pause; both drivers of the acquire plan must try as often, pause as long, end the same way and
clean up the same attempts. The store's clock is a ``FakeClock`` the lease is not given: the
wait is measured on the store's clock in both.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import celery_lease
from celery_lease import (
    LockNotAcquiredError,
    MemoryLockStore,
    ReplicaLagError,
    StoreUnavailableError,
    ThreadedAsyncStore,
    lease,
)
from celery_lease._core.dispatch import drain
from celery_lease.stores.base import LockStore
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT

Reply = int | None | BaseException
"""What the store answers a try: a token, ``None`` (held), or an error it raises."""


class ScriptedStore:
    """A synchronous store answering acquires from a script, on a FakeClock.

    ``wait_for_release`` returns at once, after moving the clock by the pause (plus the
    scenario's jump for that pause).
    """

    def __init__(self, replies: list[Reply], jumps: list[float]) -> None:
        self.clock = FakeClock(1000.0)
        self.replies = list(replies)
        self.jumps = list(jumps)
        self.owners: list[str] = []
        self.pauses: list[float] = []
        self.released: list[str] = []
        self.lock = threading.Lock()

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        self.owners.append(owner)
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    def release(self, key: str, owner: str) -> None:
        with self.lock:
            self.released.append(owner)

    def wait_for_release(self, key: str, timeout: float) -> bool:
        self.pauses.append(timeout)
        # A real wait ends at its deadline or a little after it.
        self.clock.advance(timeout + 1e-6 + (self.jumps.pop(0) if self.jumps else 0.0))
        return False


class ScriptedAsyncStore:
    """The async twin of a :class:`ScriptedStore`: each call is its twin's, awaited."""

    def __init__(self, sync: ScriptedStore) -> None:
        self._sync = sync

    @property
    def sync(self) -> LockStore:
        return self._sync

    async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self._sync.acquire(key, owner, ttl_ms)

    async def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._sync.renew(key, owner, ttl_ms)

    async def release(self, key: str, owner: str) -> None:
        self._sync.release(key, owner)

    async def wait_for_release(self, key: str, timeout: float) -> bool:
        return self._sync.wait_for_release(key, timeout)

    async def aclose(self) -> None:
        return None


@dataclass(frozen=True)
class Scenario:
    """Store answers and clock jumps in; outcome, tries, pauses and clean-ups out."""

    name: str
    replies: list[Reply]
    wait: float
    outcome: type[BaseException] | None  # None: the lease is held
    pauses: list[float]
    jumps: list[float] = field(default_factory=list)
    cleaned_up: list[int] = field(default_factory=list)  # tries whose owner id is released


LAG = ReplicaLagError("injected: the replicas did not confirm")
DOWN = StoreUnavailableError("injected")

SCENARIOS = [
    Scenario("free key", [7], 0, None, []),
    Scenario("held, no wait", [None], 0, LockNotAcquiredError, []),
    Scenario("freed after two tries", [None, None, 7], 5, None, [0.05, 0.1]),
    Scenario(
        "backoff doubles to one second, then the wait runs out",
        [None] * 8,
        3,
        LockNotAcquiredError,
        [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 0.45],
    ),
    Scenario(
        "the store's clock jumps past the wait during the first pause",
        [None, None],
        5,
        LockNotAcquiredError,
        [0.05],
        jumps=[6.0],
    ),
    Scenario("replica lag is asked again", [LAG, 7], 5, None, [0.05]),
    Scenario(
        "replica lag at the end of the wait is raised and its attempt released",
        [LAG, LAG],
        0.05,
        ReplicaLagError,
        [0.05],
        cleaned_up=[1],
    ),
    Scenario(
        "a failed try is released and raised",
        [None, DOWN],
        5,
        StoreUnavailableError,
        [0.05],
        cleaned_up=[1],
    ),
]


@pytest.fixture(autouse=True)
def threads_stop() -> Iterator[None]:
    yield
    assert drain()
    celery_lease.shutdown()


def enter_sync(store: ScriptedAsyncStore, wait: float) -> None:
    with lease("k", store=store, wait=wait):
        pass


def enter_async(store: ScriptedAsyncStore, wait: float) -> None:
    async def main() -> None:
        async with lease("k", store=store, wait=wait):
            pass

    async def guarded() -> None:
        await asyncio.wait_for(main(), REAL_TIMEOUT)

    asyncio.run(guarded())


@pytest.mark.parametrize("enter", [enter_sync, enter_async], ids=["with", "async with"])
@pytest.mark.parametrize("case", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_both_drivers_follow_the_same_plan(case: Scenario, enter: object) -> None:
    """The tries, pauses, outcome and clean-ups of a scenario are the same in both drivers."""
    sync = ScriptedStore(case.replies, case.jumps)
    store = ScriptedAsyncStore(sync)
    assert callable(enter)
    if case.outcome is None:
        enter(store, case.wait)
    else:
        with pytest.raises(case.outcome):
            enter(store, case.wait)
    assert drain()
    assert len(sync.owners) == len(case.replies), "tries"
    assert sync.pauses == pytest.approx(case.pauses, abs=0.01)  # less the real time it took
    assert len(set(sync.owners)) == 1, "one owner id per acquisition"
    expected = [sync.owners[i] for i in case.cleaned_up]
    if case.outcome is None:
        expected.append(sync.owners[-1])  # the exit's release
    assert sync.released == expected


class PauseNoting(ThreadedAsyncStore):
    """A thread adapter that counts the pauses of waiters and sets ``pausing`` at each."""

    pausing: asyncio.Event
    pauses = 0

    async def wait_for_release(self, key: str, timeout: float) -> bool:
        self.pauses += 1
        self.pausing.set()
        return await super().wait_for_release(key, timeout)


def test_an_async_wait_on_the_plugin_store_ends_when_its_clock_passes_the_wait(
    lease_store: MemoryLockStore, lease_clock: FakeClock
) -> None:
    """``async with lease(key, wait="5s")`` on the plugin's store counts its wait on
    ``lease_clock``, as ``with`` does: it gives up at the first try after the test moved that
    clock by 5 s (not after 5 s of the event loop's time, pausing all the while)."""
    lease_store.acquire("report", "another-worker", 60_000)
    store = PauseNoting(lease_store)

    async def enter() -> None:
        async with lease("report", store=store, wait="5s"):
            pass

    async def main() -> None:
        store.pausing = asyncio.Event()
        waiter = asyncio.create_task(enter())
        await store.pausing.wait()
        lease_clock.advance(5)
        await asyncio.wait_for(waiter, REAL_TIMEOUT)

    try:
        with pytest.raises(LockNotAcquiredError):
            asyncio.run(main())
        assert store.pauses == 1
    finally:
        lease_store.force_release("report")


class _Token(int):
    """A token of a subclass of ``int``, as a store built on another driver may return."""


class IntSubclassTokenStore(MemoryLockStore):
    """A memory store whose grants are ``_Token`` instances, not plain ``int``."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        token = super().acquire(key, owner, ttl_ms)
        return None if token is None else _Token(token)


@pytest.mark.parametrize("driver", ["with", "async with"])
def test_a_token_of_an_int_subclass_is_a_grant(driver: str) -> None:
    store = IntSubclassTokenStore()

    async def enter_async() -> int:
        async with lease("k", store=ThreadedAsyncStore(store)) as held:
            pass
        return held.token

    if driver == "with":
        with lease("k", store=store) as held:
            token = held.token
    else:
        token = asyncio.run(enter_async())
    assert token >= 1
    assert store.get("k") is None  # released at the exit, not left held by a refused grant
