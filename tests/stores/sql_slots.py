"""Slots and replace on the SQL stores (SQLite, PostgreSQL sync and async): what their rows
must show beyond the shared contract. A test class mixes :class:`SqlSlotChecks` in and provides:

- ``slot_store`` (fixture): a fresh store conforming to ``SupportsSlots``,
  ``SupportsReplace`` and ``SupportsInspection``.
- ``make_expired(store, store_key)``: end the live lease on ``store_key`` now (advance a fake
  clock, or move the row's expiry into the past).
- ``set_token(store, store_key, token)``: write ``token`` into the row of ``store_key``, as a
  counter running ahead of the clock would hold it.
- ``slot_store_factory()``: a picklable zero-argument callable building a store on the same
  backend in a child process (real clock).
- ``unreachable_store(tmp_path)``: a store whose first I/O would fail.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_lease.errors import StoreUnavailableError
from celery_lease.stores.base import (
    SupportsInspection,
    SupportsReleaseNotify,
    SupportsReplace,
    SupportsSlots,
    conforms,
)
from celery_lease.stores.slots import MAX_LIMIT, counter_key, marked, slot_key
from tests.stores.contract import DEADLINE, LONG_MS

Store = Any  # SupportsSlots & SupportsReplace & SupportsInspection & LockStore


def _hammer_in_child(
    factory: Callable[[], Store],
    name: str,
    limit: int,
    rounds: int,
    start: Any,
    gauge: Any,
    peak: Any,
    tokens: Any,
) -> None:
    """Child process: ``rounds`` times take a slot of "hot" (retrying refusals), count itself
    as a holder on the shared gauge while it holds it, then release it."""
    store = factory()
    try:
        start.wait(DEADLINE)
        for round_ in range(rounds):
            owner = f"{name}/{round_}"
            while True:
                got = store.acquire_slot("hot", owner, LONG_MS, limit)
                if got is not None:
                    break
            slot, token = got
            with gauge.get_lock():
                gauge.value += 1
                if gauge.value > peak.value:
                    peak.value = gauge.value
            tokens.put((slot, token))
            with gauge.get_lock():
                gauge.value -= 1
            store.release(slot_key("hot", slot), owner)
    finally:
        close = getattr(store, "close", None)
        if callable(close):
            close()


class SqlSlotChecks:
    """Slots and replace as an SQL store must keep them (not collected by itself)."""

    # Hooks --------------------------------------------------------------------------------------

    def make_expired(self, store: Store, store_key: str) -> None:
        raise NotImplementedError

    def set_token(self, store: Store, store_key: str, token: int) -> None:
        raise NotImplementedError

    def slot_store_factory(self) -> Callable[[], Store]:
        raise NotImplementedError

    def unreachable_store(self, tmp_path: Path) -> Store:
        raise NotImplementedError

    @pytest.fixture
    def slot_store(self) -> Iterator[Store]:
        raise NotImplementedError
        yield

    # Capabilities -------------------------------------------------------------------------------

    def test_the_store_offers_slots_and_replace(self, slot_store: Store) -> None:
        """The store conforms to SupportsSlots and SupportsReplace."""
        assert conforms(slot_store, SupportsSlots)
        assert conforms(slot_store, SupportsReplace)

    # Bad input ----------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("key", "limit"),
        [("k", 0), ("k", -1), ("k", MAX_LIMIT + 1), ("k\x1f", 2), ("a\x1f1", 2)],
    )
    def test_a_bad_limit_or_key_is_a_value_error_before_any_io(
        self, key: str, limit: int, tmp_path: Path
    ) -> None:
        """ValueError, not the unreachable store's StoreUnavailableError: nothing was sent."""
        store = self.unreachable_store(tmp_path)
        try:
            with pytest.raises(ValueError, match="limit"):
                store.acquire_slot(key, "a", LONG_MS, limit)
            with pytest.raises(StoreUnavailableError):
                store.acquire_slot("k", "a", LONG_MS, 2)
        finally:
            close = getattr(store, "close", None)
            if callable(close):
                close()

    # Slots --------------------------------------------------------------------------------------

    def test_slots_fill_up_to_the_limit_lowest_first(self, slot_store: Store) -> None:
        """Three owners take slots 0, 1, 2 with growing tokens; a fourth is refused."""
        taken = [slot_store.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        assert [got[0] for got in taken if got is not None] == [0, 1, 2]
        tokens = [got[1] for got in taken if got is not None]
        assert tokens == sorted(set(tokens))
        assert slot_store.acquire_slot("k", "o3", LONG_MS, 3) is None
        for i, (slot, token) in enumerate(taken):  # type: ignore[misc]
            info = slot_store.get(slot_key("k", slot))
            assert info is not None and (info.owner, info.token) == (f"o{i}", token)

    def test_the_key_itself_and_its_slots_are_separate(self, slot_store: Store) -> None:
        """A lease on the key without limit does not count against its slots, nor they
        against it; the slot counter is never a lease."""
        assert slot_store.acquire("k", "plain", LONG_MS) is not None
        assert slot_store.acquire_slot("k", "a", LONG_MS, 1) is not None
        assert slot_store.acquire_slot("k", "b", LONG_MS, 1) is None
        assert slot_store.acquire("k", "other", LONG_MS) is None
        assert slot_store.get(counter_key("k")) is None
        assert [info.key for info in slot_store.list("k")] == ["k", slot_key("k", 0)]

    def test_a_released_slot_is_taken_again_with_a_larger_token(self, slot_store: Store) -> None:
        """Release frees the slot (the lowest free is taken next); every token grows."""
        got = [slot_store.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        slot_store.release(slot_key("k", 1), "o1")
        again = slot_store.acquire_slot("k", "n", LONG_MS, 3)
        assert again is not None and again[0] == 1
        assert again[1] > max(token for _, token in got)  # type: ignore[misc]

    def test_release_by_another_owner_leaves_the_slot_held(self, slot_store: Store) -> None:
        """A release is owner-checked on a slot as on a key."""
        assert slot_store.acquire_slot("k", "a", LONG_MS, 1) is not None
        slot_store.release(slot_key("k", 0), "b")
        assert slot_store.acquire_slot("k", "b", LONG_MS, 1) is None

    def test_an_expired_slot_is_free_and_tokens_still_grow(self, slot_store: Store) -> None:
        """An expired slot counts as free; the token taken after it is larger."""
        first = slot_store.acquire_slot("k", "a", LONG_MS, 1)
        assert first is not None
        self.make_expired(slot_store, slot_key("k", 0))
        second = slot_store.acquire_slot("k", "b", LONG_MS, 1)
        assert second is not None and second[0] == 0 and second[1] > first[1]

    def test_tokens_exceed_a_slot_counter_ahead_of_the_clock(self, slot_store: Store) -> None:
        """The next token is above the slot counter even when it runs ahead of the clock."""
        assert slot_store.acquire_slot("k", "a", LONG_MS, 2) is not None
        ahead = 2**60
        self.set_token(slot_store, counter_key("k"), ahead)
        got = slot_store.acquire_slot("k", "b", LONG_MS, 2)
        assert got is not None and got == (1, ahead + 1)

    def test_the_same_owner_again_gets_its_slot_and_token_and_a_new_expiry(
        self, slot_store: Store
    ) -> None:
        """A retry after a lost reply: the owner's own slot and token, expiry set to now + ttl,
        whatever the limit; no second slot taken."""
        first = slot_store.acquire_slot("k", "a", 1000, 3)
        assert first is not None
        assert slot_store.acquire_slot("k", "a", LONG_MS, 3) == first
        assert slot_store.acquire_slot("k", "a", LONG_MS, 1) == first
        info = slot_store.get(slot_key("k", first[0]))
        assert info is not None and info.expires_in > 1.0
        second = slot_store.acquire_slot("k", "b", LONG_MS, 2)
        assert second is not None and second[0] == 1 and second[1] > first[1]
        assert [info.owner for info in slot_store.list(slot_key("k", 0)[:-1])] == ["a", "b"]

    def test_a_lowered_limit_refuses_until_the_count_is_below_it(self, slot_store: Store) -> None:
        """Slots held under a larger limit all count (also those at or above the new limit);
        none is freed by the lower limit."""
        held = [slot_store.acquire_slot("k", f"o{i}", LONG_MS, 3) for i in range(3)]
        assert all(got is not None for got in held)
        assert slot_store.acquire_slot("k", "n", LONG_MS, 2) is None
        slot_store.release(slot_key("k", 0), "o0")
        assert slot_store.acquire_slot("k", "n", LONG_MS, 2) is None  # 2 live, limit 2
        for i in (1, 2):
            assert slot_store.renew(slot_key("k", i), f"o{i}", LONG_MS) is True
        slot_store.release(slot_key("k", 1), "o1")
        got = slot_store.acquire_slot("k", "n", LONG_MS, 2)
        assert got is not None and got[0] == 0  # slot 2 is still held: 2 live now
        assert slot_store.acquire_slot("k", "m", LONG_MS, 2) is None
        assert slot_store.get(slot_key("k", 2)) is not None

    def test_limit_one_holds_one_slot(self, slot_store: Store) -> None:
        """limit=1 through acquire_slot: one holder at a time, in slot 0."""
        got = slot_store.acquire_slot("k", "a", LONG_MS, 1)
        assert got is not None and got[0] == 0
        assert slot_store.acquire_slot("k", "b", LONG_MS, 1) is None

    def test_threads_never_hold_more_slots_than_the_limit(self, slot_store: Store) -> None:
        """Eight threads take and release slots of one key with limit 3: at no time more than
        3 holders (counted between a grant and the release), tokens all distinct."""
        limit, threads, rounds = 3, 8, 15
        gauge = {"now": 0, "peak": 0}
        lock = threading.Lock()
        tokens: list[int] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(threads)

        def run(name: str) -> None:
            try:
                barrier.wait(DEADLINE)
                for round_ in range(rounds):
                    owner = f"{name}/{round_}"
                    while (got := slot_store.acquire_slot("hot", owner, LONG_MS, limit)) is None:
                        pass
                    with lock:
                        gauge["now"] += 1
                        gauge["peak"] = max(gauge["peak"], gauge["now"])
                        tokens.append(got[1])
                    with lock:
                        gauge["now"] -= 1
                    slot_store.release(slot_key("hot", got[0]), owner)
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(DEADLINE * 6)
        assert not errors, errors
        assert 1 <= gauge["peak"] <= limit
        assert len(tokens) == len(set(tokens)) == threads * rounds

    def test_processes_never_hold_more_slots_than_the_limit(self, slot_store: Store) -> None:
        """Four processes hammer acquire_slot on one key with limit 2: the holders counted on a
        shared gauge never exceed 2, and every token is distinct."""
        del slot_store  # the table or file exists: the children share it
        limit, processes, rounds = 2, 4, 12
        context = multiprocessing.get_context("fork")
        start = context.Barrier(processes)
        gauge = context.Value("i", 0)
        peak = context.Value("i", 0)
        results = context.Queue()
        children = [
            context.Process(
                target=_hammer_in_child,
                args=(
                    self.slot_store_factory(),
                    f"p{i}",
                    limit,
                    rounds,
                    start,
                    gauge,
                    peak,
                    results,
                ),
            )
            for i in range(processes)
        ]
        for child in children:
            child.start()
        got = [results.get(timeout=DEADLINE * 6) for _ in range(processes * rounds)]
        for child in children:
            child.join(DEADLINE)
            assert child.exitcode == 0
        assert 1 <= peak.value <= limit
        assert all(slot < limit for slot, _ in got)
        tokens = [token for _, token in got]
        assert len(set(tokens)) == len(tokens)

    def test_a_slot_release_wakes_a_waiter_of_the_key(self, slot_store: Store) -> None:
        """wait_for_release(key) is woken by the release of any of its slots."""
        if not conforms(slot_store, SupportsReleaseNotify):
            pytest.skip("the store has no wait_for_release")
        got = slot_store.acquire_slot("k", "a", LONG_MS, 1)
        assert got is not None
        woke: list[bool] = []
        waiter = threading.Thread(
            target=lambda: woke.append(slot_store.wait_for_release("k", DEADLINE))
        )
        waiter.start()
        self.wait_until_waiting(slot_store, 1)  # type: ignore[attr-defined]
        slot_store.release(slot_key("k", 0), "a")
        waiter.join(DEADLINE)
        assert woke == [True]

    # Replace ------------------------------------------------------------------------------------

    def test_mark_replaced_on_a_free_key_draws_a_ticket_below_later_tokens(
        self, slot_store: Store
    ) -> None:
        """Free key: (ticket, None, False); the next token is larger than the ticket."""
        token = slot_store.acquire("k", "a", LONG_MS)
        slot_store.release("k", "a")
        ticket, holder, asked = slot_store.mark_replaced("k")
        assert ticket > token and (holder, asked) == (None, False)
        later = slot_store.acquire("k", "b", LONG_MS)
        assert later is not None and later > ticket
        never = slot_store.mark_replaced("never-used")
        assert never[1:] == (None, False)
        first = slot_store.acquire("never-used", "a", LONG_MS)
        assert first is not None and first > never[0]

    def test_mark_replaced_asks_the_holder_and_keeps_its_token(self, slot_store: Store) -> None:
        """A live holder: marked (renew refused, other owners still refused, get shows the
        marked owner and the holder's own token); its release still frees the key."""
        token = slot_store.acquire("k", "a", LONG_MS)
        ticket, holder, asked = slot_store.mark_replaced("k")
        assert ticket > token and (holder, asked) == ("a", True)
        info = slot_store.get("k")
        assert info is not None and (info.owner, info.token) == (marked("a"), token)
        assert slot_store.last_token("k") == ticket  # the last ticket drawn counts
        assert slot_store.renew("k", "a", LONG_MS) is False
        assert slot_store.acquire("k", "b", LONG_MS) is None
        assert slot_store.acquire("k", "a", LONG_MS) is None
        slot_store.release("k", "a")
        assert slot_store.get("k") is None
        later = slot_store.acquire("k", "b", LONG_MS)
        assert later is not None and later > ticket

    def test_tickets_grow_and_a_holder_is_marked_once(self, slot_store: Store) -> None:
        """Each drawn ticket is above the last; a second ask leaves the mark as it is."""
        slot_store.acquire("k", "a", LONG_MS)
        first = slot_store.mark_replaced("k")
        second = slot_store.mark_replaced("k")
        assert second[0] > first[0] and second[1:] == ("a", True)
        info = slot_store.get("k")
        assert info is not None and info.owner == marked("a")

    def test_a_given_ticket_is_returned_as_given_and_draws_nothing(self, slot_store: Store) -> None:
        """ticket given: returned unchanged; the holder filter decides whether it is asked."""
        slot_store.acquire("k", "a", LONG_MS)
        assert slot_store.mark_replaced("k", 7, holder="b") == (7, "a", False)
        info = slot_store.get("k")
        assert info is not None and info.owner == "a"
        assert slot_store.renew("k", "a", LONG_MS) is True
        assert slot_store.mark_replaced("k", 7, holder="a") == (7, "a", True)
        assert slot_store.mark_replaced("k", 8, holder="a") == (8, "a", True)

    def test_a_ticket_with_a_live_holder_exceeds_the_next_token_source(
        self, slot_store: Store
    ) -> None:
        """With the counter ahead of the clock, the ticket drawn while a holder lives is
        still below the token of whoever takes the key after that holder expired."""
        slot_store.acquire("k", "a", LONG_MS)
        self.set_token(slot_store, "k", 2**60)
        ticket, holder, asked = slot_store.mark_replaced("k")
        assert ticket > 2**60 and (holder, asked) == ("a", True)
        info = slot_store.get("k")
        assert info is not None and info.token == 2**60
        self.make_expired(slot_store, "k")
        later = slot_store.acquire("k", "b", LONG_MS)
        assert later is not None and later > ticket

    def test_a_ticket_drawn_for_another_holder_of_a_marked_lease_orders_later_tokens(
        self, slot_store: Store
    ) -> None:
        """holder names someone else than the marked holder: not asked, and the drawn ticket
        still lies below every later token (the counter ahead of the clock)."""
        slot_store.acquire("k", "a", LONG_MS)
        self.set_token(slot_store, "k", 2**60)
        first = slot_store.mark_replaced("k")
        second = slot_store.mark_replaced("k", holder="x")
        assert second[1:] == ("a", False) and second[0] > first[0] > 2**60
        info = slot_store.get("k")
        assert info is not None and (info.owner, info.token) == (marked("a"), 2**60)
        self.make_expired(slot_store, "k")
        later = slot_store.acquire("k", "b", LONG_MS)
        assert later is not None and later > second[0]

    def test_a_ticket_drawn_while_another_owner_holds_unmarked_leaves_it_alone(
        self, slot_store: Store
    ) -> None:
        """holder names someone else and the live holder is unmarked: it keeps its lease and
        token; the ticket is above every token issued so far."""
        token = slot_store.acquire("k", "a", LONG_MS)
        ticket, holder, asked = slot_store.mark_replaced("k", holder="x")
        assert (holder, asked) == ("a", False) and ticket > token
        info = slot_store.get("k")
        assert info is not None and (info.owner, info.token) == ("a", token)
        assert slot_store.last_token("k") == ticket  # set aside: the last ticket drawn counts
        assert slot_store.renew("k", "a", LONG_MS) is True
        assert slot_store.acquire("k", "a", LONG_MS) == token

    def test_inspection_shows_a_marked_holders_own_token(self, slot_store: Store) -> None:
        """While tickets are drawn past it, get, list and force_release show the marked
        holder's own token (last_token: the last ticket); the next holder's token is above
        every ticket."""
        token = slot_store.acquire("k", "a", LONG_MS)
        tickets = [slot_store.mark_replaced("k")[0] for _ in range(3)]
        assert tickets == sorted(set(tickets)) and tickets[0] > token
        listed = [(i.key, i.owner, i.token) for i in slot_store.list("k")]
        assert listed == [("k", marked("a"), token)]
        assert slot_store.last_token("k") == tickets[-1]  # the last ticket drawn counts
        removed = slot_store.force_release("k")
        assert removed is not None and (removed.owner, removed.token) == (marked("a"), token)
        later = slot_store.acquire("k", "b", LONG_MS)
        assert later is not None and later > tickets[-1]
        assert slot_store.last_token("k") == later
        info = slot_store.get("k")
        assert info is not None and (info.owner, info.token) == ("b", later)
        assert slot_store.mark_replaced("k", holder="b")[1:] == ("b", True)
        info = slot_store.get("k")
        assert info is not None and (info.owner, info.token) == (marked("b"), later)

    def test_a_marked_expired_holder_is_free_and_its_release_is_harmless(
        self, slot_store: Store
    ) -> None:
        """Once a marked lease expired, another owner takes the key; the old holder's late
        release does not free the new one."""
        slot_store.acquire("k", "a", LONG_MS)
        slot_store.mark_replaced("k")
        self.make_expired(slot_store, "k")
        token = slot_store.acquire("k", "b", LONG_MS)
        assert token is not None
        slot_store.release("k", "a")
        info = slot_store.get("k")
        assert info is not None and (info.owner, info.token) == ("b", token)

    def test_force_release_of_a_marked_lease_frees_the_key(self, slot_store: Store) -> None:
        """force_release removes a marked lease as any other, showing the marked owner."""
        slot_store.acquire("k", "a", LONG_MS)
        ticket = slot_store.mark_replaced("k")[0]
        removed = slot_store.force_release("k")
        assert removed is not None and removed.owner == marked("a")
        later = slot_store.acquire("k", "b", LONG_MS)
        assert later is not None and later > ticket

    def test_inspection_shows_no_internal_rows(self, slot_store: Store) -> None:
        """The slot counter and the ticket row are never listed as leases."""
        slot_store.acquire_slot("k", "a", LONG_MS, 2)
        slot_store.acquire("k", "b", LONG_MS)
        slot_store.mark_replaced("k")
        assert isinstance(slot_store, SupportsInspection)
        assert [info.key for info in slot_store.list()] == ["k", slot_key("k", 0)]
