"""Django ORM fenced writes against a real PostgreSQL (the session's throwaway database) and an
SQLite file.

Django is configured once per process (``settings.configure``); these tests use database
aliases of their own, added to the connection handler, so they work whether or not something
else in the process (the docs test) configured Django first. Tables are created with a schema
editor for each test and dropped after it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402
from django.db import (  # noqa: E402
    IntegrityError,
    OperationalError,
    connections,
    models,
    transaction,
)

from celery_lease import LeaseConfigError, SQLiteLockStore, lease  # noqa: E402
from celery_lease.fencing import MissingRowError, StaleTokenError  # noqa: E402
from celery_lease.fencing.django import fenced_update, fenced_upsert  # noqa: E402
from tests.fencing.conftest import JOIN_TIMEOUT, in_thread, poll, takeover  # noqa: E402

APP = "fencing_tests"


@pytest.fixture(scope="session")
def django_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, type[models.Model]]:
    """Django configured (once per process) and the test models, defined once."""
    if not settings.configured:
        default = tmp_path_factory.mktemp("django") / "default.sqlite3"
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(default)}},
            INSTALLED_APPS=[],
            USE_TZ=True,
        )
    django.setup()

    class Account(models.Model):
        id = models.IntegerField(primary_key=True)
        balance = models.IntegerField()
        fence = models.BigIntegerField(null=True)

        class Meta:
            app_label = APP
            db_table = "fencing_tests_account"

    class Slot(models.Model):
        name = models.CharField(max_length=40, unique=True)
        code = models.CharField(max_length=40, unique=True)
        owner = models.CharField(max_length=40)
        fence = models.BigIntegerField(default=0)

        class Meta:
            app_label = APP
            db_table = "fencing_tests_slot"

    class Plain(models.Model):
        id = models.IntegerField(primary_key=True)
        balance = models.IntegerField()

        class Meta:
            app_label = APP
            db_table = "fencing_tests_plain"

    class TextFence(models.Model):
        id = models.IntegerField(primary_key=True)
        balance = models.IntegerField()
        fence = models.CharField(max_length=20, null=True)

        class Meta:
            app_label = APP
            db_table = "fencing_tests_textfence"

    return {"account": Account, "slot": Slot, "plain": Plain, "textfence": TextFence}


def _add_alias(alias: str, conf: dict[str, Any]) -> None:
    databases = connections.settings
    if alias not in databases:
        databases[alias] = conf
        connections.configure_settings(databases)


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgresql", marks=pytest.mark.postgres),
        pytest.param("postgresql-repeatable-read", marks=pytest.mark.postgres),
        pytest.param("postgresql-serializable", marks=pytest.mark.postgres),
    ]
)
def alias(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    django_models: dict[str, type[models.Model]],
) -> Iterator[str]:
    """A database alias with the test models' tables, dropped after the test."""
    if request.param == "sqlite":
        name = "fencing_sqlite"
        _add_alias(name, {"ENGINE": "django.db.backends.sqlite3", "NAME": "unset"})
        connections[name].close()
        connections.settings[name]["NAME"] = str(tmp_path / "django.sqlite3")
    else:
        from psycopg import IsolationLevel

        name, isolation = {
            "postgresql": ("fencing_pg", None),
            "postgresql-repeatable-read": ("fencing_pg_rr", IsolationLevel.REPEATABLE_READ),
            "postgresql-serializable": ("fencing_pg_ser", IsolationLevel.SERIALIZABLE),
        }[request.param]
        dsn = urlsplit(request.getfixturevalue("pg_database_dsn"))
        options: dict[str, Any] = {}
        if isolation is not None:
            options["isolation_level"] = isolation
        _add_alias(
            name,
            {
                "OPTIONS": options,
                "ENGINE": "django.db.backends.postgresql",
                "NAME": dsn.path.lstrip("/"),
                "USER": unquote(dsn.username or "postgres"),
                "PASSWORD": unquote(dsn.password or ""),
                "HOST": dsn.hostname or "127.0.0.1",
                "PORT": str(dsn.port or 5432),
            },
        )
    connection = connections[name]
    with connection.schema_editor() as editor:
        for model in django_models.values():
            editor.create_model(model)
    try:
        yield name
    finally:
        with connection.schema_editor() as editor:
            for model in django_models.values():
                editor.delete_model(model)
        connection.close()


def close_thread_connections() -> None:
    connections.close_all()


def account_row(model: type[models.Model], alias: str, pk: int) -> tuple[Any, ...] | None:
    found = list(model._default_manager.using(alias).filter(pk=pk).values_list())
    return found[0] if found else None


class TestTakeover:
    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_old_holders_late_write_is_refused(
        self,
        alias: str,
        django_models: dict[str, type[models.Model]],
        lease_store: SQLiteLockStore,
        helper: Any,
    ) -> None:
        """The new holder writes; the old one, resumed, is refused with .current = new token."""
        account = django_models["account"]
        account._default_manager.using(alias).create(id=1, balance=100, fence=None)
        balances = {"new": 150, "old": 90}

        def write(who: str) -> None:
            helper(account, where={"id": 1}, values={"balance": balances[who]}, using=alias)

        story = takeover(lease_store, "account:1", write, in_thread=close_thread_connections)
        assert story.old_error is not None
        assert (story.old_error.key, story.old_error.token, story.old_error.current) == (
            "account:1",
            story.old_token,
            story.new_token,
        )
        assert account_row(account, alias, 1) == (1, 150, story.new_token)


class TestRule:
    def test_equal_token_is_accepted_and_lower_refused(
        self, alias: str, django_models: dict[str, type[models.Model]]
    ) -> None:
        """The same token writes again (the same holder retrying); a lower one is refused."""
        account = django_models["account"]
        common = {"where": {"pk": 1}, "using": alias}
        assert fenced_upsert(account, values={"balance": 1}, token=7, **common) == 7
        assert fenced_upsert(account, values={"balance": 2}, token=7, **common) == 7
        assert fenced_update(account, values={"balance": 3}, token=7, **common) == 7
        for helper in (fenced_update, fenced_upsert):
            with pytest.raises(StaleTokenError) as caught:
                helper(account, values={"balance": 4}, token=6, **common)
            assert (caught.value.token, caught.value.current) == (6, 7)
        assert account_row(account, alias, 1) == (1, 3, 7)

    def test_update_of_a_missing_row(
        self, alias: str, django_models: dict[str, type[models.Model]]
    ) -> None:
        """fenced_update never creates the row: MissingRowError."""
        account = django_models["account"]
        with pytest.raises(MissingRowError):
            fenced_update(account, where={"id": 5}, values={"balance": 1}, token=1, using=alias)
        assert account_row(account, alias, 5) is None

    def test_unique_field_names_the_row(
        self, alias: str, django_models: dict[str, type[models.Model]]
    ) -> None:
        """where= may be one unique field; the row is created, then fenced."""
        slot = django_models["slot"]
        fenced_upsert(
            slot, where={"name": "a"}, values={"code": "c1", "owner": "x"}, token=2, using=alias
        )
        fenced_upsert(
            slot, where={"name": "a"}, values={"code": "c1", "owner": "y"}, token=3, using=alias
        )
        with pytest.raises(StaleTokenError):
            fenced_update(slot, where={"name": "a"}, values={"owner": "z"}, token=1, using=alias)
        rows = list(slot._default_manager.using(alias).values_list("name", "owner", "fence"))
        assert rows == [("a", "y", 3)]

    def test_another_constraint_still_raises_integrity_error(
        self, alias: str, django_models: dict[str, type[models.Model]]
    ) -> None:
        """A create refused by a constraint other than the row's key is not taken for a race."""
        slot = django_models["slot"]
        slot._default_manager.using(alias).create(name="a", code="dup", owner="x", fence=1)
        with pytest.raises(IntegrityError):
            fenced_upsert(
                slot,
                where={"name": "b"},
                values={"code": "dup", "owner": "y"},
                token=2,
                using=alias,
            )
        assert slot._default_manager.using(alias).count() == 1

    def test_token_of_the_current_lease(
        self,
        alias: str,
        django_models: dict[str, type[models.Model]],
        lease_store: SQLiteLockStore,
    ) -> None:
        """Without token=, the current lease's token is written."""
        account = django_models["account"]
        with lease("account:1", store=lease_store) as held:
            fenced_upsert(account, where={"id": 1}, values={"balance": 1}, using=alias)
        assert account_row(account, alias, 1) == (1, 1, held.token)


class TestFirstRow:
    @pytest.mark.parametrize("newer_first", [True, False], ids=["newer-first", "older-first"])
    def test_racing_first_rows_create_one_row_and_the_newest_wins(
        self, alias: str, django_models: dict[str, type[models.Model]], newer_first: bool
    ) -> None:
        """Two connections create the missing row at once; the second waits for the first's
        transaction. One row is created (one post_save with created=True), and the older token
        is refused if it comes second."""
        account = django_models["account"]
        first_token, second_token = (8, 5) if newer_first else (5, 8)
        created: list[int] = []
        about_to_write = threading.Event()
        second_pid: list[int] = []

        def on_save(sender: Any, instance: Any, created_: bool = False, **kw: Any) -> None:
            created.append(instance.fence)

        def count_created(sender: Any, instance: Any, created: bool, **kw: Any) -> None:
            if created:
                on_save(sender, instance)

        def announce(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            about_to_write.set()
            return execute(sql, params, many, context)

        def second() -> int:
            conn = connections[alias]
            if conn.vendor == "postgresql":
                with conn.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    second_pid.append(cursor.fetchone()[0])
            with conn.execute_wrapper(announce):
                return fenced_upsert(
                    account, where={"id": 1}, values={"balance": 2}, token=second_token, using=alias
                )

        models.signals.post_save.connect(count_created, sender=account)
        try:
            with transaction.atomic(using=alias):
                fenced_upsert(
                    account, where={"id": 1}, values={"balance": 1}, token=first_token, using=alias
                )
                thread, outcome = in_thread(second, after=close_thread_connections)
                assert about_to_write.wait(JOIN_TIMEOUT)
                if connections[alias].vendor == "postgresql":
                    poll(
                        lambda: _waits_on_a_lock(alias, second_pid[0]), "the second create to block"
                    )
            thread.join(JOIN_TIMEOUT)
        finally:
            models.signals.post_save.disconnect(count_created, sender=account)
        assert outcome.done.is_set()
        assert created == [first_token]
        assert account_row(account, alias, 1) == (1, 1 if newer_first else 2, 8)
        if newer_first:
            assert isinstance(outcome.error, StaleTokenError), outcome.error
            assert (outcome.error.token, outcome.error.current) == (5, 8)
        else:
            assert outcome.error is None and outcome.result == 8


class _DriverError(Exception):
    """A driver error carrying a SQLSTATE, as psycopg's (``sqlstate``) do."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"SQLSTATE {sqlstate}")
        self.sqlstate = sqlstate


class TestOperationalErrors:
    @pytest.mark.parametrize(
        ("sqlstate", "retried"),
        [("40001", True), ("57014", False)],
        ids=["serialization-failure", "query-canceled"],
    )
    def test_only_a_serialization_failure_is_retried_in_a_new_transaction(
        self,
        alias: str,
        django_models: dict[str, type[models.Model]],
        sqlstate: str,
        retried: bool,
    ) -> None:
        """Outside a transaction, a serialization failure (SQLSTATE 40001) of the first attempt
        runs the upsert once more in a new transaction; any other OperationalError is raised."""
        account = django_models["account"]
        updates: list[str] = []

        def fail_first_update(execute: Any, sql: str, params: Any, many: bool, ctx: Any) -> Any:
            if sql.lstrip().upper().startswith("UPDATE"):
                updates.append(sql)
                if len(updates) == 1:
                    raise OperationalError("refused") from _DriverError(sqlstate)
            return execute(sql, params, many, ctx)

        with connections[alias].execute_wrapper(fail_first_update):
            if retried:
                fenced_upsert(account, where={"id": 1}, values={"balance": 1}, token=3, using=alias)
            else:
                with pytest.raises(OperationalError, match="refused"):
                    fenced_upsert(
                        account, where={"id": 1}, values={"balance": 1}, token=3, using=alias
                    )
        assert len(updates) == (2 if retried else 1)
        assert account_row(account, alias, 1) == ((1, 1, 3) if retried else None)

    def test_a_serialization_failure_inside_the_callers_transaction_is_raised(
        self, alias: str, django_models: dict[str, type[models.Model]]
    ) -> None:
        """Inside the caller's transaction the failure is the caller's to retry, whole."""
        account = django_models["account"]
        updates: list[str] = []

        def fail_update(execute: Any, sql: str, params: Any, many: bool, ctx: Any) -> Any:
            if sql.lstrip().upper().startswith("UPDATE"):
                updates.append(sql)
                raise OperationalError("refused") from _DriverError("40001")
            return execute(sql, params, many, ctx)

        with (
            pytest.raises(OperationalError, match="refused"),
            transaction.atomic(using=alias),
            connections[alias].execute_wrapper(fail_update),
        ):
            fenced_upsert(account, where={"id": 1}, values={"balance": 1}, token=3, using=alias)
        assert len(updates) == 1


def _waits_on_a_lock(alias: str, pid: int) -> bool:
    """Whether backend ``pid`` waits on a lock, seen from a connection of a thread of its own
    (not the test's, whose transaction is open: the activity view is a snapshot per
    transaction)."""
    found: list[Any] = []

    def look() -> None:
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
                found.append(cursor.fetchone())
        finally:
            connections.close_all()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(JOIN_TIMEOUT)
    return bool(found and found[0] is not None and found[0][0] == "Lock")


class TestBadInput:
    """Wrong input fails at call time, before any query, naming the parameter."""

    def test_no_lease_and_no_token(
        self, alias: str, django_models: dict[str, type[models.Model]]
    ) -> None:
        """Outside any lease and without token=: LeaseConfigError naming token=."""
        account = django_models["account"]
        with pytest.raises(LeaseConfigError, match=r"token=None"):
            fenced_upsert(account, where={"id": 1}, values={"balance": 1}, using=alias)
        assert account_row(account, alias, 1) is None

    @pytest.mark.parametrize(
        ("kwargs", "names"),
        [
            ({"where": {"id": 1}, "values": {"balanse": 1}}, r"values=.*balanse"),
            ({"where": {"idd": 1}, "values": {"balance": 1}}, r"where=.*idd"),
            ({"where": {"id": 1}, "values": {"balance": 1}, "fence": "fnce"}, r"fence='fnce'"),
            ({"where": {"id": 1}, "values": {"fence": 9}}, r"fence field 'fence'"),
            ({"where": {"balance": 1}, "values": {}}, r"where=.*primary key or one unique"),
            ({"where": {}, "values": {"balance": 1}}, r"where=\{\} must name the row"),
            ({"where": {"id": None}, "values": {"balance": 1}}, r"where=.*None"),
            ({"where": {"id": 1}, "values": {"balance": 1}, "token": -3}, r"token=-3"),
            (
                {"where": {"id": 1}, "values": {"balance": 1}, "token": 1, "lock_key": 5},
                r"lock_key=5",
            ),
        ],
    )
    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_bad_names_are_refused(
        self,
        alias: str,
        django_models: dict[str, type[models.Model]],
        kwargs: dict[str, Any],
        names: str,
        helper: Any,
    ) -> None:
        """Unknown fields, the fence in values=, a where= that is not a key, bad tokens."""
        account = django_models["account"]
        kwargs.setdefault("token", 1)
        with pytest.raises(LeaseConfigError, match=names):
            helper(account, using=alias, **kwargs)
        assert account_row(account, alias, 1) is None

    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_model_without_a_fence_field(
        self, alias: str, django_models: dict[str, type[models.Model]], helper: Any
    ) -> None:
        """A model with no fence field: LeaseConfigError naming fence= and the fields."""
        with pytest.raises(LeaseConfigError, match=r"fence='fence' is not a field.*balance"):
            helper(
                django_models["plain"], where={"id": 1}, values={"balance": 1}, token=1, using=alias
            )

    @pytest.mark.parametrize("helper", [fenced_update, fenced_upsert])
    def test_fence_field_that_is_not_an_integer(
        self, alias: str, django_models: dict[str, type[models.Model]], helper: Any
    ) -> None:
        """A text fence would compare as text: refused, naming fence=."""
        with pytest.raises(LeaseConfigError, match=r"fence='fence'.*integer"):
            helper(
                django_models["textfence"],
                where={"id": 1},
                values={"balance": 1},
                token=1,
                using=alias,
            )

    def test_not_a_model(self, alias: str) -> None:
        """model= must be a Django model class."""
        with pytest.raises(LeaseConfigError, match=r"model="):
            fenced_update(object, where={"id": 1}, values={}, token=1, using=alias)  # type: ignore[arg-type]
