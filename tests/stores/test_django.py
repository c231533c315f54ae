"""``django://<alias>``: the PostgreSQL or SQLite store of a database of Django's ``DATABASES``.

The store is built from Django's settings when it is built (not when the URL is read), against
the real PostgreSQL (the session's scratch database, ``tests.fixtures_postgres``) and an SQLite
file. Django is configured once per process (``settings.configure``): these tests configure it
if nothing did before (as ``tests/fencing/test_django.py`` does) and then give each test its own
``DATABASES`` with ``override_settings``. The end-to-end example runs a Django project of its own
in a subprocess: its settings module, ``CELERY_LEASE_STORE = "django://default"`` and a
``shared_task`` with ``LockedTask`` and one with ``@locked``, a receiver connected in
``AppConfig.ready()``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from celery_lease import (  # noqa: E402
    LeaseConfigError,
    SQLiteLockStore,
    async_store_from_url,
    lease,
    store_from_url,
)
from celery_lease.stores.base import (  # noqa: E402
    AsyncSupportsSlots,
    SupportsReplace,
    SupportsSlots,
    conforms,
)
from celery_lease.stores.django import async_database_store, database_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def configured(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Django configured once per process (whoever does it first)."""
    if not settings.configured:
        default = tmp_path_factory.mktemp("django") / "default.sqlite3"
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(default)}},
            INSTALLED_APPS=[],
            USE_TZ=True,
        )
    django.setup()


@pytest.fixture
def databases() -> Iterator[Any]:
    """``databases(**aliases)``: a context manager giving Django those ``DATABASES``."""

    def _override(**aliases: dict[str, Any]) -> Any:
        return override_settings(DATABASES=aliases)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Django warns that overriding DATABASES is unusual
        yield _override


def _postgres(dsn: str, **extra: Any) -> dict[str, Any]:
    """A Django ``DATABASES`` entry for the PostgreSQL database of ``dsn``."""
    parts = urlsplit(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        **extra,
    }


class TestPostgreSQL:
    def test_the_store_of_a_postgresql_alias_takes_leases_in_that_database(
        self, databases: Any, pg_database_dsn: str
    ) -> None:
        """``django://default`` on a PostgreSQL alias: a PostgresLockStore on that database (its
        lease visible from a store built on the same DSN by hand); ``django://`` is the same."""
        from celery_lease import PostgresLockStore

        key = f"dj:{uuid.uuid4().hex[:8]}"
        with databases(default=_postgres(pg_database_dsn, OPTIONS={"sslmode": "disable"})):
            store = store_from_url("django://default")
            bare = store_from_url("django://")
        by_hand = PostgresLockStore(pg_database_dsn)
        try:
            assert isinstance(store, PostgresLockStore) and isinstance(bare, PostgresLockStore)
            with lease(key, store=store, ttl=30) as held:
                info = by_hand.get(key)
                assert info is not None and info.token == held.token
            assert by_hand.get(key) is None
        finally:
            for made in (store, bare, by_hand):
                made.close()

    def test_another_alias_and_django_only_options(
        self, databases: Any, pg_database_dsn: str, tmp_path: Path
    ) -> None:
        """An alias other than default, with a wrapping engine (its path's last part begins
        with postgresql); Django's own OPTIONS (isolation_level, pool, server_side_binding...)
        are not given to libpq."""
        from celery_lease import PostgresLockStore

        options = {"isolation_level": 1, "server_side_binding": True, "pool": True}
        replica = _postgres(pg_database_dsn, OPTIONS=options)
        replica["ENGINE"] = "django_tenants.postgresql_backend"  # a wrapping backend
        default = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "d.db")}
        with databases(default=default, replica=replica):
            store = database_store("replica")
        try:
            assert isinstance(store, PostgresLockStore)
            with lease(f"dj:{uuid.uuid4().hex[:8]}", store=store, ttl=30) as held:
                assert held.token is not None
        finally:
            store.close()

    def test_settings_are_read_when_the_store_is_built_not_before(
        self, databases: Any, pg_database_dsn: str
    ) -> None:
        """The URL is only a name: the settings check passes whatever DATABASES holds then (a
        MySQL alias here), and the app's store is the database DATABASES names when the store
        is built (as a test database set up in between would be)."""
        from celery import Celery

        from celery_lease import PostgresLockStore
        from celery_lease._celery import settings as config

        app = Celery("dj", broker="memory://", set_as_current=False)
        app.conf.lease_store = "django://default"
        try:
            with databases(default={"ENGINE": "django.db.backends.mysql", "NAME": "x"}):
                assert config.get_settings(app).store == "django://default"
            with databases(default=_postgres(pg_database_dsn)):
                store = config.get_store(app)
            assert isinstance(store, PostgresLockStore)
        finally:
            config.reset(app)
            app.close()

    async def _async_round_trip(self, url: str) -> int | None:
        store = async_store_from_url(url)
        try:
            async with lease(f"dj:{uuid.uuid4().hex[:8]}", store=store, ttl=30) as held:
                return held.token
        finally:
            await store.aclose()

    def test_async_store_of_an_alias(
        self, databases: Any, pg_database_dsn: str, tmp_path: Path
    ) -> None:
        """``async_store_from_url("django://...")``: the native async PostgreSQL store, or the
        thread adapter over SQLite."""
        import asyncio

        from celery_lease import AsyncPostgresLockStore, ThreadedAsyncStore

        sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "a.db")}
        with databases(default=_postgres(pg_database_dsn), files=sqlite):
            for alias, kind in (("default", AsyncPostgresLockStore), ("files", ThreadedAsyncStore)):
                store = async_database_store(alias)
                try:
                    assert isinstance(store, kind)
                finally:
                    asyncio.run(store.aclose())
            assert asyncio.run(self._async_round_trip("django://default")) is not None
            assert asyncio.run(self._async_round_trip("django://files")) is not None


def _slots_and_replace(store: Any) -> None:
    """The store of an alias keeps a key's slots and asks its holder to stop."""
    assert conforms(store, SupportsSlots) and conforms(store, SupportsReplace)
    key = f"dj:{uuid.uuid4().hex[:8]}"
    got = [store.acquire_slot(key, f"o{i}", 30_000, 2) for i in range(3)]
    assert [g[0] if g is not None else None for g in got] == [0, 1, None]
    token = store.acquire(key, "h", 30_000)
    ticket, holder, asked = store.mark_replaced(key)
    assert (holder, asked) == ("h", True) and ticket > token
    assert store.renew(key, "h", 30_000) is False
    store.release(key, "h")
    following = store.acquire(key, "n", 30_000)
    assert following is not None and following > ticket


class TestSlotsAndReplace:
    def test_the_stores_of_both_engines_keep_slots_and_ask_holders_to_stop(
        self, databases: Any, pg_database_dsn: str, tmp_path: Path
    ) -> None:
        """django://<alias> on PostgreSQL and on SQLite: slots and replace as those stores
        keep them; the async store of a PostgreSQL alias takes slots as a coroutine."""
        import asyncio

        sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "s.db")}
        with databases(default=_postgres(pg_database_dsn), files=sqlite):
            stores = [store_from_url("django://default"), store_from_url("django://files")]
            async_store = async_database_store("default")
        try:
            for store in stores:
                _slots_and_replace(store)
            assert conforms(async_store, AsyncSupportsSlots)
        finally:
            for store in stores:
                store.close()  # type: ignore[attr-defined]
            asyncio.run(async_store.aclose())


class TestSQLite:
    def test_the_store_of_an_sqlite_alias_is_its_file(self, databases: Any, tmp_path: Path) -> None:
        """ENGINE sqlite3: an SQLiteLockStore on the database's own file (NAME, a str or a
        Path as Django's default settings write it)."""
        path = tmp_path / "db.sqlite3"
        with databases(default={"ENGINE": "django.db.backends.sqlite3", "NAME": path}):
            store = store_from_url("django://default")
        try:
            assert isinstance(store, SQLiteLockStore)
            key = f"dj:{uuid.uuid4().hex[:8]}"
            with lease(key, store=store, ttl=30):
                other = SQLiteLockStore(path)
                try:
                    assert other.get(key) is not None
                finally:
                    other.close()
        finally:
            store.close()

    @pytest.mark.parametrize("name", [":memory:", "file:memorydb_default?mode=memory&cache=shared"])
    def test_an_in_memory_database_is_refused_naming_the_alias(
        self, databases: Any, name: str
    ) -> None:
        """An in-memory SQLite database (Django's test database for SQLite is one) cannot
        exclude across processes: refused, naming the alias and what to do."""
        with (
            databases(default={"ENGINE": "django.db.backends.sqlite3", "NAME": name}),
            pytest.raises(LeaseConfigError, match=r"DATABASES\['default'\].*in-memory"),
        ):
            store_from_url("django://default")


class TestRefusals:
    def test_another_engine_is_refused_naming_alias_engine_and_allowed(
        self, databases: Any
    ) -> None:
        """MySQL (any engine without a lease store): a clear error at construction naming the
        alias, the engine and the engines allowed."""
        mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "shop"}
        with databases(default=mysql), pytest.raises(LeaseConfigError) as caught:
            store_from_url("django://default")
        text = str(caught.value)
        assert "DATABASES['default']" in text and "'django.db.backends.mysql'" in text, text
        assert "postgresql" in text and "sqlite3" in text, text

    def test_an_unknown_alias_names_the_aliases_there_are(self, databases: Any) -> None:
        sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.db"}
        with databases(default=sqlite), pytest.raises(LeaseConfigError) as caught:
            store_from_url("django://replica")
        assert "'replica'" in str(caught.value) and "'default'" in str(caught.value)

    @pytest.mark.parametrize("url", ["django://default/x", "django://default?table=t"])
    def test_a_url_with_more_than_an_alias_is_refused(self, url: str) -> None:
        with pytest.raises(LeaseConfigError, match="django://<alias>"):
            store_from_url(url)

    def test_the_settings_check_accepts_the_scheme(self) -> None:
        """``lease_store = "django://default"`` passes the settings check a worker runs at start
        (the scheme is in the one table of stores); nothing of Django is read there."""
        from celery import Celery

        from celery_lease._celery import settings as config

        app = Celery("dj", broker="memory://", set_as_current=False)
        app.conf.lease_store = "django://default"
        try:
            assert config.get_settings(app).store == "django://default"
        finally:
            config.reset(app)
            app.close()


def test_importing_the_module_imports_no_django() -> None:
    """``celery_lease.stores.django`` and the store table load without Django (it is read only
    when a ``django://`` store is built)."""
    code = (
        "import sys, celery_lease, celery_lease.stores.django, celery_lease.stores.registry\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'django'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


PROJECT_SETTINGS = """
DATABASES = {{"default": {database!r}}}
INSTALLED_APPS = ["shop"]
USE_TZ = True
SECRET_KEY = "test"
CELERY_BROKER_URL = "memory://"
CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_LEASE_STORE = "django://default"
CELERY_LEASE_KEY_PREFIX = "shop:"
"""

PROJECT_CELERY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

PROJECT_TASKS = """
from celery import shared_task

from celery_lease import LockedTask, current_lease, locked


@shared_task(base=LockedTask, lock_key="report:{day}")
def report(day):
    held = current_lease()
    return held.key, held.token


@shared_task
@locked(key="sync:{n}")
def sync(n):
    return current_lease().key
"""

PROJECT_APPS = """
from django.apps import AppConfig

ACQUIRED = []


def count_acquired(sender, key, token, **kwargs):
    ACQUIRED.append(key)


class ShopConfig(AppConfig):
    name = "shop"

    def ready(self):
        from celery_lease.signals import lock_acquired

        lock_acquired.connect(count_acquired, dispatch_uid="shop.count_acquired")
"""

PROJECT_MAIN = """
import django

django.setup()

from proj.celery import app
from shop.apps import ACQUIRED
from shop.tasks import report, sync
from celery_lease._celery.settings import get_store

print(type(get_store(app)).__name__)
print(report.delay("mon").get())
print(sync.delay(3).get())
print(ACQUIRED)
"""


@pytest.mark.parametrize("engine", ["postgresql", "sqlite3"])
def test_a_django_project_with_the_store_from_databases(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
    """A Django project (settings module, ``proj/celery.py`` as Celery's Django guide writes it,
    tasks in an app's ``tasks.py`` found by ``autodiscover_tasks``): ``CELERY_LEASE_STORE =
    "django://default"`` builds the store of the project's own database, and a ``shared_task``
    with ``LockedTask`` and one with ``@locked`` take their leases there, under the prefix; a
    receiver connected in ``AppConfig.ready()`` hears both."""
    if engine == "postgresql":
        database = _postgres(request.getfixturevalue("pg_database_dsn"))
        expected = "PostgresLockStore"
    else:
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
        expected = "SQLiteLockStore"
    for package in ("proj", "shop"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "proj" / "settings.py").write_text(PROJECT_SETTINGS.format(database=database))
    (tmp_path / "proj" / "celery.py").write_text(textwrap.dedent(PROJECT_CELERY))
    (tmp_path / "shop" / "tasks.py").write_text(textwrap.dedent(PROJECT_TASKS))
    (tmp_path / "shop" / "apps.py").write_text(textwrap.dedent(PROJECT_APPS))
    (tmp_path / "main.py").write_text(textwrap.dedent(PROJECT_MAIN))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "proj.settings",
    }
    result = subprocess.run(
        [sys.executable, "main.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == expected, result.stdout
    key, token = ast.literal_eval(lines[1])
    assert key == "shop:report:mon" and isinstance(token, int), lines
    assert lines[2] == "shop:sync:3", lines
    assert ast.literal_eval(lines[3]) == ["shop:report:mon", "shop:sync:3"], lines


def test_the_test_database_is_dropped_after_the_stores_are_closed(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """What pytest-django does, on the real PostgreSQL: create ``test_<NAME>``, let the app's
    ``django://default`` store take a lease there, then drop the test database. The store's own
    connections would make the drop fail; ``close_lease_stores(app)`` (the session fixture of
    docs/django.md) closes them first. Runs in a process of its own (Django configured there),
    on a database named for this test only."""
    dsn = request.getfixturevalue("pg_database_dsn")
    name = f"cl_teardown_{uuid.uuid4().hex[:12]}"
    database = {**_postgres(dsn), "NAME": name}
    script = textwrap.dedent(
        f"""
        import django
        from django.conf import settings
        settings.configure(DATABASES={{"default": {database!r}}}, INSTALLED_APPS=[])
        django.setup()
        from celery import Celery
        from django.db import connection
        from celery_lease import lease
        from celery_lease.testing import close_lease_stores

        app = Celery("teardown", broker="memory://", set_as_current=False)
        app.conf.lease_store = "django://default"
        created = connection.creation.create_test_db(verbosity=0, autoclobber=True)
        with lease("k", app=app) as held:
            assert held.store.list()[0].key == "k"
        close_lease_stores(app)
        connection.creation.destroy_test_db({name!r}, verbosity=0)
        print("dropped", created)
        """
    )
    process = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == f"dropped test_{name}"
