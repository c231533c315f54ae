"""The example project's tasks and fenced tables, run eagerly on a memory store (no worker).

The app is imported with ``EXAMPLE_DATA_DIR`` pointing at a temporary directory, and the process's
current Celery app is restored afterwards, so other tests never see the example's app.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery._state import _set_current_app, get_current_app

from celery_lease import MemoryLockStore
from celery_lease._celery import settings as config


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """``example_project.tasks``, imported with its data directory in a temporary directory."""
    previous = get_current_app()
    data = tmp_path_factory.mktemp("example-data")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXAMPLE_DATA_DIR", str(data))
        import example_project.tasks as tasks

        yield tasks
    _set_current_app(previous)


@pytest.fixture
def store(example: ModuleType) -> Iterator[MemoryLockStore]:
    """A memory lease store installed as the example app's store for one test."""
    app = example.app
    saved = app.conf.get("lease_store")
    store = MemoryLockStore()
    app.conf.lease_store = store
    config.reset(app)
    try:
        yield store
    finally:
        app.conf.lease_store = saved
        config.reset(app)


@pytest.fixture
def database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh SQLite accounts database for one test, with account 1 holding 100.00."""
    from example_project import db

    url = str(tmp_path / "accounts.sqlite3")
    monkeypatch.setenv("EXAMPLE_DATABASE_URL", url)
    db.init_db()
    db.create_account(1, 10_000)
    return url


def apply(task: Any, **kwargs: Any) -> Any:
    """Run ``task`` eagerly; returns the EagerResult."""
    return task.apply(kwargs=kwargs)


class TestFencedTable:
    def test_a_higher_token_is_accepted_and_a_lower_one_rejected(self, database: str) -> None:
        """write_balance accepts token 5 over fence 0, then rejects token 4 with StaleWriteError."""
        from example_project import db

        assert db.write_balance(1, 15_000, token=5) == db.Account(1, 15_000, 5)
        with pytest.raises(db.StaleWriteError) as caught:
            db.write_balance(1, 99_999, token=4)
        assert (caught.value.token, caught.value.fence) == (4, 5)
        assert db.get_account(1) == db.Account(1, 15_000, 5)

    def test_an_equal_token_is_accepted(self, database: str) -> None:
        """The fencing helpers' rule (<=): the same holder's token writes again (a retry)."""
        from example_project import db

        db.write_balance(1, 12_000, token=7)
        assert db.write_balance(1, 13_000, token=7) == db.Account(1, 13_000, 7)
        assert db.write_cache("c", "v1", 7) and db.write_cache("c", "v2", 7)
        assert not db.write_cache("c", "v0", 6)
        assert db.read_cache("c") == ("v2", 7)

    def test_stale_write_is_a_stale_token_error(self, database: str) -> None:
        """The demo's StaleWriteError is the helpers' StaleTokenError, with the account's key."""
        from celery_lease.fencing import StaleTokenError
        from example_project import db

        db.write_balance(1, 12_000, token=9)
        with pytest.raises(StaleTokenError) as caught:
            db.write_balance(1, 13_000, token=8)
        assert isinstance(caught.value, db.StaleWriteError)
        assert (caught.value.key, caught.value.token, caught.value.current) == ("account:1", 8, 9)

    def test_missing_account_is_not_reported_as_stale(self, database: str) -> None:
        """Writing an account that does not exist raises AccountNotFoundError."""
        from example_project import db

        with pytest.raises(db.AccountNotFoundError):
            db.write_balance(42, 1, token=1)

    @pytest.mark.parametrize("dumps", [pickle.dumps, None], ids=["pickle", "args"])
    def test_stale_write_error_round_trips(self, dumps: Any) -> None:
        """StaleWriteError rebuilds from pickle and from its args (as json results keep it)."""
        from example_project.db import StaleWriteError

        error = StaleWriteError(1, 4, 5)
        copy = pickle.loads(dumps(error)) if dumps else StaleWriteError(*error.args)
        assert (copy.account_id, copy.token, copy.fence) == (1, 4, 5)
        assert str(copy) == str(error)

    @pytest.mark.postgres
    def test_same_code_on_postgresql(self, pg_database_dsn: str) -> None:
        """On PostgreSQL the same functions fence the same way."""
        from example_project import db

        db.init_db(pg_database_dsn)
        db.create_account(7, 500, pg_database_dsn)
        db.write_balance(7, 800, token=3, url=pg_database_dsn)
        with pytest.raises(db.StaleWriteError):
            db.write_balance(7, 100, token=2, url=pg_database_dsn)
        assert db.get_account(7, pg_database_dsn) == db.Account(7, 800, 3)
        assert db.write_cache("c", "v1", 2, pg_database_dsn)
        assert not db.write_cache("c", "v0", 1, pg_database_dsn)
        assert db.read_cache("c", pg_database_dsn) == ("v1", 2)


class TestTasks:
    def test_update_balance_writes_with_its_token(
        self, example: ModuleType, store: MemoryLockStore, database: str
    ) -> None:
        """update_balance adds the amount and stores the lease's token as the row's fence."""
        from example_project import db

        result = apply(example.update_balance, account_id=1, amount=2_500).get()
        assert result["balance"] == 12_500
        assert db.get_account(1).fence == result["fence"] > 0
        assert store.get("account:1") is None  # released

    def test_update_balance_fails_when_its_write_is_stale(
        self, example: ModuleType, store: MemoryLockStore, database: str
    ) -> None:
        """A row already fenced above any token the store will hand out rejects the update."""
        from example_project import db

        db.write_balance(1, 1, token=2**62)
        outcome = apply(example.update_balance, account_id=1, amount=1)
        assert outcome.state == "FAILURE"
        assert isinstance(outcome.result, db.StaleWriteError)
        assert db.get_account(1).balance == 1

    def test_duplicate_update_is_rejected_while_the_key_is_held(
        self, example: ModuleType, store: MemoryLockStore, database: str
    ) -> None:
        """With account:1 held elsewhere, update_balance fails with LockNotAcquiredError."""
        from celery_lease import LockNotAcquiredError

        store.acquire("account:1", "someone-else", 60_000)
        outcome = apply(example.update_balance, account_id=1, amount=1)
        assert isinstance(outcome.result, LockNotAcquiredError)

    def test_nightly_report_runs_once_within_its_cooldown(
        self, example: ModuleType, store: MemoryLockStore, database: str
    ) -> None:
        """A second report after the first succeeded is skipped (None): one reports row."""
        from example_project import db

        first = apply(example.nightly_report).get()
        second = apply(example.nightly_report)
        assert first["accounts"] == 1 and first["total"] == 10_000
        assert second.state == "SUCCESS" and second.result is None
        assert len(db.read_reports()) == 1
        assert store.get("nightly-report") is not None  # kept for the cooldown

    def test_rebuild_cache_rebuilds_when_it_did_not_wait(
        self, example: ModuleType, store: MemoryLockStore, database: str
    ) -> None:
        """With the key free, rebuild_cache builds and stores the value with its token."""
        from example_project import db

        result = apply(example.rebuild_cache, name="prices", build_seconds=0).get()
        assert result["rebuilt"] is True
        assert db.read_cache("prices") is not None
        assert db.read_cache("prices")[1] == result["built_by_token"]  # type: ignore[index]

    def test_rebuild_cache_reuses_after_waiting(
        self, example: ModuleType, store: MemoryLockStore, database: str
    ) -> None:
        """After waiting for another holder that left a fresh cache, it reuses it (lock_waited)."""
        from example_project import db

        token = store.acquire("cache:prices", "other", 60_000)
        assert token is not None
        db.write_cache("prices", '{"fresh": true}', token)
        timer = threading.Timer(0.3, store.release, args=("cache:prices", "other"))
        timer.start()
        try:
            result = apply(example.rebuild_cache, name="prices", build_seconds=0).get()
        finally:
            timer.join()
        assert result == {"name": "prices", "rebuilt": False, "built_by_token": token}


class TestApp:
    def test_celery_finds_the_app_from_the_package(self, example: ModuleType) -> None:
        """``-A example_project`` and ``-A example_project.app`` resolve to the same app."""
        from celery.app.utils import find_app

        assert find_app("example_project") is example.app
        assert find_app("example_project.app") is example.app

    def test_filesystem_broker_and_sqlite_store_live_in_the_data_dir(self, tmp_path: Path) -> None:
        """With only EXAMPLE_DATA_DIR set, broker folders, results and lease store are inside it."""
        from example_project.app import create_app

        previous = get_current_app()
        app = create_app({"EXAMPLE_DATA_DIR": str(tmp_path)}, main="probe")
        try:
            options = app.conf.broker_transport_options
            assert options["data_folder_in"].startswith(str(tmp_path))
            assert app.conf.lease_store == f"sqlite:///{tmp_path / 'leases.sqlite3'}"
            assert app.conf.result_backend == f"file://{tmp_path / 'results'}"
            assert (tmp_path / "broker").is_dir()
        finally:
            app.close()
            _set_current_app(previous)

    def test_filesystem_transport_reads_an_empty_exchange_table_as_unbound(
        self, tmp_path: Path
    ) -> None:
        """An exchange table another process created but has not written yet reads as empty."""
        from example_project.app import create_app

        app = create_app({"EXAMPLE_DATA_DIR": str(tmp_path)}, main="probe")
        try:
            with app.connection_for_write() as conn:
                channel = conn.default_channel
                table = channel._table_file("race")
                table.parent.mkdir(exist_ok=True)
                table.write_bytes(b"")  # what kombu's own _queue_bind leaves before it writes
                assert channel.get_table("race") == []
                channel._queue_bind("race", "rk", "", "q1")
                channel._queue_bind("race", "rk", "", "q2")
                channel._queue_bind("race", "rk", "", "q1")
                assert sorted(q.queue for q in channel.get_table("race")) == ["q1", "q2"]
        finally:
            app.close()

    def test_filesystem_transport_renames_complete_messages_into_place(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A message file gets its consumable name only by a rename, after it was fully written."""
        import os

        from example_project.app import create_app

        renames: list[tuple[bool, int]] = []
        real_replace = os.replace

        def spy(src: str, dst: str) -> None:
            renames.append((os.path.exists(dst), os.path.getsize(src)))
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", spy)
        app = create_app({"EXAMPLE_DATA_DIR": str(tmp_path)}, main="probe")
        try:
            with app.connection_for_write() as conn:
                conn.default_channel._put("q", {"body": "x" * 100_000})
                message = conn.default_channel._get("q")
        finally:
            app.close()
        assert message == {"body": "x" * 100_000}
        assert len(renames) == 1
        assert renames[0][0] is False and renames[0][1] > 100_000
