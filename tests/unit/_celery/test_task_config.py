"""Settings on app.conf, the precedence rule, and store resolution per app and process."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, MemoryLockStore
from celery_lease._celery import settings as config


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("cfg", broker="memory://", set_as_current=False)
    yield app
    config.reset(app)
    app.close()


class TestSettings:
    def test_builtin_defaults(self, app: Celery) -> None:
        """Unset settings give 30 s ttl, no wait and no prefix."""
        s = config.get_settings(app)
        assert (s.store, s.default_ttl, s.default_wait, s.key_prefix) == (None, 30.0, 0.0, "")

    def test_precedence_option_then_setting_then_default(self) -> None:
        """pick() prefers the task option, then the app setting, then the built-in."""
        assert config.pick(1.0, 2.0, 3.0) == 1.0
        assert config.pick(None, 2.0, 3.0) == 2.0
        assert config.pick(None, None, 3.0) == 3.0

    def test_django_namespace(self) -> None:
        """CELERY_LEASE_* settings loaded with namespace="CELERY" are read."""

        class Settings:
            CELERY_LEASE_DEFAULT_TTL = "12s"
            CELERY_LEASE_KEY_PREFIX = "site1/"

        app = Celery("dj", set_as_current=False)
        app.config_from_object(Settings, namespace="CELERY")
        s = config.get_settings(app)
        assert (s.default_ttl, s.key_prefix) == (12.0, "site1/")

    @pytest.mark.parametrize(
        ("name", "value", "message"),
        [
            ("lease_default_ttl", "0s", "lease_default_ttl='0s' must be > 0"),
            ("lease_key_prefix", 5, "lease_key_prefix=5 must be a str"),
            ("lease_store", "localhost:6379", "is not a URL"),
            ("lease_store", 42, "lease_store=42 is not allowed"),
        ],
    )
    def test_bad_settings_name_the_setting(
        self, app: Celery, name: str, value: object, message: str
    ) -> None:
        """A bad value fails when first read, naming the setting and the value."""
        app.conf[name] = value
        with pytest.raises(LeaseConfigError, match=message):
            config.get_settings(app)


class TestStoreResolution:
    def test_instance_and_url(self, app: Celery) -> None:
        """lease_store as an instance is used as is; as a URL it is built once per app."""
        store = MemoryLockStore()
        app.conf.lease_store = store
        assert config.get_store(app) is store
        other = Celery("cfg2", set_as_current=False)
        other.conf.lease_store = "memory://"
        first = config.get_store(other)
        assert isinstance(first, MemoryLockStore) and config.get_store(other) is first

    def test_redis_broker_url(self, app: Celery) -> None:
        """A Redis broker (plain, TLS or Sentinel) gives the store URL of that Redis."""
        app.conf.broker_url = "redis://:pw@h:6380/3"
        assert config.broker_store_url(app) == "redis://:pw@h:6380/3"
        app.conf.broker_url = "sentinel://:pw@s1:26379/2;sentinel://s2:26380"
        app.conf.broker_transport_options = {"master_name": "mymaster"}
        assert config.broker_store_url(app) == "redis+sentinel://:pw@s1:26379,s2:26380/mymaster/2"
        app.conf.broker_url = "amqp://guest@localhost//"
        assert config.broker_store_url(app) is None

    def test_host_local_sqlite_fallback(
        self,
        app: Celery,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Without a setting or Redis broker: a per-user SQLite file, 0o700 dir, 0o600 file."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        monkeypatch.setattr(config, "_warned_local", False)
        with caplog.at_level(logging.WARNING, logger="celery_lease.config"):
            store = config.get_store(app)
            config.reset(app)
            config.get_store(app)
        directory = tmp_path / f"celery-lease-{os.getuid()}"
        path = directory / config.SQLITE_FILE
        assert type(store).__name__ == "SQLiteLockStore"
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        warnings = [r for r in caplog.records if "only workers on this host" in r.message]
        assert len(warnings) == 1

    def test_rebuilt_after_fork(self, app: Celery) -> None:
        """A forked child resolves its own store instead of using the parent's."""
        app.conf.lease_store = "memory://"
        parent = config.get_store(app)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.write(write, b"same" if config.get_store(app) is parent else b"new")
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        assert os.read(read, 10) == b"new"
        os.close(read)
