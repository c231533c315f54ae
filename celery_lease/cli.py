"""The ``celery-lease`` command line, also installed as ``celery lease``.

One click group serves both: the console script ``celery-lease`` (:func:`main`) and Celery's
``celery.commands`` entry point (:data:`lease_group`), where ``celery -A proj lease ...`` takes the
store from the app's configuration. ``--store URL`` on any command overrides that. ::

    celery-lease list --store redis://localhost:6379/0 --prefix report:
    celery -A proj lease show account:42
    celery -A proj lease release account:42 --yes

Every failure to reach or build the store is one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click

from celery_lease.errors import LeaseError
from celery_lease.stores.base import LeaseInfo, LockStore, SupportsInspection, store_from_url
from celery_lease.stores.memory import MemoryLockStore

__all__ = ["lease_group", "main"]

F = TypeVar("F", bound=Callable[..., Any])

_INSPECTION = ("list", "get", "last_token", "force_release")


class CliError(click.ClickException):
    """A failure reported as one line on stderr with exit status 2 (no traceback)."""

    exit_code = 2


def _open_url(url: str) -> LockStore:
    """Build the store for ``--store URL``, refusing what cannot be inspected from outside."""
    if urlsplit(url).scheme.lower() == "memory":
        raise CliError(
            "memory:// holds leases inside one process only, so there is nothing to inspect "
            "from outside it; pass a shared store (sqlite:///path.db, redis://host:6379/0, ...)"
        )
    try:
        store = store_from_url(url)
    except ImportError as exc:
        raise CliError(str(exc)) from None
    path = getattr(store, "path", None)
    if (
        urlsplit(url).scheme.lower() == "sqlite"
        and isinstance(path, str)
        and not os.path.exists(path)
    ):
        raise CliError(f"SQLite store file {path!r} does not exist (from {url!r})")
    return store


def _store_for_app(app: Any) -> LockStore:
    """The store the app's tasks use, resolved as :func:`celery_lease.config.get_store` does."""
    from celery_lease.config import get_store

    store = get_store(app)
    if isinstance(store, MemoryLockStore):
        raise CliError(
            "the app's lease store is in-process memory: nothing to inspect from outside it"
        )
    return store


def _inspectable(ctx: click.Context, url: str | None) -> SupportsInspection:
    """Resolve the store for a command and check that it supports inspection."""
    if url is not None:
        store = _open_url(url)
    else:
        app = getattr(ctx.obj, "app", None)
        if app is None:
            raise CliError(
                "no store given: pass --store URL (or set CELERY_LEASE_STORE), "
                "or run it as `celery -A proj lease ...`"
            )
        store = _store_for_app(app)
    if not isinstance(store, SupportsInspection):
        missing = ", ".join(f"{m}()" for m in _INSPECTION if not callable(getattr(store, m, None)))
        raise CliError(
            f"{type(store).__name__} cannot be inspected: it lacks {missing} "
            "(see celery_lease.SupportsInspection)"
        )
    return store


def _run(fn: Callable[[], None]) -> None:
    """Run a command's body, turning store failures into one line and exit status 2."""
    try:
        fn()
    except (LeaseError, OSError) as exc:
        raise CliError(str(exc)) from None


def store_option(func: F) -> F:
    """The ``--store URL`` option shared by every inspection command."""
    return click.option(
        "--store",
        "store_url",
        metavar="URL",
        envvar="CELERY_LEASE_STORE",
        help="Store URL (sqlite:///path.db, redis://..., postgresql://...). "
        "Default: the app's store under `celery -A proj lease`.",
    )(func)


def _time_left(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _describe(info: LeaseInfo) -> str:
    return (
        f"{info.key}: held by {info.owner}, token {info.token}, "
        f"expires in {_time_left(info.expires_in)}"
    )


def _table(rows: Sequence[LeaseInfo]) -> str:
    header = ("KEY", "OWNER", "TOKEN", "TIME LEFT")
    cells = [(r.key, r.owner, str(r.token), _time_left(r.expires_in)) for r in rows]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *cells]
    )


@click.group(name="lease")
def lease_group() -> None:
    """Inspect and free the leases held in a celery-lease store."""


@lease_group.command(name="list")
@click.option("--prefix", default="", metavar="P", help="Only keys starting with P.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of a table.")
@store_option
@click.pass_context
def list_command(ctx: click.Context, prefix: str, as_json: bool, store_url: str | None) -> None:
    """List live leases: key, owner, token, time left."""

    def body() -> None:
        rows = _inspectable(ctx, store_url).list(prefix)
        if as_json:
            data = [
                {"key": r.key, "owner": r.owner, "token": r.token, "expires_in": r.expires_in}
                for r in rows
            ]
            click.echo(json.dumps(data, indent=2))
        elif not rows:
            click.echo(f"no live leases{f' with prefix {prefix!r}' if prefix else ''}")
        else:
            click.echo(_table(rows))

    _run(body)


@lease_group.command(name="show")
@click.argument("key")
@store_option
@click.pass_context
def show_command(ctx: click.Context, key: str, store_url: str | None) -> None:
    """Show the lease on KEY, or that it is free with the last token issued."""

    def body() -> None:
        store = _inspectable(ctx, store_url)
        info = store.get(key)
        if info is not None:
            click.echo(_describe(info))
            return
        last = store.last_token(key)
        issued = "no token issued yet" if last is None else f"last token issued {last}"
        click.echo(f"{key}: free ({issued})")

    _run(body)


@lease_group.command(name="release")
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@store_option
@click.pass_context
def release_command(ctx: click.Context, key: str, yes: bool, store_url: str | None) -> None:
    """Force-release the lease on KEY, whoever holds it.

    The holder is not stopped: if it still runs, its lease is reported lost at its next renewal,
    and the next acquirer gets a higher fencing token, so writes guarded by the token reject the
    old holder.
    """

    def body() -> None:
        store = _inspectable(ctx, store_url)
        info = store.get(key)
        if info is None:
            click.echo(f"{key}: free, nothing to release")
            return
        if not yes:
            click.confirm(f"Force-release {_describe(info)}?", abort=True)
        removed = store.force_release(key)
        if removed is None:
            click.echo(f"{key}: already free, nothing released")
            return
        click.echo(
            f"released {removed.key}: owner {removed.owner}, token {removed.token}; "
            "the next holder gets a higher token"
        )

    _run(body)


@lease_group.command(
    name="demo",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo_command(args: tuple[str, ...]) -> None:
    """Run the example project's demo (two workers, a paused holder, a rejected stale write).

    Options after ``demo`` go to the demo itself (for example ``--redis URL``).
    """
    try:
        demo_main = importlib.import_module("example_project.demo").main
    except (ImportError, AttributeError) as exc:
        raise CliError(
            f"the demo needs the example_project package, which is not importable here ({exc}); "
            "from a clone of celery-lease: pip install -e . && python -m example_project demo"
        ) from None
    code = demo_main(list(args))
    raise SystemExit(code if isinstance(code, int) else 0)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``celery-lease`` console script."""
    lease_group.main(args=list(argv) if argv is not None else None, prog_name="celery-lease")
