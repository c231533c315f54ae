"""``lease(key, limit=n)`` under seeded orders of every store call, with lost replies and failed
calls: never more bodies than the limit, tokens only grow, no slot leaks (the explorer is
tests/slot_explorer.py)."""

from __future__ import annotations

import pytest

from celery_lease.stores.memory import MemoryLockStore
from tests.slot_explorer import SCENARIOS, Explorer, Violation, explore

SEEDS = range(60)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_order_lets_more_bodies_in_than_the_limit(name: str) -> None:
    seen = explore(name, SEEDS)
    # Some order filled every slot: the explorer reaches the interesting states.
    assert seen["peak"] == SCENARIOS[name].limit, seen
    assert seen.get("ran", 0) > 0, seen


@pytest.mark.parametrize(("name", "outcome"), [("faults", "store failed"), ("burst", "refused")])
def test_the_runs_meet_failed_calls_and_refusals(name: str, outcome: str) -> None:
    assert explore(name, SEEDS).get(outcome, 0) > 0


class _OverGranting(MemoryLockStore):
    """A store that forgets the limit: every slot request gets a fresh slot."""

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        return super().acquire_slot(key, owner, ttl_ms, limit + 5)


class _RecyclingTokens(MemoryLockStore):
    """A store that hands out the token of the slot it gives (not a new, larger one)."""

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        got = super().acquire_slot(key, owner, ttl_ms, limit)
        return None if got is None else (got[0], got[0] + 1)


@pytest.mark.parametrize(
    ("store_class", "found"),
    [(_OverGranting, "bodies inside"), (_RecyclingTokens, "not strictly increasing")],
)
def test_the_explorer_catches_a_store_that_breaks_slots(
    store_class: type[MemoryLockStore], found: str
) -> None:
    with pytest.raises(Violation, match=found):
        for seed in SEEDS:
            Explorer(SCENARIOS["burst"], seed, store_class).run()
