"""The ``celery-lease`` / ``celery lease`` command line against real SQLite and Redis stores."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_lease import LockStore, store_from_url
from celery_lease.cli import lease_group, main
from tests.support import free_port

TTL_MS = 60_000


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty, shared store: an SQLite file, or a throwaway redis-server."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    store_from_url(url).release("init", "nobody")  # creates the file
    return url


@pytest.fixture
def store(store_url: str) -> Iterator[LockStore]:
    """A second client of the same store, as the process holding the leases would have."""
    client = store_from_url(store_url)
    yield client
    close = getattr(client, "close", None)
    if close is not None:
        close()


def run(*args: str, input: str | None = None, obj: Any = None) -> Result:
    """Invoke the CLI in-process, keeping stdout and stderr apart."""
    return CliRunner().invoke(lease_group, list(args), input=input, obj=obj)


class TestList:
    def test_table_shows_key_owner_token_and_time_left(self, store: LockStore, store_url: str):
        """Each live lease is one row with its key, owner, token and remaining time."""
        token = store.acquire("report:nightly", "host/1/abc", TTL_MS)
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        header, row = result.stdout.splitlines()
        assert header.split() == ["KEY", "OWNER", "TOKEN", "TIME", "LEFT"]
        key, owner, shown_token, left = row.split()
        assert (key, owner, int(shown_token)) == ("report:nightly", "host/1/abc", token)
        assert 50 <= float(left.rstrip("s")) <= 60

    def test_prefix_filters_keys(self, store: LockStore, store_url: str):
        """``--prefix`` keeps only keys that start with it."""
        store.acquire("report:a", "o1", TTL_MS)
        store.acquire("account:1", "o2", TTL_MS)
        result = run("list", "--prefix", "report:", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert "report:a" in result.stdout
        assert "account:1" not in result.stdout

    def test_json_is_an_array_of_objects(self, store: LockStore, store_url: str):
        """``--json`` prints key, owner, token and expires_in (seconds) per lease, sorted by key."""
        t2 = store.acquire("b", "o2", TTL_MS)
        t1 = store.acquire("a", "o1", 5_000)
        result = run("list", "--json", "--store", store_url)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert [(d["key"], d["owner"], d["token"]) for d in data] == [
            ("a", "o1", t1),
            ("b", "o2", t2),
        ]
        assert set(data[0]) == {"key", "owner", "token", "expires_in"}
        assert 0 < data[0]["expires_in"] <= 5
        assert 50 < data[1]["expires_in"] <= 60

    def test_released_leases_are_not_listed(self, store: LockStore, store_url: str):
        """A released lease disappears from the list, and an empty list says so."""
        store.acquire("k", "o", TTL_MS)
        store.release("k", "o")
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "no live leases"
        assert json.loads(run("list", "--json", "--store", store_url).stdout) == []


class TestShow:
    def test_held_lease_is_described(self, store: LockStore, store_url: str):
        """``show`` prints the holder and the token of a held key."""
        token = store.acquire("account:42", "host/9/xyz", TTL_MS)
        result = run("show", "account:42", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert "held by host/9/xyz" in result.stdout
        assert f"token {token}" in result.stdout

    def test_free_key_shows_the_last_token(self, store: LockStore, store_url: str):
        """A released key is reported free with the last token the store issued for it."""
        token = store.acquire("account:42", "o", TTL_MS)
        store.release("account:42", "o")
        result = run("show", "account:42", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == f"account:42: free (last token issued {token})"

    def test_never_used_key_is_free_without_a_token(self, store_url: str):
        """A key the store never saw is free with no token issued."""
        result = run("show", "never", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "never: free (no token issued yet)"


class TestRelease:
    def test_declining_the_prompt_keeps_the_lease(self, store: LockStore, store_url: str):
        """Answering no to the confirmation aborts with status 1 and leaves the lease held."""
        store.acquire("k", "owner-1", TTL_MS)
        result = run("release", "k", "--store", store_url, input="n\n")
        assert result.exit_code == 1
        assert "Force-release k: held by owner-1" in result.stdout
        assert store.acquire("k", "other", TTL_MS) is None

    def test_confirmed_release_frees_the_key_and_says_what_it_removed(
        self, store: LockStore, store_url: str
    ):
        """Answering yes removes the lease and prints its owner and token."""
        token = store.acquire("k", "owner-1", TTL_MS)
        result = run("release", "k", "--store", store_url, input="y\n")
        assert result.exit_code == 0, result.output
        assert f"released k: owner owner-1, token {token}" in result.stdout
        assert store.acquire("k", "other", TTL_MS) is not None

    def test_yes_skips_the_prompt_and_the_next_token_is_higher(
        self, store: LockStore, store_url: str
    ):
        """``--yes`` releases without asking; the next acquirer still gets a higher token."""
        token = store.acquire("k", "owner-1", TTL_MS)
        assert token is not None
        result = run("release", "k", "--yes", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert "[y/N]" not in result.stdout
        following = store.acquire("k", "owner-2", TTL_MS)
        assert following is not None and following > token
        store.renew("k", "owner-1", TTL_MS)  # the old holder cannot renew its way back
        assert store.get("k").owner == "owner-2"  # type: ignore[attr-defined]

    def test_free_key_releases_nothing(self, store_url: str):
        """Releasing a free key says so and succeeds without prompting."""
        result = run("release", "nothing-here", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "nothing-here: free, nothing to release"


class NoInspectionStore:
    """A custom store with only the three required operations."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return 1

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    def release(self, key: str, owner: str) -> None:
        return None


def celery_obj(**conf: Any) -> types.SimpleNamespace:
    """What ``celery -A app`` puts in ``ctx.obj``: an object with the app at ``.app``."""
    app = Celery("cli-test", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return types.SimpleNamespace(app=app)


class TestErrors:
    def assert_one_line_error(self, result: Result, *fragments: str) -> None:
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "Traceback" not in result.stderr
        for fragment in fragments:
            assert fragment in lines[0]

    @pytest.mark.parametrize("command", [["list"], ["show", "k"], ["release", "k", "--yes"]])
    def test_memory_store_is_refused(self, command: list[str]):
        """``memory://`` is refused on every command: nothing to list from outside the process."""
        self.assert_one_line_error(
            run(*command, "--store", "memory://"), "memory://", "one process"
        )

    def test_unknown_scheme_lists_the_supported_ones(self):
        """A URL with an unknown scheme is one line naming the scheme, status 2."""
        self.assert_one_line_error(run("list", "--store", "nope://x"), "'nope'", "supported")

    def test_missing_sqlite_file_is_reported_not_created(self, tmp_path: Path):
        """An SQLite URL naming a missing file is an error, and the file is not created."""
        path = tmp_path / "typo.db"
        self.assert_one_line_error(run("show", "k", "--store", f"sqlite:///{path}"), "typo.db")
        assert not path.exists()

    def test_unreachable_redis_is_one_line(self):
        """A Redis server that does not answer is reported in one line, status 2."""
        url = f"redis://127.0.0.1:{free_port()}/0"
        self.assert_one_line_error(run("list", "--store", url), "Redis")

    def test_no_store_at_all(self):
        """Without ``--store`` and outside ``celery -A app``, the CLI says how to name a store."""
        self.assert_one_line_error(run("list"), "--store")

    def test_store_url_from_the_environment(self, store: LockStore, store_url: str):
        """``CELERY_LEASE_STORE`` stands in for ``--store``."""
        store.acquire("env-key", "o", TTL_MS)
        result = CliRunner().invoke(lease_group, ["list"], env={"CELERY_LEASE_STORE": store_url})
        assert result.exit_code == 0, result.output
        assert "env-key" in result.stdout

    def test_custom_store_without_inspection_is_named(self):
        """A custom store lacking the inspection methods gets a message listing what it lacks."""
        result = run("list", obj=celery_obj(lease_store=NoInspectionStore()))
        self.assert_one_line_error(result, "NoInspectionStore", "list()", "force_release()")

    def test_app_with_memory_store_is_refused(self):
        """An app whose lease store is in-process memory has nothing to show from outside."""
        from celery_lease import MemoryLockStore

        result = run("list", obj=celery_obj(lease_store=MemoryLockStore()))
        self.assert_one_line_error(result, "memory")


class TestApp:
    def test_store_comes_from_the_apps_lease_store(self, store: LockStore, store_url: str):
        """Under ``celery -A app lease``, the store is the app's ``lease_store`` setting."""
        store.acquire("from-app", "o", TTL_MS)
        result = run("list", obj=celery_obj(lease_store=store_url))
        assert result.exit_code == 0, result.output
        assert "from-app" in result.stdout

    def test_store_option_overrides_the_app(self, store: LockStore, store_url: str):
        """``--store`` wins over the app's configuration."""
        store.acquire("from-option", "o", TTL_MS)
        result = run("list", "--store", store_url, obj=celery_obj(lease_store="memory://"))
        assert result.exit_code == 0, result.output
        assert "from-option" in result.stdout

    def test_redis_broker_is_the_default_store(self, redis_url: str):
        """An app with no ``lease_store`` and a Redis broker is inspected in the broker's Redis."""
        token = store_from_url(redis_url).acquire("on-broker", "o", TTL_MS)
        app = Celery("cli-broker", broker=redis_url, set_as_current=False)
        result = run("show", "on-broker", obj=types.SimpleNamespace(app=app))
        assert result.exit_code == 0, result.output
        assert f"token {token}" in result.stdout


class TestDemo:
    def test_demo_runs_the_example_projects_entry(self, monkeypatch: pytest.MonkeyPatch):
        """``demo`` calls ``example_project.demo.main`` with its arguments and exits likewise."""
        seen: list[list[str]] = []

        def fake_main(argv: list[str]) -> int:
            seen.append(argv)
            return 3

        module = types.ModuleType("example_project.demo")
        module.main = fake_main  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "example_project.demo", module)
        result = run("demo", "--redis", "redis://h:1/0")
        assert seen == [["--redis", "redis://h:1/0"]]
        assert result.exit_code == 3

    def test_demo_without_example_project_is_a_clear_error(self, monkeypatch: pytest.MonkeyPatch):
        """Without the example project, ``demo`` says what is missing, status 2."""
        monkeypatch.setitem(sys.modules, "example_project.demo", None)
        result = run("demo")
        assert result.exit_code == 2
        assert "example_project" in result.stderr
        assert "Traceback" not in result.stderr


class TestEntryPoints:
    def test_console_script_and_celery_command_are_registered(self):
        """The installed metadata points ``celery-lease`` and ``celery lease`` at this module."""
        scripts = {e.name: e for e in entry_points(group="console_scripts")}
        commands = {e.name: e for e in entry_points(group="celery.commands")}
        assert scripts["celery-lease"].load() is main
        assert commands["lease"].load() is lease_group

    def test_main_runs_the_group(self, store: LockStore, store_url: str, capsys):
        """``main(argv)`` runs the same commands as the group and exits 0 on success."""
        store.acquire("via-main", "o", TTL_MS)
        with pytest.raises(SystemExit) as exited:
            main(["show", "via-main", "--store", store_url])
        assert exited.value.code == 0
        assert "held by o" in capsys.readouterr().out

    def test_celery_lease_list_in_a_subprocess(
        self, store: LockStore, store_url: str, tmp_path: Path
    ):
        """``celery -A app lease list`` lists a lease from the app's configured store."""
        token = store.acquire("held-by-task", "worker/1/abc", TTL_MS)
        (tmp_path / "lease_cli_app.py").write_text(
            textwrap.dedent(
                f"""
                from celery import Celery

                app = Celery("lease_cli_app", broker="memory://")
                app.conf.lease_store = {store_url!r}
                """
            )
        )
        result = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "lease_cli_app", "lease", "list", "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [
            {
                "key": "held-by-task",
                "owner": "worker/1/abc",
                "token": token,
                "expires_in": pytest.approx(60, abs=30),
            }
        ]
