"""Owner ids: which node, task and task id took a lease, and when. Core module.

``host/pid/<16 hex>`` (unique per acquisition attempt), then ``;name=value`` fields (``;=%/``
percent-encoded): ``n`` node, ``t`` task, ``i`` task id, ``l`` label, ``ttl`` and ``cd``
(cooldown) in ms, ``rt`` the ticket of an ``on_held="replace"`` execution that asked for the key
first, ``at`` unix ms when made::

    host/123/0f3a9c11d2e4b5a6;n=w1@host;t=report.build;i=5b1d...;ttl=30000;at=1733260000123

A queued lease's is ``queued;t=<task>;i=<id>;at=<ms>;n=<nonce>``. In a worker, left-out fields
take the node (:func:`set_node`) and the running task (:func:`set_task_source`).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from celery_lease import _forking as forking
from celery_lease.stores.slots import unmarked

# Longest value (characters, before encoding) :func:`make_owner` accepts for one field: stores take
# any length, but a runaway label would make every renewal send kilobytes.
MAX_OWNER_FIELD_CHARS = 1000
# How a queued lease's (or debounce tombstone's) owner id begins; never an ordinary one's.
QUEUED_OWNER_HEAD = "queued;"
_HOST = socket.gethostname()
_SPECIAL = frozenset(";=%/")
_ENCODE = str.maketrans({";": "%3B", "=": "%3D", "%": "%25", "/": "%2F"})
_HEX_MASK = 0xFFFFFFFFFFFFFFFF


class _Ids:
    """``host/pid/`` plus 16 hex digits (a random 64-bit start plus a count), never the same
    twice in a process; ``generation``: the fork generation (a child makes its own)."""

    __slots__ = ("base", "count", "generation", "prefix")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.prefix = f"{_HOST.translate(_ENCODE)}/{os.getpid()}/"
        self.base = secrets.randbits(64)
        self.count = itertools.count(1)

    def hex(self) -> str:
        """The next 16 hex digits alone."""
        return f"{(self.base + next(self.count)) & _HEX_MASK:016x}"


_ids = _Ids(forking.generation())


def _this_process_ids() -> _Ids:
    """The owner-id generator of this process, made anew in a forked child."""
    global _ids
    current = forking.generation()
    ids = _ids
    if ids.generation != current:
        ids = _ids = _Ids(current)  # two threads racing here each make one: both unique
    return ids


def new_nonce() -> str:
    """16 hex digits this process never returns twice, random across processes."""
    return _this_process_ids().hex()


_node: str | None = None  # this worker process's Celery node name (prefork children inherit it)

# ``() -> (task name, task id) or None``: the task running in this thread, asked only when an
# owner id is made without task fields (the Celery layer installs one).
_task_source: Callable[[], tuple[str | None, str | None] | None] | None = None


def set_node(node: str | None) -> None:
    """Make ``node`` (a Celery node name, ``w1@host``) the default node of this process's owners."""
    global _node
    _node = node


def set_task_source(source: Callable[[], tuple[str | None, str | None] | None] | None) -> None:
    """Make ``source()`` (the running task's ``(name, id)``, or None outside a task) the default
    task of owner ids made without task fields; None: no default."""
    global _task_source
    _task_source = source


def _field(name: str, value: str | None) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(
            f"make_owner: {name} must be a str or None, got {type(value).__name__} {value!r}"
        )
    if len(value) > MAX_OWNER_FIELD_CHARS:
        raise ValueError(
            f"make_owner: {name} is {len(value)} characters long ({value[:40]!r}...); "
            f"at most {MAX_OWNER_FIELD_CHARS} are allowed"
        )
    if _SPECIAL.isdisjoint(value):
        return value
    return value.translate(_ENCODE)


def owner_field(value: object) -> str | None:
    """An owner-id field from any id Celery accepts (its ``str``), cut to
    :data:`MAX_OWNER_FIELD_CHARS`: never fails an acquire; None stays None."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_OWNER_FIELD_CHARS]


def owner_fields(node: object, task: object, task_id: object) -> tuple[str | None, ...]:
    """:func:`owner_field` of each of the three; as they are when each is None or a str short
    enough (as most are: one check, no call per field)."""
    most = MAX_OWNER_FIELD_CHARS
    if (
        (node is None or (type(node) is str and len(node) <= most))
        and (task is None or (type(task) is str and len(task) <= most))
        and (task_id is None or (type(task_id) is str and len(task_id) <= most))
    ):
        return node, task, task_id  # each None or a str
    return owner_field(node), owner_field(task), owner_field(task_id)


def make_owner(
    *,
    node: str | None = None,
    task: str | None = None,
    task_id: str | None = None,
    label: str | None = None,
    ttl_ms: int | None = None,
    cooldown_ms: int | None = None,
    replace_ticket: int | None = None,
) -> str:
    """A fresh owner id, unique per call in the process (a store's idempotent re-acquire relies
    on it): ``host/pid/<16 hex>``, the given fields, ``at``.

    Args:
        node: the Celery node name (``w1@host``); default the process's (:func:`set_node`).
        task, task_id: default (both left out) the task running here (:func:`set_task_source`).
        label: a free text naming the holder (``lease(..., holder=...)``), or None.
        ttl_ms, cooldown_ms: the lease's ttl and cooldown, milliseconds, or None.
        replace_ticket: the ticket an ``on_held="replace"`` execution drew when it asked the
            holder to stop (``rt``), or None.

    Raises:
        TypeError: a value is not a str.
        ValueError: a value is longer than :data:`MAX_OWNER_FIELD_CHARS`.
    """
    ids = _ids
    if ids.generation != forking.generation():
        ids = _this_process_ids()
    if node is None:
        node = _node
    if task is None and task_id is None and _task_source is not None:
        current = _task_source()
        if current is not None:
            task, task_id = current
    head = ids.prefix + "%016x" % ((ids.base + next(ids.count)) & _HEX_MASK)
    known = None
    if (
        (node is None or type(node) is str)
        and (task is None or type(task) is str)
        and label is None  # a holder label is often per call: never kept
        and (ttl_ms is None or type(ttl_ms) is int)
        and (cooldown_ms is None or type(cooldown_ms) is int)
    ):
        known = _known_fields.get((node, task, label, ttl_ms, cooldown_ms))
    if known is None:  # checks every field, in order, and keeps them when all are plain
        return _made_slowly(head, node, task, task_id, label, ttl_ms, cooldown_ms, replace_ticket)
    named, rest = known
    if task_id is not None:
        if (
            type(task_id) is str
            and len(task_id) <= MAX_OWNER_FIELD_CHARS
            and ";" not in task_id
            and "=" not in task_id
            and "%" not in task_id
            and "/" not in task_id
        ):
            named += ";i=" + task_id
        else:
            named += ";i=" + _field("task_id", task_id)
    if replace_ticket is not None:
        rest += f";rt={int(replace_ticket)}"
    return f"{head}{named}{rest};at={time.time_ns() // 1_000_000}"


# (node, task, None, ttl_ms, cooldown_ms), each None or of exactly str / int, checked ->
# (their ``;n=..;t=..`` fields, their ``;ttl=..;cd=..`` fields): a worker has a few. Cleared
# when full; a ``label`` (``holder=``) is never kept.
_known_fields: dict[
    tuple[str | None, str | None, str | None, int | None, int | None], tuple[str, str]
] = {}
_KNOWN_FIELDS_KEPT = 1024


def _made_slowly(
    head: str,
    node: str | None,
    task: str | None,
    task_id: str | None,
    label: str | None,
    ttl_ms: int | None,
    cooldown_ms: int | None,
    replace_ticket: int | None,
) -> str:
    """:func:`make_owner` after ``head`` (``host/pid/<hex>``): every field checked and encoded;
    kept in :data:`_known_fields` when there is no label and all are None or exactly str /
    int."""
    named = ""
    if node is not None:
        named += ";n=" + _field("node", node)
    if task is not None:
        named += ";t=" + _field("task", task)
    with_id = named if task_id is None else named + ";i=" + _field("task_id", task_id)
    rest = ""
    if label is not None:
        rest += ";l=" + _field("label", label)
    if ttl_ms is not None:
        rest += f";ttl={int(ttl_ms)}"
    if cooldown_ms:
        rest += f";cd={int(cooldown_ms)}"
    if (
        (node is None or type(node) is str)
        and (task is None or type(task) is str)
        and label is None
        and (ttl_ms is None or type(ttl_ms) is int)
        and (cooldown_ms is None or type(cooldown_ms) is int)
    ):
        if len(_known_fields) >= _KNOWN_FIELDS_KEPT:
            _known_fields.clear()  # begun again: the combinations in use come back at once
        _known_fields[(node, task, label, ttl_ms, cooldown_ms)] = (named, rest)
    if replace_ticket is not None:
        rest += f";rt={int(replace_ticket)}"
    return f"{head}{with_id}{rest};at={time.time_ns() // 1_000_000}"


def queued_owner(task: str, task_id: str, at_ms: int, label: str | None = None) -> str:
    """The owner id of the queued lease of copy ``task_id``; ``label`` tells kinds apart (a
    debounced copy's claim on its own tombstone). The nonce ``n=`` makes it unique per call, so
    two calls reusing a task id in one millisecond do not both hold the key.
    """
    tail = "" if label is None else f";l={_field('label', label)}"
    return (
        f"{QUEUED_OWNER_HEAD}t={_field('task', task)};i={_field('task_id', task_id)};at={at_ms}"
        f"{tail};n={new_nonce()}"
    )


def is_queued_owner(owner: str) -> bool:
    """Whether ``owner`` is the owner id of a queued lease (:func:`queued_owner`)."""
    return owner.startswith(QUEUED_OWNER_HEAD)


@dataclass(frozen=True)
class Holder:
    """An owner id read back by :func:`parse_owner`; ``None`` for each part it does not carry."""

    raw: str
    """The owner id its holder took the lease under (pass it to ``release``): as the store
    recorded it, without the replace mark."""
    host: str | None
    """The host name of the process that took the lease."""
    pid: int | None
    """The process id (on ``host``) of the process that took the lease."""
    node: str | None
    """The Celery node name (``w1@host``) of the worker, if taken in one."""
    task: str | None
    """The task name, if taken for a task."""
    task_id: str | None
    """The task id, if taken for a task."""
    label: str | None
    """The ``holder=`` label given to ``lease()``, if any."""
    taken_at: float | None
    """When the owner id was made (just before the acquisition), unix seconds."""
    ttl: float | None = None
    """The ttl the lease is renewed with, seconds (owner ids of older versions have none)."""
    cooldown: float | None = None
    """The cooldown kept after a body that succeeded, seconds; None: none (or not recorded)."""
    replace_ticket: int | None = None
    """The ticket of the ``on_held="replace"`` execution that took the lease after asking its
    holder to stop; None for any other lease."""
    replaced: bool = False
    """Whether a newer ``on_held="replace"`` call asked this holder to stop (its stored owner id
    carries the replace mark)."""


_FIELDS = {"n": "node", "t": "task", "i": "task_id", "l": "label"}


def _decode(value: str) -> str:
    return unquote(value) if "%" in value else value


def parse_owner(owner: str) -> Holder:
    """Read an owner id (ours or a foreign one, with or without the replace mark) into a
    :class:`Holder`; never raises: what does not follow the format is ``None``, an unknown field
    ignored."""
    try:
        owner, replaced = unmarked(owner)
    except Exception:  # documented: never raises, whatever the store returned
        return Holder(str(owner), None, None, None, None, None, None, None)
    found: dict[str, str | None] = {"node": None, "task": None, "task_id": None, "label": None}
    host: str | None = None
    pid: int | None = None
    millis: dict[str, float] = {}
    ticket: int | None = None
    try:
        head, *fields = owner.split(";")
        bits = head.split("/")
        if len(bits) == 3 and bits[0] and bits[1].isdigit():
            host = _decode(bits[0])
            pid = int(bits[1])
        for item in fields:
            name, sep, value = item.partition("=")
            if not sep:
                continue
            if name in ("at", "ttl", "cd"):
                if value.isdigit():
                    millis[name] = int(value) / 1000.0
            elif name == "rt":
                if value.isdigit() and value.isascii():
                    ticket = int(value)
            elif name in _FIELDS:
                found[_FIELDS[name]] = _decode(value)
    except Exception:  # documented: never raises, whatever the store returned
        return Holder(str(owner), None, None, None, None, None, None, None)
    return Holder(
        owner,
        host,
        pid,
        **found,
        taken_at=millis.get("at"),
        ttl=millis.get("ttl"),
        cooldown=millis.get("cd"),
        replace_ticket=ticket,
        replaced=replaced,
    )
