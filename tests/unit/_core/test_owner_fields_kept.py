"""Which owner-id fields ``make_owner`` keeps encoded between calls: a worker's few steady
combinations stay kept, whatever one-off labels come and go."""

from __future__ import annotations

from celery_lease._core import owners


def test_a_steady_combination_stays_kept_after_many_one_off_labels() -> None:
    owners.make_owner(node="w1@h", task="t", ttl_ms=30000)
    for n in range(owners._KNOWN_FIELDS_KEPT + 10):
        owners.make_owner(node="w1@h", task="t", label=f"job {n}", ttl_ms=30000)
    assert not any(key[2] is not None for key in owners._known_fields)
    assert ("w1@h", "t", None, 30000, None) in owners._known_fields


def test_a_full_table_begins_again_and_keeps_the_new_combination() -> None:
    for n in range(owners._KNOWN_FIELDS_KEPT + 5):
        owners.make_owner(node=f"w{n}@h", task="t", ttl_ms=1000)
    assert len(owners._known_fields) <= owners._KNOWN_FIELDS_KEPT
    owners.make_owner(node="steady@h", task="t", ttl_ms=1000)
    assert ("steady@h", "t", None, 1000, None) in owners._known_fields
