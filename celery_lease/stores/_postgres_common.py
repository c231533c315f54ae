"""What the PostgreSQL store and its asyncio twin share: the table, the SQL, the DSN, the errors.

Both run the statements rendered by :func:`statements` on the same table, so sync and async
holders of a key exclude each other. A pool outage is logged once (:class:`ConnectFailures`,
:func:`fold_pool_record`).

Slots and replace use the same table, with no other column. Slot ``i`` of ``k`` is the row of
``slot_key(k, i)``; ``k``'s slot counter is the token of the row ``counter_key(k)`` (owner NULL,
expires ``-infinity``: never live). :func:`slot_plan` and :func:`replace_plan` are the
multi-statement transactions of ``acquire_slot`` and ``mark_replaced``, written once as
generators that both stores drive (one yields a statement, the driver sends back its rows).

A holder asked to stop (``mark_replaced``) has ``REPLACED_MARK`` appended to its stored owner,
and its own token is copied to the row ``k + U+001F + "holder"`` (:data:`HOLDER_SUFFIX`; owner
NULL, never live). From then on ``k``'s row's token is only the key's counter: a ticket drawn
while the holder is marked goes there, and the next acquire's token (drawn from that column, as
always, in the one statement that locks the row) exceeds it; the plain statements read nothing
more. ``get``, ``list`` and ``force_release`` show a marked holder's own token from its holder
row; ``last_token`` is the larger of the key's last token and the last ticket drawn for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, unquote_plus

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores.base import LeaseInfo, mask_secrets, redact_url, secrets_among
from celery_lease.stores.slots import (
    MAX_LIMIT,
    REPLACED_MARK,
    SLOT_MARK,
    counter_key,
    marked,
    release_channel,
    slot_key,
    split_slot,
    unmarked,
)

DEFAULT_TABLE = "celery_lease"

# One or two dot-separated parts ("table" or "schema.table"), each a plain identifier.
_TABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(?:\.[A-Za-z_][A-Za-z0-9_]{0,62})?")
_MAX_CHANNEL = 63  # PostgreSQL's NAMEDATALEN - 1: pg_notify refuses longer channel names

_SCHEMA_TEMPLATE = """\
CREATE TABLE IF NOT EXISTS {table} (
    key text COLLATE "C" PRIMARY KEY,
    owner text NULL,
    expires timestamptz NOT NULL,
    token bigint NOT NULL
)"""

# The server's clock in whole microseconds since the epoch: the floor of every new token.
_NOW_US = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"

# Params: key, owner, ttl_ms. Returns one row (token) when taken, or already held by this owner
# (then its token is kept and its expiry set to now + ttl); no row when another owner's lease is
# live. (In SET, t.* are the old values.)
_ACQUIRE = f"""\
INSERT INTO {{table}} AS t (key, owner, expires, token)
VALUES (%(key)s, %(owner)s, clock_timestamp() + %(ttl_ms)s * interval '1 millisecond', {_NOW_US})
ON CONFLICT (key) DO UPDATE
    SET owner = EXCLUDED.owner,
        expires = clock_timestamp() + %(ttl_ms)s * interval '1 millisecond',
        token = CASE WHEN t.owner = EXCLUDED.owner AND t.expires > clock_timestamp()
                     THEN t.token
                     ELSE GREATEST(t.token + 1, {_NOW_US}) END
    WHERE t.owner IS NULL OR t.owner = EXCLUDED.owner OR t.expires <= clock_timestamp()
RETURNING t.token"""

HOLDER_SUFFIX = SLOT_MARK + "holder"
"""Appended to a key to name the row keeping the own token of the key's holder while it is
marked as asked to stop (its token; owner NULL, never a lease)."""

# The holder's own token of a row of {table} aliased t: from its holder row while the owner is
# marked, else the row's token.
_HOLDER_TOKEN = f"""CASE WHEN right(t.owner, {len(REPLACED_MARK)}) = chr({ord(SLOT_MARK)}) || \
'{REPLACED_MARK[1:]}'
    THEN coalesce((SELECT holder.token FROM {{table}} AS holder
                   WHERE holder.key = t.key || chr({ord(SLOT_MARK)}) || '{HOLDER_SUFFIX[1:]}'),
                  t.token)
    ELSE t.token END"""

# Params: key, owner, ttl_ms. rowcount 1 when renewed, 0 when owner has no live lease.
_RENEW = """\
UPDATE {table}
SET expires = clock_timestamp() + %(ttl_ms)s * interval '1 millisecond'
WHERE key = %(key)s AND owner = %(owner)s AND expires > clock_timestamp()"""

# Params: keys, owners, ttls (three parallel arrays). Returns the (key, owner) pairs renewed.
_RENEW_MANY = """\
UPDATE {table} AS t
SET expires = clock_timestamp() + b.ttl_ms * interval '1 millisecond'
FROM unnest(%(keys)s::text[], %(owners)s::text[], %(ttls)s::bigint[]) AS b(key, owner, ttl_ms)
WHERE t.key = b.key AND t.owner = b.owner AND t.expires > clock_timestamp()
RETURNING t.key, t.owner"""

# Params: key, owner, marked (the owner as stored once asked to stop), channel, payload
# (notify_payload(release_channel(key))). Clears owner (the row and its counter stay) and
# notifies the channel with the payload, in one statement; returns one row when something was
# released.
_RELEASE = """\
WITH released AS (
    UPDATE {table} SET owner = NULL
    WHERE key = %(key)s AND owner IN (%(owner)s, %(marked)s)
    RETURNING key
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM released"""

# Params: first, end (a key's slot range, first <= key < end), owner, channel, payload. Clears
# every slot of the key that owner holds (undoing an interrupted acquire_slot) and notifies.
_RELEASE_SLOTS = """\
WITH released AS (
    UPDATE {table} SET owner = NULL
    WHERE key >= %(first)s AND key < %(end)s AND owner = %(owner)s
    RETURNING key
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM released LIMIT 1"""

# Params: key. Locks a counter's row (none: no row).
_LOCK_COUNTER = "SELECT token FROM {table} WHERE key = %(key)s FOR UPDATE"

# Params: key. Creates a missing counter row (token 0, never live) or locks the existing one.
_CREATE_COUNTER = """\
INSERT INTO {table} AS t (key, owner, expires, token) VALUES (%(key)s, NULL, '-infinity', 0)
ON CONFLICT (key) DO UPDATE SET token = t.token
RETURNING t.token"""

# Params: first, end. Every row of a key's slot range: (key, owner, token, live).
_SLOT_ROWS = """\
SELECT key, owner, token, owner IS NOT NULL AND expires > clock_timestamp()
FROM {table} WHERE key >= %(first)s AND key < %(end)s"""

# Params: keys. Clears the rows of a key's slot range read as expired but not released (their
# holders stopped renewing; the token stays), so no later acquire_slot reads them doubtful
# again. A renewal of one of them still running is waited for, and a row it renewed (or
# released) since the read is left alone. Returns (key, token) of each row cleared.
_CLEAR_DEAD_SLOTS = """\
UPDATE {table} SET owner = NULL
WHERE key = ANY(%(keys)s::text[]) AND owner IS NOT NULL AND expires <= clock_timestamp()
RETURNING key, token"""

# Params: keys. Rows of a key's slot range, read again in a new statement (after
# clear_dead_slots waited for their renewals): (key, owner, token, live).
_RECHECK_SLOTS = """\
SELECT key, owner, token, owner IS NOT NULL AND expires > clock_timestamp()
FROM {table} WHERE key = ANY(%(keys)s::text[])"""

# Params: key, owner, ttl_ms. Renews a live lease; returns its token (no row: not renewed).
_EXTEND = """\
UPDATE {table}
SET expires = clock_timestamp() + %(ttl_ms)s * interval '1 millisecond'
WHERE key = %(key)s AND owner = %(owner)s AND expires > clock_timestamp()
RETURNING token"""

# Params: counter, last, key (the slot's), owner, ttl_ms. Draws the next token from the
# counter (above its own value, last and the clock) and gives the free slot that token; no row
# when the slot turned out live.
_TAKE_SLOT = f"""\
WITH counter AS (
    UPDATE {{table}} SET token = GREATEST(token + 1, %(last)s + 1, {_NOW_US})
    WHERE key = %(counter)s
    RETURNING token
)
INSERT INTO {{table}} AS t (key, owner, expires, token)
SELECT %(key)s, %(owner)s, clock_timestamp() + %(ttl_ms)s * interval '1 millisecond', token
FROM counter
ON CONFLICT (key) DO UPDATE
    SET owner = EXCLUDED.owner, expires = EXCLUDED.expires, token = EXCLUDED.token
    WHERE t.owner IS NULL OR t.expires <= clock_timestamp()
RETURNING t.token"""

# Params: key. Locks a key's row, created (free, token 0) when missing: (owner, token, live).
_LOCK_KEY = """\
INSERT INTO {table} AS t (key, owner, expires, token) VALUES (%(key)s, NULL, '-infinity', 0)
ON CONFLICT (key) DO UPDATE SET token = t.token
RETURNING t.owner, t.token, t.owner IS NOT NULL AND t.expires > clock_timestamp()"""

# Params: key. Draws a ticket into a key's row (its counter: the key is free or its holder
# marked), above the row's token and the clock.
_DRAW_TICKET = f"""\
UPDATE {{table}} SET token = GREATEST(token + 1, {_NOW_US}) WHERE key = %(key)s RETURNING token"""

# Params: key, holder (the key's holder row). A ticket above a key's row's token and the clock,
# set aside in the key's holder row (the key's unmarked holder keeps the row's token; the holder
# row is unused until it is marked): last_token counts it.
_SET_ASIDE_TICKET = f"""\
INSERT INTO {{table}} AS t (key, owner, expires, token)
SELECT %(holder)s, NULL, '-infinity', GREATEST(token + 1, {_NOW_US})
FROM {{table}} WHERE key = %(key)s
ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token
RETURNING t.token"""

# Params: key (a key's holder row), token. Keeps a marked holder's own token.
_SAVE_HOLDER = """\
INSERT INTO {table} AS t (key, owner, expires, token) VALUES (%(key)s, NULL, '-infinity', %(token)s)
ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token"""

# Params: key, owner (as stored), marked. Asks the holder to stop.
_MARK = "UPDATE {table} SET owner = %(marked)s WHERE key = %(key)s AND owner = %(owner)s"

# Params: key, channel, payload (notify_payload(key)). Returns (key, owner, token, expires_in
# seconds) of the lease removed.
_FORCE_RELEASE = f"""\
WITH live AS (
    SELECT key, owner, {_HOLDER_TOKEN} AS token, expires FROM {{table}} AS t
    WHERE key = %(key)s AND owner IS NOT NULL AND expires > clock_timestamp()
    FOR UPDATE
), released AS (
    UPDATE {{table}} AS t SET owner = NULL FROM live WHERE t.key = live.key
    RETURNING live.key, live.owner, live.token, live.expires
)
SELECT key, owner, token,
       greatest(0, extract(epoch FROM expires - clock_timestamp()))::float8,
       pg_notify(%(channel)s, %(payload)s)
FROM released"""

# Params: key. Returns (key, owner, token, expires_in seconds) of a live lease.
_GET = f"""\
SELECT key, owner, {_HOLDER_TOKEN},
       greatest(0, extract(epoch FROM expires - clock_timestamp()))::float8
FROM {{table}} AS t
WHERE key = %(key)s AND owner IS NOT NULL AND expires > clock_timestamp()"""

# Params: pattern (a LIKE prefix pattern, escaped). Live leases, in key ("C", byte) order.
_LIST = f"""\
SELECT key, owner, {_HOLDER_TOKEN},
       greatest(0, extract(epoch FROM expires - clock_timestamp()))::float8
FROM {{table}} AS t
WHERE key LIKE %(pattern)s AND owner IS NOT NULL AND expires > clock_timestamp()
ORDER BY key"""

# Params: none. The key column's collation and whether it
# orders as bytes (C, POSIX, a C.UTF-8 of libc or the builtin provider: code point order is
# UTF-8 byte order); the database's default collation when the column uses it.
_KEY_COLLATION = """\
SELECT c.collname,
       CASE WHEN c.collname = 'default'
            THEN (coalesce(d.db->>'datlocprovider', 'c') IN ('c', 'b')
                  AND coalesce(d.db->>'datlocale', d.db->>'datcollate')
                      IN ('C', 'POSIX', 'C.UTF-8', 'C.utf8'))
            ELSE c.collname IN ('C', 'POSIX', 'ucs_basic', 'pg_c_utf8')
                 OR (c.collprovider IN ('c', 'b')
                     AND coalesce(to_jsonb(c)->>'colllocale', c.collcollate)
                         IN ('C', 'POSIX', 'C.UTF-8', 'C.utf8'))
       END,
       CASE WHEN c.collname = 'default'
            THEN coalesce(d.db->>'datlocale', d.db->>'daticulocale', d.db->>'datcollate') END
FROM pg_attribute AS a
JOIN pg_collation AS c ON c.oid = a.attcollation
CROSS JOIN (SELECT to_jsonb(pg_database) AS db FROM pg_database
            WHERE datname = current_database()) AS d
WHERE a.attrelid = {table_name}::regclass AND a.attname = 'key' AND NOT a.attisdropped"""

# Params: key. Returns the last token issued for the key, live or not, or the last ticket drawn
# for it when larger: the row's token (a marked holder's row carries the last ticket) or its
# holder row's (a ticket set aside while an unmarked holder kept the row).
_LAST_TOKEN = f"""\
SELECT GREATEST(t.token, (
    SELECT holder.token FROM {{table}} AS holder
    WHERE holder.key = t.key || chr({ord(SLOT_MARK)}) || '{HOLDER_SUFFIX[1:]}'))
FROM {{table}} AS t WHERE key = %(key)s"""


def validate_table(table: object) -> str:
    if not isinstance(table, str) or not _TABLE_RE.fullmatch(table):
        raise LeaseConfigError(
            f"table={table!r} must be an identifier (letters, digits, _; not starting with a "
            "digit; at most 63 characters), optionally schema-qualified as schema.table"
        )
    return table


_TEMPLATES = (
    ("acquire", _ACQUIRE),
    ("renew", _RENEW),
    ("renew_many", _RENEW_MANY),
    ("release", _RELEASE),
    ("force_release", _FORCE_RELEASE),
    ("release_slots", _RELEASE_SLOTS),
    ("lock_counter", _LOCK_COUNTER),
    ("create_counter", _CREATE_COUNTER),
    ("slot_rows", _SLOT_ROWS),
    ("clear_dead_slots", _CLEAR_DEAD_SLOTS),
    ("recheck_slots", _RECHECK_SLOTS),
    ("extend", _EXTEND),
    ("take_slot", _TAKE_SLOT),
    ("lock_key", _LOCK_KEY),
    ("draw_ticket", _DRAW_TICKET),
    ("set_aside_ticket", _SET_ASIDE_TICKET),
    ("save_holder", _SAVE_HOLDER),
    ("mark", _MARK),
    ("get", _GET),
    ("list", _LIST),
    ("last_token", _LAST_TOKEN),
    ("key_collation", _KEY_COLLATION),
    ("schema", _SCHEMA_TEMPLATE),
)


def statements(table: str) -> dict[str, bytes]:
    """Every statement of the store (names as in ``_TEMPLATES``), rendered once for ``table``
    (already validated, quoted in; no connection needed): the SQL of both stores."""
    ident = sql.Identifier(*table.split("."))
    quoted = sql.Literal(ident.as_string())  # the quoted name, as a regclass reads it
    return {
        name: sql.SQL(t).format(table=ident, table_name=quoted).as_bytes(None)
        for name, t in _TEMPLATES
    }


def channel_for(table: str) -> str:
    """The NOTIFY channel of a table: readable when short enough, hashed otherwise."""
    channel = f"celery_lease:{table}"
    if len(channel) > _MAX_CHANNEL:
        channel = "celery_lease:" + hashlib.sha256(table.encode()).hexdigest()[:32]
    return channel


NOTIFY_KEY_BYTES = 1000
"""The longest key (UTF-8 bytes) a release notification carries as is; a longer key is
announced by its digest (see :func:`notify_payload`)."""

INDEX_KEY_BYTES = 2704
"""PostgreSQL's limit on one entry of a btree index (version 4, 8 kB pages), in bytes: the
primary key holds a key of at most about this size after compression (a random key cannot be
compressed; a repetitive one may be much longer)."""


PLAN_IDLE_SHARE = 0.5
"""A plan transaction's ``idle_in_transaction_session_timeout``, as a share of the store's
statement timeout: a member stalled between two statements of ``acquire_slot`` or
``mark_replaced`` (a paused process, a blocked event loop, a partition) holds row locks; the
server ends its session this long after its last statement, so a statement of another member
queued on those locks (a holder's renew or release, another ``acquire_slot``) still gets them
within its own statement timeout. A healthy client sends the next statement within
milliseconds."""

PLAN_LOCK_SHARE = 1.0
"""A plan transaction's ``lock_timeout``, as a share of the store's statement timeout: a plan
statement waits for a row lock no longer than the store's statement timeout, also on a pool
passed in (which carries no ``statement_timeout`` of the store) and in the async store (whose
own bound is measured by the client)."""

_PLAN_SETTINGS = (
    "SELECT set_config('lock_timeout', {lock}, true),"
    " set_config('idle_in_transaction_session_timeout', {idle}, true)"
)


def plan_settings(statement_timeout: float) -> bytes:
    """The statement opening every plan transaction: ``SET LOCAL lock_timeout`` and ``SET LOCAL
    idle_in_transaction_session_timeout`` (:data:`PLAN_LOCK_SHARE`, :data:`PLAN_IDLE_SHARE` of
    ``statement_timeout`` seconds; at least 1 ms each, as 0 would turn them off). Local to the
    transaction, so a pool passed in keeps its own settings."""

    def millis(share: float) -> sql.Literal:
        return sql.Literal(f"{max(1, round(statement_timeout * share * 1000))}ms")

    query = sql.SQL(_PLAN_SETTINGS).format(
        lock=millis(PLAN_LOCK_SHARE), idle=millis(PLAN_IDLE_SHARE)
    )
    return query.as_bytes(None)


Step = tuple[bytes, dict[str, Any]]
"""One statement of a plan and its parameters."""

Rows = list[tuple[Any, ...]]
"""What a driver sends back for a step: the rows the statement returned (none: ``[]``)."""


def check_slot_request(key: str, limit: int) -> None:
    """ValueError for a ``limit`` outside 1 .. MAX_LIMIT (or not an int) or a key holding
    U+001F, before any I/O."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"acquire_slot({key!r}, limit={limit!r}): needs 1 <= limit <= {MAX_LIMIT}")
    if SLOT_MARK in key:
        raise ValueError(f"acquire_slot({key!r}, limit={limit!r}): a key may not contain U+001F")


def check_key_order(store: str, table: str, rows: Rows) -> None:
    """``LeaseConfigError`` unless the ``key_collation`` row says the table's key column orders
    as bytes: a slot acquire reads a key's rows as the primary-key range :func:`slot_range`,
    which holds them all only in byte order (in a linguistic collation U+001F sorts as if
    absent, so a key would see at most one of its slots). Names the table, the collation and
    the ``ALTER TABLE`` fixing it. No row (no ``key`` column): nothing to say here."""
    if not rows:
        return
    ((name, byte_order, default_of),) = rows
    if byte_order:
        return
    collation = f"{name} ({default_of}, the database's)" if default_of else str(name)
    ident = sql.Identifier(*table.split(".")).as_string()
    raise LeaseConfigError(
        f"{store}: slots (acquire_slot) need the key column of table {table!r} in byte order, "
        f"but its collation is {collation!r}; change it with: ALTER TABLE {ident} ALTER COLUMN "
        'key TYPE text COLLATE "C"'
    )


def slot_range(key: str) -> dict[str, str]:
    """``first`` and ``end`` of the primary-key range holding every slot row of ``key`` (and its
    counter and holder rows): ``key + U+001F <= store key < key + U+0020``."""
    return {"first": counter_key(key), "end": key + chr(ord(SLOT_MARK) + 1)}


def _slot_of(key: str, store_key: str) -> int | None:
    """The slot of ``key`` that ``store_key`` names (canonical digits), else None."""
    base, slot = split_slot(store_key)
    if base != key or slot is None or store_key != slot_key(key, slot):
        return None
    return slot


def slot_plan(
    statements: dict[str, bytes], key: str, owner: str, ttl_ms: int, limit: int
) -> Generator[Step, Rows, tuple[int, int] | None]:
    """``acquire_slot`` as one transaction (READ COMMITTED): lock the key's counter row (every
    slot taker queues there), then read the key's slot range in a new statement (so it sees every
    taker that committed before the lock was granted), then renew the owner's own slot or take
    the lowest free one with the next counter token.

    Renewals do not queue on the counter: a slot read as expired but not released may have been
    renewed by a statement that committed after the read began. Those rows (holders that
    stopped renewing) are cleared by an ``UPDATE`` that waits for such a renewal and leaves a
    row it renewed; only rows not cleared are read again, so a slot still held is never
    counted free. Once cleared, a dead holder's row is not touched by later calls (no row lock,
    no write, no WAL per call)."""
    counter = counter_key(key)
    if not (yield statements["lock_counter"], {"key": counter}):
        yield statements["create_counter"], {"key": counter}
    rows = yield statements["slot_rows"], slot_range(key)
    doubtful = {
        row[0]
        for row in rows
        if row[1] is not None and not row[3] and _slot_of(key, row[0]) is not None
    }
    if doubtful:
        rows = [row for row in rows if row[0] not in doubtful]
        cleared = yield statements["clear_dead_slots"], {"keys": sorted(doubtful)}
        rows += [(row_key, None, row_token, False) for row_key, row_token in cleared]
        kept = doubtful - {row[0] for row in cleared}
        if kept:  # renewed since the read: rare (a renewal racing its own expiry)
            rows += yield statements["recheck_slots"], {"keys": sorted(kept)}
    last = 0
    live: set[int] = set()
    mine: int | None = None
    for row_key, row_owner, row_token, row_live in rows:
        slot = _slot_of(key, row_key)
        if row_key == counter or slot is not None:
            last = max(last, int(row_token))
        if slot is None or not row_live:
            continue
        live.add(slot)
        if row_owner == owner and (mine is None or slot < mine):
            mine = slot
    if mine is not None:
        params = {"key": slot_key(key, mine), "owner": owner, "ttl_ms": ttl_ms}
        renewed = yield statements["extend"], params
        if renewed:
            return mine, int(renewed[0][0])
        live.discard(mine)  # expired since it was read: free
    if len(live) >= limit:
        return None
    free = next(slot for slot in range(limit) if slot not in live)
    params = {
        "counter": counter,
        "last": last,
        "key": slot_key(key, free),
        "owner": owner,
        "ttl_ms": ttl_ms,
    }
    taken = yield statements["take_slot"], params
    return (free, int(taken[0][0])) if taken else None


def replace_plan(
    statements: dict[str, bytes], key: str, ticket: int | None, holder: str | None
) -> Generator[Step, Rows, tuple[int, str | None, bool]]:
    """``mark_replaced`` as one transaction: lock the key's row; marking an unmarked holder
    copies its own token to the key's holder row first, so the row's token is the key's counter
    from then on and a drawn ticket goes there. A ticket drawn while another owner than
    ``holder`` holds the key unmarked cannot go into the row (it carries that holder's token):
    it is set aside in the key's holder row, where ``last_token`` counts it; it is above every
    token issued so far, and a later token exceeds it once the clock passed it."""
    ((stored, token, live),) = yield statements["lock_key"], {"key": key}
    current: str | None = None
    asked = False
    keep = True  # whether a drawn ticket can go into the key's row
    if live:
        current, was_asked = unmarked(str(stored))
        asked = holder is None or current == holder
        if asked and not was_asked:
            yield statements["save_holder"], {"key": key + HOLDER_SUFFIX, "token": token}
            yield statements["mark"], {"key": key, "owner": stored, "marked": marked(current)}
        keep = asked or was_asked
    if ticket is None:
        if keep:
            ((drawn,),) = yield statements["draw_ticket"], {"key": key}
        else:
            params = {"key": key, "holder": key + HOLDER_SUFFIX}
            ((drawn,),) = yield statements["set_aside_ticket"], params
        ticket = int(drawn)
    return ticket, current, asked


def notify_payload(key: str) -> str:
    """The ``NOTIFY`` payload announcing a release of ``key`` (what listeners match): the key
    up to :data:`NOTIFY_KEY_BYTES` bytes, a longer one (a payload over 8000 bytes fails the
    release) as ``sha256:`` + the hex digest of its UTF-8 bytes. A short key reading like
    another's digest only wakes that key's waiters spuriously, which waiters allow."""
    if len(key) <= NOTIFY_KEY_BYTES // 4:  # at most 4 bytes a character
        return key
    data = key.encode("utf-8", "surrogatepass")
    if len(data) <= NOTIFY_KEY_BYTES:
        return key
    return "sha256:" + hashlib.sha256(data).hexdigest()


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_URL_OPTION = "create_table"  # the one query parameter of a store URL that is ours, not libpq's


def _take_url_option(dsn: str) -> tuple[str, bool | None]:
    """``dsn`` without ``?create_table=...`` (only URLs carry it; the rest kept byte for
    byte), and its value (None when absent); ``LeaseConfigError`` for a value other than
    true/false, 1/0, yes/no, on/off, or a repeat."""
    if "://" not in dsn or "?" not in dsn:
        return dsn, None
    base, _, rest = dsn.partition("?")
    query, hash_, fragment = rest.partition("#")
    kept, values = [], []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if unquote_plus(name) == _URL_OPTION:
            values.append(unquote_plus(value))
        else:
            kept.append(part)
    if not values:
        return dsn, None
    if len(values) > 1:
        raise LeaseConfigError(
            f"the store URL gives {_URL_OPTION}= {len(values)} times: give it once"
        )
    value = values[0].strip().lower()
    if value not in _TRUE | _FALSE:
        raise LeaseConfigError(
            f"{_URL_OPTION}={values[0]!r} in the store URL must be true or false "
            "(or 1/0, yes/no, on/off)"
        )
    query = "&".join(kept)
    return base + ("?" + query if query else "") + hash_ + fragment, value in _TRUE


def _refuse_split_userinfo(dsn: str) -> None:
    """Refuse (``LeaseConfigError``, the password masked) a URL whose password holds an
    unencoded ``@`` or ``/``: libpq would split it at the first one, connect elsewhere and show
    pieces of the password in every message."""
    if "://" not in dsn:
        return
    rest = dsn.split("://", 1)[1].split("?", 1)[0]
    slash = rest.find("/")
    authority, path = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
    if authority.count("@") > 1 or ("@" in path and ":" in authority and "@" not in authority):
        raise LeaseConfigError(
            f"the store URL {redact_url(dsn)!r} has an '@' or '/' in its user or password part: "
            "percent-encode them ('@' as %40, '/' as %2F, ':' as %3A)"
        )


def _secrets_of(dsn: str, password: str | None) -> tuple[str, ...]:
    """Every form of the DSN's password that could appear in a message (raw, decoded)."""
    found = [password]
    if "://" in dsn:
        rest = dsn.split("://", 1)[1]
        userinfo = rest[: rest.rfind("@")] if "@" in rest else ""
        if ":" in userinfo:
            raw = userinfo.split(":", 1)[1]
            found += [raw, unquote(raw)]
    return secrets_among(found)


_QUOTED = re.compile(r'"([^"]*)"')


def _mask_parse_error(message: str, dsn: str) -> str:
    """libpq's message about a DSN it could not parse, with no piece of the password in it:
    a quoted piece is kept if the masked DSN holds it, masked if a URL, else ``***``."""
    masked_dsn = redact_url(dsn)
    if masked_dsn == dsn:
        return message  # no password in it

    def piece(match: re.Match[str]) -> str:
        quoted = match.group(1)
        if quoted and quoted in masked_dsn:
            return match.group(0)
        redacted = redact_url(quoted)
        return f'"{redacted}"' if redacted != quoted else '"***"'

    return _QUOTED.sub(piece, message)


def describe_error(exc: BaseException) -> str:
    """The server's (or libpq's) own message, on one line, with its SQLSTATE when it has one."""
    text = ""
    sqlstate = None
    if isinstance(exc, psycopg.Error):
        sqlstate = exc.sqlstate
        if sqlstate:
            text = exc.diag.message_primary or ""
    text = " ".join((text or str(exc)).split()) or type(exc).__name__
    return f"{text} (SQLSTATE {sqlstate})" if sqlstate else text


logger = logging.getLogger("celery_lease.stores.postgres")

POOL_NAME = "celery-lease"
"""The name of the sync store's own pool; psycopg_pool's outage records about it are folded."""

OWN_CONNECTION = "celery_lease_own_connection"
"""The class attribute (``True``) marking the connection classes of the stores' own pools."""


class ConnectFailures:
    """The last connect failure of a store's own pool (``None`` after a success); one WARNING
    per outage (its first failure), one INFO at its end. Called on the pool's threads; the
    outage flag is a lock never taken blocking (a fork while it is held blocks nobody)."""

    __slots__ = ("_outage", "attempts", "last", "logger", "what")

    def __init__(
        self, what: str = "the PostgreSQL store", log: logging.Logger | None = None
    ) -> None:
        self.last: str | None = None
        self.logger = logger if log is None else log
        self.what = what
        self.attempts = 0
        self._outage = threading.Lock()

    def failed(self, detail: str) -> None:
        """A connect failed with ``detail``: the outage's WARNING if it is the first."""
        self.last = detail
        self.attempts += 1
        if self._outage.acquire(blocking=False):
            detail = " ".join(detail.split())  # libpq's hint comes on a line of its own
            self.logger.warning(
                "celery-lease: %s cannot connect (%s); retrying. Further connection errors of its"
                " pool are said once, when it connects again",
                self.what,
                detail,
            )

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the block's connect: :meth:`failed` on a driver error (raised again), else
        :meth:`connected`."""
        try:
            yield
        except psycopg.Error as exc:
            self.failed(describe_error(exc))
            raise
        self.connected()

    def connected(self) -> None:
        """A connect succeeded: the end of an outage is said, once."""
        self.last = None
        if self._outage.locked():
            attempts, self.attempts = self.attempts, 0
            try:
                self._outage.release()
            except RuntimeError:  # another success released it first
                return
            self.logger.info(
                "celery-lease: %s connected again after %d failed attempt%s",
                self.what,
                attempts,
                "" if attempts == 1 else "s",
            )
        else:
            self.attempts = 0


ASYNC_POOL_NAME = POOL_NAME + "-async"
OWN_POOL_NAMES: frozenset[str] = frozenset({POOL_NAME, ASYNC_POOL_NAME})
"""The exact names of the stores' own pools (a user's ``celery-lease-orders`` is not one)."""

_NAMING_THE_POOL = frozenset(
    {
        "error connecting in %r: %s",
        # Given up on purpose after the connect timeout (the next call connects at once).
        "reconnection attempt in pool %r failed after %s sec",
    }
)
_NAMING_THE_CONNECTION = frozenset(
    {"discarding broken connection: %s", "discarding closed connection: %s"}
)


def fold_pool_record(record: logging.LogRecord) -> bool:
    """psycopg_pool's logger filter: drop (``False``) the records an outage repeats about the
    stores' own pools (a failed or given-up connect, a broken or closed connection discarded),
    which :class:`ConnectFailures` says once; keep every other record."""
    if record.levelno < logging.WARNING:
        return True
    args = record.args if isinstance(record.args, tuple) else (record.args,)
    if not args:
        return True
    if record.msg in _NAMING_THE_POOL:
        return args[0] not in OWN_POOL_NAMES
    if record.msg in _NAMING_THE_CONNECTION:
        return not getattr(type(args[0]), OWN_CONNECTION, False)
    return True


logging.getLogger("psycopg.pool").addFilter(fold_pool_record)


def target(params: dict[str, Any]) -> str:
    """``host=..., port=..., dbname=...`` of libpq parameters (the password is never shown)."""
    port = params.get("port")
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    return f"host={params.get('host')!r}, port={port!r}, dbname={params.get('dbname')!r}"


SCHEMA_SQL: str = sql.SQL(_SCHEMA_TEMPLATE).format(table=sql.Identifier(DEFAULT_TABLE)).as_string()
"""The ``CREATE TABLE IF NOT EXISTS`` statement for the default table ``celery_lease``."""


def schema_sql(table: str = DEFAULT_TABLE) -> str:
    """The ``CREATE TABLE IF NOT EXISTS`` statement for ``table`` (validated and quoted;
    ``LeaseConfigError`` for a bad one)."""
    ident = sql.Identifier(*validate_table(table).split("."))
    return sql.SQL(_SCHEMA_TEMPLATE).format(table=ident).as_string()


def check_options(
    table: object, connect_timeout: object, max_connections: object, create_table: object
) -> str:
    """Validate the options both stores take; the table name. ``LeaseConfigError`` names the
    first bad one (table, create_table, connect_timeout, max_connections, in that order)."""
    valid_table = validate_table(table)
    if create_table is not None and not isinstance(create_table, bool):
        raise LeaseConfigError(
            f"create_table={create_table!r} must be True or False (or None: the URL's "
            "?create_table=, else True)"
        )
    check_seconds("connect_timeout", connect_timeout)
    if (
        isinstance(max_connections, bool)
        or not isinstance(max_connections, int)
        or max_connections < 1
    ):
        raise LeaseConfigError(f"max_connections={max_connections!r} must be an int >= 1")
    return valid_table


def check_seconds(name: str, value: object) -> None:
    """Raise ``LeaseConfigError`` naming ``name`` unless ``value`` is a number of seconds > 0
    (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LeaseConfigError(f"{name}={value!r} must be a number of seconds > 0")


@dataclass(frozen=True)
class ParsedDSN:
    """A store's DSN or URL, read once (see :func:`parse_dsn`)."""

    dsn: str  # what libpq is given: without ``?create_table=``
    create_table: bool | None  # the keyword, else the URL's; None when neither
    secrets: tuple[str, ...]  # every form of the password, to mask in messages
    where: str  # ``host=..., port=..., dbname=...`` for messages
    application_name: bool  # whether the store names its connections


def parse_dsn(dsn: str, create_table: bool | None) -> ParsedDSN:
    """Read a libpq DSN or URL as both stores do, with the ``create_table`` keyword.
    ``LeaseConfigError`` for a DSN libpq cannot parse (its message, the password masked), a
    password with an unencoded ``@`` or ``/``, or a ``?create_table=`` not a boolean, repeated
    or contradicting the keyword."""
    plain, from_url = _take_url_option(dsn)
    if from_url is not None and create_table is not None and from_url != create_table:
        raise LeaseConfigError(
            f"create_table={create_table!r} contradicts ?create_table= in the store "
            "URL: give one of them"
        )
    _refuse_split_userinfo(plain)
    try:
        params = conninfo_to_dict(plain)
    except psycopg.ProgrammingError as exc:
        hint = ""
        if _URL_OPTION in str(exc):
            hint = " (create_table goes in a URL's query or the create_table= keyword)"
        raise LeaseConfigError(
            "dsn_or_pool is not a valid PostgreSQL DSN or URL: "
            f"{_mask_parse_error(str(exc), plain)}{hint}"
        ) from None
    return ParsedDSN(
        dsn=plain,
        create_table=from_url if create_table is None else create_table,
        secrets=_secrets_of(plain, str(params.get("password") or "")),
        where=target(params),
        application_name="application_name" not in params,
    )


def connect_kwargs(connect_timeout: float, application_name: bool) -> dict[str, Any]:
    """The keywords of a store's own connections: autocommit, libpq's ``connect_timeout``
    (whole seconds, at least 1) and, unless the DSN names them, ``application_name``."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(1, round(connect_timeout)),
    }
    if application_name:
        kwargs["application_name"] = "celery-lease"
    return kwargs


def lease_info(row: Sequence[Any]) -> LeaseInfo:
    """A LeaseInfo from a ``(key, owner, token, expires_in seconds)`` row."""
    return LeaseInfo(str(row[0]), str(row[1]), int(row[2]), float(row[3]))


def token_of(row: Sequence[Any] | None) -> int | None:
    """The token of an acquire's ``RETURNING`` row; None when no row came (refused)."""
    return None if row is None else int(row[0])


MISSING_TABLE = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)
"""Errors of a statement that found no table (or no schema): create it, or say how to."""

CANCELLED_BY_TIMEOUT = (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)
"""The server ended the statement (statement/lock timeout, a cancel): it did nothing, the
connection is sound."""

OVER_A_LIMIT = (
    psycopg.errors.ProgramLimitExceeded,
    psycopg.errors.StatementTooComplex,
    psycopg.errors.TooManyColumns,
    psycopg.errors.TooManyArguments,
)
"""SQLSTATE class 54 (a server limit, e.g. a key too long for the index): psycopg makes it an
``OperationalError`` like a dropped connection, but a retry can only fail again."""

CREATED_CONCURRENTLY = (
    psycopg.errors.UniqueViolation,
    psycopg.errors.DuplicateTable,
    psycopg.errors.DuplicateObject,
)
"""A ``CREATE TABLE IF NOT EXISTS`` that lost a race (IF NOT EXISTS is not atomic)."""


def store_error(
    store: str, operation: str, detail: str, secrets: Sequence[str]
) -> StoreUnavailableError:
    """``<store> failed to <operation>: <detail>``, with every password masked."""
    return StoreUnavailableError(mask_secrets(f"{store} failed to {operation}: {detail}", secrets))


def no_connection_detail(
    connect_timeout: float, last_failure: str | None, exc: BaseException
) -> str:
    """No connection within ``connect_timeout``, and why the last connect failed if known."""
    detail = f"no connection within {connect_timeout:g} s"
    if last_failure is not None:
        return f"{detail}; the last attempt to connect failed: {last_failure}"
    return f"{detail} ({exc})"


def _ddl_hint(table: str) -> str:
    return f"create it with PostgresLockStore.schema_sql({table!r})"


def missing_table_detail(missing: psycopg.Error, table: str, create_table: bool) -> str | None:
    """Why the store will not create a missing table, and how to; None when it may."""
    ddl = _ddl_hint(table)
    if isinstance(missing, psycopg.errors.InvalidSchemaName):
        return (
            f"the schema of table {table!r} does not exist: {describe_error(missing)}; "
            f"create the schema, then {ddl}"
        )
    if not create_table:
        return (
            f"table {table!r} does not exist and create_table=False: {ddl} "
            f"({describe_error(missing)})"
        )
    return None


def log_undo_failed(log: logging.Logger, key: str, why: str, exc: BaseException) -> None:
    """Say that releasing what an interrupted acquire of ``key`` may have taken failed."""
    log.warning(
        "celery-lease: acquire of %r %s and releasing what it may have taken failed (%s); it "
        "expires within its ttl",
        key,
        why,
        exc,
    )


class ListenerRetry:
    """A listener's reconnect backoff (50 ms doubling to 2 s) and one WARNING/INFO per outage."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self._what = what
        self._log = log
        self._backoff = 0.05
        self._failing = False
        self._connected_before = False

    def failed(self, exc: BaseException) -> float:
        """A connect failed: the seconds to wait before the next."""
        if not self._failing:
            self._log.warning(
                "celery-lease: %s failed to connect (%s); retrying until it connects",
                self._what,
                " ".join(str(exc).split()),
            )
        self._failing = True
        wait, self._backoff = self._backoff, min(self._backoff * 2, 2.0)
        return wait

    def connected(self) -> bool:
        """The listener listens again: whether it had before (then wake its waiters: a release
        may have been notified while nobody listened)."""
        if self._failing:
            self._log.info("celery-lease: %s connected again", self._what)
        before = self._connected_before
        self._connected_before, self._backoff, self._failing = True, 0.05, False
        return before


class StoreBase:
    """The I/O-free part of both stores: options, statement parameters, pool options, errors."""

    _logger: logging.Logger
    _table: str
    _channel: str
    _statement_timeout: float
    _create_table: bool
    _connect_timeout: float
    _max_connections: int
    _connection_class: type
    _secrets: tuple[str, ...]
    _sql: dict[str, bytes]
    _plan_settings: bytes
    _key_order_checked: bool  # whether the key column's collation was found in byte order

    def _set_options(
        self,
        table: str,
        connect_timeout: float,
        statement_timeout: float,
        max_connections: int,
        create_table: bool | None,
    ) -> None:
        """Validate (:func:`check_options`) and keep the options, channel and statements."""
        self._table = check_options(table, connect_timeout, max_connections, create_table)
        check_seconds("statement_timeout", statement_timeout)
        self._connect_timeout = float(connect_timeout)
        self._statement_timeout = float(statement_timeout)
        self._max_connections = max_connections
        self._channel = channel_for(self._table)
        self._sql = statements(self._table)
        self._plan_settings = plan_settings(self._statement_timeout)
        self._key_order_checked = False

    @property
    def table(self) -> str:
        """The table name, as given."""
        return self._table

    def _error(self, what: str, key: str | None, detail: str) -> StoreUnavailableError:
        """``<store> failed to <what> [<key>]: <detail>``."""
        operation = what if key is None else f"{what} {key!r}"
        return store_error(repr(self), operation, detail, self._secrets)

    def _refuse_long_key(self, key: str, error: StoreUnavailableError) -> None:
        """LeaseConfigError if ``key`` did not fit the primary-key index (SQLSTATE 54000)."""
        exc = error.__cause__
        if not isinstance(exc, psycopg.errors.ProgramLimitExceeded):
            return
        size = len(key.encode("utf-8", "surrogatepass"))
        raise LeaseConfigError(
            f"key of {size} bytes is too long for {self!r}: its primary-key index holds at most "
            f"{INDEX_KEY_BYTES} bytes (after compression) a key; the server said: "
            f"{describe_error(exc)}. Use a shorter key (e.g. a digest of its long part)"
        ) from exc

    def _check_may_create(self, what: str, key: str | None, missing: psycopg.Error) -> None:
        """Unless the store may create the missing table: how to, as StoreUnavailableError."""
        refusal = missing_table_detail(missing, self._table, self._create_table)
        if refusal is not None:
            raise self._error(what, key, refusal) from missing

    def _failure(
        self,
        what: str,
        key: str | None,
        exc: psycopg.Error,
        *,
        connected: bool,
        first: bool,
        redo: bool = True,
    ) -> StoreUnavailableError | None:
        """The error a statement that raised ``exc`` ends in, or None (logged) to run it once
        more on another connection: only a dropped connection (an ``OperationalError`` once a
        connection was had, but not :data:`OVER_A_LIMIT`, a server limit a retry cannot pass)
        on the ``first`` attempt, when ``redo`` (safe to repeat if it took effect)."""
        detail = describe_error(exc)
        if isinstance(exc, psycopg.OperationalError) and not isinstance(exc, OVER_A_LIMIT):
            if connected and first and redo:
                self._logger.info("celery-lease: retrying %s after %s", what, detail)
                return None
            if connected and not redo:
                detail += "; not retried: it may have taken effect (look with get())"
        elif isinstance(exc, psycopg.errors.InsufficientPrivilege):
            detail = self._denied(exc)
        return self._error(what, key, detail)

    def _denied(self, exc: BaseException, creating: bool = False) -> str:
        """Privileges refused: the grants needed, or (``creating``) how to create the table."""
        table = self._table
        if creating:
            return (
                f"table {table!r} does not exist and this role may not create it: "
                f"{describe_error(exc)}; {_ddl_hint(table)} as its owner, or grant CREATE on "
                "the schema"
            )
        return (
            f"{describe_error(exc)}; the store's role needs USAGE on the table's schema and "
            f"SELECT, INSERT, UPDATE on table {table!r}"
        )

    @property
    def channel(self) -> str:
        """The ``NOTIFY`` channel released keys are announced on (payload: the key, or for a
        key over 1000 bytes ``sha256:`` and its hex digest; see ``notify_payload``)."""
        return self._channel

    def _release_params(self, key: str, owner: str | None = None) -> dict[str, Any]:
        """The parameters of ``release`` (with ``owner``) or ``force_release`` (without)."""
        channel = release_channel(key)
        params = {"key": key, "channel": self._channel, "payload": notify_payload(channel)}
        if owner is not None:
            # The stored owners a release by ``owner`` deletes: ``unmarked(stored)[0] == owner``
            # (an owner id ending in REPLACED_MARK: only its marked form).
            params["owner"] = marked(owner) if owner.endswith(REPLACED_MARK) else owner
            params["marked"] = marked(owner)
        return params

    def _release_slots_params(self, key: str, owner: str) -> dict[str, Any]:
        """The parameters of ``release_slots``: every slot of ``key`` that ``owner`` holds."""
        params = slot_range(key)
        return {
            **params,
            "owner": owner,
            "channel": self._channel,
            "payload": notify_payload(key),
        }

    @property
    def statement_timeout(self) -> float:
        """Seconds one statement of the store may run before it is cancelled."""
        return self._statement_timeout

    def _pool_options(self, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The options of the store's own pool: 1 to ``max_connections``, opened on first use."""
        return {
            "connection_class": self._connection_class,
            "kwargs": kwargs,
            "min_size": 1,
            "max_size": self._max_connections,
            "open": False,
            "timeout": self._connect_timeout,
            # Stop background reconnection after as long as a caller waits, so the next call
            # connects at once instead of after a backoff grown during a long outage.
            "reconnect_timeout": self._connect_timeout,
            "name": name,
        }

    @property
    def create_table(self) -> bool:
        """Whether the store creates its table when a statement finds it missing."""
        return self._create_table
