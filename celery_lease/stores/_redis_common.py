"""What the Redis store and its asyncio twin share: Lua scripts, URL options, replies, messages.

Both run these scripts (each headed by what its KEYS, ARGV and reply mean) on the same keys, so
sync and async holders of a key exclude each other and its tokens only grow; they differ only in
how they wait for the server. No message ever carries a password.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.durations import to_seconds
from celery_lease.errors import (
    LeaseConfigError,
    ReplicaLagError,
    RestartGraceError,
    StoreUnavailableError,
)
from celery_lease.stores._redis_fast import pack_eval_head, pack_head
from celery_lease.stores.base import LeaseInfo, mask_secrets
from celery_lease.stores.slots import (
    MAX_LIMIT,
    REPLACED_MARK,
    SLOT_MARK,
    release_channel,
    split_slot,
)

DEFAULT_PREFIX = "celery-lease:"  # Prefix of every key the store writes.

SOCKET_TIMEOUT = 5.0
"""Seconds: ``socket_timeout`` and ``socket_connect_timeout`` of clients built from a URL."""

REPLICA_TIMEOUT = 0.2
"""Seconds an acquire or renewal waits (``WAIT``) for ``min_replicas`` acknowledgements."""

CONFIRM_WINDOW = 1.0
"""Seconds an acquire too few replicas acknowledged is asked again (the same owner's idempotent
acquire, with its own ``WAIT``), so a replica a moment behind confirms a later ask. After that
the lease is released and :class:`~celery_lease.errors.ReplicaLagError` raised (retried within
the caller's ``wait``)."""

SIGNAL_TTL_MS = 60_000
"""Milliseconds a release signal waits in its list for a waiter before Redis drops it."""

TOKEN_TTL_MS = 7 * 24 * 3600 * 1000
"""Milliseconds a token counter lives after its key's last acquire (7 days), so Redis does not
grow with every key ever locked; the clock floor then keeps the next token above old ones."""

NOT_A_LEASE = (
    "WRONGTYPE the lease key holds a value of another type, written by something else; "
    "left as it is"
)
"""The error reply of a script that finds a lease key of another type (a foreign writer's):
such a key is never overwritten; renewals answer 0 instead."""


WIDTH_MARK = ">"
"""First character of a slot script's reply asking to be called again with more slot leases
declared: the mark and the key's stored width (see :data:`ACQUIRE_SLOT_SCRIPT`)."""


def _lua(source: str) -> str:
    """``source`` with the NOT_A_LEASE placeholder made a Lua string literal, GRACE_MARK ``~``
    (the first character of a reply refusing a free key in a restart grace), WIDTH_MARK
    :data:`WIDTH_MARK`, REPLACED_MARK the Lua literal of
    :data:`~celery_lease.stores.slots.REPLACED_MARK` and MAX_LIMIT its number."""
    return (
        source.replace("NOT_A_LEASE", f"'{NOT_A_LEASE}'")
        .replace("GRACE_MARK", "~")
        .replace("WIDTH_MARK", WIDTH_MARK)
        .replace("REPLACED_MARK", _lua_literal(REPLACED_MARK))
        .replace("MAX_LIMIT", str(MAX_LIMIT))
    )


def _lua_literal(value: str) -> str:
    """``value`` as a Lua string literal: its UTF-8 bytes, all but printable ASCII as decimal
    escapes."""
    body = "".join(
        chr(b) if 0x20 <= b < 0x7F and b not in b"'\\" else f"\\{b:03d}" for b in value.encode()
    )
    return f"'{body}'"


# Draws `floor` (server TIME in µs) and, with a marker key (MARKER_KEY, a placeholder), refuses
# a free key until GRACE_ARG µs after this server run started (see ACQUIRE_SCRIPT). Shared by the
# plain and the slot acquire, so a free slot meets the grace a free key meets.
_GRACE = """local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
if MARKER_KEY then
    local info = redis.call('INFO', 'server')
    local boot = string.match(info, 'run_id:(%x+)')
    local mark = redis.call('HMGET', MARKER_KEY, 'boot', 'started', 'cause')
    local started, cause = tonumber(mark[2] or '0'), mark[3]
    if mark[1] ~= boot then
        local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
        started = (tonumber(now[1]) - uptime) * 1000000
        cause = mark[1] and 'restored' or 'new'
        redis.call('HSET', MARKER_KEY, 'boot', boot, 'started', string.format('%d', started),
            'cause', cause)
    end
    local hold = started + tonumber(GRACE_ARG)
    if floor < hold then
        return 'GRACE_MARK' .. string.format('%d', hold) .. ':' .. cause .. ':'
            .. string.format('%d', started)
    end
end
"""


def _grace(marker_key: str, grace_arg: str) -> str:
    return _GRACE.replace("MARKER_KEY", marker_key).replace("GRACE_ARG", grace_arg)


def _owned_by(stored: str, owner: str) -> str:
    """A Lua condition: the stored owner ``stored`` is ``owner``'s, marked or not. An owner id
    itself ending in REPLACED_MARK owns only its marked form (as ``unmarked(stored)[0] ==
    owner`` reads it), so the id ``x`` + REPLACED_MARK never releases ``x``'s marked lease."""
    return (
        f"({stored} == {owner} .. REPLACED_MARK or ({stored} == {owner} "
        f"and string.sub({owner}, -#REPLACED_MARK) ~= REPLACED_MARK))"
    )


def _signal(signal: str, lifetime: str, keep: str) -> str:
    """Lua adding one wake-up to the list ``signal`` (its lifetime in ms: ``lifetime``), the
    list trimmed to its last ``keep`` (1 for a key: exactly one waiter wakes, however often it
    was released; MAX_LIMIT for a key's slots: one per freed slot)."""
    return (
        f"redis.call('RPUSH', {signal}, '1')\n"
        f"redis.call('LTRIM', {signal}, -tonumber({keep}), -1)\n"
        f"redis.call('PEXPIRE', {signal}, {lifetime})\n"
    )


# A key's stored width (`counter` holds HMGET {token, width} of its slot counter) as `width`: an
# integer from 0 to MAX_LIMIT, whatever another writer left there (above: MAX_LIMIT; not a
# number: 0, so only the slots below the limit count until a grant writes a width again).
_STORED_WIDTH = """local width = tonumber(counter[2]) or 0
if width ~= width then
    width = 0
end
width = math.floor(math.max(0, math.min(width, MAX_LIMIT)))
"""


# KEYS[1] the lease hash, KEYS[2] the token counter, optional KEYS[3] the store's marker hash.
# ARGV[1] the owner, ARGV[2] the ttl in ms, ARGV[3] the counter's idle lifetime in ms; with
# KEYS[3]: ARGV[4] the restart grace in microseconds.
# Returns the token as a decimal string, or false when another owner holds a live lease. A free
# key gets max(counter + 1, server TIME in µs). The live lease's owner gets its own token back and
# its expiry set (never added) to ttl from now. A lease key of another type: NOT_A_LEASE.
# With KEYS[3], a free key is refused until ARGV[4] after this run started: GRACE_MARK .. until
# .. ':' .. cause .. ':' .. started (µs); see docs/stores.md (When Redis restarts or is flushed).
ACQUIRE_SCRIPT = _lua(
    """
local lease = redis.pcall('HMGET', KEYS[1], 'owner', 'token')
if lease.err then
    return redis.error_reply(NOT_A_LEASE)
end
if lease[1] then
    if lease[1] == ARGV[1] then
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return lease[2]
    end
    return false
end
"""
    + _grace("KEYS[3]", "ARGV[4]")
    + """local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if floor > token then
    token = floor
end
token = string.format('%d', token)
redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""
)

HELD_MARK = "!"
"""First character of an :data:`ACQUIRE_OR_HOLDER_SCRIPT` reply that names the holder (a token
is all digits)."""

# ACQUIRE_SCRIPT, but a refusal returns HELD_MARK and the holder's owner id (atomically with the
# refusal; still one scalar reply, as the fast path reads).
ACQUIRE_OR_HOLDER_SCRIPT = ACQUIRE_SCRIPT.replace(
    "    return false\n", f"    return '{HELD_MARK}' .. lease[1]\n", 1
)
assert ACQUIRE_OR_HOLDER_SCRIPT != ACQUIRE_SCRIPT

# KEYS[1] the lease hash.
# ARGV[1] the owner, ARGV[2] the ttl in ms.
# Returns 1 when the owner's live lease now expires ttl ms from now (set, never added), else 0
# (also for a key of another type).
RENEW_SCRIPT = """
if redis.pcall('HGET', KEYS[1], 'owner') == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""

# KEYS[1..n] lease hashes (any number; on a Cluster they must share a slot).
# ARGV[2i-1] the owner of KEYS[i], ARGV[2i] its ttl in ms.
# Returns n integers, 1 or 0 as RENEW_SCRIPT's (pcall: one foreign value must not abort the
# others). One command per chunk: the client packs one command, not one per lease.
RENEW_MANY_SCRIPT = """
local renewed = {}
for i = 1, #KEYS do
    if redis.pcall('HGET', KEYS[i], 'owner') == ARGV[2 * i - 1] then
        redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
        renewed[i] = 1
    else
        renewed[i] = 0
    end
end
return renewed
"""

RENEW_CHUNK = 1000
"""Leases renewed by one script call (one pipelined round trip carries all the chunks)."""

# KEYS[1] the lease hash, KEYS[2] the release-signal list (a slot's: its key's).
# ARGV[1] the owner, ARGV[2] the signal's lifetime in ms, ARGV[3] the most wake-ups the list
# keeps (1 for a key, MAX_LIMIT for a slot).
# Deletes the owner's lease (also once marked: owner .. REPLACED_MARK, see MARK_REPLACED_SCRIPT)
# and adds one wake-up to the signal list (for a key: the list then holds exactly one, one BLPOP
# waiter wakes; for a slot: one per slot freed). Returns 1 when released, else 0; a key of
# another type: NOT_A_LEASE.
RELEASE_SCRIPT = _lua(
    """
local owner = redis.pcall('HGET', KEYS[1], 'owner')
if type(owner) == 'table' and owner.err then
    return redis.error_reply(NOT_A_LEASE)
end
if owner and """
    + _owned_by("owner", "ARGV[1]")
    + """ then
    redis.call('DEL', KEYS[1])
"""
    + _signal("KEYS[2]", "ARGV[2]", "ARGV[3]")
    + """    return 1
end
return 0
"""
)

# KEYS[1] the key's slot counter hash {token, width}, KEYS[2 .. n + 1] the lease hashes of its
# slots 0 .. n - 1, optional KEYS[n + 2] the store's marker hash (every key the script touches is
# declared: a Cluster resharding the key's hash slot then answers TRYAGAIN or ASK for all of
# them, never runs the script on a node missing some).
# ARGV[1] the owner, ARGV[2] the ttl in ms, ARGV[3] the counter's idle lifetime in ms, ARGV[4]
# the limit, ARGV[5] n (the slots declared, at least the limit); with KEYS[n + 2]: ARGV[6] the
# restart grace in microseconds.
# width = 1 + the highest slot given (kept with the counter, so a counter dropped after its idle
# lifetime forgets slots at or above the limit; read as an integer from 0 to MAX_LIMIT). When
# width > n the script answers WIDTH_MARK .. width and does nothing: the client calls again
# with that many slots declared. Else it reads the n slots: the owner's live slot is returned
# with its token and its expiry set (never added) to ttl from now; else, when fewer than limit
# are live, the lowest free slot below limit is taken with token max(counter + 1, server TIME
# in µs), and width set to 1 + the highest live slot.
# Returns slot .. ':' .. token .. ':' .. the width stored, or false when limit or more slots are
# live (or none below limit is free). A slot lease of another type: NOT_A_LEASE. A free slot
# meets the restart grace a free key meets (ACQUIRE_SCRIPT): GRACE_MARK ...
ACQUIRE_SLOT_SCRIPT = _lua(
    """
local limit, n = tonumber(ARGV[4]), tonumber(ARGV[5])
local counter = redis.call('HMGET', KEYS[1], 'token', 'width')
"""
    + _STORED_WIDTH
    + """if width > n then
    return 'WIDTH_MARK' .. width
end
local free, held, top = nil, 0, -1
for slot = 0, n - 1 do
    local name = KEYS[slot + 2]
    local lease = redis.pcall('HMGET', name, 'owner', 'token')
    if lease.err then
        return redis.error_reply(NOT_A_LEASE)
    end
    if lease[1] then
        if lease[1] == ARGV[1] then
            redis.call('PEXPIRE', name, ARGV[2])
            return slot .. ':' .. lease[2] .. ':' .. width
        end
        held = held + 1
        top = slot
    elseif not free and slot < limit then
        free = slot
    end
end
if held >= limit or not free then
    return false
end
"""
    + _grace("KEYS[n + 2]", "ARGV[6]")
    + """local token = tonumber(counter[1] or '0') + 1
if floor > token then
    token = floor
end
token = string.format('%d', token)
width = math.max(free, top) + 1
redis.call('HSET', KEYS[1], 'token', token, 'width', width)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local name = KEYS[free + 2]
redis.call('HSET', name, 'owner', ARGV[1], 'token', token)
redis.call('PEXPIRE', name, ARGV[2])
return free .. ':' .. token .. ':' .. width
"""
)

# KEYS[1] the key's slot counter hash, KEYS[2] its release-signal list, KEYS[3 .. n + 2] the
# lease hashes of its slots 0 .. n - 1 (as ACQUIRE_SLOT_SCRIPT declares them).
# ARGV[1] the owner, ARGV[2] the signal's lifetime in ms, ARGV[3] n.
# Releases the slot of the key the owner holds (marked or not), as RELEASE_SCRIPT releases one,
# reading the slots ACQUIRE_SLOT_SCRIPT reads: undoes a slot acquire whose reply never came.
# Returns the slot released, or -1; WIDTH_MARK .. width (nothing done) when the key's stored
# width exceeds n, as ACQUIRE_SLOT_SCRIPT answers.
RELEASE_OWNERS_SLOT_SCRIPT = _lua(
    """
local n = tonumber(ARGV[3])
local counter = redis.call('HMGET', KEYS[1], 'token', 'width')
"""
    + _STORED_WIDTH
    + """if width > n then
    return 'WIDTH_MARK' .. width
end
for slot = 0, n - 1 do
    local owner = redis.pcall('HGET', KEYS[slot + 3], 'owner')
    if """
    + _owned_by("owner", "ARGV[1]")
    + """ then
        redis.call('DEL', KEYS[slot + 3])
"""
    + _signal("KEYS[2]", "ARGV[2]", "MAX_LIMIT")
    + """        return slot
    end
end
return -1
"""
)

# KEYS[1] the lease hash, KEYS[2] the token counter.
# ARGV[1] the ticket ('': draw one), ARGV[2] '1' when only ARGV[3] (an owner id) is to be asked,
# ARGV[4] the counter's idle lifetime in ms.
# A drawn ticket is max(counter + 1, the live lease's token + 1, server TIME in µs), written to
# the counter (so every later token is larger). The live lease's owner gets REPLACED_MARK
# appended, unless ARGV[2] names another owner (or it has it already).
# Returns {ticket, the owner without the mark or false when free, 1 when the lease is marked
# now else 0}. A lease key of another type: NOT_A_LEASE (nothing drawn, nothing written).
MARK_REPLACED_SCRIPT = _lua(
    """
local lease = redis.pcall('HMGET', KEYS[1], 'owner', 'token')
if lease.err then
    return redis.error_reply(NOT_A_LEASE)
end
local ticket = ARGV[1]
if ticket == '' then
    local now = redis.call('TIME')
    local draw = tonumber(now[1]) * 1000000 + tonumber(now[2])
    local counted = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
    if counted > draw then
        draw = counted
    end
    if lease[2] and tonumber(lease[2]) + 1 > draw then
        draw = tonumber(lease[2]) + 1
    end
    ticket = string.format('%d', draw)
    redis.call('SET', KEYS[2], ticket, 'PX', ARGV[4])
end
local owner = lease[1]
if not owner then
    return {ticket, false, 0}
end
local mark = REPLACED_MARK
local asked = string.sub(owner, -#mark) == mark
if asked then
    owner = string.sub(owner, 1, #owner - #mark)
end
if ARGV[2] == '1' and owner ~= ARGV[3] then
    return {ticket, owner, 0}
end
if not asked then
    redis.call('HSET', KEYS[1], 'owner', owner .. mark)
end
return {ticket, owner, 1}
"""
)

# The start of the scripts that read a live lease: `lease` holds {owner, token}; a free key
# answers false (nil), a lease key holding another type the NOT_A_LEASE error reply.
_READ_LEASE = """
local lease = redis.pcall('HMGET', KEYS[1], 'owner', 'token')
if lease.err then
    return redis.error_reply(NOT_A_LEASE)
end
if not lease[1] then
    return false
end
"""

# KEYS[1] the lease hash, KEYS[2] the release-signal list.
# ARGV[1] the signal's lifetime in ms, ARGV[2] the most wake-ups the list keeps (as
# RELEASE_SCRIPT's ARGV[3]).
# Deletes the live lease whoever holds it (the counter is kept) and signals one waiter.
# Returns {owner, token, remaining ms} of it, or false when free; another type: NOT_A_LEASE.
FORCE_RELEASE_SCRIPT = _lua(
    _READ_LEASE
    + """local left = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
"""
    + _signal("KEYS[2]", "ARGV[1]", "ARGV[2]")
    + """return {lease[1], lease[2], left}
"""
)

# KEYS[1] the lease hash.
# Returns {owner, token, remaining ms} of the live lease, or false; another type: NOT_A_LEASE.
INSPECT_SCRIPT = _lua(_READ_LEASE + "return {lease[1], lease[2], redis.call('PTTL', KEYS[1])}\n")


@dataclass(frozen=True)
class Script:
    """A Lua script, its SHA1 (for EVALSHA) and, for the fast path, its packed request heads."""

    source: str
    # (numkeys, nargs) when the fast path runs it with those counts; (0, 0): with any counts
    # (its heads packed per call)
    fast: tuple[int, int] | None = None
    sha: str = field(init=False)
    head: bytes = field(init=False)  # packed ``EVALSHA <sha> <numkeys>`` (fast path only)
    cold_head: bytes = field(init=False)  # packed ``EVAL <source> <numkeys>`` (fast path only)

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.source.encode()).hexdigest()
        object.__setattr__(self, "sha", sha)
        object.__setattr__(self, "head", pack_head(sha, *self.fast) if self.fast else b"")
        cold = pack_eval_head(self.source, *self.fast) if self.fast else b""
        object.__setattr__(self, "cold_head", cold)

    def head_for(self, numkeys: int, nargs: int, *, cold: bool = False) -> bytes:
        """The packed head of a fast-path call with ``numkeys`` keys and ``nargs`` arguments:
        ``EVALSHA`` (``cold``: ``EVAL`` with the source)."""
        if (numkeys, nargs) == self.fast:
            return self.cold_head if cold else self.head
        if cold:
            return pack_eval_head(self.source, numkeys, nargs)
        return pack_head(self.sha, numkeys, nargs)


ACQUIRE = Script(ACQUIRE_SCRIPT, fast=(2, 3))
ACQUIRE_OR_HOLDER = Script(ACQUIRE_OR_HOLDER_SCRIPT, fast=(2, 3))
ACQUIRE_WITH_GRACE = Script(ACQUIRE_SCRIPT, fast=(3, 4))
ACQUIRE_OR_HOLDER_WITH_GRACE = Script(ACQUIRE_OR_HOLDER_SCRIPT, fast=(3, 4))
RENEW = Script(RENEW_SCRIPT, fast=(1, 2))
RENEW_MANY = Script(RENEW_MANY_SCRIPT)
RELEASE = Script(RELEASE_SCRIPT, fast=(2, 3))
ACQUIRE_SLOT = Script(ACQUIRE_SLOT_SCRIPT, fast=(0, 0))  # its number of keys varies
RELEASE_OWNERS_SLOT = Script(RELEASE_OWNERS_SLOT_SCRIPT)
MARK_REPLACED = Script(MARK_REPLACED_SCRIPT)
# The acquire scripts called with the marker key and the grace (another fast-path head).
WITH_GRACE = {
    ACQUIRE: ACQUIRE_WITH_GRACE,
    ACQUIRE_OR_HOLDER: ACQUIRE_OR_HOLDER_WITH_GRACE,
}
FORCE_RELEASE = Script(FORCE_RELEASE_SCRIPT)
INSPECT = Script(INSPECT_SCRIPT)

MARKER = "marker"  # the marker hash's name after the prefix


def check_slot_request(key: object, limit: object) -> None:
    """``LeaseConfigError`` (a ``ValueError``) unless ``limit`` is an int in 1 ..
    :data:`~celery_lease.stores.slots.MAX_LIMIT` and ``key`` a string without U+001F."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise LeaseConfigError(f"acquire_slot(limit={limit!r}): needs an int from 1 to {MAX_LIMIT}")
    if not isinstance(key, str) or SLOT_MARK in key:
        raise LeaseConfigError(
            f"acquire_slot(key={key!r}): needs a string key without U+001F (the slot mark)"
        )


def slot_reply(reply: bytes | str) -> tuple[int, int]:
    """``(slot, token)`` of an :data:`ACQUIRE_SLOT_SCRIPT` reply granting a slot."""
    slot, token, _ = text(reply).split(":")
    return int(slot), int(token)


def stored_width(reply: bytes | str) -> int:
    """The key's width an :data:`ACQUIRE_SLOT_SCRIPT` reply granting a slot names."""
    return int(text(reply).rpartition(":")[2])


_WIDTH_MARKS = (WIDTH_MARK.encode(), WIDTH_MARK)


def width_wanted(reply: Any) -> int | None:
    """The width a slot script's :data:`WIDTH_MARK` reply asks to be called with, else None."""
    if isinstance(reply, (bytes, str)) and reply[:1] in _WIDTH_MARKS:
        return int(text(reply)[1:])
    return None


def grants(reply: Any) -> bool:
    """Whether an acquire script's reply took a lease (a token or a slot, no refusal)."""
    return (
        reply is not None
        and not refused(reply)
        and not in_grace(reply)
        and width_wanted(reply) is None
    )


def in_grace(reply: Any) -> bool:
    """Whether an acquire script's reply refused a free key during a restart grace."""
    return isinstance(reply, (bytes, str)) and reply[:1] in (b"~", "~")


@dataclass(frozen=True)
class Grace:
    """A restart grace an acquire script refused a free key for (see ``ACQUIRE_SCRIPT``):
    its end and the server run's start (Unix seconds, server clock), and its cause (``"new"``:
    no marker; ``"restored"``: the marker named another run)."""

    until: float
    started: float
    cause: str

    @classmethod
    def parse(cls, reply: bytes | str) -> Grace:
        """The grace an :func:`in_grace` reply names."""
        until, cause, started = text(reply)[1:].split(":")
        return cls(int(until) / 1_000_000, int(started) / 1_000_000, cause)

    def explain(self, restart_grace: float, now: float) -> str:
        """Why the grace is on, until when and how to turn it off; ``now``: Unix time."""
        if self.cause == "restored":
            why = (
                "with a marker of another server run (a restart that reloaded a snapshot or an "
                "AOF, which may lack the newest leases, or a failover)"
            )
        else:
            why = (
                "without this store's marker (a new server, or one restarted without "
                "persistence, or flushed: the leases it held may be lost)"
            )
        age = max(0.0, now - self.started)
        return (
            f"refused by the restart grace: the server started {age:.0f} s ago "
            f"({_utc(self.started)} UTC) {why}; free keys are refused until "
            f"{_utc(self.until)} UTC (restart_grace={restart_grace:g} s from the server's "
            "start), so that a holder of a lost lease hears it lost it first. For a throwaway "
            "server (tests, CI) turn it off: restart_grace=0 on the store (?restart_grace=0 "
            "in its URL) or the Celery setting lease_restart_grace=0"
        )


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def check_restart_grace(value: object, name: str = "restart_grace") -> float:
    """``restart_grace`` in seconds (a number, ``"30s"``, a timedelta; 0 turns it off)."""
    return to_seconds(value, name=name)


RETRIED = (RedisConnectionError, RedisTimeoutError)
"""Driver errors a call is retried once after (every script is safe to run twice)."""


STORE_OPTIONS = ("min_replicas", "replica_timeout", "restart_grace")
"""The store's own URL query options (never passed to redis-py)."""


def min_replicas_of(
    value: object, options: dict[str, object], sentinel: bool, cluster: bool
) -> int:
    """A store's ``min_replicas``: ``value``, else the URL's, else 1 under Sentinel, else 0;
    ``LeaseConfigError`` unless a non-negative integer (0 on a Cluster)."""
    if value is None and "min_replicas" in options:
        value = options["min_replicas"]
        if isinstance(value, str):
            if not value.isdigit():
                raise LeaseConfigError(
                    f"min_replicas={value!r} (URL option) must be a non-negative integer"
                )
            value = int(value)
    if value is None:
        value = 1 if sentinel else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LeaseConfigError(f"min_replicas={value!r} must be a non-negative integer")
    if value and cluster:
        raise LeaseConfigError(
            f"min_replicas={value!r} is not supported on a Redis Cluster (WAIT cannot ride "
            "along its per-node script pipelines); use min_replicas=0"
        )
    return value


def replica_timeout_of(
    value: object, options: dict[str, object], min_replicas: int, socket_timeout: float | None
) -> float:
    """A store's ``replica_timeout`` in seconds: ``value``, else the URL's, else
    :data:`REPLICA_TIMEOUT`; ``LeaseConfigError`` unless a duration (with ``min_replicas``,
    shorter than the client's ``socket_timeout``)."""
    if value is None:
        value = options.get("replica_timeout", REPLICA_TIMEOUT)
    seconds = to_seconds(value, name="replica_timeout", minimum=0.001)
    if min_replicas and socket_timeout is not None and seconds >= socket_timeout:
        raise LeaseConfigError(
            f"replica_timeout={value!r} must be shorter than the client's "
            f"socket_timeout ({socket_timeout:g} s), or the socket times out first"
        )
    return seconds


def restart_grace_of(value: object, options: dict[str, object], cluster: bool) -> float:
    """A store's ``restart_grace`` in seconds: ``value``, else the URL's, else 0 (off);
    ``LeaseConfigError`` unless a duration (0 on a Cluster)."""
    if value is None:
        value = options.get("restart_grace")
    if value is None:
        return 0.0
    seconds = check_restart_grace(value)
    if seconds and cluster:
        raise LeaseConfigError(
            f"restart_grace={value!r} is not supported on a Redis Cluster (its marker "
            "would have to live in every slot); use restart_grace=0 and persistence "
            "(appendonly yes) on the cluster's masters"
        )
    return seconds


def split_store_options(url: str) -> tuple[str, dict[str, object]]:
    """``url`` without the store's own query options, and those options (raw strings)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    options: dict[str, object] = {k: v for k, v in query if k in STORE_OPTIONS}
    if not options:
        return url, options
    rest = urlencode([(k, v) for k, v in query if k not in STORE_OPTIONS])
    return urlunsplit(parts._replace(query=rest)), options


def text(value: bytes | str) -> str:
    """A reply as text (UTF-8)."""
    return value.decode() if isinstance(value, bytes) else value


_HELD_MARKS = (HELD_MARK.encode(), HELD_MARK)


def refused(reply: bytes | str) -> bool:
    """Whether an :data:`ACQUIRE_OR_HOLDER_SCRIPT` reply names the holder (else: a token)."""
    return reply[:1] in _HELD_MARKS


def int_or_none(value: Any) -> int | None:
    """A reply holding a decimal integer as an int; nil as None."""
    return None if value is None else int(value)


def lease_info(key: str, result: Any, decode: Callable[[bytes | str], str]) -> LeaseInfo | None:
    """A LeaseInfo from the ``{owner, token, remaining ms}`` reply of a script, or None."""
    if not result:
        return None
    owner, token, left_ms = result
    return LeaseInfo(key, decode(owner), int(token), max(0, int(left_ms)) / 1000.0)


def not_a_lease(error: BaseException) -> bool:
    """Whether ``error`` is a script's :data:`NOT_A_LEASE` error reply."""
    return str(error).startswith(NOT_A_LEASE)


def glob_escape(value: str) -> str:
    """Escape the characters special to Redis' glob-style MATCH patterns."""
    return "".join("\\" + c if c in "\\*?[]^" else c for c in value)


def blpop_slice(socket_timeout: float | None) -> float:
    """The longest BLPOP (seconds) that still returns before the client's socket times out."""
    if socket_timeout is None:
        return 3600.0
    return max(0.01, socket_timeout - 1.0 if socket_timeout > 2.0 else socket_timeout / 2)


def what(operation: str, key: str | None) -> str:
    """``acquire 'k'`` for a per-key operation, the operation alone otherwise."""
    return operation if key is None else f"{operation} {key!r}"


def host_port(kwargs: Mapping[str, Any]) -> str:
    """``host:port`` of a connection's keywords, an IPv6 host in brackets."""
    host = str(kwargs.get("host", "localhost"))
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{kwargs.get('port', 6379)}"


def error_text(where: str, operation: str, key: str | None, detail: str) -> str:
    """The text of a store error, not yet redacted."""
    return f"Redis store {where}: {what(operation, key)} {detail}"


def failed(exc: BaseException) -> str:
    """``failed: <driver error class>: <server's message>``, for :func:`error_text`."""
    return f"failed: {type(exc).__name__}: {exc}"


def describe_server(kwargs: Mapping[str, Any], *, ssl: bool) -> str:
    """A standalone server's address for messages: ``redis://host:port/db``, ``rediss://...``
    (``ssl``) or ``unix://path?db=n``, from its connection keywords. Never a password."""
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={db}"
    return f"{'rediss' if ssl else 'redis'}://{host_port(kwargs)}/{db}"


def socket_timeout_of(kwargs: Mapping[str, Any]) -> float | None:
    """The ``socket_timeout`` (seconds) of a client's connection keywords, None for none."""
    value = kwargs.get("socket_timeout")
    return None if value is None else float(value)


WIDTHS_KEPT = 4096
"""Keys whose slot width a store remembers (the most; the oldest is forgotten first)."""


class SlotWidths:
    """The width (1 + the highest slot given) a store last saw for each key whose width once
    exceeded the limit it was asked with: the slot leases its next slot script declares beyond
    the limit (at most :data:`WIDTHS_KEPT` keys, the oldest forgotten first; thread-safe)."""

    def __init__(self) -> None:
        self._widths: dict[str, int] = {}
        self._lock = threading.Lock()

    def declared(self, key: str, limit: int) -> int:
        """How many slot leases a slot script on ``key`` with ``limit`` declares."""
        return max(limit, self._widths.get(key, 0))

    def saw(self, key: str, width: int, limit: int) -> None:
        """Remember ``width`` of ``key``, read by a call with ``limit`` (a key not remembered
        yet only when ``width`` exceeds ``limit``)."""
        with self._lock:
            if key not in self._widths:
                if width <= limit:
                    return
                if len(self._widths) >= WIDTHS_KEPT:
                    del self._widths[next(iter(self._widths))]
            self._widths[key] = min(width, MAX_LIMIT)


class StoreBase:
    """The I/O-free part of both Redis stores: keys, options, script arguments, replies, errors."""

    _logger: logging.Logger
    _prefix: str
    _min_replicas: int
    _replica_timeout: float
    _restart_grace: float
    _grace_until = 0.0  # the end of the last grace logged (server seconds)
    _secrets: tuple[str, ...] = ()
    _slot_widths: SlotWidths

    def _where(self) -> str:
        """The store's address for messages (never a password)."""
        raise NotImplementedError

    @property
    def prefix(self) -> str:
        """The prefix of every key the store writes."""
        return self._prefix

    def _base(self, key: str) -> str:
        """``<prefix>{<key>}``; for a slot's store key ``k`` U+001F ``i``: ``<prefix>{<k>}``
        U+001F ``i`` (the hash tag of its key: a key's slots share one Cluster hash slot)."""
        if not isinstance(key, str) or not key or key.startswith("}"):
            # '{}' or '{}...' is no hash tag: the three keys would land in different slots.
            raise LeaseConfigError(f"key={key!r} must be a non-empty string not starting with '}}'")
        if SLOT_MARK in key:
            head, _, slot = key.rpartition(SLOT_MARK)
            if slot.isdigit() and slot.isascii():
                if not head or head.startswith("}"):
                    raise LeaseConfigError(
                        f"key={key!r} is a slot of {head!r}, which must be a non-empty string "
                        "not starting with '}'"
                    )
                return f"{self._prefix}{{{head}}}{SLOT_MARK}{slot}"
        return f"{self._prefix}{{{key}}}"

    def lease_key(self, key: str) -> str:
        """The Redis key of the lease hash of ``key``: ``<prefix>{<key>}:lease`` (of slot ``i``
        of ``k``: ``<prefix>{<k>}`` U+001F ``i`` ``:lease``)."""
        return self._base(key) + ":lease"

    def token_key(self, key: str) -> str:
        """The Redis key of the token counter of ``key``: ``<prefix>{<key>}:token``."""
        return self._base(key) + ":token"

    def signal_key(self, key: str) -> str:
        """The Redis key of the release-signal list of ``key``: ``<prefix>{<key>}:signal``;
        a slot's is its key's (a release of any slot wakes the key's waiters)."""
        return self._base(release_channel(key)) + ":signal"

    def slots_key(self, key: str) -> str:
        """The Redis key of the slot counter hash of ``key``, ``<prefix>{<key>}:slots``:
        ``{token, width}``, the last token given to a slot of ``key`` and 1 + the highest slot
        given, dropped after 7 days without a slot acquire."""
        return self._base(key) + ":slots"

    def _store_key(self, lease_key: str) -> str | None:
        """The store key whose lease hash is ``lease_key`` (a name :meth:`lease_key` makes,
        found by a scan), or None for another name."""
        inner = lease_key[len(self._prefix) + 1 : -len(":lease")]
        if inner.endswith("}"):
            key = inner[:-1]
        else:
            head, mark, slot = inner.rpartition(SLOT_MARK)
            if not (mark and head.endswith("}")):
                return None
            key = head[:-1] + SLOT_MARK + slot
        try:
            return key if self.lease_key(key) == lease_key else None
        except LeaseConfigError:
            return None

    def _counted_key(self, key: str) -> str | None:
        """The key whose slot counter ``key`` names (a slot's store key or
        :func:`~celery_lease.stores.slots.counter_key`), or None."""
        if SLOT_MARK not in key:
            return None
        head, slot = split_slot(key)
        if slot is None:
            if not key.endswith(SLOT_MARK):
                return None
            head = key[:-1]
        return head if head and SLOT_MARK not in head else None

    @property
    def marker_key(self) -> str:
        """The Redis key of the store's marker hash, ``<prefix>marker``: ``{boot, started,
        cause}`` of the server run, written by its first acquire, never expiring (see
        ``restart_grace``)."""
        return self._prefix + MARKER

    def _acquire_call(
        self, script: Script, key: str, owner: str, ttl_ms: int
    ) -> tuple[Script, tuple[str, ...], tuple[str | int, ...]]:
        """``(script, keys, args)`` of an acquire (with the marker and grace when set)."""
        base = self._base(key)
        keys: tuple[str, ...] = (base + ":lease", base + ":token")
        args: tuple[str | int, ...] = (owner, int(ttl_ms), TOKEN_TTL_MS)
        if self._restart_grace:
            script = WITH_GRACE[script]
            keys += (self.marker_key,)
            args += (round(self._restart_grace * 1_000_000),)
        return script, keys, args

    def _slot_call(
        self, key: str, owner: str, ttl_ms: int, limit: int, width: int = 0
    ) -> tuple[Script, tuple[str, ...], tuple[str | int, ...], int]:
        """``(script, keys, args, n)`` of :data:`ACQUIRE_SLOT` (with the marker and grace when
        set), declaring the ``n`` slots below the larger of ``limit``, ``width`` and the width
        last seen for ``key``; ``LeaseConfigError`` (a ``ValueError``) for a bad ``key`` or
        ``limit``."""
        check_slot_request(key, limit)
        base = self._base(key)
        n = max(width, self._slot_widths.declared(key, limit))
        keys = (base + ":slots", *self._slot_leases(base, n))
        args: tuple[str | int, ...] = (owner, int(ttl_ms), TOKEN_TTL_MS, limit, n)
        if self._restart_grace:
            keys += (self.marker_key,)
            args += (round(self._restart_grace * 1_000_000),)
        return ACQUIRE_SLOT, keys, args, n

    @staticmethod
    def _slot_leases(base: str, n: int) -> tuple[str, ...]:
        """The lease hashes of slots 0 .. ``n`` - 1 of the key whose ``_base`` is ``base``."""
        head = base + SLOT_MARK
        return tuple(f"{head}{slot}:lease" for slot in range(n))

    def _wider(self, operation: str, key: str, limit: int, n: int, reply: Any) -> int | None:
        """The width a slot script on ``key`` that declared ``n`` slots asks to be called again
        with (remembered for ``key``), else None (``reply`` is its answer)."""
        wanted = width_wanted(reply)
        if wanted is None:
            return None
        if not n < wanted <= MAX_LIMIT:
            raise self._error(operation, key, f"answered width {wanted} to a call declaring {n}")
        self._slot_widths.saw(key, wanted, limit)
        return wanted

    def _granted_slot(self, key: str, limit: int, reply: Any) -> tuple[int, int] | None:
        """``(slot, token)`` of an :data:`ACQUIRE_SLOT` answer (its width remembered for
        ``key``), or None for a refusal."""
        if reply is None:
            return None
        self._slot_widths.saw(key, stored_width(reply), limit)
        return slot_reply(reply)

    def _release_call(self, key: str, owner: str) -> tuple[tuple[str, str], tuple[str, int, int]]:
        """``(keys, args)`` of :data:`RELEASE`."""
        base = self._base(key)
        if split_slot(key)[1] is None:
            return (base + ":lease", base + ":signal"), (owner, SIGNAL_TTL_MS, 1)
        return (base + ":lease", self.signal_key(key)), (owner, SIGNAL_TTL_MS, MAX_LIMIT)

    def _force_release_call(self, key: str) -> tuple[tuple[str, str], tuple[int, int]]:
        """``(keys, args)`` of :data:`FORCE_RELEASE`."""
        keep = 1 if split_slot(key)[1] is None else MAX_LIMIT
        return (self.lease_key(key), self.signal_key(key)), (SIGNAL_TTL_MS, keep)

    def _owners_slot_call(
        self, key: str, owner: str, limit: int, width: int = 0
    ) -> tuple[tuple[str, ...], tuple[str | int, ...], int]:
        """``(keys, args, n)`` of :data:`RELEASE_OWNERS_SLOT`, declaring the ``n`` slots
        :meth:`_slot_call` declares."""
        base = self._base(key)
        n = max(width, self._slot_widths.declared(key, limit))
        keys = (base + ":slots", base + ":signal", *self._slot_leases(base, n))
        return keys, (owner, SIGNAL_TTL_MS, n), n

    def _mark_call(
        self, key: str, ticket: int | None, holder: str | None
    ) -> tuple[tuple[str, str], tuple[str | int, ...]]:
        """``(keys, args)`` of :data:`MARK_REPLACED`; ``LeaseConfigError`` for a bad argument."""
        if not isinstance(key, str) or SLOT_MARK in key:
            raise LeaseConfigError(
                f"mark_replaced(key={key!r}): needs a key without U+001F (a key, not a slot)"
            )
        if ticket is not None and (isinstance(ticket, bool) or not isinstance(ticket, int)):
            raise LeaseConfigError(f"mark_replaced(ticket={ticket!r}): needs an int or None")
        if holder is not None and not isinstance(holder, str):
            raise LeaseConfigError(f"mark_replaced(holder={holder!r}): needs an owner id or None")
        base = self._base(key)
        args: tuple[str | int, ...] = (
            "" if ticket is None else ticket,
            "0" if holder is None else "1",
            "" if holder is None else holder,
            TOKEN_TTL_MS,
        )
        return (base + ":lease", base + ":token"), args

    def _mark_reply(self, ticket: int | None, reply: Any) -> tuple[int, str | None, bool]:
        """``(ticket, holder, asked)`` of a :data:`MARK_REPLACED` reply."""
        drawn, owner, asked = reply
        holder = None if owner is None else self._decode(owner)
        return (int(drawn) if ticket is None else ticket), holder, bool(asked)

    def _decode(self, value: bytes | str) -> str:
        """A reply's text as an owner id (UTF-8; the sync store decodes as its client does)."""
        return text(value)

    @property
    def replica_timeout(self) -> float:
        """Seconds one ``WAIT`` may block for :attr:`min_replicas` acknowledgements."""
        return self._replica_timeout

    def _wait_args(self) -> tuple[int, int] | None:
        """``(numreplicas, timeout ms)`` of the WAIT that follows a write, or None (no WAIT)."""
        if not self._min_replicas:
            return None
        return self._min_replicas, max(1, round(self._replica_timeout * 1000))

    @property
    def min_replicas(self) -> int:
        """Replicas that must acknowledge an acquire or a renewal (0: no ``WAIT``)."""
        return self._min_replicas

    def _confirmed(self, acks: int | None) -> bool:
        """Whether a write's ``acks`` (None: no WAIT) satisfy :attr:`min_replicas`."""
        return acks is None or acks >= self._min_replicas

    def _renewed(self, key: str, reply: Any, acks: int | None) -> bool:
        """A renewal's answer; a renewal too few replicas acknowledged raises."""
        renewed = bool(reply)
        if renewed and not self._confirmed(acks):
            assert acks is not None
            raise self._unconfirmed(
                "renew", key, acks, "its holder keeps its last confirmed expiry"
            )
        return renewed

    @property
    def restart_grace(self) -> float:
        """Seconds after its start a server that may have lost leases refuses free keys
        (0: no grace)."""
        return self._restart_grace

    def _outside_grace(self, key: str, reply: Any) -> Any:
        """``reply``; a refusal of a free key by a restart grace raised (logged once a grace)."""
        if not in_grace(reply):
            return reply
        grace = Grace.parse(reply)
        detail = grace.explain(self._restart_grace, SYSTEM_CLOCK.time())
        error = RestartGraceError(
            self._redact(error_text(self._where(), "acquire", key, detail)), grace.until
        )
        if grace.until != self._grace_until:
            self._grace_until = grace.until
            self._logger.warning("%s", error)
        raise error

    def _redact(self, message: str) -> str:
        return mask_secrets(message, self._secrets)

    def _error(self, operation: str, key: str | None, detail: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            self._redact(error_text(self._where(), operation, key, detail))
        )

    def _log_retry(self, operation: str, key: str | None, exc: BaseException) -> None:
        self._logger.info(
            "Redis store %s: retrying %s once after %s: %s",
            self._where(),
            what(operation, key),
            type(exc).__name__,
            self._redact(str(exc)),
        )

    def _unconfirmed(
        self, operation: str, key: str | None, acks: int, after: str, asks: int = 0
    ) -> StoreUnavailableError:
        """A write too few replicas acknowledged: ``ReplicaLagError`` for an acquire asked
        ``asks`` times, else ``StoreUnavailableError``."""
        times = "" if asks <= 1 else f" (asked {asks} times over {CONFIRM_WINDOW:g} s)"
        detail = (
            f"not confirmed: {acks} of {self._min_replicas} replicas acknowledged it within "
            f"{self._replica_timeout * 1000:g} ms{times} (min_replicas={self._min_replicas}; "
            f"0 accepts writes a failover may lose); {after}"
        )
        message = self._redact(error_text(self._where(), operation, key, detail))
        return ReplicaLagError(message) if asks else StoreUnavailableError(message)

    def _given_up(
        self, key: str, acks: int, asks: int, release_failed: Exception | None
    ) -> StoreUnavailableError:
        """The (logged) error of an acquire unconfirmed within :data:`CONFIRM_WINDOW`, its lease
        released (or ``release_failed``)."""
        if release_failed is None:
            after = "the lease was released"
        else:
            self._logger.warning(
                "Redis store: releasing an unconfirmed lease failed: %s", release_failed
            )
            after = "releasing it failed too: it expires within its ttl"
        error = self._unconfirmed("acquire", key, acks, after, asks)
        self._logger.warning("%s; asked again within the caller's wait", error)
        return error


def blpop_waits(
    timeout: float, socket_timeout: float | None, monotonic: Callable[[], float]
) -> Iterator[float]:
    """The BLPOP timeouts (seconds, never 0: that blocks forever) of a wait of ``timeout``
    seconds, each shorter than the client's ``socket_timeout``."""
    deadline = monotonic() + timeout
    step = blpop_slice(socket_timeout)
    while (left := deadline - monotonic()) > 0:
        yield max(0.001, round(min(left, step), 3))
