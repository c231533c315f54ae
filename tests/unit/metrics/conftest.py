"""A memory store, an app with two locked tasks on it, and a Prometheus sink on a registry of the
test's own: eager tasks send the real lock signals and the sinks count them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

import celery_lease.metrics as metrics
from celery_lease import LockedTask, MemoryLockStore


@pytest.fixture
def store() -> MemoryLockStore:
    return MemoryLockStore()


@pytest.fixture
def app(store: MemoryLockStore) -> Iterator[Celery]:
    app = Celery("m", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.task_eager_propagates = False

    @app.task(name="m.work", base=LockedTask, lock_key="work:{n}", shared=False)
    def work(n: int) -> int:
        return n

    @app.task(
        name="m.skip", base=LockedTask, lock_key="work:{n}", lock_on_held="skip", shared=False
    )
    def skip(n: int) -> int:
        return n

    yield app
    app.close()


@pytest.fixture
def registry() -> Iterator[Any]:
    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_lease.metrics.prometheus import PrometheusSink

    registry = prometheus_client.CollectorRegistry()
    metrics.connect(PrometheusSink(registry))
    yield registry
    metrics.disconnect()
