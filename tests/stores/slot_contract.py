"""The behaviour of a key's slots and of asking a holder to stop, for every store that offers them.

Mix :class:`SlotContract` (stores with :class:`~celery_lease.stores.base.SupportsSlots`) and
:class:`ReplaceContract` (:class:`~celery_lease.stores.base.SupportsReplace`) into a store's
:class:`~tests.stores.contract.StoreContract` subclass; they use its hooks (``store``,
``clock``, ``short_ttl_ms``, ``let_expire``, ``wait_until_waiting``, ``store_factory``,
``supports_processes``). A third-party store proves its slots the same way.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_lease.stores.base import (
    LockStore,
    SupportsAcquireOrHolder,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsOwnedSlotsRelease,
    SupportsReleaseNotify,
    SupportsReplace,
    SupportsSlots,
)
from celery_lease.stores.slots import MAX_LIMIT, marked, slot_key
from tests.stores.contract import DEADLINE, LONG_MS, _close

__all__ = ["ReplaceContract", "SlotContract"]


def _slots(store: LockStore) -> SupportsSlots:
    if not isinstance(store, SupportsSlots):
        pytest.fail(f"{type(store).__name__} has no acquire_slot")
    return store


def _owned_release(store: LockStore) -> SupportsOwnedSlotsRelease:
    if not isinstance(store, SupportsOwnedSlotsRelease):
        pytest.skip(f"{type(store).__name__} has no release_owned_slots (optional)")
    return store


def _replacing(store: LockStore) -> SupportsReplace:
    if not isinstance(store, SupportsReplace):
        pytest.fail(f"{type(store).__name__} has no mark_replaced")
    return store


def _race_slots_in_child(
    factory: Callable[[], LockStore],
    barrier: Any,
    results: Any,
    rounds: int,
    limit: int,
    name: str,
) -> None:
    """Child process: in each round, wait for the others, then try for a slot of the round's key."""
    store = factory()
    try:
        for round_ in range(rounds):
            barrier.wait(DEADLINE)
            got = _slots(store).acquire_slot(f"proc-slots-{round_}", name, LONG_MS, limit)
            results.put((round_, name, got))
    finally:
        _close(store)


class SlotContract:
    """Slots: up to ``limit`` leases of one key, each an ordinary lease on its slot key."""

    # Mixed into a StoreContract subclass: its hooks (short_ttl_ms, let_expire,
    # wait_until_waiting, store_factory, supports_processes, clock) are used as they are.
    clock: Any

    def test_slots_are_given_lowest_first_up_to_the_limit(self, store: LockStore) -> None:
        """Three owners get slots 0, 1, 2 with growing tokens; a fourth is refused."""
        slots = _slots(store)
        got = [slots.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        assert [g[0] for g in got if g is not None] == [0, 1, 2]
        tokens = [g[1] for g in got if g is not None]
        assert all(type(t) is int for t in tokens) and tokens == sorted(set(tokens))
        assert slots.acquire_slot("k", "o3", LONG_MS, 3) is None
        for i in range(3):  # each slot is an ordinary lease of its owner
            assert store.acquire(slot_key("k", i), "x", LONG_MS) is None
            assert store.renew(slot_key("k", i), f"o{i}", LONG_MS) is True
            assert store.renew(slot_key("k", i), "o3", LONG_MS) is False

    def test_a_released_slot_is_taken_again_with_a_larger_token(self, store: LockStore) -> None:
        """Releasing slot 1 frees that slot only; the next taker gets it with a new top token."""
        slots = _slots(store)
        got = [slots.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        top = max(g[1] for g in got if g is not None)
        store.release(slot_key("k", 1), "o0")  # not its owner: nothing happens
        assert slots.acquire_slot("k", "n", LONG_MS, 3) is None
        store.release(slot_key("k", 1), "o1")
        again = slots.acquire_slot("k", "n", LONG_MS, 3)
        assert again is not None and again[0] == 1 and again[1] > top
        assert slots.acquire_slot("k", "m", LONG_MS, 3) is None

    def test_an_expired_slot_is_free_again(self, store: LockStore) -> None:
        """A slot not renewed within its ttl frees itself; the others stay held."""
        slots = _slots(store)
        ttl = self.short_ttl_ms()
        first = slots.acquire_slot("k", "a", ttl, 2)
        second = slots.acquire_slot("k", "b", LONG_MS, 2)
        assert first is not None and second is not None and (first[0], second[0]) == (0, 1)
        self.let_expire(store, slot_key("k", 0), ttl)
        third = slots.acquire_slot("k", "c", LONG_MS, 2)
        assert third is not None and third[0] == 0 and third[1] > second[1]
        assert store.renew(slot_key("k", 0), "a", LONG_MS) is False
        assert store.renew(slot_key("k", 1), "b", LONG_MS) is True

    def test_the_holder_asking_again_gets_its_own_slot_and_token(self, store: LockStore) -> None:
        """A repeated acquire_slot by a holder returns its slot and token, whatever the limit."""
        slots = _slots(store)
        assert slots.acquire_slot("k", "a", LONG_MS, 2) is not None
        mine = slots.acquire_slot("k", "b", LONG_MS, 2)
        assert mine is not None and mine[0] == 1
        assert slots.acquire_slot("k", "b", LONG_MS, 2) == mine
        assert slots.acquire_slot("k", "b", LONG_MS, 1) == mine  # its slot, though over limit 1
        assert slots.acquire_slot("k", "c", LONG_MS, 2) is None

    def test_a_slot_acquire_retried_after_its_reply_was_lost_gets_its_slot_back(
        self, store: LockStore
    ) -> None:
        """The call took effect, its reply was lost: the same owner's retry gets that slot and
        token, and no second slot is taken for it."""
        slots = _slots(store)
        lost = slots.acquire_slot("k", "a", LONG_MS, 2)  # took effect; the caller never saw it
        assert lost is not None
        assert slots.acquire_slot("k", "a", LONG_MS, 2) == lost
        other = slots.acquire_slot("k", "b", LONG_MS, 2)
        assert other is not None and other[0] != lost[0]
        assert slots.acquire_slot("k", "c", LONG_MS, 2) is None

    def test_releasing_an_owners_slots_frees_its_slot_only(self, store: LockStore) -> None:
        """release_owned_slots(key, owner) frees the slot ``owner`` holds, at any index, and
        leaves other owners' slots and the key itself (a lease of its own) alone."""
        slots, owned = _slots(store), _owned_release(store)
        got = [slots.acquire_slot("k", f"o{i}", LONG_MS, 8) for i in range(6)]
        assert [g[0] for g in got if g is not None] == list(range(6))
        assert store.acquire("k", "o5", LONG_MS) is not None  # the key itself, same owner id
        owned.release_owned_slots("k", "o5")  # slot 5: above any width asked before
        owned.release_owned_slots("k", "o2")
        owned.release_owned_slots("k", "nobody")  # holds nothing: nothing happens
        for i in range(6):
            assert store.renew(slot_key("k", i), f"o{i}", LONG_MS) is (i not in (2, 5))
        assert store.renew("k", "o5", LONG_MS) is True
        again = slots.acquire_slot("k", "n", LONG_MS, 8)
        assert again is not None and again[0] == 2

    def test_releasing_an_owners_slots_wakes_a_waiter_on_the_key(self, store: LockStore) -> None:
        """A slot freed by release_owned_slots wakes ``wait_for_release(key)``."""
        slots, owned = _slots(store), _owned_release(store)
        if not isinstance(store, SupportsReleaseNotify):
            pytest.skip("no wait_for_release")
        assert slots.acquire_slot("k", "a", LONG_MS, 1) is not None
        woken: list[bool] = []
        waiter = threading.Thread(target=lambda: woken.append(store.wait_for_release("k", 30)))
        waiter.start()
        self.wait_until_waiting(store, 1)
        owned.release_owned_slots("k", "a")
        waiter.join(DEADLINE)
        assert woken == [True]
        assert slots.acquire_slot("k", "b", LONG_MS, 1) is not None

    def test_a_lowered_limit_refuses_until_the_count_is_below_it(self, store: LockStore) -> None:
        """Five held under limit 5, then limit 2: refused (nobody freed) until only one is left."""
        slots = _slots(store)
        for i in range(5):
            assert slots.acquire_slot("k", f"o{i}", LONG_MS, 5) is not None
        assert slots.acquire_slot("k", "new", LONG_MS, 2) is None
        for i in range(5):
            assert store.renew(slot_key("k", i), f"o{i}", LONG_MS) is True  # nobody was freed
        for i in (0, 1, 2):
            store.release(slot_key("k", i), f"o{i}")
        # Slots 3 and 4 are held, above the new limit: they still count.
        assert slots.acquire_slot("k", "new", LONG_MS, 2) is None
        under_three = slots.acquire_slot("k", "new", LONG_MS, 3)  # two held, limit 3: one more
        assert under_three is not None and under_three[0] == 0
        store.release(slot_key("k", 0), "new")
        store.release(slot_key("k", 3), "o3")
        got = slots.acquire_slot("k", "newer", LONG_MS, 2)
        assert got is not None and got[0] == 0

    def test_tokens_of_a_key_grow_across_its_slots_release_and_expiry(
        self, store: LockStore
    ) -> None:
        """Every token given to any slot of a key is larger than every earlier one."""
        slots = _slots(store)
        ttl = self.short_ttl_ms()
        seen: list[int] = []
        for round_ in range(3):
            got = [slots.acquire_slot("k", f"r{round_}o{i}", ttl, 3) for i in range(3)]
            seen.extend(g[1] for g in got if g is not None)
            store.release(slot_key("k", 2), f"r{round_}o2")
            # Slot 2, or a lower one when a loaded machine let a real ttl run out meanwhile.
            got2 = slots.acquire_slot("k", f"r{round_}x", ttl, 3)
            assert got2 is not None
            seen.append(got2[1])
            for i in range(3):
                self.let_expire(store, slot_key("k", i), ttl)
        assert seen == sorted(seen) and len(set(seen)) == len(seen) == 12

    def test_slots_and_the_key_itself_are_separate(self, store: LockStore) -> None:
        """A lease on the key without limit and the key's slots do not count against each other."""
        slots = _slots(store)
        assert store.acquire("k", "plain", LONG_MS) is not None
        got = slots.acquire_slot("k", "a", LONG_MS, 1)
        assert got is not None and got[0] == 0
        assert store.acquire("k", "other", LONG_MS) is None
        assert slots.acquire_slot("k", "b", LONG_MS, 1) is None
        assert slots.acquire_slot("k2", "b", LONG_MS, 1) is not None

    @pytest.mark.parametrize("limit", [0, -1, MAX_LIMIT + 1])
    def test_a_limit_out_of_range_is_refused_before_anything_is_taken(
        self, store: LockStore, limit: int
    ) -> None:
        slots = _slots(store)
        with pytest.raises(ValueError, match="limit"):
            slots.acquire_slot("k", "a", LONG_MS, limit)
        assert slots.acquire_slot("k", "a", LONG_MS, 1) is not None

    def test_a_key_holding_the_slot_mark_is_refused(self, store: LockStore) -> None:
        slots = _slots(store)
        with pytest.raises(ValueError):
            slots.acquire_slot("k\x1f", "a", LONG_MS, 2)
        with pytest.raises(ValueError):
            slots.acquire_slot(slot_key("k", 0), "a", LONG_MS, 2)

    def test_the_largest_limit_is_accepted(self, store: LockStore) -> None:
        slots = _slots(store)
        got = slots.acquire_slot("k", "a", LONG_MS, MAX_LIMIT)
        assert got is not None and got[0] == 0

    def test_racing_threads_take_exactly_limit_slots(self, store: LockStore) -> None:
        """Eight threads released together on a free key with limit 3: three distinct slots."""
        slots = _slots(store)
        threads, rounds, limit = 8, 4, 3
        barrier = threading.Barrier(threads)
        results: list[tuple[int, tuple[int, int] | None]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def run(name: str) -> None:
            try:
                for round_ in range(rounds):
                    barrier.wait(DEADLINE)
                    got = slots.acquire_slot(f"race-{round_}", name, LONG_MS, limit)
                    with lock:
                        results.append((round_, got))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                barrier.abort()

        workers = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(DEADLINE * 2)
        assert not errors, errors
        assert len(results) == threads * rounds
        for round_ in range(rounds):
            won = [g for r, g in results if r == round_ and g is not None]
            assert sorted(g[0] for g in won) == list(range(limit)), (round_, results)
            assert len({g[1] for g in won}) == limit

    def test_racing_processes_take_exactly_limit_slots(self, store: LockStore) -> None:
        """Four processes released together with limit 2: two distinct slots in every round."""
        _slots(store)
        if not self.supports_processes:
            pytest.skip(f"{type(store).__name__} excludes within one process only")
        factory = self.store_factory()
        ctx = multiprocessing.get_context("fork")
        processes, rounds, limit = 4, 3, 2
        barrier = ctx.Barrier(processes)
        results = ctx.Queue()
        children = [
            ctx.Process(
                target=_race_slots_in_child,
                args=(factory, barrier, results, rounds, limit, f"p{i}"),
            )
            for i in range(processes)
        ]
        for child in children:
            child.start()
        got: list[tuple[int, str, tuple[int, int] | None]] = []
        try:
            for _ in range(processes * rounds):
                got.append(results.get(timeout=DEADLINE * 2))
        except queue.Empty:
            pytest.fail(f"children reported only {got}")
        finally:
            for child in children:
                child.join(DEADLINE)
                if child.is_alive():
                    child.kill()
        assert [child.exitcode for child in children] == [0] * processes
        for round_ in range(rounds):
            won = [g for r, _, g in got if r == round_ and g is not None]
            assert sorted(g[0] for g in won) == list(range(limit)), (round_, got)

    def test_a_slot_release_wakes_a_waiter_on_the_key(self, store: LockStore) -> None:
        """A waiter blocked on the key returns True when any of its slots is released."""
        slots = _slots(store)
        if not isinstance(store, SupportsReleaseNotify):
            pytest.skip(f"{type(store).__name__} has no release notification")
        assert slots.acquire_slot("k", "a", LONG_MS, 2) is not None
        assert slots.acquire_slot("k", "b", LONG_MS, 2) is not None
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(store.wait_for_release("k", 30)))
        waiter.start()
        self.wait_until_waiting(store, 1)
        store.release(slot_key("k", 1), "b")
        waiter.join(DEADLINE)
        assert outcome == [True]
        got = slots.acquire_slot("k", "c", LONG_MS, 2)
        assert got is not None and got[0] == 1

    def test_slots_are_listed_renewed_in_batches_and_force_released(self, store: LockStore) -> None:
        """Inspection and batch renewal see each slot as the lease on its slot key."""
        slots = _slots(store)
        if not isinstance(store, SupportsInspection):
            pytest.skip(f"{type(store).__name__} is not inspectable")
        a = slots.acquire_slot("k", "a", LONG_MS, 2)
        b = slots.acquire_slot("k", "b", LONG_MS, 2)
        assert a is not None and b is not None
        listed = [(i.key, i.owner, i.token) for i in store.list("k")]
        assert listed == [(slot_key("k", 0), "a", a[1]), (slot_key("k", 1), "b", b[1])]
        info = store.get(slot_key("k", 1))
        assert info is not None and (info.owner, info.token) == ("b", b[1])
        if isinstance(store, SupportsBatchRenew):
            answers = store.renew_many(
                [(slot_key("k", 0), "a", LONG_MS), (slot_key("k", 1), "a", LONG_MS)]
            )
            assert list(answers) == [True, False]
        removed = store.force_release(slot_key("k", 0))
        assert removed is not None and removed.owner == "a"
        again = slots.acquire_slot("k", "c", LONG_MS, 2)
        assert again is not None and again[0] == 0 and again[1] > b[1]


class ReplaceContract:
    """Asking a holder to stop: its renewals are refused, its release still frees the key."""

    clock: Any

    def test_a_holder_asked_to_stop_is_refused_renewal_and_still_releases(
        self, store: LockStore
    ) -> None:
        """Marked: renew False, another acquire refused, release by the holder frees the key;
        the next token is above the ticket, which is above the holder's token."""
        replacing = _replacing(store)
        token = store.acquire("k", "h", LONG_MS)
        assert token is not None
        ticket, holder, asked = replacing.mark_replaced("k")
        assert (holder, asked) == ("h", True) and type(ticket) is int and ticket > token
        assert store.renew("k", "h", LONG_MS) is False
        assert store.acquire("k", "n", LONG_MS) is None
        if isinstance(store, SupportsInspection):
            info = store.get("k")
            assert info is not None and (info.owner, info.token) == (marked("h"), token)
        if isinstance(store, SupportsAcquireOrHolder):
            assert store.acquire_or_holder("k", "n", LONG_MS) == (None, marked("h"))
        store.release("k", "other")  # not its holder: nothing happens
        assert store.acquire("k", "n", LONG_MS) is None
        store.release("k", "h")
        following = store.acquire("k", "n", LONG_MS)
        assert following is not None and following > ticket

    def test_asking_a_free_key_draws_a_ticket_below_every_later_token(
        self, store: LockStore
    ) -> None:
        replacing = _replacing(store)
        first = store.acquire("k", "a", LONG_MS)
        assert first is not None
        store.release("k", "a")
        ticket, holder, asked = replacing.mark_replaced("k")
        assert (holder, asked) == (None, False) and ticket > first
        following = store.acquire("k", "b", LONG_MS)
        assert following is not None and following > ticket

    def test_asking_again_keeps_one_mark_and_a_given_ticket(self, store: LockStore) -> None:
        replacing = _replacing(store)
        assert store.acquire("k", "h", LONG_MS) is not None
        ticket, _, _ = replacing.mark_replaced("k")
        assert replacing.mark_replaced("k", ticket) == (ticket, "h", True)
        assert replacing.mark_replaced("k", ticket, "h") == (ticket, "h", True)
        if isinstance(store, SupportsInspection):
            info = store.get("k")
            assert info is not None and info.owner == marked("h")
        store.release("k", "h")
        assert store.acquire("k", "n", LONG_MS) is not None

    def test_asking_another_holder_than_named_leaves_it_alone(self, store: LockStore) -> None:
        replacing = _replacing(store)
        token = store.acquire("k", "h2", LONG_MS)
        assert token is not None
        assert replacing.mark_replaced("k", 5, "h1") == (5, "h2", False)
        assert store.renew("k", "h2", LONG_MS) is True
        if isinstance(store, SupportsInspection):
            info = store.get("k")
            assert info is not None and info.owner == "h2"

    def test_only_the_owner_releases_its_marked_lease_not_the_marked_owner_id(
        self, store: LockStore
    ) -> None:
        """A marked lease of ``x`` is released by ``x`` only: a release by the owner id equal to
        ``x`` + REPLACED_MARK (the stored form) leaves it, as does one by that id marked again."""
        replacing = _replacing(store)
        assert store.acquire("k", "x", LONG_MS) is not None
        assert replacing.mark_replaced("k")[1:] == ("x", True)
        store.release("k", marked("x"))
        store.release("k", marked(marked("x")))
        assert store.acquire("k", "n", LONG_MS) is None
        if isinstance(store, SupportsInspection):
            info = store.get("k")
            assert info is not None and info.owner == marked("x")
        store.release("k", "x")
        assert store.acquire("k", "n", LONG_MS) is not None

    def test_a_marked_lease_expires_within_its_ttl(self, store: LockStore) -> None:
        replacing = _replacing(store)
        ttl = self.short_ttl_ms()
        token = store.acquire("k", "h", ttl)
        assert token is not None
        ticket, _, asked = replacing.mark_replaced("k")
        assert asked and store.renew("k", "h", LONG_MS) is False
        self.let_expire(store, "k", ttl)
        following = store.acquire("k", "n", LONG_MS)
        assert following is not None and following > ticket

    def test_the_release_of_a_marked_lease_wakes_a_waiter(self, store: LockStore) -> None:
        replacing = _replacing(store)
        if not isinstance(store, SupportsReleaseNotify):
            pytest.skip(f"{type(store).__name__} has no release notification")
        assert store.acquire("k", "h", LONG_MS) is not None
        replacing.mark_replaced("k")
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(store.wait_for_release("k", 30)))
        waiter.start()
        self.wait_until_waiting(store, 1)
        store.release("k", "h")
        waiter.join(DEADLINE)
        assert outcome == [True]

    def test_the_last_token_counts_the_last_ticket_drawn(self, store: LockStore) -> None:
        """last_token is the larger of the key's last token and the last ticket drawn for it:
        while the holder is asked to stop, after it released, after a force release, and when
        the ticket was drawn while another holder than the one named held the key. A given
        ticket draws nothing."""
        replacing = _replacing(store)
        assert store.acquire("k", "h", LONG_MS) is not None
        ticket, _, asked = replacing.mark_replaced("k")
        assert asked and store.last_token("k") == ticket
        store.release("k", "h")
        assert store.last_token("k") == ticket

        assert store.acquire("forced", "h", LONG_MS) is not None
        forced_ticket, _, _ = replacing.mark_replaced("forced")
        removed = store.force_release("forced")
        assert removed is not None and removed.owner == marked("h")
        assert store.last_token("forced") == forced_ticket

        token = store.acquire("other", "h2", LONG_MS)
        assert token is not None
        other_ticket, holder, asked = replacing.mark_replaced("other", None, "h1")
        assert (holder, asked) == ("h2", False) and other_ticket > token
        assert store.last_token("other") == other_ticket
        assert replacing.mark_replaced("other", 5, "h1") == (5, "h2", False)
        assert store.last_token("other") == other_ticket
        following = store.acquire("free", "a", LONG_MS)
        assert following is not None and store.last_token("free") == following
