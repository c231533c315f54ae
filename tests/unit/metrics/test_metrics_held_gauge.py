"""``celery_lease_held`` counts the leases held, whatever order and process the signals come in.

The lock signals sent as the engine and the worker's reaper send them, into a Prometheus sink on
a registry of the test's own. Each process counts the leases it took (known by key and token),
and only those go down on release or loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

import celery_lease.metrics as metrics
from celery_lease import LockedTask, MemoryLockStore
from celery_lease import signals as lease_signals
from tests.support import service_missing


@pytest.fixture
def registry() -> Iterator[Any]:
    try:
        import prometheus_client
    except ImportError:
        service_missing("prometheus_client", "pip install 'celery-lease[prometheus]'")
    from celery_lease.metrics.prometheus import PrometheusSink

    registry = prometheus_client.CollectorRegistry()
    metrics.connect(PrometheusSink(registry))
    yield registry
    metrics.disconnect()


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("g", broker="memory://", set_as_current=False)
    app.conf.lease_store = MemoryLockStore()
    app.conf.lease_key_prefix = "p:"

    @app.task(
        name="g.unique", base=LockedTask, lock_key="u:{n}", lock_unique="until_done", shared=False
    )
    def unique(n: int) -> int:
        return n

    yield app
    app.close()


def value(registry: Any, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else float(got)


TASK = type("T", (), {"name": "g.t"})()


def acquired(key: str, token: int, sender: Any = TASK) -> None:
    lease_signals.send(
        lease_signals.lock_acquired, sender, key=key, token=token, waited=False,
        wait_seconds=0.0, task_id="i",
    )  # fmt: skip


def released(key: str, token: int, **named: Any) -> None:
    lease_signals.send(
        lease_signals.lock_released, TASK, key=key, token=token, held_seconds=1.0, task_id="i",
        **named,
    )  # fmt: skip


class TestHeld:
    def test_a_release_sent_before_its_acquisition_is_counted_after_it(self, registry: Any) -> None:
        """Another thread's signal overtook the acquisition's: held 0 in the end, both counted."""
        released("k", 1)
        assert value(registry, "celery_lease_released_total", task="g.t") == 0
        acquired("k", 1)
        assert value(registry, "celery_lease_held", task="g.t") == 0
        assert value(registry, "celery_lease_acquired_total", task="g.t") == 1
        assert value(registry, "celery_lease_released_total", task="g.t") == 1

    def test_a_dead_childs_lease_released_here_is_counted_but_never_held_here(
        self, registry: Any
    ) -> None:
        """The main process releases a dead pool child's lease (``reason="holder_died"``): a
        release, but this process never counted the lease as held: the gauge stays 0."""
        released("k", 7, reason="holder_died", pid=4242, exitcode=-9)
        assert value(registry, "celery_lease_released_total", task="g.t") == 1
        assert value(registry, "celery_lease_held", task="g.t") == 0

    def test_a_release_without_acquisition_leaves_the_gauge(self, registry: Any) -> None:
        """A superseded debounce copy releases the run lease it never announced: nothing held
        here went away, so nothing changes."""
        acquired("k", 1)
        released("k", 2)  # another token of the same key: not the lease counted here
        assert value(registry, "celery_lease_held", task="g.t") == 1
        assert value(registry, "celery_lease_released_total", task="g.t") == 0
        released("k", 1)
        assert value(registry, "celery_lease_held", task="g.t") == 0


class TestRenewals:
    def test_a_unique_copys_queued_key_renewals_count_under_its_task(
        self, registry: Any, app: Celery
    ) -> None:
        """An until_done copy renews ``p:queued:u:1`` beside its run lease ``p:u:1``: both count
        under the task; a renewal of a lease no task here holds counts nowhere."""
        acquired("p:u:1", 3, sender=app.tasks["g.unique"])
        metrics._on_renewal("p:u:1", 3, 0.002, True)
        metrics._on_renewal("p:queued:u:1", None, 0.002, True)
        metrics._on_renewal("elsewhere", 1, 0.002, True)
        assert value(registry, "celery_lease_renewal_seconds_count", task="g.unique") == 2
        assert value(registry, "celery_lease_renewal_seconds_count", task="unknown") == 0
