"""Re-entry belongs to the entering thread (or asyncio task), as an ``RLock``'s does.

Code that inherits the lease's context on another thread (``asyncio.to_thread``,
``contextvars.copy_context().run`` on a thread, asgiref's ``sync_to_async``) runs concurrently
with the holder: it must not re-enter the holder's lease, it must try to acquire like anyone else.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

from celery_lease import MemoryLockStore, lease
from celery_lease.errors import LockNotAcquiredError
from tests.unit.conftest import REAL_TIMEOUT


def try_enter(store: MemoryLockStore) -> str:
    try:
        with lease("k", store=store, wait=0) as held:
            return f"entered token {held.token}"
    except LockNotAcquiredError:
        return "refused"


class TestOtherThreads:
    def test_a_thread_running_a_copied_context_does_not_re_enter(self) -> None:
        store = MemoryLockStore()
        results: list[str] = []
        with lease("k", store=store):
            context = contextvars.copy_context()
            thread = threading.Thread(target=lambda: results.append(context.run(try_enter, store)))
            thread.start()
            thread.join(REAL_TIMEOUT)
        assert results == ["refused"]

    def test_to_thread_from_a_sync_lease_does_not_re_enter(self) -> None:
        store = MemoryLockStore()

        async def main() -> list[str]:
            return list(
                await asyncio.gather(
                    asyncio.to_thread(try_enter, store), asyncio.to_thread(try_enter, store)
                )
            )

        with lease("k", store=store):
            results = asyncio.run(main())
        assert results == ["refused", "refused"]

    def test_the_entering_thread_still_re_enters(self) -> None:
        store = MemoryLockStore()
        with lease("k", store=store) as outer, lease("k", store=store, wait=0) as inner:
            assert inner is outer

    def test_the_entering_thread_re_enters_after_its_context_was_copied_elsewhere(self) -> None:
        store = MemoryLockStore()
        with lease("k", store=store) as outer:
            context = contextvars.copy_context()
            results: list[str] = []
            thread = threading.Thread(target=lambda: results.append(context.run(try_enter, store)))
            thread.start()
            thread.join(REAL_TIMEOUT)
            with lease("k", store=store, wait=0) as inner:
                assert inner is outer
        assert results == ["refused"]

    def test_another_thread_waiting_gets_the_key_with_its_own_owner_after_the_holder(
        self,
    ) -> None:
        """With ``wait`` the other thread waits for the holder's release, then holds it anew."""
        store = MemoryLockStore()
        got: list[tuple[str, int]] = []
        trying = threading.Event()

        def wait_for_it() -> None:
            trying.set()
            with lease("k", store=store, wait=REAL_TIMEOUT) as held:
                got.append((held.owner, held.token))

        with lease("k", store=store) as outer:
            context = contextvars.copy_context()
            thread = threading.Thread(target=context.run, args=(wait_for_it,))
            thread.start()
            assert trying.wait(REAL_TIMEOUT)
            assert got == []
            owner, token = outer.owner, outer.token
        thread.join(REAL_TIMEOUT)
        assert len(got) == 1 and got[0][0] != owner and got[0][1] > token


class TestAsyncioTasks:
    def test_to_thread_from_a_task_does_not_re_enter_its_lease(self) -> None:
        store = MemoryLockStore()

        async def main() -> tuple[str, bool]:
            async with lease("k", store=store) as outer:
                refused = await asyncio.to_thread(try_enter, store)
                async with lease("k", store=store, wait=0) as inner:
                    return refused, inner is outer

        assert asyncio.run(main()) == ("refused", True)

    def test_a_task_of_a_loop_run_inside_a_sync_lease_body_re_enters_on_that_thread(
        self,
    ) -> None:
        """Its loop runs inside the body, on the entering thread (as an RLock's owner)."""
        store = MemoryLockStore()

        async def inner() -> object:
            async with lease("k", store=store, wait=0) as held:
                return held

        with lease("k", store=store) as outer:
            assert asyncio.run(inner()) is outer
