"""``lease_restart_grace``: the restart grace of a Redis store built from the app's settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_lease import LeaseConfigError
from celery_lease._celery import settings as config
from celery_lease.stores.redis import RedisLockStore


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("grace", set_as_current=False)
    try:
        yield app
    finally:
        config.reset(app)


def _grace_of(app: Celery) -> float:
    store = config.get_store(app)
    assert isinstance(store, RedisLockStore)
    try:
        return store.restart_grace
    finally:
        store.close()


class TestRestartGraceSetting:
    def test_unset_it_is_the_default_ttl(self, app: Celery) -> None:
        """Without lease_restart_grace a Redis store's grace is lease_default_ttl (else 30 s):
        the longest a holder of a default lease goes on without hearing it lost it."""
        app.conf.lease_store = "redis://localhost:1/0"
        assert _grace_of(app) == 30.0
        config.reset(app)
        app.conf.lease_default_ttl = "2m"
        assert _grace_of(app) == 120.0

    def test_the_setting_and_the_urls_own_option(self, app: Celery) -> None:
        """lease_restart_grace sets it (0 turns it off); a URL's ?restart_grace= wins."""
        app.conf.lease_store = "redis+sentinel://s1:26379/svc"
        app.conf.lease_restart_grace = "0"
        assert _grace_of(app) == 0.0
        config.reset(app)
        app.conf.lease_store = "redis://localhost:1/0?restart_grace=7"
        assert _grace_of(app) == 7.0

    def test_the_broker_store_gets_it_too(self, app: Celery) -> None:
        """The store taken from a Redis broker URL gets the setting as well."""
        app.conf.broker_url = "redis://localhost:1/3"
        app.conf.lease_restart_grace = 45
        assert _grace_of(app) == 45.0

    def test_other_urls_are_left_alone(self) -> None:
        """Only Redis URLs carry the option (the other stores are durable: no grace)."""
        settings = config.LeaseSettings(None, 30.0, 0.0, "")
        for url in ("sqlite:////tmp/x.db", "postgresql://u@h/db", "memory://"):
            assert config.with_restart_grace(url, settings) == url
        assert config.with_restart_grace("unix:///s.sock?db=2", settings) == (
            "unix:///s.sock?db=2&restart_grace=30"
        )

    def test_a_bad_value_is_refused_naming_the_setting(self, app: Celery) -> None:
        """A bad lease_restart_grace fails when the settings are read, naming it."""
        app.conf.lease_store = "redis://localhost:1/0"
        app.conf.lease_restart_grace = "soon"
        with pytest.raises(LeaseConfigError, match="lease_restart_grace"):
            config.get_settings(app)
