"""The ``celery-lease`` / ``celery lease`` command line against real SQLite and Redis stores."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import types
import uuid
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_lease import LockStore, lease, store_from_url
from celery_lease._core.owners import make_owner
from celery_lease.cli import lease_group, main, stale_margin
from celery_lease.stores.sqlite import SQLiteLockStore
from tests.support import free_port

TTL_MS = 60_000


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty, shared store: an SQLite file, a throwaway redis-server, or the
    default table of the session's scratch PostgreSQL database (emptied for each test)."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "postgres":
        import psycopg

        dsn = str(request.getfixturevalue("pg_database_dsn"))
        store_from_url(dsn).release("init", "nobody")  # creates the table
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM celery_lease")
        return dsn
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


def table(result: Result) -> list[list[str]]:
    """The rows of a table printed by ``list``, split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines()]


HEADER = [
    "KEY", "STATE", "NODE", "PID", "TASK", "TASK ID", "HELD FOR", "RENEWED", "TOKEN", "EXPIRES IN",
]  # fmt: skip


class TestList:
    def test_table_shows_node_task_task_id_held_for_token_and_time_left(
        self, store: LockStore, store_url: str
    ):
        """Each live lease is one row: key, state, node, pid, task, task id, held for, token,
        time left (the state is "held": without an app there is no result backend to ask)."""
        owner = make_owner(node="w1@host", task="report.build", task_id="id-1")
        token = store.acquire("report:nightly", owner, TTL_MS)
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        header, row = table(result)
        assert header == HEADER
        key, state, node, pid, task, task_id, held, renewed, shown_token, left = row
        assert renewed == "-"  # an owner id that records no ttl
        assert (key, state, node, pid, task, task_id) == (
            "report:nightly", "held", "w1@host", str(os.getpid()), "report.build", "id-1",
        )  # fmt: skip
        assert int(shown_token) == token
        assert 0 <= float(held.rstrip("s")) < 30
        assert 50 <= float(left.rstrip("s")) <= 60

    def test_old_owner_without_fields_still_lists(self, store: LockStore, store_url: str):
        """An owner id without fields (``host/pid/hex``) lists with host, pid and dashes."""
        token = store.acquire("report:old", "oldhost/41/abc", TTL_MS)
        store.acquire("report:foreign", "something-else", TTL_MS)
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        header, foreign, old = table(result)
        assert header == HEADER
        assert old[:7] == ["report:old", "held", "oldhost", "41", "-", "-", "-"]
        assert int(old[8]) == token
        assert foreign[:7] == ["report:foreign", "held", "something-else", "-", "-", "-", "-"]

    def test_label_column_appears_when_a_lease_has_one(self, store: LockStore, store_url: str):
        """A ``holder=`` label gets a LABEL column (only when some lease has a label)."""
        store.acquire("import:1", make_owner(label="nightly import"), TTL_MS)
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        header, row = table(result)
        assert header[6] == "LABEL"
        assert row[6] == "nightly import"

    def test_prefix_filters_keys(self, store: LockStore, store_url: str):
        """``--prefix`` keeps only keys that start with it."""
        store.acquire("report:a", "o1", TTL_MS)
        store.acquire("account:1", "o2", TTL_MS)
        result = run("list", "--prefix", "report:", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert "report:a" in result.stdout
        assert "account:1" not in result.stdout

    def test_task_and_node_filter(self, store: LockStore, store_url: str):
        """``--task`` and ``--node`` keep the leases of that task name / worker node (both: and)."""
        store.acquire("a", make_owner(node="w1@h", task="t.build", task_id="1"), TTL_MS)
        store.acquire("b", make_owner(node="w2@h", task="t.build", task_id="2"), TTL_MS)
        store.acquire("c", make_owner(node="w1@h", task="t.other", task_id="3"), TTL_MS)
        store.acquire("d", "oldhost/1/abc", TTL_MS)

        def keys(*args: str) -> list[str]:
            result = run("list", "--json", *args, "--store", store_url)
            assert result.exit_code == 0, result.output
            return [row["key"] for row in json.loads(result.stdout)]

        assert keys("--task", "t.build") == ["a", "b"]
        assert keys("--node", "w1@h") == ["a", "c"]
        assert keys("--task", "t.build", "--node", "w1@h") == ["a"]
        assert keys("--task", "nope") == []
        empty = run("list", "--task", "nope", "--node", "w1@h", "--store", store_url)
        assert empty.stdout.strip() == "no live leases with task 'nope', node 'w1@h'"

    def test_json_is_an_array_of_objects_with_the_holder(self, store: LockStore, store_url: str):
        """``--json`` prints the store's view and the parsed owner per lease, sorted by key."""
        owner = make_owner(node="w1@h", task="t.build", task_id="tid", label="lbl")
        t2 = store.acquire("b", owner, TTL_MS)
        t1 = store.acquire("a", "o1", 5_000)
        result = run("list", "--json", "--store", store_url)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert [(d["key"], d["owner"], d["token"]) for d in data] == [
            ("a", "o1", t1),
            ("b", owner, t2),
        ]
        assert set(data[0]) == {
            "key", "slot", "owner", "replaced", "token", "expires_in", "node", "host", "pid",
            "task", "task_id", "label", "taken_at", "held_seconds", "state", "ttl", "cooldown",
            "renewed_seconds_ago", "stale",
        }  # fmt: skip
        assert (data[0]["slot"], data[0]["replaced"]) == (None, False)  # a plain key's lease
        assert 0 < data[0]["expires_in"] <= 5
        assert data[0]["node"] is data[0]["taken_at"] is data[0]["held_seconds"] is None
        assert 50 < data[1]["expires_in"] <= 60
        assert (data[1]["node"], data[1]["task"], data[1]["task_id"], data[1]["label"]) == (
            "w1@h", "t.build", "tid", "lbl",
        )  # fmt: skip
        assert (data[1]["host"], data[1]["pid"]) == (socket.gethostname(), os.getpid())
        assert abs(data[1]["taken_at"] - time.time()) < 60
        assert 0 <= data[1]["held_seconds"] < 60

    def test_a_holder_asked_to_stop_lists_as_itself(self, store: LockStore, store_url: str):
        """A lease a newer ``on_held="replace"`` call marked: its task, id, ttl and the time it
        was taken are read through the mark."""
        owner = make_owner(node="w1@h", task="t.build", task_id="tid", ttl_ms=TTL_MS)
        store.acquire("m", owner, TTL_MS)
        store.mark_replaced("m")  # type: ignore[attr-defined]  # every store listed here can
        result = run("list", "--json", "--store", store_url)
        assert result.exit_code == 0, result.output
        [data] = json.loads(result.stdout)
        assert (data["node"], data["task"], data["task_id"], data["ttl"]) == (
            "w1@h", "t.build", "tid", TTL_MS / 1000,
        )  # fmt: skip
        assert data["taken_at"] is not None and abs(data["taken_at"] - time.time()) < 60

    def test_released_leases_are_not_listed(self, store: LockStore, store_url: str):
        """A released lease disappears from the list, and an empty list says so."""
        store.acquire("k", "o", TTL_MS)
        store.release("k", "o")
        result = run("list", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "no live leases"
        assert json.loads(run("list", "--json", "--store", store_url).stdout) == []


class TestStates:
    def test_queued_running_and_cooldown_are_told_apart(
        self, store: LockStore, store_url: str, redis_url: str
    ):
        """Under an app with a result backend: a unique copy's queued lease is "queued", a lease
        of a task that succeeded is "cooldown", one of an unfinished task "running"; a lease that
        names no task is "held". ``--state`` keeps one state."""
        from celery_lease._core.owners import queued_owner

        obj = celery_obj(lease_store=store_url, result_backend=redis_url)
        done, busy = f"done-{uuid.uuid4().hex}", f"busy-{uuid.uuid4().hex}"
        obj.app.backend.store_result(done, 7, "SUCCESS")
        obj.app.backend.store_result(busy, None, "STARTED")
        store.acquire("k:cool", make_owner(node="w1@h", task="t.x", task_id=done), TTL_MS)
        store.acquire("k:run", make_owner(node="w1@h", task="t.x", task_id=busy), TTL_MS)
        store.acquire("k:never", make_owner(node="w1@h", task="t.x", task_id="unknown"), TTL_MS)
        store.acquire("k:queued", queued_owner("t.x", "q-1", 1_700_000_000_000), TTL_MS)
        store.acquire("k:plain", make_owner(label="script"), TTL_MS)
        result = run("list", "--prefix", "k:", obj=obj)
        assert result.exit_code == 0, result.output
        states = {row[0]: row[1] for row in table(result)[1:]}
        assert states == {
            "k:cool": "cooldown",
            "k:run": "running",
            "k:never": "running",  # PENDING: not started, or started without a stored state
            "k:queued": "queued",
            "k:plain": "held",
        }
        cooling = run("list", "--json", "--state", "cooldown", obj=obj)
        assert [r["key"] for r in json.loads(cooling.stdout)] == ["k:cool"]
        shown = run("show", "k:cool", obj=obj)
        assert shown.stdout.startswith("k:cool: held (cooldown) by task t.x[")
        queued = json.loads(run("show", "k:queued", "--json", obj=obj).stdout)
        assert (queued["state"], queued["task_id"]) == ("queued", "q-1")

    def test_the_queued_owner_prefix_is_the_unique_modules(self):
        """The CLI recognises queued owners by the head the unique copies' owners are made with."""
        from celery_lease import cli
        from celery_lease._core import owners

        assert cli.is_queued_owner(owners.queued_owner("t", "i", 1))
        assert not cli.is_queued_owner(make_owner(task="t", task_id="i"))

    def test_an_unreachable_backend_leaves_the_state_held(self, store: LockStore, store_url: str):
        """A result backend that does not answer makes the state "held", not an error."""
        obj = celery_obj(
            lease_store=store_url,
            result_backend=f"redis://127.0.0.1:{free_port()}/0",
            redis_backend_health_check_interval=None,
            result_backend_always_retry=False,
        )
        store.acquire("k:x", make_owner(task="t.x", task_id="i-1"), TTL_MS)
        result = run("list", "--json", obj=obj)
        assert result.exit_code == 0, result.output
        assert [r["state"] for r in json.loads(result.stdout)] == ["held"]


class TestShow:
    def test_held_lease_is_described_with_its_holder(self, store: LockStore, store_url: str):
        """``show`` prints the holder (task, id, node, host, pid), token, and one line per field."""
        owner = make_owner(node="w1@h", task="t.build", task_id="tid-9")
        token = store.acquire("account:42", owner, TTL_MS)
        result = run("show", "account:42", "--store", store_url)
        assert result.exit_code == 0, result.output
        first, *fields = result.stdout.splitlines()
        assert first.startswith(
            f"account:42: held by task t.build[tid-9] on w1@h (host {socket.gethostname()}, "
            f"pid {os.getpid()}), token {token}, expires in "
        )
        assert ", held for " in first
        lines = dict(re.split(r":\s+", line.strip(), maxsplit=1) for line in fields)
        assert lines["node"] == "w1@h"
        assert lines["task"] == "t.build"
        assert lines["task id"] == "tid-9"
        assert lines["label"] == "-"
        assert lines["state"] == "held"
        assert lines["owner"] == owner
        assert lines["taken at"].endswith("Z")

    def test_old_owner_is_shown_as_it_is(self, store: LockStore, store_url: str):
        """An owner with no holder fields is shown by host and pid, and in full."""
        token = store.acquire("account:42", "host/9/xyz", TTL_MS)
        result = run("show", "account:42", "--store", store_url)
        assert result.exit_code == 0, result.output
        assert "held by (host host, pid 9)" in result.stdout
        assert f"token {token}" in result.stdout
        assert "owner:    host/9/xyz" in result.stdout

    def test_json_of_a_held_and_of_a_free_key(self, store: LockStore, store_url: str):
        """``show --json``: the object ``list --json`` gives plus ``held`` and the key's live
        ``slots`` (none here), or the free key."""
        owner = make_owner(task="t.x", task_id="i")
        token = store.acquire("k", owner, TTL_MS)
        shown = json.loads(run("show", "k", "--json", "--store", store_url).stdout)
        listed = json.loads(run("list", "--json", "--store", store_url).stdout)
        assert shown["held"] is True
        assert (shown["owner"], shown["token"], shown["task"]) == (owner, token, "t.x")
        assert set(shown) == {"held", "slots", *listed[0]}
        assert shown["slots"] == []
        store.release("k", owner)
        free = json.loads(run("show", "k", "--json", "--store", store_url).stdout)
        assert free == {"key": "k", "held": False, "last_token": token, "slots": []}

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
        assert "Force-release k: held by owner-1, token" in result.stdout
        assert store.acquire("k", "other", TTL_MS) is None

    def test_confirmed_release_frees_the_key_and_says_what_it_removed(
        self, store: LockStore, store_url: str
    ):
        """Answering yes removes the lease and prints its owner and token."""
        token = store.acquire("k", "owner-1", TTL_MS)
        result = run("release", "k", "--store", store_url, input="y\n")
        assert result.exit_code == 0, result.output
        assert f"released k: owner owner-1, token {token}" in result.stdout
        assert "reason 'released'" in result.stdout
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
        assert "held by o, token" in capsys.readouterr().out

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
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},  # this tree
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [
            {
                "key": "held-by-task",
                "slot": None,
                "owner": "worker/1/abc",
                "replaced": False,
                "token": token,
                "expires_in": pytest.approx(60, abs=30),
                "node": None,
                "host": "worker",
                "pid": 1,
                "task": None,
                "task_id": None,
                "label": None,
                "taken_at": None,
                "held_seconds": None,
                "ttl": None,
                "cooldown": None,
                "renewed_seconds_ago": None,
                "state": "held",
                "stale": False,
            }
        ]


def _sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    store_from_url(url).release("init", "nobody")  # creates the file
    return url


class TestClosedPipe:
    @pytest.mark.parametrize("command", [["show", "k"], ["list"], ["show", "free-key"]])
    def test_a_closed_pipe_ends_quietly_with_the_sigpipe_status(
        self, tmp_path: Path, command: list[str]
    ):
        """``celery-lease show KEY | head -1``: a reader that went away ends the command with no
        message and status 141 (128 + SIGPIPE, what the shell reports for ``git log | head``),
        not 2, which says the store could not be reached."""
        url = _sqlite_url(tmp_path)
        store_from_url(url).acquire("k", make_owner(label="script"), TTL_MS)
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before anything is written: every write fails
        try:
            process = subprocess.run(
                [sys.executable, "-c", "from celery_lease.cli import main; main()",
                 "--store", url, *command],
                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
            )  # fmt: skip
        finally:
            os.close(write_end)
        assert "Broken pipe" not in process.stderr
        assert "Error" not in process.stderr
        assert process.returncode == 128 + 13

    def test_under_celery_a_closed_pipe_ends_quietly_too(self, tmp_path: Path):
        """``celery -A proj lease list | head -1``: the same quiet end under Celery's program."""
        url = _sqlite_url(tmp_path)
        store_from_url(url).acquire("k", make_owner(label="script"), TTL_MS)
        (tmp_path / "pipe_app.py").write_text(
            "from celery import Celery\n"
            "app = Celery('pipe_app', broker='memory://')\n"
            f"app.conf.lease_store = {url!r}\n"
        )
        read_end, write_end = os.pipe()
        os.close(read_end)
        root = str(Path(__file__).resolve().parents[2])
        try:
            process = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "pipe_app", "lease", "list"],
                cwd=tmp_path, env={**os.environ, "PYTHONPATH": root}, stdout=write_end,
                stderr=subprocess.PIPE, text=True, timeout=60,
            )  # fmt: skip
        finally:
            os.close(write_end)
        assert "Broken pipe" not in process.stderr and "Error" not in process.stderr
        assert process.returncode == 128 + 13


class TestNodeColumn:
    def test_a_lease_taken_outside_celery_has_the_same_node_in_list_and_show(self, tmp_path: Path):
        """A lease with no Celery node (taken by ``lease()`` in a script) shows one NODE in
        ``list`` and ``show``: its host."""
        url = _sqlite_url(tmp_path)
        # What a lease() in a script records: no node (make_owner would add the node an
        # earlier test set for this process).
        owner = f"{socket.gethostname()}/{os.getpid()}/00000000000000ab;l=script;at=1"
        store_from_url(url).acquire("script:1", owner, TTL_MS)
        listed = table(run("list", "--store", url))
        node_in_list = listed[1][listed[0].index("NODE")]
        shown = run("show", "script:1", "--store", url).stdout.splitlines()[1:]
        fields = dict(re.split(r":\s+", line.strip(), maxsplit=1) for line in shown)
        assert node_in_list == fields["node"] == socket.gethostname()


class TestLastRenewed:
    """When each lease was last renewed: its ttl minus the time left, both the store's (the ttl
    is recorded in the owner id when it is taken); past a third of the ttl it is stale."""

    def test_a_lease_being_renewed_says_when_and_is_not_stale(
        self, store: LockStore, store_url: str
    ):
        with lease("k", store=store, ttl="60s"):
            (record,) = json.loads(run("list", "--json", "--store", store_url).stdout)
            rows = table(run("list", "--store", store_url))
            shown = run("show", "k", "--store", store_url).stdout
        assert 0 <= record["renewed_seconds_ago"] < 20
        assert record["ttl"] == 60
        assert record["stale"] is False
        cells = dict(zip(rows[0], rows[1], strict=True))
        assert cells["STATE"] == "held"
        assert cells["RENEWED"].endswith(" ago")
        assert shown.startswith("k: held by ")
        assert re.search(r"^  renewed:  \d+\.\ds ago \(ttl 1m00s\)$", shown, re.M), shown

    def test_a_lease_not_renewed_for_over_a_third_of_its_ttl_is_stale(
        self, store: LockStore, store_url: str
    ):
        """Its holder stopped renewing (a dead worker): ``list`` and ``show`` say ``stale``
        instead of plainly "held"."""
        with lease("k", store=store, ttl="60s") as held:
            # As if the last renewal had set its expiry 30 s ago: 30 s are left of its 60 s
            # (past the 20 s due renewal and its 6 s margin).
            assert store.renew("k", held.owner, 30_000)
            (record,) = json.loads(run("list", "--json", "--store", store_url).stdout)
            rows = table(run("list", "--store", store_url))
            shown = run("show", "k", "--store", store_url).stdout
        assert record["renewed_seconds_ago"] == pytest.approx(30, abs=3)
        assert record["stale"] is True
        cells = dict(zip(rows[0], rows[1], strict=True))
        assert cells["STATE"] == "held, stale"
        assert shown.startswith("k: held (stale: not renewed for 3"), shown
        assert "more than a third of its 1m00s ttl" in shown.splitlines()[0]

    def test_an_owner_without_a_ttl_tells_nothing(self, store: LockStore, store_url: str):
        """An owner id that records no ttl (another program's, an older version's): no time,
        never stale."""
        store.acquire("k", "host/9/xyz", TTL_MS)
        (record,) = json.loads(run("list", "--json", "--store", store_url).stdout)
        assert (record["renewed_seconds_ago"], record["stale"]) == (None, False)
        rows = table(run("list", "--store", store_url))
        assert dict(zip(rows[0], rows[1], strict=True))["RENEWED"] == "-"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """An empty SQLite store file (the CLI's view of a lease does not depend on the store)."""
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    store_from_url(url).release("init", "nobody")  # creates the file
    return url


def listed(url: str) -> dict[str, Any]:
    (record,) = json.loads(run("list", "--json", "--store", url).stdout)
    return dict(record)


class TestStaleMargin:
    """Stale means not renewed for more than a third of the ttl plus a margin (the larger of
    1 s and a tenth of the ttl): a renewal due at ttl/3 that is a little late is not stale."""

    def test_a_renewal_a_little_late_is_not_stale(self, sqlite_url: str) -> None:
        store = store_from_url(sqlite_url)
        # 21 s since the last renewal of a 60 s lease: due at 20 s, within the 6 s margin.
        store.acquire("k", make_owner(ttl_ms=60_000), 39_000)
        record = listed(sqlite_url)
        assert record["renewed_seconds_ago"] == pytest.approx(21, abs=1)
        assert record["stale"] is False

    def test_past_the_margin_it_is_stale(self, sqlite_url: str) -> None:
        store = store_from_url(sqlite_url)
        store.acquire("k", make_owner(ttl_ms=60_000), 32_000)  # 28 s: past 20 s + 6 s
        assert listed(sqlite_url)["stale"] is True

    def test_a_short_ttl_gets_at_least_a_second(self, sqlite_url: str) -> None:
        assert stale_margin(3.0) == 1.0  # a tenth of the ttl would be 0.3 s
        store = store_from_url(sqlite_url)
        # ttl 3 s, renewed 1.5 s ago: due at 1 s, 0.5 s late; stale past 1 s + the 1 s floor.
        store.acquire("k", make_owner(ttl_ms=3_000), 1_500)
        record = listed(sqlite_url)
        # The listing reads the real clock: on a loaded machine it may come later than 1.5 s,
        # so the verdict is checked against the age it reports (over 1.3 s without the floor).
        assert record["stale"] is (record["renewed_seconds_ago"] > 2.0)


class TestALeaseInItsCooldown:
    """A lease kept for its cooldown (recorded as ``cd=`` in the owner) is not renewed on
    purpose: with the time left within the cooldown it is shown in cooldown, not stale, even
    without a result backend to ask."""

    def test_it_is_shown_in_cooldown_not_stale(self, sqlite_url: str) -> None:
        store = store_from_url(sqlite_url)
        with lease("cool", store=store, ttl=30, cooldown=20, holder="nightly"):
            pass
        record = listed(sqlite_url)
        assert (record["state"], record["stale"]) == ("cooldown", False)
        rows = table(run("list", "--store", sqlite_url))
        assert dict(zip(rows[0], rows[1], strict=True))["STATE"] == "cooldown"

    def test_renewed_is_never_before_it_was_taken(self, sqlite_url: str) -> None:
        store = store_from_url(sqlite_url)
        with lease("cool", store=store, ttl=30, cooldown=20):
            pass
        record = listed(sqlite_url)
        assert record["renewed_seconds_ago"] <= record["held_seconds"]


class _BrokenPipeStore(SQLiteLockStore):
    """A store whose connection broke (its socket's peer went away): reads raise
    ``BrokenPipeError`` while stdout is fine."""

    def get(self, key: str) -> Any:
        raise BrokenPipeError(32, "Broken pipe (the store's socket)")

    def list(self, prefix: str = "") -> Any:
        raise BrokenPipeError(32, "Broken pipe (the store's socket)")


class TestABrokenPipeThatIsNotStdouts:
    """A ``BrokenPipeError`` from elsewhere than stdout (a store's socket, the demo's children)
    is an error to report, not a reader that went away: only a stdout that really is closed ends
    the command quietly with 141."""

    @pytest.mark.parametrize("command", [["show", "k"], ["list"]])
    def test_a_store_socket_that_broke_is_a_store_failure(
        self, command: list[str], tmp_path: Path
    ) -> None:
        """In-process (stdout without a descriptor, as under ``CliRunner``): status 2, with
        the error, not the quiet 141."""
        app = Celery("broken-pipe", broker="memory://", set_as_current=False)
        app.conf.lease_store = _BrokenPipeStore(str(tmp_path / "leases.db"))
        result = run(*command, obj=types.SimpleNamespace(app=app))
        assert result.exit_code == 2, (result.exit_code, result.output)
        assert "Broken pipe (the store's socket)" in result.output

    def test_outside_a_store_call_it_is_raised_while_stdout_is_open(self) -> None:
        """A command whose own work breaks a pipe (the demo's) with stdout a live pipe: the
        error is reported (status 2, its message), not hidden behind 141."""
        script = textwrap.dedent(
            """
            import sys, types
            demo = types.ModuleType("example_project.demo")
            def main(args):
                raise BrokenPipeError(32, "Broken pipe (a child of the demo)")
            demo.main = main
            sys.modules["example_project.demo"] = demo
            from celery_lease.cli import main as cli_main
            cli_main(["demo"])
            """
        )
        process = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert process.returncode == 2, (process.returncode, process.stderr)
        assert "Broken pipe (a child of the demo)" in process.stderr
