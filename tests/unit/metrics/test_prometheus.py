"""celery_lease.metrics.prometheus: the Prometheus sink counts the real lock signals of eager
tasks on a MemoryLockStore, into a registry of the test's own (prometheus_client)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

import celery_lease.metrics as metrics
from celery_lease import MemoryLockStore
from celery_lease import signals as lease_signals
from tests.unit.metrics.samples import value

pytest.importorskip("prometheus_client")


class TestPrometheusSink:
    def test_acquired_released_and_hold_counted_by_task(self, app: Celery, registry: Any) -> None:
        """Two runs: two acquisitions and releases, two hold observations, nothing held after."""
        assert app.tasks["m.work"].apply((1,)).get() == 1
        assert app.tasks["m.work"].apply((2,)).get() == 2
        assert value(registry, "celery_lease_acquired_total", task="m.work") == 2
        assert value(registry, "celery_lease_released_total", task="m.work") == 2
        assert value(registry, "celery_lease_hold_seconds_count", task="m.work") == 2
        assert value(registry, "celery_lease_wait_seconds_count", task="m.work") == 2
        assert value(registry, "celery_lease_held", task="m.work") == 0

    def test_rejected_run_counted_and_gauge_follows_holding(
        self, app: Celery, registry: Any, store: MemoryLockStore
    ) -> None:
        """A run turned away (key held by another owner) counts as rejected, not acquired."""
        store.acquire("work:7", "someone-else", 60_000)
        app.tasks["m.skip"].apply((7,)).get()
        assert value(registry, "celery_lease_rejected_total", task="m.skip") == 1
        assert value(registry, "celery_lease_acquired_total", task="m.skip") == 0

    def test_lost_counted_by_reason_and_leaves_gauge(self, registry: Any) -> None:
        """lock_lost as the engine sends it: counted under its reason; the gauge goes down."""
        task = type("T", (), {"name": "m.x"})()
        lease_signals.send(
            lease_signals.lock_acquired, task, key="k", token=1, waited=False, wait_seconds=0.5,
            task_id="i",
        )  # fmt: skip
        assert value(registry, "celery_lease_held", task="m.x") == 1
        lease_signals.send(
            lease_signals.lock_lost, task, key="k", token=1, reason="expired", task_id="i"
        )
        assert value(registry, "celery_lease_lost_total", task="m.x", reason="expired") == 1
        assert value(registry, "celery_lease_held", task="m.x") == 0
        assert value(registry, "celery_lease_wait_seconds_sum", task="m.x") == 0.5

    def test_renewal_observer_labels_by_task_of_key(self, registry: Any) -> None:
        """A renewal of a key held by a task is observed under that task's name."""
        task = type("T", (), {"name": "m.r"})()
        lease_signals.send(
            lease_signals.lock_acquired, task, key="rk", token=1, waited=False, wait_seconds=0.0,
            task_id="i",
        )  # fmt: skip
        metrics._on_renewal("rk", 1, 0.004, True)
        assert value(registry, "celery_lease_renewal_seconds_count", task="m.r") == 1
        assert value(registry, "celery_lease_renewal_seconds_sum", task="m.r") == 0.004
