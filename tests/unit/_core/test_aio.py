"""``async with lease(...)`` and ``@lease`` on ``async def``: on a FakeClock, never sleeping.

The loops are driven with ``asyncio.run`` (and a loop of our own for "inside a running loop"),
so no asyncio plugin is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

import celery_lease
from celery_lease import (
    LeaseConfigError,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    SQLiteLockStore,
    StoreUnavailableError,
    current_lease,
    get_lock_token,
    lease,
)
from celery_lease._core import aio
from celery_lease._core.aio import ThreadedAsyncStore
from celery_lease._core.dispatch import drain
from celery_lease._core.renewer import get_renewer
from celery_lease.stores import async_store_from_url
from celery_lease.stores import threaded as _aio_store
from celery_lease.stores.base import AsyncLockStore
from celery_lease.testing import FakeClock
from tests.adversary import AdversaryStore
from tests.unit.conftest import REAL_TIMEOUT, SpyStore

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    """Run ``coro`` under ``asyncio.run`` with a real-time guard (a hang fails, never blocks)."""

    async def guarded() -> T:
        return await asyncio.wait_for(coro, REAL_TIMEOUT)

    return asyncio.run(guarded())


def take_away(store: MemoryLockStore, key: str) -> None:
    """Another owner takes ``key`` (an operator's force-release, then a new holder)."""
    store.force_release(key)
    assert store.acquire(key, "intruder", 60_000) is not None


def cancelling(task: asyncio.Task[Any]) -> int:
    """``task.cancelling()`` (Python 3.11+); 0 on 3.10, which does not count cancel requests."""
    count = getattr(task, "cancelling", None)
    return 0 if count is None else int(count())


@pytest.fixture(autouse=True)
def nothing_left_held() -> Iterator[None]:
    """After each test no lease is held and celery-lease's threads stop (shutdown raises if not)."""
    before = set(threading.enumerate())
    yield
    assert drain()
    celery_lease.shutdown()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, leaked


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the loop until ``predicate()`` holds (looking again every millisecond)."""
    while not predicate():
        await asyncio.sleep(0.001)


class GatedStore(MemoryLockStore):
    """A MemoryLockStore whose acquire or release can be held at a gate, counted."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        super().__init__(clock=clock)
        self.gate_acquire = threading.Event()
        self.gate_acquire.set()
        self.gate_release = threading.Event()
        self.gate_release.set()
        self.in_acquire = threading.Event()
        self.in_release = threading.Event()
        self.releases: list[str] = []
        self.released = threading.Condition()

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        self.in_acquire.set()
        assert self.gate_acquire.wait(REAL_TIMEOUT)
        return super().acquire(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.in_release.set()
        assert self.gate_release.wait(REAL_TIMEOUT)
        super().release(key, owner)
        with self.released:
            self.releases.append(owner)
            self.released.notify_all()

    def wait_releases(self, count: int) -> None:
        with self.released:
            assert self.released.wait_for(lambda: len(self.releases) >= count, REAL_TIMEOUT)


class TestAsyncWith:
    def test_holds_then_releases(self, store: SpyStore, clock: FakeClock) -> None:
        """In the block the key is held by the lease's owner; after it, the key is free."""

        async def main() -> None:
            async with lease("k", store=store, clock=clock, ttl="30s") as held:
                info = store.get("k")
                assert info is not None and info.owner == held.owner
                assert info.token == held.token and not held.lost
            assert store.get("k") is None

        run(main())

    def test_holder_label_is_in_the_owner_id(self, store: SpyStore, clock: FakeClock) -> None:
        """lease(holder=...) labels the owner id of an async acquisition as of a sync one."""

        async def main() -> str:
            async with lease("k", store=store, clock=clock, holder="web") as held:
                return held.owner

        with lease("j", store=store, clock=clock, holder="web") as sync_held:
            sync_owner = sync_held.owner
        owner = run(main())
        assert "l=web" in sync_owner and "l=web" in owner

    def test_decorator_on_async_def(self, store: SpyStore, clock: FakeClock) -> None:
        """@lease on an async def holds the key for each call and returns the body's value."""
        seen: list[int | None] = []

        @lease("k", store=store, clock=clock)
        async def job(x: int) -> int:
            seen.append(get_lock_token())
            assert store.get("k") is not None
            return x * 2

        assert asyncio.iscoroutinefunction(job)
        assert run(job(21)) == 42
        assert run(job(1)) == 2
        assert len(seen) == 2 and seen[0] is not None and seen[1] is not None
        assert seen[1] > seen[0] and store.get("k") is None

    def test_token_in_body_and_child_tasks(self, store: SpyStore, clock: FakeClock) -> None:
        """get_lock_token()/current_lease() work in the body and in the tasks it creates."""

        async def child() -> tuple[int | None, object]:
            await asyncio.sleep(0)
            return get_lock_token(), current_lease()

        async def main() -> None:
            assert get_lock_token() is None
            async with lease("k", store=store, clock=clock) as held:
                assert get_lock_token() == held.token and current_lease() is held
                token, current = await asyncio.create_task(child())
                assert token == held.token and current is held
                results = await asyncio.gather(child(), child())
                assert results == [(held.token, held), (held.token, held)]
            assert get_lock_token() is None

        run(main())

    def test_sibling_tasks_do_not_see_each_others_lease(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Two tasks holding different keys at once each see their own lease (per-task context)."""

        async def holder(key: str, mine: asyncio.Event, theirs: asyncio.Event) -> str | None:
            async with lease(key, store=store, clock=clock):
                mine.set()
                await theirs.wait()  # both hold their key now
                current = current_lease()
                return None if current is None else current.key

        async def main() -> None:
            a_in, b_in = asyncio.Event(), asyncio.Event()
            got = await asyncio.gather(holder("a", a_in, b_in), holder("b", b_in, a_in))
            assert got == ["a", "b"]

        run(main())

    def test_reentrant_on_same_key_and_store(self, store: SpyStore, clock: FakeClock) -> None:
        """A nested async with on the same key and store reuses the held lease."""

        async def main() -> None:
            async with lease("k", store=store, clock=clock) as outer:
                async with lease("k", store=store, clock=clock) as inner:
                    assert inner is outer
                assert store.get("k") is not None and not outer.lost
            assert store.get("k") is None

        run(main())

    def test_child_task_does_not_reenter_its_parents_lease(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A task created in the block sees the lease but, taking the key, waits for the parent."""
        events: list[str] = []

        async def child() -> None:
            assert current_lease() is not None  # it sees the parent's lease
            events.append("child tries")
            async with lease("k", store=store, clock=clock, wait="1h") as held:
                events.append("child holds")
                assert held.waited

        async def main() -> None:
            async with lease("k", store=store, clock=clock):
                task = asyncio.create_task(child())
                await until(lambda: bool(_aio_store._waiters))  # the child waits for the key
                events.append("parent leaves")
            await task

        run(main())
        assert events == ["child tries", "parent leaves", "child holds"]

    def test_held_key_is_rejected_and_wait_runs_out(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """wait=0 fails at once; a wait that runs out (fake time) raises LockNotAcquiredError."""
        store.acquire("k", "someone-else", 60_000)

        async def main() -> None:
            with pytest.raises(LockNotAcquiredError):
                async with lease("k", store=store, clock=clock):
                    pass
            waiter = asyncio.create_task(
                lease("k", store=store, clock=clock, wait="5s").__aenter__()
            )
            await until(lambda: bool(_aio_store._waiters))  # it waits between two tries
            clock.advance(6.0)
            with pytest.raises(LockNotAcquiredError):
                await waiter

        run(main())
        info = store.get("k")
        assert info is not None and info.owner == "someone-else"

    def test_waiter_wakes_on_async_release(self, clock: FakeClock) -> None:
        """A coroutine waiting for the key gets it once the holder's block ends (no fake time).
        The holder leaves once the waiter was refused (its acquire runs on a thread)."""
        order: list[str] = []
        refused: list[str] = []

        class RefusalStore(SpyStore):
            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                token = super().acquire(key, owner, ttl_ms)
                if token is None:
                    refused.append(key)
                return token

        store = RefusalStore(clock)

        async def first(entered: asyncio.Event, go: asyncio.Event) -> None:
            async with lease("k", store=store, clock=clock):
                entered.set()
                await go.wait()
                order.append("first out")

        async def second(entered: asyncio.Event) -> None:
            await entered.wait()
            async with lease("k", store=store, clock=clock, wait="1h") as held:
                order.append("second in")
                assert held.waited

        async def main() -> None:
            entered, go = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(first(entered, go)), asyncio.create_task(second(entered))]
            await entered.wait()
            await until(lambda: bool(refused))
            go.set()
            await asyncio.gather(*tasks)

        run(main())
        assert order == ["first out", "second in"]


class TestStores:
    def test_sync_store_is_wrapped(self, store: SpyStore, clock: FakeClock) -> None:
        """A sync store works with async with: its calls run on threads, not on the loop."""
        threads: list[str] = []
        acquire = store.acquire

        def spy(key: str, owner: str, ttl_ms: int) -> int | None:
            threads.append(threading.current_thread().name)
            return acquire(key, owner, ttl_ms)

        store.acquire = spy  # type: ignore[method-assign]

        async def main() -> str:
            async with lease("k", store=store, clock=clock):
                pass
            return threading.current_thread().name

        loop_thread = run(main())
        assert threads and all(name != loop_thread for name in threads)

    def test_async_store_is_awaited_and_its_twin_renews(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """An AsyncLockStore passed to lease() is awaited; renewals go through its .sync."""
        astore = ThreadedAsyncStore(store)
        assert isinstance(astore, AsyncLockStore)

        async def main() -> None:
            async with lease("k", store=astore, clock=clock, ttl=3) as held:
                assert held.store is store
                clock.advance(1.0)
                await asyncio.to_thread(store.wait_renewals, 1)
                assert not held.lost

        run(main())
        assert store.renewals and store.get("k") is None

    def test_async_store_with_a_bad_twin_is_refused(self) -> None:
        """An async store whose .sync is no sync LockStore is refused by lease(), naming it."""

        class Broken(ThreadedAsyncStore):
            @property
            def sync(self) -> Any:
                return object()

        with pytest.raises(LeaseConfigError, match=r"\.sync"):
            lease("k", store=Broken(MemoryLockStore()))

    def test_url_string_is_refused_with_a_hint(self) -> None:
        """A URL string is not a store: the error names both factories."""
        with pytest.raises(LeaseConfigError, match="async_store_from_url"):
            lease("k", store="memory://")  # type: ignore[arg-type]

    def test_threaded_store_refuses_an_async_store(self) -> None:
        """ThreadedAsyncStore wraps sync stores only."""
        with pytest.raises(LeaseConfigError, match="synchronous LockStore"):
            ThreadedAsyncStore(ThreadedAsyncStore(MemoryLockStore()))  # type: ignore[arg-type]

    def test_async_store_from_url_local_schemes(self, tmp_path: Path) -> None:
        """memory:// and sqlite:/// give a ThreadedAsyncStore that owns its sync store."""

        async def main() -> None:
            for url in ("memory://", f"sqlite:///{tmp_path}/a.db"):
                astore = async_store_from_url(url)
                assert isinstance(astore, ThreadedAsyncStore)
                async with lease("k", store=astore) as held:
                    assert astore.sync.acquire("k", "other", 1000) is None
                    assert held.token > 0
                await astore.aclose()

        run(main())

    def test_async_store_from_url_unknown_scheme(self) -> None:
        """An unknown scheme is a LeaseConfigError listing the supported ones."""
        with pytest.raises(LeaseConfigError, match="supported"):
            async_store_from_url("mongodb://x")
        with pytest.raises(LeaseConfigError, match="not a URL"):
            async_store_from_url("nothing")

    def test_cancel_option_on_a_sync_function_is_refused(self, store: SpyStore) -> None:
        """on_lost='cancel' on a plain def fails at decoration time."""
        with pytest.raises(LeaseConfigError, match="async def"):

            @lease("k", store=store, on_lost="cancel")
            def job() -> None:
                pass

    def test_cancel_option_in_a_sync_with_is_refused(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """on_lost='cancel' in a plain ``with`` fails on entering, before anything is taken:
        the message names on_lost, its value and that it is for ``async with``."""
        context = lease("k", store=store, clock=clock, on_lost="cancel")
        with pytest.raises(LeaseConfigError, match=r"on_lost='cancel'.*async with"), context:
            raise AssertionError("never entered")
        assert store.last_token("k") is None  # never acquired

        async def use() -> int:
            async with lease("k", store=store, clock=clock, on_lost="cancel") as held:
                return held.token

        assert run(use()) > 0  # the same options work with async with

    def test_async_generator_function_is_refused(self, store: SpyStore) -> None:
        """@lease on an async generator function fails when decorating (it would hold nothing)."""
        with pytest.raises(LeaseConfigError, match="async generator"):

            @lease("k", store=store)
            async def rows() -> AsyncIterator[int]:
                yield 1

    def test_bad_on_lost_string_is_refused(self, store: SpyStore) -> None:
        """Only the string 'cancel' is accepted for on_lost."""
        with pytest.raises(LeaseConfigError, match="'cancel'"):
            lease("k", store=store, on_lost="revoke")  # type: ignore[arg-type]


class TestExclusion:
    def test_twenty_coroutines_never_overlap(self, store: SpyStore, clock: FakeClock) -> None:
        """20 coroutines racing for one key in one loop hold it one at a time, tokens growing."""
        inside = 0
        tokens: list[int] = []

        @lease("k", store=store, clock=clock, wait="1h", ttl=30)
        async def critical() -> None:
            nonlocal inside
            inside += 1
            assert inside == 1, "two holders at once"
            tokens.append(get_lock_token() or 0)
            for _ in range(3):
                await asyncio.sleep(0)  # let the others try while we hold it
                assert inside == 1
            inside -= 1

        async def main() -> None:
            await asyncio.gather(*(critical() for _ in range(20)))

        run(main())
        assert len(tokens) == 20 and tokens == sorted(set(tokens))

    def test_twenty_coroutines_on_sqlite(self, tmp_path: Path) -> None:
        """The same race over an SQLite file (ThreadedAsyncStore, polling between tries)."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        inside = 0
        held_by: list[int] = []

        async def critical(i: int) -> None:
            nonlocal inside
            async with lease("k", store=store, wait="1h", ttl=30):
                inside += 1
                assert inside == 1, "two holders at once"
                held_by.append(i)
                await asyncio.sleep(0)
                inside -= 1

        async def main() -> None:
            await asyncio.gather(*(critical(i) for i in range(20)))

        try:
            run(main())
        finally:
            store.close()
        assert sorted(held_by) == list(range(20))


class TestRenewalOffLoop:
    def test_blocked_loop_keeps_the_lease(self, store: SpyStore, clock: FakeClock) -> None:
        """While the loop is blocked (2 x ttl of fake time pass), the renewer thread renews."""
        ttl = 3.0

        def move_time() -> None:  # another thread moves time while the loop cannot run
            for step in range(1, 7):
                clock.advance(ttl / 3)
                store.wait_renewals(step)

        async def main() -> list[str]:
            async with lease("k", store=store, clock=clock, ttl=ttl) as held:
                mover = threading.Thread(target=move_time)
                mover.start()
                mover.join(REAL_TIMEOUT)  # blocks the loop, as a CPU-bound task would
                assert not mover.is_alive()
                assert not held.lost
                info = store.get("k")
                assert info is not None and info.owner == held.owner
            return [threading.current_thread().name]

        run(main())
        assert len(store.renewals) >= 6

    def test_time_sleep_of_two_thirds_ttl_keeps_the_lease(self) -> None:
        """A coroutine blocking the loop with time.sleep(2 x ttl/3) does not lose the lease.

        Real time on purpose: the renewer thread renews (due at ttl/3) while the loop sleeps.
        """
        renewed: list[tuple[str, float]] = []

        class Recording(MemoryLockStore):
            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                renewed.append((threading.current_thread().name, time.monotonic()))
                return super().renew(key, owner, ttl_ms)

        store = Recording()
        ttl = 0.6

        async def main() -> None:
            async with lease("k", store=store, ttl=ttl) as held:
                began = time.monotonic()
                time.sleep(2 * ttl / 3)  # the point of the test: the loop is blocked
                ended = time.monotonic()
                assert not held.lost
                held.check()
                info = store.get("k")
                assert info is not None and info.owner == held.owner
            during = [name for name, at in renewed if began <= at <= ended]
            assert during, "no renewal while the loop was blocked"
            assert all(name == "celery-lease-renewer" for name in during)

        run(main())


class TestCancelOnLoss:
    def test_loss_cancels_the_body_with_lock_lost(self, store: SpyStore, clock: FakeClock) -> None:
        """on_lost='cancel': a refused renewal cancels the body, which ends with LockLostError."""
        reached: list[str] = []

        async def main() -> None:
            task = asyncio.current_task()
            assert task is not None
            with pytest.raises(LockLostError) as info:
                async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel") as held:
                    take_away(store, "k")
                    clock.advance(1.0)  # the renewer renews: refused, "taken"
                    await asyncio.Event().wait()  # forever, unless cancelled
                    reached.append("after wait")
            assert info.value.key == "k" and held.lost_reason == "taken"
            intruder = store.get("k")
            assert intruder is not None and intruder.owner == "intruder"  # never released
            assert isinstance(info.value.__cause__, asyncio.CancelledError)
            assert cancelling(task) == 0  # our cancel was taken back
            await asyncio.sleep(0)  # and the task goes on: nothing else is pending

        run(main())
        assert reached == []

    def test_on_lost_listener_still_runs_on_the_dispatcher(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The loss is reported as for the sync lease: lost, check(), and a listener."""
        told: list[str] = []

        async def main() -> None:
            with pytest.raises(LockLostError):
                async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel") as held:
                    held.add_loss_listener(
                        lambda lease: told.append(threading.current_thread().name)
                    )
                    take_away(store, "k")
                    clock.advance(1.0)
                    await asyncio.Event().wait()
            assert held.lost
            with pytest.raises(LockLostError):
                held.check()

        run(main())
        assert drain() and len(told) == 1 and told[0].startswith("celery-lease-dispatch")

    @pytest.mark.skipif(
        sys.version_info < (3, 11),
        reason="3.10 merges an outside cancel of the same loop iteration into ours (documented)",
    )
    def test_outside_cancel_with_ours_propagates(
        self, store: SpyStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """When an outside cancel lands with ours, the block ends with CancelledError."""
        ours = aio.Canceller._cancel

        def both(self: Any) -> None:  # an outside cancel right after ours, same loop iteration
            ours(self)
            assert self.fired
            self.task.cancel()

        monkeypatch.setattr(aio.Canceller, "_cancel", both)

        async def body(entered: asyncio.Event) -> None:
            async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                entered.set()
                await asyncio.Event().wait()

        async def main() -> None:
            entered = asyncio.Event()
            task = asyncio.create_task(body(entered))
            await entered.wait()
            take_away(store, "k")
            clock.advance(1.0)
            with pytest.raises(asyncio.CancelledError):
                await task
            info = store.get("k")
            assert info is not None and info.owner == "intruder"  # its lease is left alone

        run(main())

    def test_loss_after_the_body_cancels_nothing(self, store: SpyStore, clock: FakeClock) -> None:
        """A block that ended normally is not cancelled later; the task goes on."""

        async def main() -> None:
            async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                pass
            await asyncio.sleep(0)
            task = asyncio.current_task()
            assert task is not None and cancelling(task) == 0

        run(main())

    def test_body_error_after_loss_is_lock_lost(self, store: SpyStore, clock: FakeClock) -> None:
        """Without 'cancel', a body raising after the loss leaves with LockLostError (chained)."""

        async def main() -> None:
            with pytest.raises(LockLostError) as info:
                async with lease("k", store=store, clock=clock, ttl=3) as held:
                    take_away(store, "k")
                    clock.advance(1.0)
                    await asyncio.to_thread(store.wait_renewals, 1)
                    assert held.lost
                    raise ValueError("boom")
            assert isinstance(info.value.__cause__, ValueError)

        run(main())


class TestCallerCancellation:
    def test_cancel_while_waiting_leaves_nothing_held(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Cancelling a waiter stops the wait: CancelledError, nothing held, no task left."""
        store.acquire("k", "someone-else", 60_000)

        async def waiter() -> None:
            async with lease("k", store=store, clock=clock, wait="1h"):
                raise AssertionError("never acquired")

        async def main() -> None:
            before = asyncio.all_tasks()
            task = asyncio.create_task(waiter())
            await until(lambda: bool(_aio_store._waiters))  # it waits for a release
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not _aio_store._waiters
            assert asyncio.all_tasks() == before  # no task of ours is left behind

        run(main())
        info = store.get("k")
        assert info is not None and info.owner == "someone-else"
        assert len(get_renewer(clock, store)) == 0

    def test_cancel_during_an_acquire_in_flight_releases_it(self, clock: FakeClock) -> None:
        """An acquire that lands after its caller was cancelled is released owner-checked."""
        store = GatedStore(clock)
        store.gate_acquire.clear()

        async def main() -> None:
            task = asyncio.create_task(lease("k", store=store, clock=clock).__aenter__())
            await asyncio.to_thread(store.in_acquire.wait, REAL_TIMEOUT)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(drain)  # the clean-up on the dispatcher ran first
            store.gate_acquire.set()  # the acquire takes effect now, after the cancel

        run(main())
        store.wait_releases(2)  # the dispatcher's (too early: a no-op) and the late undo
        assert store.get("k") is None

    def test_cancel_while_holding_releases(self, store: SpyStore, clock: FakeClock) -> None:
        """Cancelling the holder propagates CancelledError and releases the key."""

        async def holder(entered: asyncio.Event) -> None:
            async with lease("k", store=store, clock=clock):
                entered.set()
                await asyncio.Event().wait()

        async def main() -> None:
            entered = asyncio.Event()
            task = asyncio.create_task(holder(entered))
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert store.get("k") is None

        run(main())

    def test_cancelled_release_is_finished_off_loop(self, clock: FakeClock) -> None:
        """A cancel landing in the exit's release still frees the key (thread and dispatcher)."""
        store = GatedStore(clock)

        async def holder() -> None:
            async with lease("k", store=store, clock=clock):
                store.gate_release.clear()
                store.in_release.clear()

        async def main() -> None:
            task = asyncio.create_task(holder())
            await asyncio.to_thread(store.in_release.wait, REAL_TIMEOUT)
            task.cancel()  # while the release is on its thread
            with pytest.raises(asyncio.CancelledError):
                await task
            store.gate_release.set()

        run(main())
        store.wait_releases(2)  # the awaited one, finished on its thread, and the dispatcher's
        assert store.get("k") is None


class TestAdversary:
    def test_lost_acquire_reply_is_released(self, clock: FakeClock) -> None:
        """An acquire that took effect but lost its reply raises, and the attempt is freed."""
        store = AdversaryStore(MemoryLockStore(clock=clock))
        store.trap("acquire", lose_reply=True)

        async def main() -> None:
            with pytest.raises(StoreUnavailableError):
                async with lease("k", store=store, clock=clock):
                    raise AssertionError("never entered")

        run(main())
        assert drain()
        assert store.get("k") is None
        assert [outcome for method, _, outcome in store.history if method == "release"] == ["ok"]

    def test_failed_release_is_done_again_on_the_dispatcher(self, clock: FakeClock) -> None:
        """A release the store fails is retried on the dispatcher: the key does not wait a ttl."""
        store = AdversaryStore(MemoryLockStore(clock=clock))
        store.trap("release", fail=True)

        async def main() -> None:
            async with lease("k", store=store, clock=clock, ttl=30):
                pass

        run(main())
        assert drain()
        assert store.get("k") is None
        outcomes = [outcome for method, _, outcome in store.history if method == "release"]
        assert outcomes == ["failed", "ok"]

    def test_exit_during_a_renewal_in_flight_does_not_block_the_loop(
        self, clock: FakeClock
    ) -> None:
        """The exit waits for a renewal in flight off the loop: another coroutine lets it land.

        Only a coroutine can open the renewal's gate; had the exit blocked the loop while it
        waits for that renewal, the gate would open only on its timeout (``timed_out``).
        """
        store = AdversaryStore(MemoryLockStore(clock=clock))
        trap = store.trap("renew", delay="before")

        async def opener(exiting: asyncio.Event) -> None:
            await exiting.wait()
            trap.open()

        async def main() -> None:
            exiting = asyncio.Event()
            opening = asyncio.create_task(opener(exiting))
            async with lease("k", store=store, clock=clock, ttl=3) as held:
                clock.advance(1.0)
                await asyncio.to_thread(trap.wait_entered)  # the renewal is on the wire
                exiting.set()  # the opener runs at the exit's first await, not before
            await opening
            assert not held.lost

        run(main())
        assert not trap.timed_out
        assert store.get("k") is None

    def test_cooldown_keeps_the_key_after_success(self, store: SpyStore, clock: FakeClock) -> None:
        """cooldown works as for the sync lease: the key stays taken after a successful block."""

        async def main() -> None:
            async with lease("k", store=store, clock=clock, cooldown="10s"):
                pass

        run(main())
        info = store.get("k")
        assert info is not None and 9.0 < info.expires_in <= 10.0
        clock.advance(10.0)
        assert store.get("k") is None


class TestLoops:
    def test_inside_a_loop_of_our_own(self, store: SpyStore, clock: FakeClock) -> None:
        """Works in a loop run with run_until_complete, and from a loop in another thread."""

        async def use() -> int:
            async with lease("k", store=store, clock=clock) as held:
                return held.token

        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(use()) > 0
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        other = asyncio.new_event_loop()
        thread = threading.Thread(target=other.run_forever)
        thread.start()
        try:
            future = asyncio.run_coroutine_threadsafe(use(), other)
            assert future.result(REAL_TIMEOUT) > 0
        finally:
            asyncio.run_coroutine_threadsafe(other.shutdown_default_executor(), other).result(
                REAL_TIMEOUT
            )
            other.call_soon_threadsafe(other.stop)
            thread.join(REAL_TIMEOUT)
            other.close()
        assert store.get("k") is None


needs_uncancel = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Task.cancelling()/uncancel() and asyncio.timeout: 3.11+"
)


class TestCancelOnLossBookkeeping:
    @needs_uncancel
    def test_outside_cancel_during_the_exit_after_ours_keeps_the_count_right(
        self, clock: FakeClock
    ) -> None:
        """Our cancel fired, then a timeout fires while the exit awaits the release: the
        ``asyncio.timeout`` around the block still turns it into TimeoutError (our cancel
        request was taken back, not left counted on the task)."""
        store = GatedStore(clock)
        seen: list[str] = []

        async def holder(entered: asyncio.Event, scopes: list[asyncio.Timeout]) -> None:
            try:
                async with asyncio.timeout(None) as scope:
                    scopes.append(scope)
                    async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                        entered.set()
                        await asyncio.Event().wait()
            except TimeoutError:
                seen.append("timeout")
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            task = asyncio.current_task()
            assert task is not None
            seen.append(f"cancelling={task.cancelling()}")

        async def main() -> None:
            entered = asyncio.Event()
            scopes: list[asyncio.Timeout] = []
            task = asyncio.create_task(holder(entered, scopes))
            await entered.wait()
            store.gate_release.clear()
            store.in_release.clear()
            take_away(store, "k")
            clock.advance(1.0)  # the renewal is refused: lost, our cancel lands in the body
            await asyncio.to_thread(store.in_release.wait, REAL_TIMEOUT)  # exit: in release
            scopes[0].reschedule(asyncio.get_running_loop().time())  # the timeout fires now
            await until(lambda: bool(seen))
            store.gate_release.set()
            await asyncio.gather(task, return_exceptions=True)

        run(main())
        assert seen == ["timeout", "cancelling=0"]

    def test_body_that_swallows_our_cancel_ends_with_lock_lost(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A body that catches our CancelledError and returns still leaves with LockLostError,
        and the task is not left cancelling."""

        async def main() -> None:
            task = asyncio.current_task()
            assert task is not None
            with pytest.raises(LockLostError):
                async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                    take_away(store, "k")
                    clock.advance(1.0)
                    with contextlib.suppress(asyncio.CancelledError):  # it keeps the cancel
                        await asyncio.Event().wait()
            assert cancelling(task) == 0
            await asyncio.sleep(0)  # nothing pending: the task goes on

        run(main())

    def test_loss_landing_in_the_finally_of_an_outside_cancel_stays_cancelled(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The caller cancels; while the body's ``finally`` awaits its clean-up the lease is
        lost and our cancel lands there: the block ends with CancelledError (the caller's)."""
        entered = asyncio.Event()
        in_finally = asyncio.Event()

        async def body() -> None:
            async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                try:
                    entered.set()
                    await asyncio.Event().wait()
                finally:
                    in_finally.set()
                    await asyncio.Event().wait()  # a clean-up our cancel cuts short

        async def main() -> None:
            task = asyncio.create_task(body())
            await entered.wait()
            task.cancel()
            await in_finally.wait()
            take_away(store, "k")
            clock.advance(1.0)
            with pytest.raises(asyncio.CancelledError):
                await task

        run(main())

    def test_loss_in_the_handler_of_the_bodys_own_timeout_is_a_lost_lease(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The body's ``wait_for`` times out (its TimeoutError carries the cancel of the inner
        task) and the lease is lost while the handler awaits: the block ends with
        LockLostError, not as if the caller had cancelled it."""
        seen: list[str] = []

        async def body() -> None:
            try:
                async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                    try:
                        await asyncio.wait_for(asyncio.Event().wait(), 0.01)
                    except asyncio.TimeoutError:
                        take_away(store, "k")
                        clock.advance(1.0)
                        await asyncio.Event().wait()  # our cancel lands here
            except LockLostError:
                seen.append("lock lost")
            except asyncio.CancelledError:
                seen.append("cancelled")

        run(body())
        assert seen == ["lock lost"]

    @needs_uncancel
    def test_taskgroup_sibling_failing_with_a_loss_propagates_the_group_error(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The loss and a failing sibling cancel the body in the same loop iteration: the body
        ends cancelled (the group's cancel stays a cancel), the group raises only the sibling's
        error."""

        async def body(entered: asyncio.Event) -> None:
            async with lease("k", store=store, clock=clock, ttl=3, on_lost="cancel"):
                entered.set()
                await asyncio.Event().wait()

        async def sibling(entered: asyncio.Event) -> None:
            await entered.wait()
            take_away(store, "k")
            clock.advance(1.0)
            store.wait_renewals(1)  # blocking the loop: the loss is recorded, our cancel queued
            raise ValueError("sibling failed")  # the group cancels the body in this iteration

        async def main() -> None:
            entered = asyncio.Event()
            with pytest.raises(ExceptionGroup) as info:  # noqa: F821 - 3.11+ builtin
                async with asyncio.TaskGroup() as group:
                    group.create_task(body(entered))
                    group.create_task(sibling(entered))
            errors = info.value.exceptions
            assert len(errors) == 1 and isinstance(errors[0], ValueError), errors

        run(main())


class TestLossReportedAtAnInterruptedExit:
    def test_lapse_found_by_the_exit_is_reported_when_the_release_is_cancelled(
        self, clock: FakeClock
    ) -> None:
        """The exit finds the lease past its validity (nobody noticed before) and the task is
        cancelled in the release: on_lost still runs, once, with "expired"."""
        store = GatedStore(clock)
        lost: list[str | None] = []

        async def holder() -> None:
            async with lease(
                "k", store=store, clock=clock, ttl=3, on_lost=lambda h: lost.append(h.lost_reason)
            ) as held:
                assert held._entry is not None
                held._entry.valid_until = clock.monotonic()  # only the exit sees the lapse
                store.gate_release.clear()
                store.in_release.clear()

        async def main() -> None:
            task = asyncio.create_task(holder())
            await asyncio.to_thread(store.in_release.wait, REAL_TIMEOUT)
            task.cancel()  # while the exit's release is on its thread
            with pytest.raises(asyncio.CancelledError):
                await task
            store.gate_release.set()

        run(main())
        store.wait_releases(2)
        assert drain()
        assert lost == ["expired"]
        assert store.get("k") is None


class TestReentryAcrossTasks:
    def test_child_task_with_a_sync_with_does_not_reenter_the_parents_async_lease(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A task created in an ``async with`` block that enters ``with lease(...)`` on the same
        key is another holder: with wait=0 it is refused, it does not share the parent's."""

        async def main() -> None:
            async with lease("k", store=store, clock=clock) as held:

                async def child() -> bool:
                    with lease("k", store=store, clock=clock) as mine:
                        return mine is held

                with pytest.raises(LockNotAcquiredError):
                    await asyncio.create_task(child())

        run(main())

    def test_child_task_does_not_reenter_a_sync_with_held_across_awaits(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A coroutine holds ``with lease(...)`` across awaits; a task it creates that enters
        ``async with lease(...)`` on the key must not hold it too (the parent may release first)."""

        async def main() -> None:
            with lease("k", store=store, clock=clock):
                child_in = asyncio.Event()
                parent_out = asyncio.Event()

                async def child() -> str:
                    async with lease("k", store=store, clock=clock):
                        child_in.set()
                        await parent_out.wait()
                        info = store.get("k")
                        return "alone" if info is not None else "key freed under me"

                task = asyncio.create_task(child())
                entered = asyncio.create_task(child_in.wait())
                await asyncio.wait({task, entered}, return_when=asyncio.FIRST_COMPLETED)
                entered.cancel()
            parent_out.set()
            with pytest.raises(LockNotAcquiredError):
                await task

        run(main())

    def test_child_task_lease_does_not_leak_into_siblings(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A lease entered in a child task is current there only, not in its parent or in a
        sibling created before or after it."""
        seen: dict[str, int | None] = {}

        async def main() -> None:
            go = asyncio.Event()

            async def sibling(name: str) -> None:
                await go.wait()
                seen[name] = celery_lease.get_lock_token()

            early = asyncio.create_task(sibling("early"))

            async def child() -> None:
                async with lease("k", store=store, clock=clock) as held:
                    seen["child"] = held.token
                    late = asyncio.create_task(sibling("grandchild"))
                    go.set()
                    await late

            await asyncio.create_task(child())
            await early
            seen["parent"] = celery_lease.get_lock_token()

        run(main())
        assert seen["child"] is not None and seen["grandchild"] == seen["child"]
        assert seen["early"] is None and seen["parent"] is None


class TestTwoLoops:
    def test_two_loops_in_two_threads_never_overlap(self) -> None:
        """Ten coroutines in each of two loops (two threads) race for one key of one memory
        store through the thread adapter: never two holders at once."""
        store = MemoryLockStore()
        inside: list[int] = []
        peak: list[int] = []
        mutex = threading.Lock()
        errors: list[BaseException] = []

        async def one() -> None:
            async with lease("k", store=store, ttl=30, wait=REAL_TIMEOUT):
                with mutex:
                    inside.append(1)
                    peak.append(len(inside))
                await asyncio.sleep(0)
                with mutex:
                    inside.pop()

        async def ten() -> None:
            await asyncio.gather(*(one() for _ in range(10)))

        def loop_thread() -> None:
            try:
                asyncio.run(ten())
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=loop_thread) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REAL_TIMEOUT * 3)
        assert not errors and len(peak) == 20 and max(peak) == 1
        assert store.get("k") is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
class TestFork:
    def test_forked_child_can_use_the_thread_adapter(self) -> None:
        """Forked while another thread held the adapter's waiter lock (a coroutine registering
        a wait, a release waking one): the child's ``async with`` does not deadlock."""
        store = MemoryLockStore()

        async def use() -> int:
            async with lease("k", store=store, ttl=30) as held:
                return held.token

        with _aio_store._waiters_lock:  # held by "another thread" at the moment of the fork
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 3
                try:
                    code = 0 if asyncio.run(use()) > 0 else 1
                finally:
                    os._exit(code)
        status: list[int] = []
        waiter = threading.Thread(target=lambda: status.append(os.waitpid(pid, 0)[1]))
        waiter.start()
        waiter.join(REAL_TIMEOUT)
        if waiter.is_alive():
            os.kill(pid, 9)
            waiter.join(REAL_TIMEOUT)
            pytest.fail("the forked child hung on the adapter's waiter lock")
        assert status and os.waitstatus_to_exitcode(status[0]) == 0


# The stores under async with: the thread adapter and the native stores' client side ----------


class _FakeCursor:
    def __init__(self, row: tuple[int] | None) -> None:
        self.row = row
        self.rowcount = 1

    async def fetchone(self) -> tuple[int] | None:
        return self.row


class _FakeConn:
    """A psycopg connection stand-in: the acquire's reply waits at ``gate``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.released: list[str] = []

    async def execute(self, statement: object, params: dict[str, Any]) -> _FakeCursor:
        if "ttl_ms" in params:  # the acquire: its reply lands when the gate opens
            self.entered.set()
            await self.gate.wait()
            return _FakeCursor((42,))
        self.released.append(params["owner"])
        return _FakeCursor(None)


class _FakePool:
    def __init__(self, conn: _FakeConn) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float | None = None) -> AsyncIterator[_FakeConn]:
        yield self.conn


class TestPostgresReplyRacingACancel:
    def test_a_reply_landing_with_the_callers_cancel_does_not_swallow_it(self) -> None:
        """The acquire's reply and the caller's cancel land in the same loop iteration: the
        cancel propagates (``asyncio.wait_for`` of Python 3.11 returns the result instead) and
        the lease the reply carried is released, owner-checked."""
        pytest.importorskip("psycopg")
        from celery_lease.stores.postgres_async import AsyncPostgresLockStore

        store = AsyncPostgresLockStore("postgresql://nobody@127.0.0.1:1/none")  # never dialled
        conn = _FakeConn()

        async def fake_pool() -> _FakePool:
            return _FakePool(conn)

        store._get_pool = fake_pool  # type: ignore[method-assign, assignment]

        async def main() -> None:
            task = asyncio.create_task(store.acquire("k", "attempt-1", 30_000))
            await conn.entered.wait()
            conn.gate.set()  # the reply is on its way back...
            task.cancel()  # ...as the caller gives up
            with pytest.raises(asyncio.CancelledError):
                await task
            assert conn.released == ["attempt-1"]

        run(main())


class TestAsyncStoreConstruction:
    def test_a_redis_replica_timeout_the_twin_does_not_share_is_refused(self) -> None:
        """With ``sync=`` given, a ``replica_timeout`` other than the twin's would be silently
        dropped (the twin's is used): refused at construction, naming the parameter."""
        pytest.importorskip("redis")
        from celery_lease.stores.redis import RedisLockStore
        from celery_lease.stores.redis_async import AsyncRedisLockStore

        url = "redis://127.0.0.1:1/0"  # never dialled
        twin = RedisLockStore(url)
        try:
            with pytest.raises(LeaseConfigError, match="replica_timeout='1s'"):
                AsyncRedisLockStore(url, sync=twin, replica_timeout="1s")
            same = AsyncRedisLockStore(url, sync=twin, replica_timeout=twin.replica_timeout)
            assert same.sync is twin
        finally:
            twin.close()


class _RecordingExecutor(ThreadPoolExecutor):
    """A default executor that keeps the futures it hands out (to see a call end)."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.futures: list[Future[Any]] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


class TestThreadAdapterCancel:
    def test_cancel_after_the_call_ended_but_before_its_reply_releases(
        self, clock: FakeClock
    ) -> None:
        """The adapter's acquire took the lease on its thread; the caller is cancelled before
        the result reaches the loop: the adapter itself releases it (owner-checked), as it does
        for a cancel that lands while the call runs."""
        store = GatedStore(clock)
        store.gate_acquire.clear()
        adapter = ThreadedAsyncStore(store)
        executor = _RecordingExecutor()

        async def main() -> None:
            asyncio.get_running_loop().set_default_executor(executor)
            task = asyncio.create_task(adapter.acquire("k", "attempt-1", 30_000))
            await asyncio.to_thread(store.in_acquire.wait, REAL_TIMEOUT)
            (call,) = [future for future in executor.futures if not future.done()]  # acquire
            store.gate_acquire.set()
            call.result(REAL_TIMEOUT)  # the loop waits: the call ended, its reply is queued
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run(main())
        store.wait_releases(1)
        assert store.get("k") is None
        assert store.releases == ["attempt-1"]


class TestLoopShutdown:
    def test_asyncio_run_ending_with_a_lease_held_in_a_task_releases_it(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """``asyncio.run`` returns while a background task still holds a lease: the run cancels
        the task, its exit releases the key before the loop closes, nothing stays renewed."""

        async def background(entered: asyncio.Event) -> None:
            async with lease("k", store=store, clock=clock, ttl=30):
                entered.set()
                await asyncio.Event().wait()

        async def main() -> None:
            entered = asyncio.Event()
            asyncio.get_running_loop().create_task(background(entered))  # never awaited
            await entered.wait()

        asyncio.run(main())
        assert store.get("k") is None
        assert len(get_renewer(clock, store)) == 0
