"""``celery_lease._core.renewer.snapshot()``: the leases this process holds, for ``inspect
leases``."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_lease import MemoryLockStore, lease
from celery_lease._core.renewer import snapshot
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore
from tests.unit.core_faults import GatedRenewalStore, churn


def _row(key: str) -> dict[str, object]:
    rows = [row for row in snapshot() if row["key"] == key]
    assert len(rows) == 1, rows
    return rows[0]


class TestSnapshot:
    def test_a_held_lease_is_listed_with_its_token_owner_and_times(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Key, token, owner, held and validity seconds, renewals counted; gone after exit."""
        with lease("snap", store=store, ttl=3, clock=clock) as held:
            row = _row("snap")
            assert row["token"] == held.token and row["owner"] == held.owner
            assert row["renewals"] == 0 and row["last_renewal_error"] is None
            assert row["held_seconds"] == pytest.approx(0.0)
            clock.advance(1.0)
            store.wait_renewals(1)
            row = _row("snap")
            assert row["renewals"] == 1
            assert row["held_seconds"] == pytest.approx(1.0)
            assert 0 < float(row["valid_for_seconds"]) <= 3.0  # type: ignore[arg-type]
        assert not [row for row in snapshot() if row["key"] == "snap"]

    def test_a_failed_renewal_is_shown_until_one_succeeds(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """``last_renewal_error`` names the last failed attempt's error; a success clears it."""
        with lease("snap-err", store=store, ttl=3, clock=clock):
            store.fail_renewals = 1
            clock.advance(1.0)
            store.wait_renewals(1)
            row = _row("snap-err")
            assert row["renewals"] == 0
            assert "StoreUnavailableError" in str(row["last_renewal_error"])
            clock.advance(0.2)  # the retry (ttl/15 later) succeeds
            store.wait_renewals(2)
            row = _row("snap-err")
            assert row["renewals"] == 1 and row["last_renewal_error"] is None

    def test_it_answers_while_the_renewer_is_stuck_in_a_store_call(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """A renewal that hangs in the store does not block the snapshot (another thread)."""
        entered, release = threading.Event(), threading.Event()
        original = store.renew

        def hanging(key: str, owner: str, ttl_ms: int) -> bool:
            entered.set()
            release.wait(REAL_TIMEOUT)
            return original(key, owner, ttl_ms)

        store.renew = hanging  # type: ignore[method-assign]
        try:
            with lease("snap-hang", store=store, ttl=30, clock=clock):
                clock.advance(10.0)
                assert entered.wait(REAL_TIMEOUT)
                answers: list[list[dict[str, object]]] = []
                reader = threading.Thread(target=lambda: answers.append(snapshot()))
                reader.start()
                reader.join(REAL_TIMEOUT)
                assert answers and not release.is_set()
                assert any(row["key"] == "snap-hang" for row in answers[0])
                release.set()
        finally:
            release.set()


class TestSnapshotUnderConcurrency:
    def test_snapshot_under_churn_lists_only_held_leases_and_never_raises(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        stop = threading.Event()
        problems: list[object] = []

        def reader() -> None:
            while not stop.is_set():
                try:
                    for row in snapshot():
                        if not str(row["key"]).startswith(("c", "steady")):
                            continue  # another test's clock: not ours to judge
                        if not isinstance(row["token"], int) or row["valid_for_seconds"] < 0:
                            problems.append(row)
                except BaseException as exc:
                    problems.append(exc)
                    return

        with lease("steady", store=store, ttl=3, clock=clock) as steady:
            thread = threading.Thread(target=reader)
            thread.start()
            try:
                churn(store, clock, "c", 500)
            finally:
                stop.set()
                thread.join(REAL_TIMEOUT)
            rows = [row for row in snapshot() if row["key"] in ("steady", "c0", "c499")]
            assert rows == [
                {
                    "key": "steady",
                    "token": steady.token,
                    "owner": steady.owner,
                    "held_seconds": 0.0,
                    "valid_for_seconds": pytest.approx(3 - 0.03 - 0.002),
                    "renewals": 0,
                    "last_renewal_error": None,
                }
            ]
        assert problems == []

    def test_snapshot_answers_while_a_renewal_hangs(self) -> None:
        clock = FakeClock(1000.0)
        store = GatedRenewalStore(clock)
        try:
            with lease("stuck", store=store, ttl=3, clock=clock) as stuck:
                store.gate_key = "stuck"
                clock.advance(1.0)
                assert store.entered.wait(REAL_TIMEOUT)
                rows: list[list[dict[str, Any]]] = []
                thread = threading.Thread(target=lambda: rows.append(snapshot()))
                thread.start()
                thread.join(REAL_TIMEOUT)
                assert not thread.is_alive(), "snapshot() waited for the store"
                assert [r["owner"] for r in rows[0] if r["key"] == "stuck"] == [stuck.owner]
                store.go.set()  # before the exit, which waits for the renewal in flight
        finally:
            store.go.set()
