"""Which store a locked task uses: its ``lock_store`` option, else the app's ``lease_store``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_lease import MemoryLockStore
from celery_lease import _forking as forking
from celery_lease._celery import settings as config
from celery_lease._celery.store_resolution import execution_store, store_for
from celery_lease.errors import LeaseConfigError


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("stores", broker="memory://", set_as_current=False)
    app.conf.lease_store = MemoryLockStore()
    yield app
    config.reset(app)


class TestStoreFor:
    def test_no_option_is_the_apps_store(self, app: Celery) -> None:
        """A task without ``lock_store`` uses ``lease_store``."""
        assert store_for(None, app) is app.conf.lease_store

    def test_a_store_object_is_used_as_it_is(self, app: Celery) -> None:
        """A ``LockStore`` given as the option is the task's store."""
        own = MemoryLockStore()
        assert store_for(own, app) is own

    def test_a_url_is_opened_once_per_process(self, app: Celery) -> None:
        """Every execution of tasks naming one URL shares the store opened for it first."""
        first = store_for("memory://", app)
        assert isinstance(first, MemoryLockStore)
        assert store_for("memory://", app) is first
        assert first is not app.conf.lease_store

    def test_a_new_pool_process_opens_the_url_again(self, app: Celery) -> None:
        """The resets of a new process forget the stores opened from URLs."""
        first = store_for("memory://", app)
        forking.reset_child_state()
        assert store_for("memory://", app) is not first


class TestExecutionStore:
    def test_an_async_store_is_held_through_its_sync_twin(self, app: Celery) -> None:
        """An execution renews from a thread: an async ``lock_store`` gives its ``.sync``."""
        from celery_lease import ThreadedAsyncStore

        sync = MemoryLockStore()
        assert execution_store(ThreadedAsyncStore(sync), app, "k") is sync
        assert execution_store(None, app, "k") is app.conf.lease_store

    def test_a_store_that_is_no_lock_store_is_refused_as_lease_refuses_it(
        self, app: Celery
    ) -> None:
        with pytest.raises(LeaseConfigError, match="store="):
            execution_store(object(), app, "k")  # type: ignore[arg-type]

    def test_a_non_store_is_refused_every_time_after_a_store_was_accepted(
        self, app: Celery
    ) -> None:
        """What was found to be a LockStore is not checked again; anything else always is."""
        assert execution_store(None, app, "k") is app.conf.lease_store
        for _ in range(2):
            with pytest.raises(LeaseConfigError, match="store="):
                execution_store(object(), app, "k")  # type: ignore[arg-type]
        assert execution_store(None, app, "k") is app.conf.lease_store

    def test_the_settings_just_read_give_the_apps_store(self, app: Celery) -> None:
        """Passed the app's settings, it reads them no second time and picks the same store."""
        settings = config.get_settings(app)
        assert execution_store(None, app, "k", settings) is app.conf.lease_store
        assert store_for(None, app, settings) is store_for(None, app)

    def test_a_refused_configuration_still_raises_without_settings_passed(
        self, app: Celery
    ) -> None:
        execution_store(None, app, "k")
        config.refuse(app, "refused for this test")
        with pytest.raises(LeaseConfigError, match="refused for this test"):
            execution_store(None, app, "k")
