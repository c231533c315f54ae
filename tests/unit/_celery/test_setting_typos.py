"""A misspelled ``lease_*`` setting is an error naming it, its close match and the settings.

Celery keeps any key it does not know and never complains, so before this check a typo such as
``lease_stor`` (or ``CELERY_LEASE_STOR`` under ``namespace="CELERY"``) was silently ignored and
the task used another store (the broker's Redis or the host-local SQLite file): two deployments
that believed they shared a store did not exclude each other.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.app.defaults import _OLD_SETTING_KEYS, SETTING_KEYS

from celery_lease import LeaseConfigError, MemoryLockStore
from celery_lease._celery import settings as config
from celery_lease._celery.setting_typos import misspelled_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def apps() -> Iterator[list[Celery]]:
    """Apps a test creates; their cached settings and refusals are forgotten afterwards."""
    made: list[Celery] = []
    yield made
    for app in made:
        config.reset(app)
        app.close()


def _app(apps: list[Celery], namespace: str | None = None, **changes: Any) -> Celery:
    app = Celery("typos", broker="memory://", set_as_current=False, namespace=namespace)
    app.conf.update(changes)
    apps.append(app)
    return app


def _source(**attributes: Any) -> type:
    """A settings object like a ``celeryconfig`` module or Django's settings."""
    return type("Settings", (), attributes)


class TestMisspelledNames:
    def test_plain_attribute(self, apps: list[Celery]) -> None:
        """app.conf.lease_stor = ... fails, naming the key, the close match and the settings."""
        app = _app(apps)
        app.conf.lease_stor = "redis://redis.internal:6379/1"
        with pytest.raises(LeaseConfigError) as info:
            config.get_settings(app)
        message = str(info.value)
        assert "'lease_stor'" in message
        assert "did you mean 'lease_store'?" in message
        assert all(name in message for name in config.SETTINGS)

    def test_update_and_constructor(self, apps: list[Celery]) -> None:
        """conf.update(...) and Celery(..., lease_default_tll=...) are checked alike."""
        app = _app(apps, lease_key_prefx="site1/")
        with pytest.raises(LeaseConfigError, match=r"'lease_key_prefx'.*'lease_key_prefix'"):
            config.get_settings(app)
        built = Celery("typos", broker="memory://", set_as_current=False, lease_default_tll=5)
        apps.append(built)
        with pytest.raises(LeaseConfigError, match=r"'lease_default_tll'.*'lease_default_ttl'"):
            config.get_settings(built)

    def test_config_from_object_without_namespace(self, apps: list[Celery]) -> None:
        """A celeryconfig-style object with lease_stor fails."""
        app = _app(apps)
        app.config_from_object(_source(lease_stor="sqlite:////srv/leases.db"))
        with pytest.raises(LeaseConfigError, match=r"'lease_stor'.*did you mean 'lease_store'"):
            config.get_settings(app)

    def test_django_namespace(self, apps: list[Celery]) -> None:
        """Under namespace="CELERY", CELERY_LEASE_STOR fails and the hint is CELERY_LEASE_STORE."""
        app = _app(apps)
        app.config_from_object(
            _source(CELERY_LEASE_STOR="redis://r/1", DATABASES={}, DEBUG=True),
            namespace="CELERY",
        )
        with pytest.raises(LeaseConfigError) as info:
            config.get_settings(app)
        message = str(info.value)
        assert "'CELERY_LEASE_STOR'" in message
        assert "did you mean 'CELERY_LEASE_STORE'?" in message
        assert "CELERY_LEASE_DEFAULT_TTL" in message  # the settings, spelled for this namespace

    @pytest.mark.parametrize(
        ("key", "hint"),
        [
            ("lease_ttl", "lease_default_ttl"),
            ("lease_wait", "lease_default_wait"),
            ("lease_prefix", "lease_key_prefix"),
            ("leasestore", "lease_store"),
            ("lease_stores", "lease_store"),
        ],
    )
    def test_hint_is_the_setting_meant(self, apps: list[Celery], key: str, hint: str) -> None:
        """Shortened and run-together names suggest the setting they abbreviate."""
        app = _app(apps)
        app.conf[key] = 1
        with pytest.raises(LeaseConfigError, match=f"did you mean '{hint}'"):
            config.get_settings(app)

    def test_every_problem_in_one_error(self, apps: list[Celery]) -> None:
        """Two typos are reported together, so one restart fixes both."""
        app = _app(apps, lease_stor="memory://", lease_key_prefx="a/")
        with pytest.raises(LeaseConfigError) as info:
            config.get_settings(app)
        assert "'lease_stor'" in str(info.value) and "'lease_key_prefx'" in str(info.value)


class TestSpellingsCeleryNeverReads:
    @pytest.mark.parametrize(
        ("key", "namespace", "readable"),
        [
            ("LEASE_STORE", None, "'lease_store'"),  # upper case without a namespace
            ("CELERY_LEASE_STORE", None, "'lease_store'"),  # Django style, namespace forgotten
            ("LEASE_STORE", "CELERY", "'CELERY_LEASE_STORE'"),  # namespace prefix forgotten
            ("celery_lease_store", "CELERY", "'CELERY_LEASE_STORE'"),  # wrong case of the prefix
            ("CELERY_LEASE_STORE", "celery", "'celery_lease_store'"),
        ],
    )
    def test_known_name_in_an_unread_spelling(
        self, apps: list[Celery], key: str, namespace: str | None, readable: str
    ) -> None:
        """A known setting spelled so that Celery never reads it fails, naming the spelling."""
        app = _app(apps)
        app.config_from_object(_source(**{key: "redis://r/1"}), namespace=namespace)
        with pytest.raises(LeaseConfigError) as info:
            config.get_settings(app)
        assert f"'{key}' is never read" in str(info.value)
        assert readable in str(info.value)

    @pytest.mark.parametrize("namespace", [None, "CELERY", "celery"])
    @pytest.mark.parametrize(
        "key",
        [
            "lease_store",
            "LEASE_STORE",
            "Lease_Store",
            "CELERY_LEASE_STORE",
            "celery_lease_store",
            "CELERY_lease_store",
            "lease_stor",
            "LEASE_STOR",
            "CELERY_LEASE_STOR",
        ],
    )
    def test_error_exactly_when_celery_ignores_the_value(
        self, apps: list[Celery], key: str, namespace: str | None
    ) -> None:
        """Checked against Celery itself: no error iff app.conf really yields the value."""
        app = _app(apps)
        app.config_from_object(_source(**{key: "memory://"}), namespace=namespace)
        celery_reads_it = app.conf.get("lease_store") == "memory://"
        if celery_reads_it:
            assert config.get_settings(app).store == "memory://"
        else:
            with pytest.raises(LeaseConfigError, match=re.escape(repr(key))):
                config.get_settings(app)


class TestNoFalseAlarms:
    def test_correct_spellings(self, apps: list[Celery]) -> None:
        """The documented spellings, plain and under a namespace, are accepted."""
        plain = _app(apps, lease_store="memory://", lease_default_ttl="12s")
        assert config.get_settings(plain).default_ttl == 12.0
        django = _app(apps)
        django.config_from_object(
            _source(CELERY_LEASE_STORE="memory://", CELERY_LEASE_KEY_PREFIX="s/"),
            namespace="CELERY",
        )
        assert config.get_settings(django).key_prefix == "s/"

    def test_unrelated_keys(self, apps: list[Celery]) -> None:
        """Other libraries' and Django's own settings are not ours and pass."""
        app = _app(apps)
        app.config_from_object(
            _source(
                DATABASES={},
                RELEASE_NAME="v1",
                LEASING_MODE="monthly",
                CELERY_BROKER_URL="memory://",
                CELERY_TASK_ACKS_LATE=True,
                default_ttl=3,
            ),
            namespace="CELERY",
        )
        config.get_settings(app)

    def test_celery_setting_names_are_never_ours(self) -> None:
        """No Celery setting (new or old name) is taken for a misspelled lease setting."""
        for key in sorted(SETTING_KEYS | _OLD_SETTING_KEYS):
            assert misspelled_settings({key: 1}, config.SETTINGS) == [], key

    def test_a_store_instance_value(self, apps: list[Celery]) -> None:
        """The check looks at names only: any value under a known name passes it."""
        store = MemoryLockStore()
        assert config.get_settings(_app(apps, lease_store=store)).store is store


class TestOneListOfSettings:
    def test_settings_match_the_dataclass(self) -> None:
        """SETTINGS is lease_<field> for each LeaseSettings field: adding one is one line."""
        fields = [f"lease_{f.name}" for f in dataclasses.fields(config.LeaseSettings)]
        assert list(config.SETTINGS) == fields

    def test_docs_list_every_setting(self) -> None:
        """The settings table of docs/celery.md lists exactly SETTINGS."""
        text = (ROOT / "docs" / "celery.md").read_text()
        table = text.split("### App settings", 1)[1].split("###", 1)[0]
        listed = re.findall(r"^\| `(lease_\w+)` \|", table, flags=re.MULTILINE)
        assert listed == list(config.SETTINGS)


# Real-world settings are not ours; typos of "lease" still are ---------------------------------

# Settings of real projects and libraries that share words with ours. The marked ones are close to
# a lease setting by spelling alone (difflib ratio >= 0.8 to lease_key_prefix, lease_default_ttl,
# lease_default_wait or lease_store): taken for "a misspelled lease setting", a Django project
# with Flask-Caching's CACHE_KEY_PREFIX or django-redis' REDIS_KEY_PREFIX could not start a worker
# at all, and every locked task of the app would fail with LeaseConfigError (the check cannot be
# silenced), so none of them may be refused.
OTHER_LIBRARIES_UPPER = [
    "CACHE_KEY_PREFIX",  # close to a lease setting
    "REDIS_KEY_PREFIX",  # close to a lease setting
    "API_KEY_PREFIX",  # close to a lease setting
    "CACHE_DEFAULT_TTL",  # close to a lease setting
    "REDIS_DEFAULT_TTL",  # close to a lease setting
    "DEFAULT_WAIT",  # close to a lease setting
    "RELEASE_STORE",  # close to a lease setting
    "CACHE_MIDDLEWARE_KEY_PREFIX",
    "CACHE_DEFAULT_TIMEOUT",
    "DEFAULT_TABLESPACE",
    "DEFAULT_FILE_STORAGE",
    "SESSION_KEY_PREFIX",
    "RELEASE_STAGE",
    "SENTRY_RELEASE",
    "LEASE_DEFAULT_TERM_MONTHS",  # a car-leasing business' own setting
]
OTHER_LIBRARIES_LOWER = [
    "redis_key_prefix",  # close to a lease setting
    "cache_key_prefix",  # close to a lease setting
    "cache_default_ttl",  # close to a lease setting
    "default_wait",  # close to a lease setting
    "api_key_prefix",  # close to a lease setting
    "release_store",  # close to a lease setting
    "leasing_store",  # close to a lease setting
    "redbeat_key_prefix",
    "redbeat_lock_key",
    "redbeat_lock_timeout",
    "redbeat_redis_url",
    "beat_scheduler",
    "beat_max_loop_interval",
    "singleton_key_prefix",
    "once",
]


class TestNoFalseAlarmsFromOtherLibraries:
    @pytest.mark.parametrize("key", OTHER_LIBRARIES_UPPER)
    def test_django_settings_of_other_libraries(self, apps: list[Celery], key: str) -> None:
        """A Django settings module (namespace="CELERY") with another library's setting passes."""
        app = _app(apps)
        app.config_from_object(
            _source(**{key: "x", "CELERY_LEASE_STORE": "memory://"}), namespace="CELERY"
        )
        assert config.get_settings(app).store == "memory://"

    @pytest.mark.parametrize("key", OTHER_LIBRARIES_UPPER + OTHER_LIBRARIES_LOWER)
    def test_celeryconfig_of_other_libraries(self, apps: list[Celery], key: str) -> None:
        """A celeryconfig module (no namespace) with another library's setting passes."""
        app = _app(apps)
        app.config_from_object(_source(**{key: "x", "lease_store": "memory://"}))
        assert config.get_settings(app).store == "memory://"

    @pytest.mark.parametrize("key", [k.upper() for k in OTHER_LIBRARIES_LOWER])
    def test_namespaced_settings_of_other_libraries(self, apps: list[Celery], key: str) -> None:
        """Inside the namespace too: CELERY_REDBEAT_KEY_PREFIX is redbeat's, not a typo of ours."""
        app = _app(apps)
        app.config_from_object(_source(**{f"CELERY_{key}": "x"}), namespace="CELERY")
        config.get_settings(app)


class TestTyposStillCaught:
    @pytest.mark.parametrize(
        ("key", "namespace", "hint"),
        [
            ("leas_store", None, "lease_store"),
            ("laese_store", None, "lease_store"),
            ("lease_stroe", None, "lease_store"),
            ("leasestore", None, "lease_store"),
            ("lease_keyprefix", None, "lease_key_prefix"),
            ("lease_default_tll", None, "lease_default_ttl"),
            ("LEASE_STROE", None, "lease_store"),
            ("CELERY_LEASE_STOR", None, "lease_store"),
            ("CELERY_LEASESTORE", "CELERY", "CELERY_LEASE_STORE"),
            ("CELERY_LAESE_STORE", "CELERY", "CELERY_LEASE_STORE"),
            ("CELERY_LEASE_TTL", "CELERY", "CELERY_LEASE_DEFAULT_TTL"),
        ],
    )
    def test_misspelled_lease_settings(
        self, apps: list[Celery], key: str, namespace: str | None, hint: str
    ) -> None:
        """A one-letter slip in "lease" or in the rest is still an error naming the setting."""
        app = _app(apps)
        app.config_from_object(_source(**{key: "redis://r/1"}), namespace=namespace)
        with pytest.raises(LeaseConfigError, match=f"did you mean '{hint}'"):
            config.get_settings(app)
