"""``lease(key, app=app)``: the app's lease store and ``lease_key_prefix``, as its tasks use them.

The store is the one the app's locked tasks use in this process, the key is prefixed as a task's
``lock_key`` is, and the ttl and wait a task that sets none gets are the defaults. Sync and async.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from celery import Celery

import celery_lease
from celery_lease import LeaseConfigError, LockNotAcquiredError, MemoryLockStore, lease
from celery_lease._celery import settings as config


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("applease", broker="memory://", set_as_current=False)
    app.conf.update(lease_store=MemoryLockStore(), lease_key_prefix="nc5:")
    yield app
    config.reset(app)


def held_keys(store: MemoryLockStore) -> list[str]:
    return [info.key for info in store.list()]


class TestTheAppsStoreAndPrefix:
    def test_the_key_is_prefixed_in_the_apps_store(self, app: Celery) -> None:
        """``lease("cache:prices", app=app)`` holds ``nc5:cache:prices`` in ``lease_store``:
        the key a task with ``lock_key="cache:prices"`` takes."""
        store = app.conf.lease_store
        with lease("cache:prices", app=app) as held:
            assert held.key == "nc5:cache:prices"
            assert held_keys(store) == ["nc5:cache:prices"]
        assert held_keys(store) == []

    def test_the_store_is_the_one_the_apps_tasks_use(self, app: Celery) -> None:
        """Built once per process from ``lease_store`` (a URL too), shared with the tasks."""
        app.conf.lease_store = "memory://"
        config.reset(app)
        with lease("k", app=app):
            assert held_keys(config.get_store(app)) == ["nc5:k"]  # type: ignore[arg-type]

    def test_a_held_task_key_is_not_acquired(self, app: Celery) -> None:
        """A key the app's task holds (prefixed) excludes ``lease(app=...)`` of the same key."""
        store = app.conf.lease_store
        assert store.acquire("nc5:cache:prices", "task-owner", 30_000) is not None
        with pytest.raises(LockNotAcquiredError), lease("cache:prices", app=app):
            pass

    def test_store_given_wins_and_the_prefix_still_applies(self, app: Celery) -> None:
        """``store=`` picks the store; the app still gives its prefix."""
        own = MemoryLockStore()
        with lease("k", app=app, store=own):
            assert held_keys(own) == ["nc5:k"]
            assert held_keys(app.conf.lease_store) == []

    def test_ttl_and_wait_default_to_the_apps(self, app: Celery) -> None:
        """Left out, ttl and wait are ``lease_default_ttl`` and ``lease_default_wait`` (read on
        entry); given, they win."""
        app.conf.update(lease_default_ttl="12s", lease_default_wait="2s")
        config.reset(app)

        def entered(**given: float) -> tuple[float, float]:
            context = lease("k", app=app, **given)  # type: ignore[arg-type]
            with context:
                return context.ttl, context.wait

        assert entered() == (12.0, 2.0)
        assert entered(ttl=5, wait=0) == (5.0, 0.0)

    def test_without_an_app_the_defaults_and_key_are_the_cores(self) -> None:
        """No app: the key as given, ttl 30 s, wait 0."""
        ctx = lease("k", store=MemoryLockStore())
        assert (ctx.key, ctx.ttl, ctx.wait) == ("k", 30.0, 0.0)

    def test_async_with_uses_the_apps_store_and_prefix(self, app: Celery) -> None:
        """``async with lease(key, app=app)`` holds the same prefixed key."""
        store = app.conf.lease_store

        async def body() -> list[str]:
            async with lease("cache:prices", app=app):
                return held_keys(store)

        assert asyncio.run(body()) == ["nc5:cache:prices"]


class TestBadInput:
    def test_neither_store_nor_app_names_both(self) -> None:
        with pytest.raises(LeaseConfigError, match=r"store=.*app="):
            lease("k")  # type: ignore[call-arg]

    def test_an_app_without_conf_is_refused_naming_it(self) -> None:
        with pytest.raises(LeaseConfigError, match=r"app=42"):
            lease("k", app=42)  # type: ignore[arg-type]

    def test_a_bad_setting_of_the_app_is_refused_naming_it(self, app: Celery) -> None:
        """Refused on entry, before anything is acquired (the app is read then)."""
        app.conf.lease_key_prefix = 7
        config.reset(app)
        with pytest.raises(LeaseConfigError, match="lease_key_prefix"), lease("k", app=app):
            pass

    def test_a_bad_setting_of_a_configured_app_is_refused_by_lease_itself(self) -> None:
        """An app already configured is read when the lease is made: the error comes then."""
        app = Celery("configured-bad", set_as_current=False)
        app.config_from_object({"lease_key_prefix": 7}, force=True)
        try:
            with pytest.raises(LeaseConfigError, match="lease_key_prefix"):
                lease("k", app=app)
        finally:
            config.reset(app)

    def test_a_bad_argument_is_refused_before_the_app_is_configured(self) -> None:
        """What does not depend on the app (a ttl, a key) is checked when the lease is made."""
        app = Celery("unconfigured-bad-arg", set_as_current=False)
        with pytest.raises(LeaseConfigError, match="ttl"):
            lease("k", app=app, ttl=-1)
        with pytest.raises(LeaseConfigError, match="key"):
            lease("", app=app)
        assert app.configured is False

    def test_the_package_exports_it(self) -> None:
        assert celery_lease.lease is lease


class TestAnAppConfiguredAfterTheLeaseIsMade:
    """``@lease(key, app=app)`` runs at import, often before ``app.config_from_object``: the
    app's store, prefix and defaults are those it has when the lease is entered."""

    def test_the_decorator_uses_the_store_and_prefix_configured_after_it(self) -> None:
        app = Celery("configured-later", set_as_current=False)
        seen: list[str] = []

        @lease("nightly", app=app)
        def nightly() -> None:
            seen.extend(held_keys(store))

        store = MemoryLockStore()

        class Conf:
            lease_store = store
            lease_key_prefix = "proj:"
            lease_default_ttl = "12s"

        app.config_from_object(Conf)
        try:
            nightly()
            assert seen == ["proj:nightly"]
            assert config.get_settings(app).key_prefix == "proj:"
            assert config.get_store(app) is store
        finally:
            config.reset(app)

    def test_making_the_lease_leaves_an_unconfigured_app_unconfigured(self) -> None:
        app = Celery("still-unconfigured", set_as_current=False)
        lease("k", app=app)
        assert app.configured is False
