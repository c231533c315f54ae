"""celery_lease._celery.startup: what a worker refuses at start-up (check_worker and the
LeaseCheck bootstep Celery's worker blueprint runs), and that a refusal reaches pool processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LockedTask, MemoryLockStore, locked
from celery_lease._celery import settings as config
from celery_lease._celery import startup, worker


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("cfg", broker="memory://", set_as_current=False)
    yield app
    config.reset(app)
    app.close()


class _GeventLikePool:
    """Stands in for celery.concurrency.gevent.TaskPool without importing gevent."""


_GeventLikePool.__module__ = "celery.concurrency.gevent"


def _pool(name: str) -> type:
    from celery.concurrency import get_implementation

    return get_implementation(name)  # type: ignore[no-any-return]


class TestWorkerCheck:
    """What a worker refuses at start-up (celery_lease._celery.startup.check_worker and its
    bootstep)."""

    @pytest.mark.parametrize("store", [MemoryLockStore(), "memory://"])
    def test_process_local_store_under_prefork_refused(self, app: Celery, store: object) -> None:
        """lease_store in memory on prefork -c 2: the two processes would not exclude."""
        app.conf.lease_store = store
        error = startup.check_worker(app, _pool("prefork"), 2)
        assert isinstance(error, LeaseConfigError)
        message = str(error)
        assert "lease_store" in message and "2 processes" in message and "prefork" in message

    def test_task_lock_store_in_memory_refused(self, app: Celery, tmp_path: Path) -> None:
        """A task's own lock_store="memory://" is refused too, naming the task."""
        app.conf.lease_store = f"sqlite:///{tmp_path / 'l.db'}"

        @app.task(
            name="cfg.local", base=LockedTask, lock_key="k", lock_store="memory://", shared=False
        )
        def local() -> None: ...

        error = startup.check_worker(app, _pool("prefork"), 2)
        assert error is not None and "'cfg.local'" in str(error) and "lock_store" in str(error)

    def test_locked_decorator_store_in_memory_refused(self, app: Celery, tmp_path: Path) -> None:
        """@locked(store="memory://") under @app.task is refused like LockedTask's lock_store."""
        app.conf.lease_store = f"sqlite:///{tmp_path / 'l.db'}"

        @app.task(name="cfg.decorated", shared=False)
        @locked(key="k", store="memory://")
        def decorated() -> None: ...

        error = startup.check_worker(app, _pool("prefork"), 2)
        assert error is not None and "'cfg.decorated'" in str(error)

    def test_autoscale_counts_the_most_processes(self, app: Celery) -> None:
        """--autoscale=4,1 on prefork can run 4 processes: refused even with -c 1."""
        app.conf.lease_store = "memory://"
        assert startup.check_worker(app, _pool("prefork"), 1, autoscale="4,1") is not None
        assert startup.check_worker(app, _pool("prefork"), 1, autoscale=(4, 1)) is not None

    @pytest.mark.parametrize(
        ("pool", "concurrency"),
        [("prefork", 1), ("solo", 1), ("threads", 8), ("gevent-like", 100)],
    )
    def test_one_process_accepts_memory(
        self, app: Celery, caplog: pytest.LogCaptureFixture, pool: str, concurrency: int
    ) -> None:
        """One process running tasks (prefork -c 1, solo, threads, gevent) may use memory."""
        app.conf.lease_store = MemoryLockStore()
        pool_cls = _GeventLikePool if pool == "gevent-like" else _pool(pool)
        with caplog.at_level(logging.WARNING, logger="celery_lease.worker"):
            assert startup.check_worker(app, pool_cls, concurrency) is None
        assert any("process-local" in r.getMessage() for r in caplog.records)

    def test_unknown_pool_with_concurrency_is_taken_as_processes(self, app: Celery) -> None:
        """A pool we cannot classify counts as one process per concurrency slot (safe side)."""
        app.conf.lease_store = "memory://"
        unknown = type("CustomPool", (), {"__module__": "myproject.pools"})
        assert startup.check_worker(app, unknown, 2) is not None

    def test_shared_store_accepted_under_prefork(self, app: Celery, tmp_path: Path) -> None:
        """A store shared by processes (SQLite file here) is fine on prefork -c 2."""
        app.conf.lease_store = f"sqlite:///{tmp_path / 'l.db'}"
        assert startup.check_worker(app, _pool("prefork"), 2) is None

    def test_misspelled_setting_refused(self, app: Celery) -> None:
        """A typo in a setting name is a refusal on any pool."""
        app.conf.lease_stor = "redis://r/1"
        error = startup.check_worker(app, _pool("solo"), 1)
        assert error is not None and "did you mean 'lease_store'" in str(error)


class TestWorkerBootstep:
    """worker_init adds the check as a bootstep of Celery's own worker blueprint."""

    @pytest.fixture
    def main_pid(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """Process globals that building a WorkController sets, restored afterwards."""
        from celery import _state

        monkeypatch.setattr(worker, "_main_pid", None)
        blocks = _state.task_join_will_block()
        yield
        _state._set_task_join_will_block(blocks)  # the Pool step sets it for its pool

    def test_refusal_raised_while_building_and_recorded(self, app: Celery, main_pid: None) -> None:
        """Building a prefork -c 2 worker raises the refusal (nothing started) and records it."""
        app.conf.lease_store = "memory://"
        with pytest.raises(LeaseConfigError, match="2 processes"):
            app.WorkController(pool_cls="prefork", concurrency=2, without_mingle=True)
        with pytest.raises(LeaseConfigError, match="2 processes"):
            config.get_settings(app)  # every locked execution of the app fails from now on
        with pytest.raises(LeaseConfigError, match="2 processes"):
            config.get_store(app)
        config.reset(app, refusals=False)  # what a new pool process does: still refused
        with pytest.raises(LeaseConfigError):
            config.get_settings(app)
        config.reset(app)
        assert config.get_settings(app).store == "memory://"

    def test_threads_worker_not_refused(self, app: Celery, main_pid: None) -> None:
        """A threads worker with a memory store builds and its step starts quietly."""
        app.conf.lease_store = MemoryLockStore()
        controller = app.WorkController(pool_cls="threads", concurrency=4, without_mingle=True)
        (step,) = [s for s in controller.steps if isinstance(s, startup.LeaseCheck)]
        step.start(controller)  # the check ran at build time; starting it does nothing more
        assert isinstance(config.get_store(app), MemoryLockStore)

    def test_a_worker_warns_of_a_key_template_with_and_without_a_limit(
        self, app: Celery, main_pid: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        app.conf.lease_store = MemoryLockStore()

        @app.task(base=LockedTask, name="mix.limited", shared=False, lock_key="k", lock_limit=2)
        def limited() -> None:
            return None

        @app.task(base=LockedTask, name="mix.plain", shared=False, lock_key="k")
        def plain() -> None:
            return None

        with caplog.at_level(logging.WARNING, logger="celery_lease.worker"):
            app.WorkController(pool_cls="threads", concurrency=1, without_mingle=True)
        assert any("'mix.limited'" in r.getMessage() for r in caplog.records)

    def test_refusal_survives_fork(self, app: Celery) -> None:
        """A pool child forked after the refusal fails its locked executions too."""
        config.refuse(app, "refused for the test")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: what a prefork pool process does first, then a locked execution
            try:
                worker.reset_process_state()
                try:
                    config.get_settings(app)
                    os.write(write, b"ran")
                except LeaseConfigError as exc:
                    os.write(write, str(exc).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        assert os.read(read, 100) == b"refused for the test"
        os.close(read)


class TestWorkerCheckRefusals:
    """The worker check: what it must refuse, and what it must not."""

    @pytest.fixture
    def main_pid(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """Process globals that building a WorkController sets, restored afterwards."""
        from celery import _state

        monkeypatch.setattr(worker, "_main_pid", None)
        monkeypatch.setattr(startup, "_processes", 0)
        monkeypatch.setattr(startup, "_app", None)
        blocks = _state.task_join_will_block()
        yield
        _state._set_task_join_will_block(blocks)

    def test_pool_and_concurrency_from_app_conf(self, app: Celery, main_pid: None) -> None:
        """worker_pool / worker_concurrency in app.conf count as -P / -c do."""
        app.conf.lease_store = "memory://"
        app.conf.update(worker_pool="threads", worker_concurrency=4)
        app.WorkController(without_mingle=True)  # one process: accepted
        config.reset(app)
        app.conf.update(worker_pool="prefork", worker_concurrency=2)
        with pytest.raises(LeaseConfigError, match="2 processes"):
            app.WorkController(without_mingle=True)

    def test_an_earlier_refused_build_does_not_refuse_the_next(
        self, app: Celery, main_pid: None
    ) -> None:
        """A worker built after a refused one is checked afresh (one process: accepted).

        A refusal must not stick to the app: a test suite trying both pools on one app builds a
        threads worker after a refused prefork one, and that one is accepted.
        """
        app.conf.lease_store = "memory://"
        with pytest.raises(LeaseConfigError, match="2 processes"):
            app.WorkController(pool_cls="prefork", concurrency=2, without_mingle=True)
        app.WorkController(pool_cls="threads", concurrency=2, without_mingle=True)
        assert isinstance(config.get_store(app), MemoryLockStore)

    def test_task_registered_after_the_check_is_refused_in_new_pool_processes(
        self, app: Celery, tmp_path: Path, main_pid: None
    ) -> None:
        """A task with lock_store="memory://" registered after the worker's check (a module
        imported late, children re-forked by --max-tasks-per-child or --autoscale) fails in
        every pool process started after it instead of running unexcluded (each child would
        have a memory store of its own).
        """
        app.conf.lease_store = f"sqlite:///{tmp_path / 'l.db'}"
        app.WorkController(pool_cls="prefork", concurrency=2, without_mingle=True)  # accepted

        @app.task(name="cfg.late", base=LockedTask, lock_key="k", lock_store="memory://")
        def late() -> None: ...

        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a pool process forked after the registration: what prefork runs first
            try:
                worker.on_worker_process_init()
                try:
                    config.get_settings(app)  # what every locked execution reads first
                    os.write(write, b"ran")
                except LeaseConfigError as exc:
                    os.write(write, str(exc).encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        answer = os.read(read, 2000).decode()
        os.close(read)
        assert "'cfg.late'" in answer and "2 processes" in answer, answer

    def test_embedded_test_worker_accepts_a_memory_store(self, app: Celery) -> None:
        """start_worker's defaults (solo, one slot), the fixture of users' own test suites,
        runs locked tasks on a MemoryLockStore."""
        from celery.contrib.testing.worker import start_worker

        app.conf.update(result_backend="cache+memory://", lease_store=MemoryLockStore())
        app.conf.broker_transport_options = {"polling_interval": 0.01}

        @app.task(base=LockedTask, lock_key="emb:{n}", shared=False)
        def embedded(n: int) -> int | None:
            return embedded.request.lock_token

        with start_worker(app, perform_ping_check=False, shutdown_timeout=10):
            assert embedded.delay(1).get(timeout=10, interval=0.01) > 0

    @pytest.mark.parametrize("url", ["reddis://r:6379/1", "postgressql://db/x", "sqllite:///l.db"])
    def test_unknown_store_scheme_refused_at_start(self, app: Celery, url: str) -> None:
        """A misspelled store scheme is refused by the worker check, not at the first task
        (a worker that started would fail every locked execution)."""
        app.conf.lease_store = url
        error = startup.check_worker(app, _pool("solo"), 1)
        assert error is not None and "unknown scheme" in str(error) and repr(url) in str(error)

    def test_the_schemes_checked_are_the_ones_stores_are_built_for(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """config.STORE_SCHEMES is exactly what store_from_url builds a store for."""
        from celery_lease.stores import django as django_databases
        from celery_lease.stores import memory, postgres, redis, sqlite, store_from_url

        built: list[str] = []

        def fake(url: str = "") -> object:
            built.append(url)
            return object()

        monkeypatch.setattr(memory, "MemoryLockStore", fake)
        monkeypatch.setattr(redis, "RedisLockStore", fake)
        monkeypatch.setattr(postgres, "PostgresLockStore", fake)
        monkeypatch.setattr(sqlite.SQLiteLockStore, "from_url", staticmethod(fake))
        monkeypatch.setattr(django_databases.DjangoStore, "from_url", staticmethod(fake))
        for scheme in config.STORE_SCHEMES:
            store_from_url(f"{scheme}://h/x")
        assert len(built) == len(config.STORE_SCHEMES)
        with pytest.raises(LeaseConfigError, match="unknown scheme"):
            store_from_url("nope://h/x")

    def test_a_refusal_is_of_one_app(self, app: Celery) -> None:
        """Refusing one app leaves another (even one of the same name) alone."""
        twin = Celery(app.main, broker="memory://", set_as_current=False)
        try:
            config.refuse(app, "refused for the test")
            assert config.get_settings(twin).store is None
            with pytest.raises(LeaseConfigError, match="refused for the test"):
                config.get_settings(app)
        finally:
            config.reset(twin)
            twin.close()


class TestHostLocalFallback:
    """check_host_local: the worker's main process on the host-local SQLite fallback."""

    @pytest.fixture
    def fallback_app(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
        import tempfile

        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        monkeypatch.setattr(config, "_warned_local", False)
        app = Celery("fallback", broker="amqp://guest@localhost//", set_as_current=False)
        yield app
        config.reset(app)
        app.close()

    def test_the_warning_is_logged_once_and_not_again_when_the_store_is_opened(
        self, fallback_app: Celery, caplog: pytest.LogCaptureFixture
    ) -> None:
        """At start, then at the first locked task of a process forked after it: one line."""

        @fallback_app.task(name="fallback.locked", base=LockedTask, shared=False)
        def uses_app_store() -> None: ...

        with caplog.at_level(logging.WARNING, logger="celery_lease.config"):
            assert startup.check_host_local(fallback_app) is None
            config.get_store(fallback_app)
        lines = [
            r for r in caplog.records if "excludes only workers on this host" in r.getMessage()
        ]
        assert len(lines) == 1

    def test_required_shared_store_is_a_refusal_naming_the_setting(
        self, fallback_app: Celery
    ) -> None:
        fallback_app.conf.lease_require_shared_store = True

        @fallback_app.task(name="fallback.app_store", base=LockedTask, shared=False)
        def app_store() -> None: ...

        error = startup.check_host_local(fallback_app)
        assert isinstance(error, LeaseConfigError)
        assert "lease_require_shared_store=True refuses it" in str(error)

    def test_tasks_that_all_have_their_own_store_need_no_warning(
        self,
        fallback_app: Celery,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The app's store is never used: nothing to warn about or refuse. (The app's locked
        tasks are given: Celery adds every shared task defined earlier in this process to a new
        app.)"""
        fallback_app.conf.lease_require_shared_store = True
        own = [("fallback.own", f"sqlite:///{tmp_path}/own.db")]
        monkeypatch.setattr(startup, "locked_tasks", lambda app: iter(own))
        with caplog.at_level(logging.WARNING, logger="celery_lease.config"):
            assert startup.check_host_local(fallback_app) is None
        assert caplog.records == []

    def test_a_broker_redis_is_no_fallback(self, caplog: pytest.LogCaptureFixture) -> None:
        app = Celery("redis-broker", broker="redis://127.0.0.1:6379/0", set_as_current=False)
        app.conf.lease_require_shared_store = True
        try:
            assert startup.check_host_local(app) is None
        finally:
            config.reset(app)


class _NoReplaceStore:
    """A shared store (not process-local) that cannot ask a holder to stop."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return 1

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    def release(self, key: str, owner: str) -> None:
        return None

    def get(self, key: str) -> None:
        return None


class TestReplaceStoreAtStart:
    """A task with on_held="replace" on a store that cannot mark a holder: refused when the
    worker is built, before any call."""

    def test_the_apps_store_without_replace_is_refused(self, app: Celery) -> None:
        app.conf.lease_store = _NoReplaceStore()

        @app.task(
            base=LockedTask, name="rp.job1", shared=False, lock_on_held="replace", lock_key="k"
        )
        def job() -> None:
            return None

        error = startup.check_replace_stores(app)
        assert isinstance(error, LeaseConfigError)
        assert "'rp.job1'" in str(error) and "lock_on_held='replace'" in str(error)
        assert "_NoReplaceStore()" in str(error)

    def test_a_store_that_replaces_passes(self, app: Celery) -> None:
        app.conf.lease_store = MemoryLockStore()

        @app.task(
            base=LockedTask, name="rp.job2", shared=False, lock_on_held="replace", lock_key="k"
        )
        def job() -> None:
            return None

        assert startup.check_replace_stores(app) is None

    def test_other_policies_are_not_checked(self, app: Celery) -> None:
        app.conf.lease_store = _NoReplaceStore()

        @app.task(base=LockedTask, name="rp.job3", shared=False, lock_key="k")
        def job() -> None:
            return None

        assert startup.check_replace_stores(app) is None

    def test_the_worker_build_is_refused(
        self, app: Celery, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The LeaseCheck bootstep raises it while Celery builds the worker."""
        from celery import _state

        monkeypatch.setattr(worker, "_main_pid", None)
        blocks = _state.task_join_will_block()
        app.conf.update(lease_store=_NoReplaceStore(), lease_store_check="off")

        @app.task(
            base=LockedTask, name="rp.job4", shared=False, lock_on_held="replace", lock_key="k"
        )
        def job() -> None:
            return None

        try:
            with pytest.raises(LeaseConfigError, match="lock_on_held='replace'"):
                app.WorkController(pool_cls="threads", concurrency=2, without_mingle=True)
        finally:
            _state._set_task_join_will_block(blocks)


class TestMixedLimitsAtStart:
    """Two tasks sharing a lock_key template, one with a limit and one without, hold two lock
    spaces that do not exclude each other: the worker warns at start-up."""

    def test_a_key_template_with_and_without_a_limit_is_warned_about(
        self, app: Celery, caplog: pytest.LogCaptureFixture
    ) -> None:
        @app.task(
            base=LockedTask, name="pay.limited", shared=False, lock_key="acct:{a}", lock_limit=1
        )
        def limited(a: int) -> None:
            return None

        @app.task(base=LockedTask, name="pay.plain", shared=False, lock_key="acct:{a}")
        def plain(a: int) -> None:
            return None

        with caplog.at_level(logging.WARNING, logger="celery_lease.worker"):
            startup.warn_mixed_limits(app)
        (record,) = [r for r in caplog.records if "acct:{a}" in r.getMessage()]
        message = record.getMessage()
        assert record.levelno == logging.WARNING
        assert "'pay.limited'" in message and "'pay.plain'" in message

    def test_one_kind_per_template_is_not_warned_about(
        self, app: Celery, caplog: pytest.LogCaptureFixture
    ) -> None:
        @app.task(base=LockedTask, name="pay.a", shared=False, lock_key="acct:{a}", lock_limit=2)
        def first(a: int) -> None:
            return None

        @app.task(
            base=LockedTask, name="pay.b", shared=False, lock_key="acct:{a}", lock_limit=lambda a: 3
        )
        def second(a: int) -> None:
            return None

        @app.task(base=LockedTask, name="pay.c", shared=False, lock_key="other:{a}")
        def third(a: int) -> None:
            return None

        with caplog.at_level(logging.WARNING, logger="celery_lease.worker"):
            startup.warn_mixed_limits(app)
        assert caplog.records == []
