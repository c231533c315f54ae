"""What an execution resolves from its app (settings, store, its clock, ttl and wait) is kept
between executions, and any change between two executions still applies to the next one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, current_app

from celery_lease import LeaseConfigError, LockedTask, MemoryLockStore, current_lease, locked
from celery_lease import _forking as forking
from celery_lease._celery import settings as config
from celery_lease._celery.store_resolution import close_url_stores
from celery_lease.testing import FakeClock


class _ClockSwappingStore(MemoryLockStore):
    """A memory store whose ``clock`` attribute can be replaced."""

    clock: Any = None


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("resolution", broker="memory://", set_as_current=False)
    app.conf.lease_store = MemoryLockStore()
    yield app
    config.reset(app)
    app.close()


def _task(app: Celery, **options: Any) -> Any:
    """A locked task that returns what its execution held: key, store, owner id (which names
    the ttl) and when it was acquired (read on the lease's clock)."""

    @app.task(bind=True, base=LockedTask, lock_key="k", shared=False, **options)
    def seen(self: Any) -> tuple[str, object, str, float]:
        held = current_lease()
        assert held is not None
        return self.request.lock_key, held.store, held.owner, held.acquired_at

    return seen


def _run(task: Any) -> tuple[str, object, str, float]:
    return task.apply().get()  # type: ignore[no-any-return]


class TestKeptBetweenExecutions:
    def test_a_new_key_prefix_and_ttl_apply_to_the_next_execution(self, app: Celery) -> None:
        task = _task(app)
        for _ in range(2):
            assert _run(task)[0] == "k"
        app.conf.lease_key_prefix = "p:"
        app.conf.lease_default_ttl = 60
        config.reset(app)  # the settings are read again
        key, _, owner, _ = _run(task)
        assert key == "p:k"
        assert ";ttl=60000;" in owner

    def test_a_replaced_configuration_applies_to_the_next_execution(self) -> None:
        first, other = MemoryLockStore(), MemoryLockStore()

        class First:
            lease_store = first

        class Other:
            lease_store = other

        app = Celery("resolution-configured", broker="memory://", set_as_current=False)
        app.config_from_object(First)
        try:
            task = _task(app)
            for _ in range(2):  # the second execution finds what the first resolved
                assert _run(task)[1] is first
            app.config_from_object(Other, force=True)  # Celery replaces app.conf
            assert _run(task)[1] is other
        finally:
            config.reset(app)
            app.close()

    def test_a_closed_store_is_replaced_for_the_next_execution(self, app: Celery) -> None:
        app.conf.lease_store = "memory://"
        task = _task(app)
        first = _run(task)[1]
        assert _run(task)[1] is first
        config.close_stores(app)
        assert _run(task)[1] is not first

    def test_a_closed_lock_store_url_is_opened_again(self, app: Celery) -> None:
        task = _task(app, lock_store="memory://")
        first = _run(task)[1]
        close_url_stores()
        assert _run(task)[1] is not first

    def test_a_new_pool_process_resolves_its_stores_again(self, app: Celery) -> None:
        app.conf.lease_store = "memory://"
        task = _task(app)
        first = _run(task)[1]
        forking.reset_child_state()
        assert _run(task)[1] is not first

    def test_a_forked_child_resolves_its_own_store(self, app: Celery) -> None:
        app.conf.lease_store = "memory://"
        task = _task(app)
        parent = _run(task)[1]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.write(write, b"same" if _run(task)[1] is parent else b"new")
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        assert os.read(read, 10) == b"new"
        os.close(read)

    def test_a_refusal_fails_the_next_execution(self, app: Celery) -> None:
        app.conf.task_eager_propagates = True
        task = _task(app)
        _run(task)
        config.refuse(app, "refused between two executions")
        with pytest.raises(LeaseConfigError, match="refused between two executions"):
            _run(task)

    def test_a_new_clock_of_the_store_applies_to_the_next_execution(self, app: Celery) -> None:
        store = _ClockSwappingStore()
        store.clock = FakeClock(start=1000.0)
        app.conf.lease_store = store
        task = _task(app)
        for _ in range(2):
            assert _run(task)[3] == 1000.0
        store.clock = FakeClock(start=5000.0)
        assert _run(task)[3] == 5000.0

    def test_a_locked_body_uses_the_store_of_the_app_current_at_each_call(
        self, app: Celery
    ) -> None:
        @locked(key="b")
        def body() -> object:
            held = current_lease()
            assert held is not None
            return held.store

        other_app = Celery("resolution-other", broker="memory://", set_as_current=False)
        other_app.conf.lease_store = MemoryLockStore()
        previous = current_app._get_current_object()
        try:
            for current in (app, app, other_app, other_app, app):
                current.set_current()
                assert body() is current.conf.lease_store
        finally:
            previous.set_current()
            config.reset(other_app)
            other_app.close()
