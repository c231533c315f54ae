"""``lease(key, limit=n)``: up to ``n`` holders of one key at once, each in its own slot, each
renewed, lost and released as a lease of its own; waiting for a slot is woken by a release.

Holders run on threads of their own (a nested ``lease()`` of the same key in one thread re-enters
the outer one). The clock is a ``FakeClock`` that the tests move only where a test says so: a
waiter that gets a slot without the clock moving was woken by a release, not by a poll.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_lease import (
    Lease,
    LeaseConfigError,
    LockNotAcquiredError,
    MemoryLockStore,
    StoreUnavailableError,
    lease,
)
from celery_lease._core.dispatch import drain
from celery_lease.stores.slots import MAX_LIMIT, slot_key
from celery_lease.stores.threaded import ThreadedAsyncStore
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT
from tests.unit.core_faults import Interrupt, poll_until

KEY = "acct"


class SlotStore(MemoryLockStore):
    """A memory store that counts its calls and tells when a waiter starts waiting."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.slot_calls = 0
        self.plain_calls = 0
        self.renewed: list[str] = []
        self.released: list[str] = []
        self.owned_released: list[str] = []  # keys given to release_owned_slots
        self.waiting = threading.Event()

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        self.plain_calls += 1
        return super().acquire(key, owner, ttl_ms)

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        self.slot_calls += 1
        return super().acquire_slot(key, owner, ttl_ms, limit)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        self.renewed.append(key)
        return super().renew(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.released.append(key)
        super().release(key, owner)

    def release_owned_slots(self, key: str, owner: str) -> None:
        self.owned_released.append(key)
        super().release_owned_slots(key, owner)

    def wait_for_release(self, key: str, timeout: float) -> bool:
        self.waiting.set()
        return super().wait_for_release(key, timeout)


class LostSlotReply(SlotStore):
    """``acquire_slot`` takes effect, then raises ``error`` in place of its reply (once)."""

    def __init__(self, clock: FakeClock, error: BaseException) -> None:
        super().__init__(clock)
        self.error: BaseException | None = error
        self.granted: tuple[int, int] | None = None

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        got = super().acquire_slot(key, owner, ttl_ms, limit)
        error, self.error = self.error, None
        if error is not None:
            self.granted = got
            raise error
        return got


class NoSlots:
    """A LockStore without ``acquire_slot``."""

    def __init__(self) -> None:
        self._inner = MemoryLockStore()

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self._inner.acquire(key, owner, ttl_ms)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._inner.renew(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self._inner.release(key, owner)


class Holder:
    """A ``with`` block on a thread of its own: enters, holds until :meth:`leave`, exits."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self.entered = threading.Event()
        self._go = threading.Event()
        self.held: Lease | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._make() as held:
                self.held = held
                self.entered.set()
                if not self._go.wait(REAL_TIMEOUT):
                    raise AssertionError("the test never let the holder go")
        except BaseException as exc:
            self.error = exc
        finally:
            self.entered.set()

    def wait_entered(self) -> Lease:
        assert self.entered.wait(REAL_TIMEOUT), "the holder never entered"
        assert self.error is None, self.error
        assert self.held is not None
        return self.held

    def leave(self) -> None:
        self._go.set()
        self._thread.join(REAL_TIMEOUT)
        assert not self._thread.is_alive()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1000.0)


@pytest.fixture
def store(clock: FakeClock) -> SlotStore:
    return SlotStore(clock)


def holders(store: SlotStore, count: int, limit: int = 3) -> list[Holder]:
    started = []
    for _ in range(count):
        holder = Holder(lambda: lease(KEY, store=store, ttl=30, limit=limit, clock=store.clock))
        holder.wait_entered()  # one after the other: slots in order
        started.append(holder)
    return started


def refused(make: Callable[[], Any]) -> bool:
    """Whether ``make()``, entered on another thread (wait 0), is turned away; entered, it
    leaves at once."""
    holder = Holder(make)
    assert holder.entered.wait(REAL_TIMEOUT), "the holder never entered"
    if holder.error is None:
        holder.leave()
        return False
    assert isinstance(holder.error, LockNotAcquiredError), holder.error
    return True


class TestSlots:
    def test_three_holders_get_slots_0_1_2_with_growing_tokens(self, store: SlotStore) -> None:
        """Each of three concurrent holders gets its own slot, lowest first, each token larger
        than the one before."""
        running = holders(store, 3)
        leases = [h.wait_entered() for h in running]
        assert [held.slot for held in leases] == [0, 1, 2]
        assert [held.store_key for held in leases] == [slot_key(KEY, i) for i in range(3)]
        assert all(held.key == KEY for held in leases)
        tokens = [held.token for held in leases]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3
        for held in leases:
            info = store.get(held.store_key)
            assert info is not None and info.owner == held.owner and info.token == held.token
        assert store.get(KEY) is None  # the key itself is not held
        for holder in running:
            holder.leave()

    def test_a_fourth_is_refused_at_wait_0(self, store: SlotStore) -> None:
        """With every slot held, a holder that does not wait is turned away, naming the key."""
        running = holders(store, 3)
        with pytest.raises(LockNotAcquiredError) as raised, lease(KEY, store=store, limit=3):
            pass
        assert raised.value.key == KEY
        assert [slot_key(KEY, i) for i in range(3)] == [
            info.key for info in store.list(KEY)
        ]  # the refused attempt left nothing behind
        for holder in running:
            holder.leave()

    def test_a_waiting_fourth_is_woken_by_a_release(
        self, store: SlotStore, clock: FakeClock
    ) -> None:
        """A fourth holder waiting for a slot gets the one freed, with a token above all
        earlier ones, while the clock never moves: the release woke it."""
        running = holders(store, 3)
        earlier = [h.wait_entered().token for h in running]
        fourth = Holder(lambda: lease(KEY, store=store, ttl=30, wait=60, limit=3))
        assert store.waiting.wait(REAL_TIMEOUT), "the fourth never waited for a release"
        assert not fourth.entered.is_set()
        before = clock.monotonic()
        running[1].leave()
        held = fourth.wait_entered()
        assert clock.monotonic() == before
        assert held.slot == 1
        assert held.waited
        assert held.token > max(earlier)
        for holder in (running[0], running[2], fourth):
            holder.leave()

    def test_tokens_only_grow_across_release_and_reuse(self, store: SlotStore) -> None:
        """A slot taken again after its release gets a token above every earlier one."""
        tokens = []
        for _ in range(4):
            with lease(KEY, store=store, ttl=30, limit=2) as held:
                assert held.slot == 0
                tokens.append(held.token)
        assert tokens == sorted(tokens) and len(set(tokens)) == 4

    def test_release_frees_only_its_own_slot(self, store: SlotStore) -> None:
        """A holder's exit releases its slot key and no other."""
        running = holders(store, 3)
        running[1].leave()
        assert store.get(slot_key(KEY, 1)) is None
        assert store.get(slot_key(KEY, 0)) is not None
        assert store.get(slot_key(KEY, 2)) is not None
        assert store.released == [slot_key(KEY, 1)]
        running[0].leave()
        running[2].leave()

    def test_renewal_renews_the_slot_key(self, store: SlotStore, clock: FakeClock) -> None:
        """The renewer renews the slot's store key, which stays held past its first ttl."""
        running = holders(store, 2)
        clock.advance(11)
        poll_until(lambda: slot_key(KEY, 1) in store.renewed, what="the slot's renewal")
        assert KEY not in store.renewed
        clock.advance(25)  # past the first ttl: only renewals keep it
        poll_until(lambda: store.renewed.count(slot_key(KEY, 1)) >= 2, what="a second renewal")
        assert store.get(slot_key(KEY, 1)) is not None
        for holder in running:
            holder.leave()

    def test_losing_one_slot_loses_only_its_holder(
        self, store: SlotStore, clock: FakeClock
    ) -> None:
        """A slot taken from its holder reads lost ("taken") for that holder only; its exit
        releases nothing that is not its own."""
        running = holders(store, 3)
        leases = [h.wait_entered() for h in running]
        store.force_release(slot_key(KEY, 1))
        newcomer = holders(store, 1)[0]  # takes the freed slot
        assert newcomer.wait_entered().slot == 1
        clock.advance(11)
        poll_until(lambda: leases[1].lost, what="the loss of slot 1")
        assert leases[1].lost_reason == "taken"
        assert not leases[0].lost and not leases[2].lost and not newcomer.wait_entered().lost
        running[1].leave()
        info = store.get(slot_key(KEY, 1))
        assert info is not None and info.owner == newcomer.wait_entered().owner
        for holder in (running[0], running[2], newcomer):
            holder.leave()

    def test_cooldown_keeps_the_slot(self, store: SlotStore, clock: FakeClock) -> None:
        """A cooldown after a successful body keeps that slot held, and only it."""
        with lease(KEY, store=store, ttl=30, limit=2, cooldown=5) as held:
            pass
        info = store.get(slot_key(KEY, 0))
        assert info is not None and info.owner == held.owner
        assert info.expires_in == pytest.approx(5)
        with lease(KEY, store=store, ttl=30, limit=2) as other:
            assert other.slot == 1

    def test_reentering_the_key_keeps_the_slot(self, store: SlotStore) -> None:
        """A nested lease of the same key and store in the holder's thread re-enters it."""
        with (
            lease(KEY, store=store, ttl=30, limit=3) as outer,
            lease(KEY, store=store, ttl=30, limit=3) as inner,
        ):
            assert inner is outer
        assert store.slot_calls == 1


class TestAbandonedAttempts:
    def test_a_lost_reply_is_abandoned_without_touching_others(self, clock: FakeClock) -> None:
        """acquire_slot took effect and its reply was lost: the error goes to the caller, the
        slot it took is released owner-checked, and another holder's slot stays held."""
        store = LostSlotReply(clock, StoreUnavailableError("reply lost"))
        store.error = None
        other = Holder(lambda: lease(KEY, store=store, ttl=30, limit=3))
        held = other.wait_entered()
        store.error = StoreUnavailableError("reply lost")
        with pytest.raises(StoreUnavailableError), lease(KEY, store=store, ttl=30, limit=3):
            pass
        assert store.granted is not None and store.granted[0] == 1
        assert drain(REAL_TIMEOUT)
        assert [info.key for info in store.list(KEY)] == [held.store_key]
        info = store.get(held.store_key)
        assert info is not None and info.owner == held.owner
        other.leave()
        assert store.list(KEY) == []

    @pytest.mark.parametrize("interrupt", [Interrupt, KeyboardInterrupt])
    def test_an_interrupt_after_the_acquire_leaves_no_slot(
        self, clock: FakeClock, interrupt: type[BaseException]
    ) -> None:
        """An asynchronous exception delivered after acquire_slot took effect goes on, and no
        slot stays held."""
        store = LostSlotReply(clock, interrupt())
        with pytest.raises(interrupt), lease(KEY, store=store, ttl=30, limit=3):
            pass
        assert store.granted is not None
        assert drain(REAL_TIMEOUT)
        assert store.list(KEY) == []

    def test_an_interrupt_while_the_lease_is_built_leaves_no_slot(
        self, store: SlotStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An interrupt after the slot was granted, before the lease was made, releases it."""
        from celery_lease._core import held_key

        def interrupted(self: object, clock: object, **_: object) -> None:
            raise Interrupt()

        monkeypatch.setattr(held_key.HeldKey, "start", interrupted)
        with pytest.raises(Interrupt), lease(KEY, store=store, ttl=30, limit=3):
            pass
        monkeypatch.undo()
        assert drain(REAL_TIMEOUT)
        assert store.list(KEY) == []


class TestWithoutLimit:
    def test_no_limit_takes_the_key_itself(self, store: SlotStore) -> None:
        """limit None (not given): the plain acquire of the key, slot 0, store key the key."""
        with lease(KEY, store=store, ttl=30) as held:
            assert held.slot == 0
            assert held.store_key == KEY
            assert store.get(KEY) is not None
        assert store.slot_calls == 0 and store.plain_calls == 1
        assert store.released == [KEY]

    def test_limit_1_takes_slot_0_of_the_key(self, store: SlotStore) -> None:
        """limit=1 given: one holder at a time, in the key's slot space (slot 0)."""
        with lease(KEY, store=store, ttl=30, limit=1) as held:
            assert held.slot == 0
            assert held.store_key == slot_key(KEY, 0)
            assert store.get(KEY) is None
            assert refused(lambda: lease(KEY, store=store, ttl=30, limit=1))
        assert store.slot_calls == 2 and store.plain_calls == 0

    def test_a_limit_lowered_to_1_still_counts_the_slots_held(self, store: SlotStore) -> None:
        """Three holders under limit=3: a caller with limit=1 is refused until one is left."""
        running = holders(store, 3)
        assert refused(lambda: lease(KEY, store=store, ttl=30, limit=1))
        for holder in running[1:]:
            holder.leave()
        assert refused(lambda: lease(KEY, store=store, ttl=30, limit=1))  # one still runs
        running[0].leave()
        with lease(KEY, store=store, ttl=30, limit=1) as held:
            assert held.store_key == slot_key(KEY, 0)


class TestTwoLockSpaces:
    """The key itself (no limit) and the key's slots (any limit) are two lock spaces."""

    def test_a_plain_lease_and_a_slot_holder_do_not_exclude_each_other(
        self, store: SlotStore
    ) -> None:
        with lease(KEY, store=store, ttl=30) as plain:
            other = Holder(lambda: lease(KEY, store=store, ttl=30, limit=2))
            assert other.wait_entered().store_key == slot_key(KEY, 0)
            assert plain.store_key == KEY
            other.leave()

    def test_a_nested_plain_lease_in_a_slot_takes_the_key_itself(self, store: SlotStore) -> None:
        """A nested lease without limit inside a limited one of the same key does not re-enter
        the slot: it acquires the key on its own, and releases it at its exit."""
        with lease(KEY, store=store, ttl=30, limit=3) as outer:
            with lease(KEY, store=store, ttl=30) as inner:
                assert inner is not outer
                assert inner.store_key == KEY and outer.store_key == slot_key(KEY, 0)
                assert store.get(KEY) is not None
            assert store.get(KEY) is None
            assert store.get(outer.store_key) is not None
        assert store.plain_calls == 1 and store.slot_calls == 1

    def test_a_nested_limited_lease_in_a_plain_one_takes_a_slot(self, store: SlotStore) -> None:
        with lease(KEY, store=store, ttl=30) as outer:
            with lease(KEY, store=store, ttl=30, limit=1) as inner:
                assert inner is not outer
                assert inner.store_key == slot_key(KEY, 0)
            assert store.get(slot_key(KEY, 0)) is None
            assert store.get(KEY) is not None

    def test_a_nested_lease_re_enters_the_outer_one_of_its_own_kind(self, store: SlotStore) -> None:
        """Between two kinds, the nested lease re-enters the innermost of its own kind."""
        with (
            lease(KEY, store=store, ttl=30) as plain,
            lease(KEY, store=store, ttl=30, limit=2) as slot,
            lease(KEY, store=store, ttl=30) as again_plain,
            lease(KEY, store=store, ttl=30, limit=5) as again_slot,
        ):
            assert again_plain is plain and again_slot is slot
        assert store.plain_calls == 1 and store.slot_calls == 1


class TestBadInput:
    @pytest.mark.parametrize("limit", [True, False, 1.5, 2.0, "3", 0, -1, MAX_LIMIT + 1, [2]])
    def test_a_bad_limit_is_refused_at_lease(self, store: SlotStore, limit: object) -> None:
        """Not an int from 1 to MAX_LIMIT: LeaseConfigError naming limit, the value and what
        is allowed, before anything is acquired."""
        with pytest.raises(LeaseConfigError) as raised:
            lease(KEY, store=store, limit=limit)  # type: ignore[arg-type]
        message = str(raised.value)
        assert f"limit={limit!r}" in message
        assert str(MAX_LIMIT) in message
        assert store.slot_calls == store.plain_calls == 0

    def test_the_largest_limit_is_allowed(self, store: SlotStore) -> None:
        with lease(KEY, store=store, ttl=30, limit=MAX_LIMIT) as held:
            assert held.slot == 0

    def test_a_store_without_slots_is_refused_for_a_limit(self) -> None:
        """limit > 1 on a store that has no acquire_slot: named, with the store."""
        store = NoSlots()
        with pytest.raises(LeaseConfigError) as raised:
            lease(KEY, store=store, limit=2)
        message = str(raised.value)
        assert "limit=2" in message and "acquire_slot" in message and repr(store) in message
        with pytest.raises(LeaseConfigError, match="limit=1"):  # slots too: one at a time
            lease(KEY, store=store, limit=1)
        with lease(KEY, store=store, ttl=30) as held:  # no limit: the key itself
            assert held.store_key == KEY

    def test_an_async_store_without_slots_is_refused_for_a_limit(self) -> None:
        """An async store whose own acquire_slot is missing is named too."""

        class AsyncNoSlots:
            def __init__(self) -> None:
                self.sync = MemoryLockStore()

            async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None: ...
            async def renew(self, key: str, owner: str, ttl_ms: int) -> bool: ...
            async def release(self, key: str, owner: str) -> None: ...
            async def wait_for_release(self, key: str, timeout: float) -> bool: ...
            async def aclose(self) -> None: ...

        astore = AsyncNoSlots()
        with pytest.raises(LeaseConfigError) as raised:
            lease(KEY, store=astore, limit=2)  # type: ignore[arg-type]
        assert "limit=2" in str(raised.value) and repr(astore) in str(raised.value)

    @pytest.mark.parametrize("limit", [None, 1, 3])
    def test_a_key_with_the_slot_mark_is_refused(self, store: SlotStore, limit: int | None) -> None:
        """U+001F ends a key in the store: a key holding it is refused, with or without limit."""
        with pytest.raises(LeaseConfigError) as raised:
            lease("a\x1fb", store=store, limit=limit)
        assert "key='a\\x1fb'" in str(raised.value) and "U+001F" in str(raised.value)


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, REAL_TIMEOUT))


class TestAsync:
    def test_async_holders_get_their_own_slots(self) -> None:
        """async with over the thread adapter: two slots, a third refused at wait 0, and a
        waiting one gets the slot freed."""
        sync = MemoryLockStore()
        astore = ThreadedAsyncStore(sync)

        async def scenario() -> None:
            freed = asyncio.Event()
            first_in = asyncio.Event()

            async def first() -> int:
                async with lease(KEY, store=astore, ttl=30, limit=2) as held:
                    first_in.set()
                    await freed.wait()
                    return held.slot

            task = asyncio.create_task(first())
            await first_in.wait()
            async with lease(KEY, store=astore, ttl=30, limit=2) as second:
                assert second.slot == 1
                assert second.store_key == slot_key(KEY, 1)
                with pytest.raises(LockNotAcquiredError):  # another task: no re-entry
                    await asyncio.create_task(self._take(astore, wait=0))
                waiter = asyncio.create_task(self._take(astore, wait=60))
                freed.set()
                assert await task == 0
                slot, token = await waiter
                assert slot == 0 and token > second.token
            assert sync.list(KEY) == []

        _run(scenario())

    @staticmethod
    async def _take(astore: ThreadedAsyncStore, wait: float) -> tuple[int, int]:
        async with lease(KEY, store=astore, ttl=30, wait=wait, limit=2) as held:
            return held.slot, held.token

    def test_a_sync_store_under_async_with(self) -> None:
        """A sync store given to async with runs acquire_slot on a thread; the exit releases
        the slot key."""
        sync = MemoryLockStore()

        async def scenario() -> None:
            async with lease(KEY, store=sync, ttl=30, limit=2) as held:
                assert held.store_key == slot_key(KEY, 0)
                assert sync.get(held.store_key) is not None
            assert sync.list(KEY) == []

        _run(scenario())

    def test_an_async_lost_reply_leaves_no_slot(self, clock: FakeClock) -> None:
        """async with: acquire_slot took effect and raised; the attempt is abandoned."""
        sync = LostSlotReply(clock, StoreUnavailableError("reply lost"))

        async def scenario() -> None:
            with pytest.raises(StoreUnavailableError):
                async with lease(KEY, store=ThreadedAsyncStore(sync), ttl=30, limit=2):
                    pass

        _run(scenario())
        assert sync.granted is not None
        assert drain(REAL_TIMEOUT)
        assert sync.list(KEY) == []

    def test_a_cancelled_async_acquire_leaves_no_slot(self, clock: FakeClock) -> None:
        """A task cancelled while acquire_slot runs on its thread: the slot, if taken, is
        released once the call ends."""
        sync = SlotStore(clock)
        entered = threading.Event()
        go = threading.Event()
        inner = sync.acquire_slot

        def gated(key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
            entered.set()
            assert go.wait(REAL_TIMEOUT)
            return inner(key, owner, ttl_ms, limit)

        sync.acquire_slot = gated  # type: ignore[method-assign]

        async def scenario() -> None:
            async def take() -> None:
                async with lease(KEY, store=ThreadedAsyncStore(sync), ttl=30, limit=2):
                    raise AssertionError("the cancelled acquire must not run the body")

            task = asyncio.create_task(take())
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, REAL_TIMEOUT)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            go.set()

        _run(scenario())
        poll_until(lambda: sync.list(KEY) == [] and KEY in sync.owned_released, what="the undo")


class DeferringStore(SlotStore):
    """Records the keys released without waiting for the reply."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.deferred: list[str] = []

    def release_deferred(self, key: str, owner: str) -> bool:
        self.deferred.append(key)
        self.release(key, owner)
        return True

    def flush_deferred(self) -> None:
        return None


class TestPerSlotEnds:
    def test_max_hold_ends_only_that_slot(self, store: SlotStore, clock: FakeClock) -> None:
        """A holder past its max_hold loses its slot; another slot's holder goes on."""
        running = holders(store, 1)
        capped = Holder(lambda: lease(KEY, store=store, ttl=30, limit=3, max_hold=5, clock=clock))
        held = capped.wait_entered()
        assert held.slot == 1
        clock.advance(6)
        poll_until(lambda: held.lost, what="max_hold")
        assert held.lost_reason == "max_hold"
        assert not running[0].wait_entered().lost
        capped.leave()
        assert store.get(slot_key(KEY, 1)) is None
        assert store.get(slot_key(KEY, 0)) is not None
        running[0].leave()

    def test_a_release_without_reply_sends_the_slot_key(self, clock: FakeClock) -> None:
        store = DeferringStore(clock)
        context = lease(KEY, store=store, ttl=30, limit=2)
        with context as held:
            context.release_without_reply()
        assert store.deferred == [held.store_key] == [slot_key(KEY, 0)]

    def test_release_early_frees_the_slot_key(self, store: SlotStore) -> None:
        context = lease(KEY, store=store, ttl=30, limit=2)
        with context as held:
            assert context.release_early()
            assert store.get(slot_key(KEY, 0)) is None
            assert held.lost_reason == "released"
        assert store.released == [slot_key(KEY, 0)]

    def test_an_app_lease_takes_a_slot_of_the_prefixed_key(self, store: SlotStore) -> None:
        from celery import Celery

        app = Celery("slots", set_as_current=False)
        app.conf.update(lease_store=store, lease_key_prefix="p:")
        try:
            with lease(KEY, app=app, limit=2) as held:
                assert (held.key, held.store_key) == ("p:" + KEY, slot_key("p:" + KEY, 0))
            with pytest.raises(LeaseConfigError, match="limit=0"):
                lease(KEY, app=app, limit=0)
        finally:
            app.close()


def test_reprs_name_the_limit_and_the_slot(store: SlotStore) -> None:
    context = lease(KEY, store=store, ttl=30, limit=2)
    assert repr(context).endswith(", limit=2)")
    with context as held:
        assert f"key={KEY!r} slot=0 token=" in repr(held)
    with lease(KEY, store=store, ttl=30) as plain:
        assert "slot" not in repr(plain) and "limit" not in repr(lease(KEY, store=store))


class WithoutOwnedRelease(LostSlotReply):
    """A lost slot reply on a store without ``release_owned_slots``: the clean-up releases
    slot by slot; ``failing`` releases raise (by slot index)."""

    release_owned_slots = None  # type: ignore[assignment]

    def __init__(self, clock: FakeClock, failing: Callable[[int], bool]) -> None:
        super().__init__(clock, StoreUnavailableError("reply lost"))
        self.failing = failing

    def release(self, key: str, owner: str) -> None:
        self.released.append(key)
        if self.failing(len(self.released) - 1):
            raise StoreUnavailableError("down")
        MemoryLockStore.release(self, key, owner)


class TestAbandonedSlotCleanUp:
    def test_a_store_offering_it_releases_the_owners_slots_in_one_call(
        self, clock: FakeClock
    ) -> None:
        """A lost reply, a store with release_owned_slots: one call, no release per slot."""
        store = LostSlotReply(clock, StoreUnavailableError("reply lost"))
        with pytest.raises(StoreUnavailableError, match="lost"), lease(KEY, store=store, limit=50):
            pass
        assert store.granted is not None
        assert drain(REAL_TIMEOUT)
        assert store.owned_released == [KEY] and store.released == []
        assert store.list(KEY) == []

    def test_a_failed_release_does_not_stop_the_others(self, clock: FakeClock) -> None:
        """Slot by slot, the first release fails: the others are still tried (the slot the
        lost reply took is freed); the caller gets the acquire's error."""
        store = WithoutOwnedRelease(clock, failing=lambda index: index == 0)
        for i in range(5):
            MemoryLockStore.acquire_slot(store, KEY, f"other{i}", 600_000, 8)
        with pytest.raises(StoreUnavailableError, match="lost"), lease(KEY, store=store, limit=8):
            pass
        assert store.granted is not None and store.granted[0] == 5
        assert drain(REAL_TIMEOUT)
        assert store.released == [slot_key(KEY, i) for i in range(8)]
        assert sorted(info.owner for info in store.list(KEY)) == [f"other{i}" for i in range(5)]

    def test_every_release_failing_tries_each_slot_once(self, clock: FakeClock) -> None:
        """The store fails the acquire's reply and then every release: each slot below the
        limit is tried once (the first error logged), and the caller gets the acquire's
        error."""
        store = WithoutOwnedRelease(clock, failing=lambda index: True)
        with pytest.raises(StoreUnavailableError, match="lost"), lease(KEY, store=store, limit=4):
            pass
        assert drain(REAL_TIMEOUT)
        assert store.released == [slot_key(KEY, i) for i in range(4)]


def test_many_threads_never_exceed_the_limit() -> None:
    """Eight threads take a slot of one key twenty times each, waiting for one (real clock):
    never more than three hold it at once, every call gets in, every token is new."""
    store = MemoryLockStore()
    lock = threading.Lock()
    inside, peak, tokens, errors = 0, 0, [], []

    def worker() -> None:
        nonlocal inside, peak
        try:
            for _ in range(20):
                with lease(KEY, store=store, ttl=30, wait=REAL_TIMEOUT, limit=3) as held:
                    with lock:
                        inside += 1
                        peak = max(peak, inside)
                        tokens.append(held.token)
                        assert 0 <= held.slot < 3
                    assert len(store.list(KEY)) <= 3  # what the store holds, not our count
                    with lock:
                        inside -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REAL_TIMEOUT * 3)
    assert errors == []
    assert 1 <= peak <= 3
    assert len(tokens) == 160 and len(set(tokens)) == 160
    assert store.list(KEY) == []


def test_a_decorated_function_takes_a_slot_per_call(store: SlotStore) -> None:
    """@lease(..., limit=2): each call takes its own slot (a fresh context per call); two calls
    at once hold slots 0 and 1, and every call releases its own."""
    inside = threading.Barrier(2, timeout=REAL_TIMEOUT)
    seen: list[tuple[int, str]] = []

    @lease(KEY, store=store, ttl=30, limit=2)
    def body() -> None:
        from celery_lease import current_lease

        held = current_lease()
        assert held is not None
        seen.append((held.slot, held.store_key))
        inside.wait()  # both hold a slot at once

    threads = [threading.Thread(target=body) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REAL_TIMEOUT)
    assert sorted(seen) == [(0, slot_key(KEY, 0)), (1, slot_key(KEY, 1))]
    assert store.list(KEY) == []
    releases = [store.released.count(slot_key(KEY, i)) for i in range(2)]
    assert releases == [1, 1]
