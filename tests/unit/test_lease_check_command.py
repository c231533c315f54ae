"""``celery -A proj lease check`` (and ``celery-lease check --store URL``) for deploy scripts.

It validates the app's ``lease_*`` settings and pings every store the app's locked tasks use,
printing one line per check, and exits non-zero when one failed, naming the store's URL with
its password masked. Unreachable stores here are real: a TCP port nobody listens on, a unix
socket path that does not exist.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

from celery import Celery
from click.testing import CliRunner, Result

from celery_lease import LockedTask
from celery_lease._celery import startup
from celery_lease.cli import lease_group
from tests.support import free_port

PASSWORD = "s3cret-pw"


def app_with(**settings: Any) -> Celery:
    app = Celery("check", broker="memory://", set_as_current=False)
    app.conf.update(settings)
    return app


def check(app: Celery | None = None, *args: str) -> Result:
    obj = None if app is None else types.SimpleNamespace(app=app)
    return CliRunner().invoke(lease_group, ["check", *args], obj=obj)


def closed_redis() -> tuple[str, str]:
    """A Redis URL with a password on a port nobody listens on, and how it must be shown."""
    port = free_port()
    return f"redis://:{PASSWORD}@127.0.0.1:{port}/0", f"redis://:***@127.0.0.1:{port}/0"


class TestPasses:
    def test_valid_settings_and_a_store_that_answers_exit_zero(self, tmp_path: Path) -> None:
        """Each check is one line starting with ``ok``; the status is 0."""
        url = f"sqlite:///{tmp_path / 'leases.db'}"
        result = check(app_with(lease_store=url, lease_default_ttl="20s"))
        assert result.exit_code == 0, result.output
        # Celery adds every shared task (``@app.task`` shares by default) defined earlier in
        # this process to a new app: lines for other tests' locked tasks may follow.
        lines = result.stdout.splitlines()
        assert all(line.startswith("ok") for line in lines), lines
        assert "settings" in lines[0]
        assert "lease_store" in lines[1] and url in lines[1]


class TestFails:
    def test_a_store_on_a_closed_port_fails_with_its_masked_url(self) -> None:
        """The store does not answer: its line names ``lease_store`` and the masked URL, and
        the status is non-zero; the password is never printed."""
        url, shown = closed_redis()
        result = check(app_with(lease_store=url))
        assert result.exit_code != 0, result.output
        (line,) = [x for x in result.output.splitlines() if "lease_store" in x]
        assert line.startswith("FAIL") and shown in line, result.output
        assert PASSWORD not in result.output

    def test_a_missing_socket_path_fails(self, tmp_path: Path) -> None:
        """A ``unix://`` store whose socket path does not exist fails its line."""
        url = f"unix://{tmp_path}/missing/redis.sock?db=0"
        result = check(app_with(lease_store=url))
        assert result.exit_code != 0, result.output
        (line,) = [x for x in result.output.splitlines() if "lease_store" in x]
        assert line.startswith("FAIL") and url in line, result.output

    def test_a_tasks_own_store_is_checked_beside_the_apps(self, tmp_path: Path) -> None:
        """A task's ``lock_store`` that does not answer fails its own line, naming the task;
        the app's store that answers passes."""
        url, shown = closed_redis()
        app = app_with(lease_store=f"sqlite:///{tmp_path / 'leases.db'}")

        @app.task(name="check.own", base=LockedTask, lock_store=url, shared=False)
        def own() -> None: ...

        result = check(app)
        assert result.exit_code != 0, result.output
        lines = result.stdout.splitlines()
        (app_line,) = [x for x in lines if "lease_store" in x]
        (task_line,) = [x for x in lines if "'check.own'" in x]
        assert app_line.startswith("ok"), lines
        assert task_line.startswith("FAIL") and "lock_store" in task_line and shown in task_line

    def test_a_bad_setting_fails_naming_it(self) -> None:
        """A setting with a bad value fails the settings line, which names it."""
        result = check(app_with(lease_default_ttl="-3s"))
        assert result.exit_code != 0, result.output
        first = result.output.splitlines()[0]
        assert first.startswith("FAIL") and "lease_default_ttl" in first, result.output

    def test_store_option_checks_that_store_alone(self) -> None:
        """``celery-lease check --store URL`` (no app) pings that store."""
        url, shown = closed_redis()
        result = check(None, "--store", url)
        assert result.exit_code != 0, result.output
        assert shown in result.output and PASSWORD not in result.output


class TestCeleryProgram:
    def test_celery_lease_check_reads_the_tasks_of_the_app(self, tmp_path: Path) -> None:
        """``celery -A proj lease check`` imports the app's task modules (``include``): the
        ``lock_store`` of a task defined there is checked, and the status says it failed."""
        url, shown = closed_redis()
        (tmp_path / "proj_check.py").write_text(
            textwrap.dedent(
                f"""
                from celery import Celery

                app = Celery("proj_check", broker="memory://", include=["proj_check_tasks"])
                app.conf.lease_store = "sqlite:///{tmp_path / "leases.db"}"
                """
            )
        )
        (tmp_path / "proj_check_tasks.py").write_text(
            textwrap.dedent(
                f"""
                from celery_lease import LockedTask
                from proj_check import app


                @app.task(name="proj.own", base=LockedTask, lock_store={url!r})
                def own():
                    pass
                """
            )
        )
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "proj_check", "lease", "check"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0, done.stdout + done.stderr
        (task_line,) = [x for x in done.stdout.splitlines() if "'proj.own'" in x]
        assert task_line.startswith("FAIL") and shown in task_line, done.stdout
        assert PASSWORD not in done.stdout + done.stderr


class BlockingStore:
    """A store whose ``get`` blocks until ``release_when`` is set (at most ``cap`` real s)."""

    def __init__(self, release_when: threading.Event) -> None:
        self.entered = threading.Event()
        self.release_when = release_when
        self.answered_after_the_other_began = False

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        raise NotImplementedError

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        raise NotImplementedError

    def release(self, key: str, owner: str) -> None:
        raise NotImplementedError

    def get(self, key: str) -> None:
        self.entered.set()
        self.answered_after_the_other_began = self.release_when.wait(30)

    def list(self, prefix: str = "") -> list[Any]:
        return []

    def last_token(self, key: str) -> int | None:
        return None

    def force_release(self, key: str) -> None:
        raise NotImplementedError


class TestStoresArePingedAtOnce:
    def test_a_hung_store_does_not_delay_the_ping_of_the_next(self) -> None:
        """The first store answers only once the second one's ping has begun: pinged one after
        the other, the first would wait out its timeout; pinged at once, both answer."""
        second_began = threading.Event()
        first = BlockingStore(release_when=second_began)
        second = BlockingStore(release_when=threading.Event())
        second.release_when.set()
        second_entered = second.entered

        def watch() -> None:
            second_entered.wait(30)
            second_began.set()

        threading.Thread(target=watch, daemon=True).start()
        checks = startup.ping_stores([("a", first), ("b", second)], "ping", timeout=20)
        assert [c.ok for c in checks] == [True, True], checks
        assert first.answered_after_the_other_began


RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


class TestHostLocalFallback:
    """No ``lease_store`` and a broker that is not Redis: the embedded SQLite file of this host
    (the broker is never contacted by the check)."""

    def test_the_host_local_file_is_a_warning_and_a_non_zero_status(
        self, tmp_path: Path, monkeypatch: Any
    ) -> None:
        """The app's store line starts with ``WARN``, says it excludes only this host's workers
        and names ``lease_store``; the status is 1 (2 is kept for a check that failed)."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the file's directory
        app = Celery("check", broker=RABBITMQ, set_as_current=False)
        result = check(app)
        lines = result.stdout.splitlines()
        (line,) = [x for x in lines if "lease_store" in x]
        assert line.startswith("WARN"), lines
        assert "only workers on this host" in line and "lease_store" in line
        assert result.exit_code == 1, result.output

    def test_requiring_a_shared_store_fails_the_check_naming_the_setting(
        self, tmp_path: Path, monkeypatch: Any
    ) -> None:
        """``lease_require_shared_store = True``: the fallback is a failure naming the setting."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        app = Celery("check", broker=RABBITMQ, set_as_current=False)
        app.conf.lease_require_shared_store = True
        result = check(app)
        settings, *stores = result.stdout.splitlines()
        assert settings.startswith("ok"), result.output  # a setting it knows
        (line,) = [x for x in stores if "lease_store" in x]
        assert line.startswith("FAIL") and "lease_require_shared_store" in line, result.output
        assert result.exit_code == 2, result.output

    def test_a_shared_store_is_no_warning(self, tmp_path: Path) -> None:
        """The broker's Redis (or any ``lease_store``) is shared: ``ok``, status 0."""
        app = Celery("check", broker="redis://127.0.0.1:6379/15", set_as_current=False)
        app.conf.lease_require_shared_store = True
        result = check(app)
        assert result.exit_code == 0, result.output
        assert all(line.startswith("ok") for line in result.stdout.splitlines()), result.output


class TestADownPostgres:
    def test_a_down_postgresql_store_is_one_line(self) -> None:
        """``celery-lease check --store postgresql://<nobody listens>``: the FAIL line and
        nothing else, none of psycopg_pool's connection messages (stdout and stderr alike)."""
        url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
        done = subprocess.run(
            [sys.executable, "-c", "from celery_lease.cli import main; main()",
             "check", "--store", url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        lines = (done.stdout + done.stderr).splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("FAIL") and "Connection refused" in lines[0]
        assert done.returncode == 2
