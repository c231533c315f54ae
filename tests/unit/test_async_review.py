"""Review attacks on ``async with lease(...)`` and the thread adapter (reviewer RA).

Each test forces one interleaving of the actors (the body's task, other tasks, the renewer
thread, the caller cancelling, a fork) with events and gates, never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import celery_lease
from celery_lease import (
    LeaseConfigError,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    _aio_store,
    lease,
)
from celery_lease.aio import ThreadedAsyncStore
from celery_lease.dispatch import drain
from celery_lease.renewer import get_renewer
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore
from tests.unit.test_async_lease import GatedStore, cancelling, run, take_away, until

needs_uncancel = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Task.cancelling()/uncancel() and asyncio.timeout: 3.11+"
)


@pytest.fixture(autouse=True)
def nothing_left_held() -> Iterator[None]:
    """After each test no lease is held and celery-lease's threads stop."""
    before = set(threading.enumerate())
    yield
    assert drain()
    celery_lease.shutdown()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, leaked


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


class TestConstruction:
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
        assert len(get_renewer(clock)) == 0
