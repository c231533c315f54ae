"""The names of a key's slots and of a replaced holder, as every store writes them."""

from __future__ import annotations

import pytest

from celery_lease.stores.slots import (
    REPLACED_MARK,
    SLOT_MARK,
    counter_key,
    marked,
    release_channel,
    slot_key,
    split_slot,
    unmarked,
)


@pytest.mark.parametrize("key", ["k", "", "a:b", "x" * 300, "ü/{tag}", "12"])
@pytest.mark.parametrize("slot", [0, 1, 9, 10, 4096])
def test_a_slot_key_splits_back_into_its_key_and_slot(key: str, slot: int) -> None:
    assert split_slot(slot_key(key, slot)) == (key, slot)
    assert release_channel(slot_key(key, slot)) == key


@pytest.mark.parametrize("key", ["k", "k1", "a:1", "", "k" + SLOT_MARK, "k" + SLOT_MARK + "٣"])
def test_a_key_that_is_no_slot_is_its_own_channel(key: str) -> None:
    assert split_slot(key) == (key, None)
    assert release_channel(key) == key


def test_the_counter_is_no_slot_and_no_key_of_a_slot() -> None:
    assert split_slot(counter_key("k")) == (counter_key("k"), None)
    assert counter_key("k") not in {slot_key("k", i) for i in range(100)}
    assert counter_key("k") != "k"


def test_slots_of_two_keys_never_share_a_store_key() -> None:
    keys = ["a", "a1", "a" + "1", "a:", "b"]
    names = [slot_key(k, i) for k in keys for i in range(12)]
    assert len(set(names)) == len(set(keys)) * 12


@pytest.mark.parametrize("owner", ["host/1/0f;t=a", "", "queued;t=x"])
def test_a_marked_owner_reads_back_as_its_owner_asked_to_stop(owner: str) -> None:
    assert marked(owner) == owner + REPLACED_MARK
    assert unmarked(marked(owner)) == (owner, True)
    assert unmarked(owner) == (owner, False)
