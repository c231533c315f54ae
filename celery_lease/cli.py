"""The ``celery-lease`` command line, also ``celery lease`` (the store then defaults to the
app's, whose ``lease_key_prefix`` ``show``/``release`` put before KEY). A store failure is one
line on stderr, status 2; a closed stdout (``| head -1``) ends quietly with status 141 (SIGPIPE).
See docs/operations.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn, cast
from urllib.parse import urlsplit

import click
from click.core import ParameterSource

from celery_lease._celery import compat, control
from celery_lease._core.owners import Holder, is_queued_owner, parse_owner
from celery_lease._core.unique_options import SUPERSEDED_NAMESPACE
from celery_lease.errors import LeaseError
from celery_lease.stores import store_from_url
from celery_lease.stores.base import LeaseInfo, LockStore, SupportsInspection, conforms, redact_url
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.slots import SLOT_MARK, slot_key, split_slot, unmarked

__all__ = ["lease_group", "main"]

logger = logging.getLogger("celery_lease.cli")


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
    """The store the app's tasks use (:func:`celery_lease._celery.settings.get_store`)."""
    from celery_lease._celery.settings import get_store

    store = get_store(app)
    if isinstance(store, MemoryLockStore):
        raise CliError(
            "the app's lease store is in-process memory: nothing to inspect from outside it"
        )
    return store


def _group_context(ctx: click.Context) -> click.Context | None:
    """The context of :data:`lease_group` above ``ctx`` (its parent under ``celery lease`` too)."""
    here: click.Context | None = ctx
    while here is not None and here.command is not lease_group:
        here = here.parent
    return here


def _store_url(ctx: click.Context, url: str | None) -> str | None:
    """The ``--store`` URL (after or before the command, else ``CELERY_LEASE_STORE``)."""
    group = _group_context(ctx)
    before = None if group is None else group.params.get("store_url")
    if before is None:
        return url
    typed_before = group is not None and group.get_parameter_source("store_url") is (
        ParameterSource.COMMANDLINE
    )
    typed_after = url is not None and ctx.get_parameter_source("store_url") is (
        ParameterSource.COMMANDLINE
    )
    if typed_before and typed_after and url != before:
        raise CliError(
            f"--store given twice: {redact_url(before)!r} before the command and "
            f"{redact_url(str(url))!r} after it; give one"
        )
    if typed_after or (url is not None and not typed_before):
        return url
    return str(before)


def _inspectable(ctx: click.Context, url: str | None) -> SupportsInspection:
    """The store of a command (:func:`_store_url`, else the app's), checked to be inspectable."""
    url = _store_url(ctx, url)
    if url is not None:
        store = _open_url(url)
    else:
        app = _app(ctx)
        if app is None:
            raise CliError(
                "no store given: pass --store URL (or set CELERY_LEASE_STORE), "
                "or run it as `celery -A proj lease ...`"
            )
        store = _store_for_app(app)
    if not conforms(store, SupportsInspection):
        missing = ", ".join(f"{m}()" for m in _INSPECTION if not callable(getattr(store, m, None)))
        raise CliError(
            f"{type(store).__name__} cannot be inspected: it lacks {missing} "
            "(see celery_lease.SupportsInspection)"
        )
    return cast(SupportsInspection, store)


CLOSED_PIPE_STATUS = 128 + getattr(signal, "SIGPIPE", 13)
"""Exit status when stdout's reader went away, as a shell reports SIGPIPE (141 on Linux)."""


def _end_on_closed_pipe() -> NoReturn:
    """End quietly with :data:`CLOSED_PIPE_STATUS`, stdout on ``os.devnull`` for the exit flush."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a descriptor (an in-process runner)
        pass
    logger.debug("celery-lease: stdout's reader went away; ending with %d", CLOSED_PIPE_STATUS)
    raise SystemExit(CLOSED_PIPE_STATUS)


def _stdout_closed() -> bool:
    """Whether stdout's reader went away (its pipe polls as an error; no ``poll``: closed)."""
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poll = getattr(select, "poll", None)
    if poll is None:
        return True
    try:
        poller = poll()
        poller.register(fileno, select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError):  # a descriptor closed under us: nothing to write to
        return True


class _LeaseGroup(click.Group):
    """The ``lease`` group: a closed stdout ends a command quietly, and an unreachable store is
    one line, not also the stores' WARNING through logging's last-resort handler."""

    def invoke(self, ctx: click.Context) -> Any:
        stores = logging.getLogger("celery_lease.stores")
        if not any(isinstance(h, logging.NullHandler) for h in stores.handlers):
            stores.addHandler(logging.NullHandler())
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            if not _stdout_closed():  # click would end it with status 1 and no word
                raise CliError(f"{exc} ({type(exc).__name__})") from exc
            _end_on_closed_pipe()


def _run(fn: Callable[[], None]) -> None:
    """Run a command's body, a store failure becoming :class:`CliError` (status 2)."""
    try:
        fn()
    except (LeaseError, OSError) as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            raise
        raise CliError(str(exc)) from None


store_option = click.option(
    "--store",
    "store_url",
    metavar="URL",
    envvar="CELERY_LEASE_STORE",
    help="Store URL (sqlite:///path.db, redis://..., postgresql://...), before the command or"
    " after it. Default: the app's store under `celery -A proj lease`.",
)


def _app(ctx: click.Context) -> Any:
    """The app of ``celery -A proj lease`` (``None`` for ``celery-lease``)."""
    return getattr(ctx.obj, "app", None)


def _key_prefix(app: Any) -> str:
    """The app's ``lease_key_prefix`` (``""`` without an app)."""
    if app is None:
        return ""
    from celery_lease._celery.settings import get_settings

    return get_settings(app).key_prefix


def _store_key(ctx: click.Context, key: str, raw: bool) -> str:
    """The store key looked up (said on stderr): prefix + KEY, or KEY with ``--raw`` or no app."""
    app = _app(ctx)
    prefix = _key_prefix(app)
    if app is None or (raw and prefix):
        said = (
            ": no app, so no lease_key_prefix applied (`celery -A proj lease` applies the app's)"
            if app is None
            else f" (--raw: the app's lease_key_prefix {prefix!r} not applied)"
        )
        click.echo(f"looked up {key!r} as given{said}", err=True)
        return key
    if not prefix:
        return key
    note = (
        f" (KEY already starts with it: for the store key {key!r}, pass --raw)"
        if key.startswith(prefix)
        else ""
    )
    click.echo(
        f"looked up {prefix + key!r}: {key!r} with the app's lease_key_prefix {prefix!r}{note}",
        err=True,
    )
    return prefix + key


def _other_key(ctx: click.Context, key: str, store_key: str) -> str | None:
    """KEY with the app's prefix if ``store_key`` lacks it, else without; ``None``: no prefix."""
    prefix = _key_prefix(_app(ctx))
    if not prefix:
        return None
    if store_key == prefix + key:
        return key
    return key.removeprefix(prefix) if key.startswith(prefix) else prefix + key


def _other_note(ctx: click.Context, store_key: str, other: dict[str, Any], *, both: bool) -> str:
    """The line ``show`` adds when the other spelling of KEY (:func:`_other_key`) is held."""
    prefix = _key_prefix(_app(ctx))
    key = other["key"]
    form = (
        f"with the app's lease_key_prefix {prefix!r}, as its tasks take it"
        if key.startswith(prefix) and store_key == key.removeprefix(prefix)
        else f"without the app's lease_key_prefix {prefix!r}"
    )
    said = (
        f"is held too, by {_holder_line(other)}: two holders each hold what may be meant as one"
        " key, and do not exclude each other"
        if both
        else f"is held by {_holder_line(other)}, token {other['token']}: it does not exclude a"
        f" holder of {store_key!r}"
    )
    return (
        f"note: {key!r} ({form}) {said} (lease(key, app=app) takes the key a task with the same"
        " lock_key takes)"
    )


raw_option = click.option(
    "--raw",
    is_flag=True,
    help="Look KEY up exactly as given: without the app's lease_key_prefix (a lease() "
    "taken outside Celery has none).",
)


def _time_left(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


QUEUED = "queued"
SUPERSEDED = "superseded"
STARTED = "started"
"""A debounced copy's claim on its own tombstone key (its owner's label): it reached a worker."""
RUNNING = "running"
COOLDOWN = "cooldown"
HELD = "held"
REPLACED = "replaced"
"""Said beside the state of a lease whose holder was asked to stop (``on_held="replace"``)."""
REPLACED_LINE = (
    "yes: asked to stop (on_held='replace'); its renewals are refused, and it keeps the key"
    " until it releases it or the lease expires"
)


def _holder(owner: str) -> Holder:
    """:func:`~celery_lease._core.owners.parse_owner` of the owner without the mark of a
    replaced holder; a queued owner has no node."""
    owner = unmarked(owner)[0]
    holder = parse_owner(owner)
    if is_queued_owner(owner) and holder.node is not None:
        holder = dataclasses.replace(holder, node=None)
    return holder


def _task_states(app: Any, task_ids: set[str]) -> dict[str, str]:
    """Result-backend state of each task id it knows (``SUCCESS``...); never raises."""
    backend = getattr(app, "backend", None) if app is not None else None
    get = compat.task_meta_reader(backend)
    if get is None or type(backend).__name__ == "DisabledBackend":
        return {}
    states: dict[str, str] = {}
    try:
        if str(backend.as_uri()).startswith("rpc://"):  # type: ignore[union-attr]
            return {}
        for task_id in task_ids:
            states[task_id] = str(get(task_id).get("status"))
    except Exception:  # an unreachable backend tells nothing: the state stays "held"
        return states
    return states


def _state(record: dict[str, Any], states: dict[str, str], prefix: str) -> str:
    """The STATE column (see ``list --help``)."""
    tombstone = record["key"].startswith(prefix + SUPERSEDED_NAMESPACE)  # superseded:<task id>
    if tombstone and is_queued_owner(record["owner"]):
        return STARTED if _holder(record["owner"]).label == STARTED else SUPERSEDED
    if is_queued_owner(record["owner"]):
        return QUEUED
    state = states.get(record["task_id"] or "")
    if state is None:
        return HELD
    return COOLDOWN if state == "SUCCESS" else RUNNING


def _records(infos: Sequence[LeaseInfo], now: float, app: Any) -> list[dict[str, Any]]:
    """:func:`_record` of each lease, with ``state`` and ``stale``."""
    records = [_record(info, now) for info in infos]
    ids = {
        r["task_id"]
        for r in records
        if r["task_id"] is not None and not is_queued_owner(r["owner"])
    }
    states = _task_states(app, ids) if ids else {}
    prefix = _key_prefix(app)
    for r in records:
        r["state"] = _state(r, states, prefix)
        if r["state"] == HELD and _cooling(r):
            r["state"] = COOLDOWN
        if r["state"] == COOLDOWN:
            r["renewed_seconds_ago"] = _cooldown_set_ago(r)
        r["stale"] = _is_stale(r)
    return records


STALE_FRACTION = 1 / 3
"""Not renewed for this fraction of its ttl (plus :func:`stale_margin`), a lease is stale: its
holder renews every third of the ttl, so it stopped, hangs or cannot reach the store."""

STALE_MARGIN_FRACTION = 0.1
"""Margin past the due renewal, as a fraction of the ttl, so a late round trip does not flap."""

STALE_MARGIN_MIN = 1.0
"""Seconds: the smallest such margin."""


def stale_margin(ttl: float) -> float:
    """Seconds past the due renewal (a third of ``ttl``) before a lease is stale."""
    return max(STALE_MARGIN_MIN, ttl * STALE_MARGIN_FRACTION)


def _renewed_ago(ttl: float | None, expires_in: float) -> float | None:
    """Seconds since the last renewal (store's clock); ``None`` without a ttl or in a cooldown."""
    if ttl is None:
        return None
    ago = ttl - expires_in
    return max(0.0, ago) if ago > -0.5 else None  # a little past: rounding of the store's ms


def _is_stale(record: dict[str, Any]) -> bool:
    """Not renewed for :data:`STALE_FRACTION` of its ttl plus the margin, and not cooling."""
    ago, ttl = record["renewed_seconds_ago"], record["ttl"]
    if ago is None or ttl is None or record.get("state") == COOLDOWN:
        return False
    return bool(ago > ttl * STALE_FRACTION + stale_margin(ttl))


def _cooldown_set_ago(record: dict[str, Any]) -> float | None:
    """RENEWED of a lease in its cooldown: cooldown minus time left, at most its held time."""
    ago: float | None = record["renewed_seconds_ago"]
    cooldown, left = record["cooldown"], record["expires_in"]
    if cooldown and left <= cooldown + 0.5:
        ago = max(0.0, cooldown - left)
    if ago is not None and record["held_seconds"] is not None:
        ago = min(ago, record["held_seconds"])
    return ago


def _cooling(record: dict[str, Any]) -> bool:
    """Whether the time left is within the owner's ``cd=`` and below two thirds of the ttl."""
    cooldown, ttl, left = record["cooldown"], record["ttl"], record["expires_in"]
    if not cooldown or ttl is None:
        return False
    return bool(left <= cooldown + 0.5 and left < ttl * (1 - STALE_FRACTION))


def _record(info: LeaseInfo, now: float) -> dict[str, Any]:
    """One lease as the JSON output gives it: the store's view plus the parsed owner. A slot's
    store key is split into ``key`` and ``slot`` (``None``: a key taken without ``limit``); a
    replaced holder's owner is given without its mark, and ``replaced`` is true."""
    owner, replaced = unmarked(info.owner)
    key, slot = split_slot(info.key)
    holder = _holder(owner)
    held = None if holder.taken_at is None else max(0.0, now - holder.taken_at)
    renewed = _renewed_ago(holder.ttl, info.expires_in)
    return {
        "key": key,
        "slot": slot,
        "owner": owner,
        "replaced": replaced,
        "token": info.token,
        "expires_in": info.expires_in,
        "node": holder.node,
        "host": holder.host,
        "pid": holder.pid,
        "task": holder.task,
        "task_id": holder.task_id,
        "label": holder.label,
        "taken_at": holder.taken_at,
        "held_seconds": held,
        "ttl": holder.ttl,
        "cooldown": holder.cooldown,
        "renewed_seconds_ago": renewed,
        "stale": False,
    }


def _taken(record: dict[str, Any]) -> str:
    if record["taken_at"] is None:
        return "-"
    stamp = datetime.fromtimestamp(record["taken_at"], tz=timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _holder_line(record: dict[str, Any]) -> str:
    """``task report.build[<id>] on w1@host (pid 12)``, as much of it as the owner tells."""
    parts = []
    if record["task"] is not None or record["task_id"] is not None:
        parts.append(f"task {record['task'] or '?'}[{record['task_id'] or '?'}]")
    if record["label"] is not None:
        parts.append(repr(record["label"]))
    if record["node"] is not None:
        parts.append(f"on {record['node']}")
    if record["host"] is not None:
        parts.append(f"(host {record['host']}, pid {record['pid']})")
    return " ".join(parts) if parts else record["owner"]


def _named(record: dict[str, Any]) -> str:
    """A lease as the text output names it: ``KEY``, or ``KEY slot N`` for a slot."""
    return record["key"] if record["slot"] is None else f"{record['key']} slot {record['slot']}"


def _describe(info: LeaseInfo, record: dict[str, Any] | None = None) -> str:
    record = record if record is not None else _record(info, time.time())
    held = (
        "" if record["held_seconds"] is None else f", held for {_time_left(record['held_seconds'])}"
    )
    state = record.get("state")
    told = [] if state in (None, HELD) else [str(state)]
    if record["replaced"]:
        told.append(REPLACED)
    if record.get("stale"):
        told.append(_stale_words(record))
    shown = f" ({', '.join(told)})" if told else ""
    return (
        f"{_named(record)}: held{shown} by {_holder_line(record)}, token {info.token}, "
        f"expires in {_time_left(info.expires_in)}{held}"
    )


def _node(record: dict[str, Any]) -> str | None:
    """NODE: the Celery node that took the lease, else (a plain ``lease()``) its host."""
    return cast("str | None", record["node"] or record["host"])


def _stale_words(record: dict[str, Any]) -> str:
    """``stale: not renewed for 25.0s, more than a third of its 1m00s ttl...``."""
    words = (
        f"stale: not renewed for {_time_left(record['renewed_seconds_ago'])}, more than a third"
        f" of its {_time_left(record['ttl'])} ttl (and a {_time_left(stale_margin(record['ttl']))}"
        " margin)"
    )
    if record.get("cooldown"):
        words += f" (its holder is gone, or it is in its {_time_left(record['cooldown'])} cooldown)"
    return words


def _renewed_line(record: dict[str, Any]) -> str | None:
    """``show``'s ``renewed:`` field: ``3.2s ago (ttl 1m00s)``, ``None`` when not told."""
    if record["renewed_seconds_ago"] is None:
        return None
    return f"{_renewed_cell(record)} (ttl {_time_left(record['ttl'])})"


def _renewed_cell(record: dict[str, Any]) -> str:
    ago = record["renewed_seconds_ago"]
    return "-" if ago is None else f"{_time_left(ago)} ago"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _state_cell(record: dict[str, Any]) -> str:
    """STATE: the state, then ``replaced`` and ``stale`` when they apply."""
    flags = [REPLACED] * record["replaced"] + ["stale"] * record["stale"]
    return ", ".join([record["state"], *flags])


def _table(records: Sequence[dict[str, Any]]) -> str:
    labels = any(r["label"] is not None for r in records)
    slots = any(r["slot"] is not None for r in records)
    header = [
        "KEY", "STATE", "NODE", "PID", "TASK", "TASK ID", "HELD FOR", "RENEWED", "TOKEN",
        "EXPIRES IN",
    ]  # fmt: skip
    if labels:
        header.insert(6, "LABEL")
    if slots:
        header.insert(1, "SLOT")
    cells = []
    for r in records:
        # An owner that tells nothing (no fields, or a foreign id) is shown whole in NODE.
        tells = any(r[name] is not None for name in ("task", "task_id", "label", "taken_at"))
        node = _node(r) or ("-" if tells else r["owner"])
        row = [
            r["key"],
            _state_cell(r),
            node,
            _cell(r["pid"]),
            _cell(r["task"]),
            _cell(r["task_id"]),
            "-" if r["held_seconds"] is None else _time_left(r["held_seconds"]),
            _renewed_cell(r),
            str(r["token"]),
            _time_left(r["expires_in"]),
        ]
        if labels:
            row.insert(6, _cell(r["label"]))
        if slots:
            row.insert(1, _cell(r["slot"]))
        cells.append(row)
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *cells]
    )


@click.group(name="lease", cls=_LeaseGroup)
@store_option
def lease_group(store_url: str | None) -> None:
    """Inspect and free the leases held in a celery-lease store."""


@lease_group.command(name="list")
@click.option("--prefix", default="", metavar="P", help="Only keys starting with P.")
@click.option("--task", "task_name", metavar="NAME", help="Only leases held by task NAME.")
@click.option("--node", metavar="NAME", help="Only leases held on worker node NAME (w1@host).")
@click.option(
    "--state",
    type=click.Choice([QUEUED, RUNNING, COOLDOWN, HELD, SUPERSEDED]),
    help="Only leases in this state (superseded: only debounce tombstones).",
)
@click.option(
    "--superseded",
    "with_superseded",
    is_flag=True,
    help="Also list debounce tombstones (superseded:<task id> keys), left out by default.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array instead of a table.")
@store_option
@click.pass_context
def list_command(
    ctx: click.Context,
    prefix: str,
    task_name: str | None,
    node: str | None,
    state: str | None,
    with_superseded: bool,
    as_json: bool,
    store_url: str | None,
) -> None:
    """List live leases: key, state, holder, held for, renewed, token, time left.

    STATE is queued (a unique copy waiting), running, cooldown (its task succeeded: kept for
    lock_cooldown) or held (not told: no task in the owner, or no result backend to ask).
    Held for: this host's clock minus the holder's at acquisition. Renewed: ttl minus time
    left; a lease not renewed for a third of its ttl is marked stale (its holder stopped
    renewing). Owners without holder fields are listed with "-".

    Debounce tombstones (superseded:<task id>) hold no work: they are counted on stderr, and
    listed only with --superseded or --state superseded (started: a copy's claim on its own).

    A key with a limit (lock_limit) holds one lease per slot: SLOT says which ("-": a key taken
    without a limit). A holder asked to stop by on_held="replace" is marked "replaced" beside
    its state until its lease is released or expires.
    """

    def body() -> None:
        now = time.time()
        infos = _inspectable(ctx, store_url).list(prefix)
        if task_name is not None or node is not None:
            pairs = [(info, _holder(info.owner)) for info in infos]
            infos = [
                info
                for info, holder in pairs
                if (task_name is None or holder.task == task_name)
                and (node is None or holder.node == node)
            ]
        records = _records(infos, now, _app(ctx))
        hidden = 0
        if not with_superseded and state != SUPERSEDED:
            kept = [r for r in records if r["state"] not in (SUPERSEDED, STARTED)]
            hidden = len(records) - len(kept)
            records = kept
        if state is not None:
            records = [r for r in records if r["state"] == state]
        if hidden:
            tombstones = "tombstone" if hidden == 1 else "tombstones"
            click.echo(
                f"{hidden} debounce {tombstones} ({_key_prefix(_app(ctx))}{SUPERSEDED_NAMESPACE}"
                "<task id>) not listed: --superseded lists them",
                err=True,
            )
        if as_json:
            click.echo(json.dumps(records, indent=2))
        elif not records:
            given = {"prefix": prefix, "task": task_name, "node": node, "state": state}
            filters = [f"{name} {value!r}" for name, value in given.items() if value]
            click.echo(f"no live leases{' with ' + ', '.join(filters) if filters else ''}")
        else:
            click.echo(_table(records))

    _run(body)


def _slots_of(store: SupportsInspection, key: str) -> list[LeaseInfo]:
    """The live slots of ``key`` (leases taken with ``limit``), by slot."""
    found = []
    for info in store.list(key + SLOT_MARK):
        owner_key, slot = split_slot(info.key)
        if owner_key == key and slot is not None:
            found.append((slot, info))
    return [info for _, info in sorted(found, key=lambda pair: pair[0])]


def _echo_lease(info: LeaseInfo, record: dict[str, Any]) -> None:
    """``show``'s block of one lease: the description, then one line per field."""
    click.echo(_describe(info, record))
    fields: list[tuple[str, object]] = [("slot", record["slot"])] * (record["slot"] is not None)
    fields += [
        ("state", record["state"]),
        ("node", _node(record)),
        ("task", record["task"]),
        ("task id", record["task_id"]),
        ("label", record["label"]),
        ("host", record["host"]),
        ("pid", record["pid"]),
        ("taken at", _taken(record)),
        ("renewed", _renewed_line(record)),
        ("owner", record["owner"]),
    ]
    fields += [(REPLACED, REPLACED_LINE)] * record["replaced"]
    for label, value in fields:
        click.echo(f"  {label + ':':<10}{_cell(value)}")


@lease_group.command(name="show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of text.")
@raw_option
@store_option
@click.pass_context
def show_command(
    ctx: click.Context, key: str, as_json: bool, raw: bool, store_url: str | None
) -> None:
    """Show the lease on KEY and its holder, or that it is free with the last token issued.

    A key used with a limit (lock_limit, lease(limit=...)) holds its leases in slots: each
    live slot is shown (KEY slot N). With --json, "slots" lists them and the other fields are
    the key's own lease (taken without a limit), as before.

    Under `celery -A proj lease`, the app's lease_key_prefix is put in front of KEY unless
    --raw is given; the key looked up is the answer's first word, and stderr says why.
    """

    def body() -> None:
        store = _inspectable(ctx, store_url)
        store_key = _store_key(ctx, key, raw)
        info = store.get(store_key)
        slots = _slots_of(store, store_key)
        other = _other_key(ctx, key, store_key)
        other_info = None if other is None else store.get(other)
        other_record = (
            None if other_info is None else _records([other_info], time.time(), _app(ctx))[0]
        )
        also = {} if other_record is None else {"other_key": other_record}
        held = [info] if info is not None else []
        records = _records([*held, *slots], time.time(), _app(ctx))
        slot_records = records[len(held) :]
        if as_json:
            if info is not None:
                shown = {"held": True, **records[0], "slots": slot_records, **also}
            else:
                last = store.last_token(store_key)
                shown = {"key": store_key, "held": False, "last_token": last}
                shown.update({"slots": slot_records, **also})
            click.echo(json.dumps(shown, indent=2))
            return
        for lease_info, record in zip([*held, *slots], records, strict=True):
            _echo_lease(lease_info, record)
        if records:
            if other_record is not None:
                click.echo(_other_note(ctx, store_key, other_record, both=True))
            return
        last = store.last_token(store_key)
        issued = "no token issued yet" if last is None else f"last token issued {last}"
        click.echo(f"{store_key}: free ({issued})")
        if other_record is not None:
            click.echo(_other_note(ctx, store_key, other_record, both=False))

    _run(body)


@lease_group.command(name="release")
@click.argument("key")
@click.option(
    "--slot",
    type=click.IntRange(min=0),
    metavar="N",
    help="Release slot N of KEY (a key used with a limit), not KEY's own lease.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@raw_option
@store_option
@click.pass_context
def release_command(
    ctx: click.Context, key: str, slot: int | None, yes: bool, raw: bool, store_url: str | None
) -> None:
    """Force-release the lease on KEY (or its slot N with --slot N), whoever holds it.

    The holder is not stopped: it hears of the loss at its next renewal, and the next acquirer
    gets a higher fencing token, so fenced writes reject the old holder. KEY is looked up as
    by `show`.
    """

    def body() -> None:
        store = _inspectable(ctx, store_url)
        store_key = _store_key(ctx, key, raw)
        target = store_key if slot is None else slot_key(store_key, slot)
        named = store_key if slot is None else f"{store_key} slot {slot}"
        info = store.get(target)
        if info is None:
            slots = [] if slot is not None else _slots_of(store, store_key)
            numbers = ", ".join(str(split_slot(s.key)[1]) for s in slots)
            held = f"slots {numbers} are" if len(slots) > 1 else f"slot {numbers} is"
            said = f"; its {held} held: release one with --slot N" if slots else ""
            click.echo(f"{named}: free, nothing to release{said}")
            return
        if not yes:
            (record,) = _records([info], time.time(), _app(ctx))
            click.confirm(f"Force-release {_describe(info, record)}?", abort=True)
        removed = store.force_release(target)
        if removed is None:
            click.echo(f"{named}: already free, nothing released")
            return
        click.echo(
            f"released {named}: owner {unmarked(removed.owner)[0]}, token {removed.token}; "
            "the next holder gets a higher token"
        )
        click.echo(
            "the holder, if it still runs, reports the lease lost at its next renewal: "
            "reason 'released' (or 'taken' if another holder took the key first)"
        )

    _run(body)


@lease_group.command(name="check")
@store_option
@click.pass_context
def check_command(ctx: click.Context, store_url: str | None) -> None:
    """Check the app's lease settings and that every store its locked tasks use answers.

    For deploy scripts: one line per check (ok / WARN / FAIL); exit status 2 when one failed,
    1 when one warned (the host-local SQLite fallback). Under `celery -A proj lease check` the
    task modules are imported, the lease_* settings validated and every store the tasks use
    pinged once; with --store URL, that store alone. Passwords are masked.
    """
    from celery_lease._celery import startup

    url = _store_url(ctx, store_url)
    app = _app(ctx)
    if url is not None:
        checks = [startup.ping_store("--store", url, startup.PING_KEY)]
    elif app is None:
        raise CliError(
            "nothing to check: run it as `celery -A proj lease check`, or pass --store URL"
        )
    else:
        try:
            app.loader.import_default_modules()  # the task modules, as a worker imports them
        except Exception as exc:
            checks = [startup.Check("task modules", error=f"{type(exc).__name__}: {exc}")]
        else:
            checks = startup.check_app(app)
    for check in checks:
        click.echo(check.line())
    if not all(check.ok for check in checks):
        ctx.exit(2)
    if any(check.warning is not None for check in checks):
        ctx.exit(1)


# `celery inspect leases` is checked against the running process's registry, and the -A module
# may not import celery-lease; this module loads in every `celery` run (celery.commands).
control.register_command()


@lease_group.command(
    name="demo", context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
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
