"""The CLI under an app: the app's key prefix, ``--store`` before the command, and what ``list``
shows after unique and debounce.

Real Celery apps (in-memory broker) on a real SQLite store file; the leases are taken by the task
layer itself where it matters (an eager task's body, a debounced ``delay()``), so the CLI is
checked against the keys celery-lease really writes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_lease import LockedTask, lease, store_from_url
from celery_lease._core.owners import make_owner, parse_owner, queued_owner
from celery_lease.cli import lease_group, main
from celery_lease.stores.base import SupportsInspection

TTL_MS = 60_000
PREFIX = "shop:"


def run(*args: str, obj: Any = None, env: dict[str, str] | None = None) -> Result:
    """Invoke the CLI in-process, keeping stdout and stderr apart."""
    return CliRunner().invoke(lease_group, list(args), obj=obj, env=env)


def rows(result: Result) -> list[list[str]]:
    """The rows of a table printed by ``list`` (header first), split on 2+ spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines()]


def sqlite_url(path: Path) -> str:
    url = f"sqlite:///{path}"
    store_from_url(url).release("init", "nobody")  # creates the file
    return url


@pytest.fixture
def url(tmp_path: Path) -> str:
    """An SQLite store file, shared by the app, the CLI and the test."""
    return sqlite_url(tmp_path / "leases.db")


@pytest.fixture
def store(url: str) -> SupportsInspection:
    """Another client of the store at ``url``, as the holding process has."""
    client = store_from_url(url)
    assert isinstance(client, SupportsInspection)
    return client


@pytest.fixture
def app(url: str) -> Iterator[Celery]:
    """An app with ``lease_key_prefix = "shop:"`` on the SQLite store (memory broker)."""
    app = Celery("cli-app", broker="memory://", set_as_current=False)
    app.conf.update(
        lease_store=url, lease_key_prefix=PREFIX, broker_connection_retry_on_startup=False
    )
    yield app
    app.close()


def obj(app: Celery) -> types.SimpleNamespace:
    """What ``celery -A app`` puts in ``ctx.obj``: an object with the app at ``.app``."""
    return types.SimpleNamespace(app=app)


class TestKeyPrefix:
    def test_show_finds_the_key_a_task_holds_under_the_apps_prefix(self, app: Celery) -> None:
        """``show account:1`` while a task with ``lock_key="account:{n}"`` runs under
        ``lease_key_prefix="shop:"``: held, with the task's token, and the key looked up named."""
        app.conf.task_always_eager = True
        seen: dict[str, Any] = {}

        @app.task(name="t.account", base=LockedTask, lock_key="account:{n}", lock_ttl="60s")
        def account(n: int) -> None:
            seen["key"] = account.request.lock_key
            seen["token"] = account.request.lock_token
            seen["text"] = run("show", "account:1", obj=obj(app))
            seen["json"] = run("show", "account:1", "--json", obj=obj(app))

        account.delay(1).get()
        assert seen["key"] == "shop:account:1"
        text: Result = seen["text"]
        assert text.exit_code == 0, text.output
        assert text.stdout.startswith("shop:account:1: held by task t.account[")
        assert f"token {seen['token']}" in text.stdout
        assert "'account:1' with the app's lease_key_prefix 'shop:'" in text.stderr
        shown = json.loads(seen["json"].stdout)
        assert (shown["held"], shown["key"], shown["token"]) == (
            True,
            "shop:account:1",
            seen["token"],
        )

    def test_show_of_a_free_key_names_the_prefixed_key(self, app: Celery) -> None:
        """A free key is reported by the key looked up, so "free" says which key is free."""
        result = run("show", "account:2", obj=obj(app))
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "shop:account:2: free (no token issued yet)"
        free = json.loads(run("show", "account:2", "--json", obj=obj(app)).stdout)
        assert free == {"key": "shop:account:2", "held": False, "last_token": None, "slots": []}

    def test_a_key_that_starts_with_the_prefix_is_still_prefixed(
        self, app: Celery, store: SupportsInspection
    ) -> None:
        """A task's own key may start with the prefix text (``lock_key="shop:x"`` is stored as
        ``shop:shop:x``): ``release shop:x --yes`` releases that, never another holder's
        ``shop:x``; stderr says how to name ``shop:x`` itself (``--raw``)."""
        other = store.acquire("shop:x", "another-service", TTL_MS)
        assert other is not None
        ours = store.acquire("shop:shop:x", make_owner(task="t", task_id="i"), TTL_MS)
        assert ours is not None
        result = run("release", "shop:x", "--yes", obj=obj(app))
        assert result.exit_code == 0, result.output
        assert store.get("shop:shop:x") is None
        kept = store.get("shop:x")
        assert kept is not None and kept.owner == "another-service"
        assert "'shop:shop:x'" in result.stderr
        assert "pass --raw" in result.stderr

    def test_raw_looks_a_key_up_without_the_prefix(
        self, app: Celery, store: SupportsInspection, url: str
    ) -> None:
        """A ``lease()`` taken outside Celery has no prefix: ``--raw`` finds it; without it the
        prefixed key is looked up (and reported free by that name)."""
        with lease("cache:rebuild", store=store_from_url(url), ttl="60s") as held:
            raw = run("show", "--raw", "cache:rebuild", obj=obj(app))
            assert raw.exit_code == 0, raw.output
            assert raw.stdout.startswith("cache:rebuild: held by")
            assert f"token {held.token}" in raw.stdout
            assert "--raw" in raw.stderr
            prefixed = run("show", "cache:rebuild", obj=obj(app))
            first = prefixed.stdout.splitlines()[0]
            assert first == "shop:cache:rebuild: free (no token issued yet)"

    def test_show_says_the_unprefixed_key_is_held_when_the_prefixed_one_is_free(
        self, app: Celery, store: SupportsInspection, url: str
    ) -> None:
        """``show cache:prices`` under a prefix: ``shop:cache:prices`` is free, but a ``lease()``
        taken without the app's prefix holds ``cache:prices``: the answer says so (text and
        JSON), since a task with ``lock_key="cache:prices"`` would not be excluded by it."""
        with lease("cache:prices", store=store_from_url(url), ttl="60s", holder="endpoint"):
            result = run("show", "cache:prices", obj=obj(app))
            shown = json.loads(run("show", "cache:prices", "--json", obj=obj(app)).stdout)
        assert result.exit_code == 0, result.output
        first, *notes = result.stdout.splitlines()
        assert first.startswith("shop:cache:prices: free")
        (note,) = notes
        assert "'cache:prices'" in note and "without the app's lease_key_prefix" in note
        assert "held by 'endpoint'" in note
        assert shown["held"] is False
        assert shown["other_key"]["key"] == "cache:prices"
        assert shown["other_key"]["label"] == "endpoint"

    def test_show_says_when_both_the_prefixed_and_the_unprefixed_key_are_held(
        self, app: Celery, store: SupportsInspection
    ) -> None:
        """Both forms held: two holders each believe they hold "cache:prices"; show says it."""
        assert store.acquire("cache:prices", make_owner(label="endpoint"), TTL_MS) is not None
        assert store.acquire("shop:cache:prices", make_owner(task="t", task_id="i"), TTL_MS)
        result = run("show", "cache:prices", obj=obj(app))
        assert result.stdout.startswith("shop:cache:prices: held by task t[i]")
        assert "'cache:prices' (without the app's lease_key_prefix 'shop:') is held too" in (
            result.stdout
        )

    def test_raw_says_the_prefixed_key_is_held_when_the_raw_one_is_free(
        self, app: Celery, store: SupportsInspection
    ) -> None:
        """``show --raw cache:prices`` is free while the app's task holds
        ``shop:cache:prices``: the answer names the held prefixed key."""
        assert store.acquire("shop:cache:prices", make_owner(task="t", task_id="i"), TTL_MS)
        result = run("show", "--raw", "cache:prices", obj=obj(app))
        first, note = result.stdout.splitlines()
        assert first.startswith("cache:prices: free")
        assert "'shop:cache:prices' (with the app's lease_key_prefix 'shop:'" in note
        assert "held by task t[i]" in note

    def test_release_frees_the_prefixed_key(self, app: Celery, store: SupportsInspection) -> None:
        """``release account:1 --yes`` under the app releases ``shop:account:1``."""
        token = store.acquire("shop:account:1", "owner-1", TTL_MS)
        result = run("release", "account:1", "--yes", obj=obj(app))
        assert result.exit_code == 0, result.output
        assert f"released shop:account:1: owner owner-1, token {token}" in result.stdout
        assert store.get("shop:account:1") is None

    def test_release_prompt_names_the_prefixed_key(
        self, app: Celery, store: SupportsInspection
    ) -> None:
        """The confirmation names the store key; declining keeps it."""
        store.acquire("shop:account:1", "owner-1", TTL_MS)
        result = CliRunner().invoke(
            lease_group, ["release", "account:1"], obj=obj(app), input="n\n"
        )
        assert result.exit_code == 1
        assert "Force-release shop:account:1: held by owner-1" in result.stdout
        assert store.get("shop:account:1") is not None

    def test_standalone_applies_no_prefix_and_says_so(
        self, store: SupportsInspection, url: str
    ) -> None:
        """``celery-lease`` has no app: the key is looked up as given, and stderr says why."""
        store.acquire("shop:account:1", "o", TTL_MS)
        result = run("show", "account:1", "--store", url)
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "account:1: free (no token issued yet)"
        assert "no app" in result.stderr and "lease_key_prefix" in result.stderr
        assert run("show", "shop:account:1", "--store", url).stdout.startswith(
            "shop:account:1: held by o"
        )


class TestStoreOption:
    def test_store_before_the_command(self, store: SupportsInspection, url: str) -> None:
        """``celery-lease --store URL show KEY`` works like ``show KEY --store URL``."""
        store.acquire("k", "o", TTL_MS)
        result = run("--store", url, "show", "k")
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("k: held by o")
        listed = run("--store", url, "list", "--json")
        assert [r["key"] for r in json.loads(listed.stdout)] == ["k"]
        released = run("--store", url, "release", "k", "--yes")
        assert released.exit_code == 0, released.output
        assert store.get("k") is None

    def test_console_script_takes_store_before_the_command(
        self, store: SupportsInspection, url: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The ``celery-lease`` entry point (``main``) accepts it too."""
        store.acquire("via-main", "o", TTL_MS)
        with pytest.raises(SystemExit) as exited:
            main(["--store", url, "show", "via-main"])
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith("via-main: held by o")

    def test_the_same_url_in_both_places_is_fine(self, store: SupportsInspection, url: str) -> None:
        """One URL given before and after the command is no conflict."""
        store.acquire("k", "o", TTL_MS)
        result = run("--store", url, "show", "k", "--store", url)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("k: held by o")

    def test_conflicting_urls_are_an_error_naming_both(self, url: str) -> None:
        """Two different URLs: exit 2, one line naming both (passwords masked)."""
        other = "redis://:hunter2@127.0.0.1:1/0"
        result = run("--store", url, "show", "k", "--store", other)
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert url in line and "redis://:***@127.0.0.1:1/0" in line
        assert "hunter2" not in line

    def test_command_line_beats_the_environment_in_either_place(
        self, store: SupportsInspection, url: str, tmp_path: Path
    ) -> None:
        """``CELERY_LEASE_STORE`` is the default; ``--store`` before or after the command wins
        over it without a conflict."""
        store.acquire("k", "o", TTL_MS)
        env = {"CELERY_LEASE_STORE": sqlite_url(tmp_path / "other.db")}
        for args in (["--store", url, "show", "k"], ["show", "k", "--store", url]):
            result = run(*args, env=env)
            assert result.exit_code == 0, result.output
            assert result.stdout.startswith("k: held by o"), args
        assert run("show", "k", env=env).stdout.strip() == "k: free (no token issued yet)"

    def test_store_before_the_command_under_celery(
        self, store: SupportsInspection, url: str, tmp_path: Path
    ) -> None:
        """``celery -A app lease --store URL show account:1``, a real ``celery`` process: the
        group option is taken, the store given wins over the app's, and the app's key prefix is
        applied."""
        token = store.acquire("shop:account:1", "worker/1/abc", TTL_MS)
        (tmp_path / "lease_cli_app.py").write_text(
            textwrap.dedent(
                """
                from celery import Celery

                app = Celery("lease_cli_app", broker="memory://")
                app.conf.lease_store = "memory://"
                app.conf.lease_key_prefix = "shop:"
                """
            )
        )
        command = [sys.executable, "-m", "celery", "-A", "lease_cli_app", "lease"]
        result = subprocess.run(
            [*command, "--store", url, "show", "account:1"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("shop:account:1: held by (host worker, pid 1)")
        assert f"token {token}" in result.stdout
        assert "lease_key_prefix 'shop:'" in result.stderr


@pytest.fixture
def debounced(app: Celery) -> tuple[str, str]:
    """Two calls of a debounced unique task (``k:{n}``): the first is superseded by the second.
    Returns (first id, second id); the store holds ``shop:queued:k:1`` (second's) and the
    tombstone ``shop:superseded:<first id>``."""

    @app.task(
        name="t.digest",
        base=LockedTask,
        lock_key="k:{n}",
        lock_unique="while_queued",
        lock_debounce=60,
        shared=False,
    )
    def digest(n: int) -> None: ...

    first = digest.delay(1)
    second = digest.delay(1)
    assert first.id != second.id
    return first.id, second.id


class TestListAfterUnique:
    def test_debounce_tombstones_are_hidden_by_default(
        self, app: Celery, store: SupportsInspection, debounced: tuple[str, str]
    ) -> None:
        """``list`` shows the waiting copy, not the superseded copy's tombstone; stderr says
        how many were left out and how to see them."""
        first, _ = debounced
        assert store.get(f"shop:superseded:{first}") is not None
        result = run("list", "--json", obj=obj(app))
        assert result.exit_code == 0, result.output
        assert [(r["key"], r["state"]) for r in json.loads(result.stdout)] == [
            ("shop:queued:k:1", "queued")
        ]
        assert "1 debounce tombstone" in result.stderr and "--superseded" in result.stderr
        table = run("list", obj=obj(app))
        assert [row[0] for row in rows(table)[1:]] == ["shop:queued:k:1"]

    def test_superseded_flag_lists_tombstones_as_superseded(
        self, app: Celery, debounced: tuple[str, str]
    ) -> None:
        """``--superseded`` adds them with state "superseded", the superseding copy as task id."""
        first, second = debounced
        listed = json.loads(run("list", "--json", "--superseded", obj=obj(app)).stdout)
        states = {r["key"]: (r["state"], r["task_id"], r["node"]) for r in listed}
        assert states == {
            "shop:queued:k:1": ("queued", second, None),
            f"shop:superseded:{first}": ("superseded", second, None),
        }
        only = json.loads(run("list", "--json", "--state", "superseded", obj=obj(app)).stdout)
        assert [r["key"] for r in only] == [f"shop:superseded:{first}"]
        shown = run("show", f"superseded:{first}", obj=obj(app))
        assert shown.stdout.startswith(f"shop:superseded:{first}: held (superseded) by task")

    def test_queued_rows_show_no_node(
        self, app: Celery, store: SupportsInspection, debounced: tuple[str, str]
    ) -> None:
        """A queued lease's owner carries a nonce in ``n=``, not a node: NODE is "-", ``node``
        is null, and ``--node <nonce>`` matches nothing."""
        info = store.get("shop:queued:k:1")
        assert info is not None
        nonce = parse_owner(info.owner).node
        assert nonce is not None  # what the owner carries in n= (a nonce, see queued_owner)
        (row,) = [r for r in rows(run("list", obj=obj(app))) if r[0] == "shop:queued:k:1"]
        assert (row[1], row[2], row[3]) == ("queued", "-", "-")
        listed = json.loads(run("list", "--json", obj=obj(app)).stdout)
        assert {r["key"]: r["node"] for r in listed}["shop:queued:k:1"] is None
        assert json.loads(run("list", "--json", "--node", nonce, obj=obj(app)).stdout) == []
        shown = run("show", "queued:k:1", obj=obj(app))
        assert "  node:     -" in shown.stdout.splitlines()
        assert " on " not in shown.stdout.splitlines()[0]

    def test_a_started_copys_claim_is_listed_as_started(
        self, app: Celery, store: SupportsInspection, debounced: tuple[str, str]
    ) -> None:
        """A debounced copy that reached a worker holds its own tombstone key, a started claim
        (owner labelled ``l=started``, naming that very copy): hidden and counted with the
        tombstones, and listed with state "started" (not "superseded": nothing superseded
        it)."""
        _, second = debounced
        claim = queued_owner("t.digest", second, 1, "started")
        assert store.acquire(f"shop:superseded:{second}", claim, TTL_MS) is not None
        result = run("list", "--json", obj=obj(app))
        assert "2 debounce tombstones" in result.stderr
        listed = json.loads(run("list", "--json", "--superseded", obj=obj(app)).stdout)
        states = {r["key"]: (r["state"], r["task_id"]) for r in listed}
        assert states[f"shop:superseded:{second}"] == ("started", second)

    def test_standalone_lists_unprefixed_tombstones_as_superseded(
        self, store: SupportsInspection, url: str
    ) -> None:
        """Without an app (no prefix), ``superseded:<id>`` keys with a queued owner are
        tombstones too."""
        store.acquire("superseded:old-id", queued_owner("t.d", "new-id", 1), TTL_MS)
        store.acquire("queued:k:1", queued_owner("t.d", "new-id", 1), TTL_MS)
        assert [r["key"] for r in json.loads(run("list", "--json", "--store", url).stdout)] == [
            "queued:k:1"
        ]
        listed = json.loads(run("list", "--json", "--superseded", "--store", url).stdout)
        assert [(r["key"], r["state"]) for r in listed] == [
            ("queued:k:1", "queued"),
            ("superseded:old-id", "superseded"),
        ]
