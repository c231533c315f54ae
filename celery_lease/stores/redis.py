"""Redis store: one Lua script per operation, one round trip each, Redis Cluster ready.

Keys ``celery-lease:{<key>}:lease`` (hash {owner, token}), ``:token`` (the counter) and
``:signal`` (a release wakes a waiter), a key's slots ``celery-lease:{<key>}`` U+001F ``<i>:lease``
and their counter ``:slots``, and ``celery-lease:marker`` (the restart grace). The
scripts: :mod:`~celery_lease.stores._redis_common`; key layout, tokens and guarantees:
docs/stores.md (Redis). Nothing read from Redis is ever unpickled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import redis
import redis.cluster
import redis.sentinel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.durations import Duration
from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores._redis_cluster import Calls, ClusterFanOut, pipelined
from celery_lease.stores._redis_common import (
    ACQUIRE,
    ACQUIRE_OR_HOLDER,
    ACQUIRE_SCRIPT,
    CONFIRM_WINDOW,
    DEFAULT_PREFIX,
    FORCE_RELEASE,
    FORCE_RELEASE_SCRIPT,
    HELD_MARK,
    INSPECT,
    INSPECT_SCRIPT,
    MARK_REPLACED,
    RELEASE,
    RELEASE_OWNERS_SLOT,
    RELEASE_SCRIPT,
    RENEW,
    RENEW_CHUNK,
    RENEW_MANY,
    RENEW_MANY_SCRIPT,
    RENEW_SCRIPT,
    RETRIED,
    WITH_GRACE,
    Script,
    SlotWidths,
    StoreBase,
    blpop_waits,
    failed,
    glob_escape,
    grants,
    int_or_none,
    lease_info,
    min_replicas_of,
    not_a_lease,
    refused,
    replica_timeout_of,
    restart_grace_of,
    slot_reply,
    socket_timeout_of,
    text,
)
from celery_lease.stores._redis_compat import client_retries
from celery_lease.stores._redis_fast import BUSY, FastConnection, fast_path_for, pack_request
from celery_lease.stores._redis_sentinel import (
    Sentinel,
    SentinelURL,
    client_from_url,
    describe_pool,
    follow_master,
    parse_sentinel_url,
    pool_secrets,
)
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import SLOT_MARK, slot_key

__all__ = [
    "ACQUIRE_SCRIPT",
    "FORCE_RELEASE_SCRIPT",
    "INSPECT_SCRIPT",
    "RELEASE_SCRIPT",
    "RENEW_CHUNK",
    "RENEW_MANY_SCRIPT",
    "RENEW_SCRIPT",
    "RedisLockStore",
    "SentinelURL",
    "parse_sentinel_url",
]

logger = logging.getLogger("celery_lease.stores.redis")

_T = TypeVar("_T")


class RedisLockStore(StoreBase):
    """A :class:`~celery_lease.LockStore` on Redis (standalone, Sentinel-managed or Cluster).

    Implements the protocol, :class:`~celery_lease.SupportsReleaseNotify` (waiters block on a
    list, one waiter wakes per release), :class:`~celery_lease.SupportsBatchRenew` (one
    pipelined round trip), :class:`~celery_lease.SupportsInspection`,
    :class:`~celery_lease.stores.base.SupportsSlots` (one script per slot acquire, whatever the
    limit) and :class:`~celery_lease.stores.base.SupportsReplace`.

    Every operation is one EVALSHA round trip, retried once after a connection error or
    timeout (every script is safe to run twice); then, like any other Redis error, it raises
    ``StoreUnavailableError`` naming the store (never a password), the operation, the key and
    the server's message. A store may be made before ``fork()`` (redis-py's pools reconnect).
    A plain standalone client gets the fast path (:mod:`~._redis_fast`). Under Sentinel, writes
    first follow the current master; with ``min_replicas`` > 0 they are confirmed by ``WAIT``
    (an acquire is asked again for up to 1 s, then released and raised as
    ``ReplicaLagError``). Details: docs/stores.md (Redis).

    Args:
        client_or_url: a ``redis.Redis`` (also from ``Sentinel.master_for``) or a
            ``redis.cluster.RedisCluster`` (used as is), or a ``redis://``, ``rediss://``,
            ``unix://`` or ``redis+sentinel://`` URL (see :func:`parse_sentinel_url`), whose
            client gets 5 s socket timeouts unless the URL sets them and no redis-py retries;
            its query may carry ``min_replicas``, ``replica_timeout`` and ``restart_grace``.
        prefix: prepended to every key (default ``"celery-lease:"``); must not contain ``{`` or
            ``}``, which would break the Cluster hash tag.
        min_replicas: replicas that must acknowledge (``WAIT``) an acquire or a renewal before
            it counts. Default (``None``): the URL's ``min_replicas``, else 1 for a
            Sentinel-managed master and 0 (no ``WAIT``) otherwise. Not supported on a Cluster.
        replica_timeout: how long (a duration: seconds, ``"250ms"``) one ``WAIT`` may block.
            Default: the URL's ``replica_timeout``, else 0.2 s; must be shorter than the
            client's ``socket_timeout``.
        restart_grace: how long (a duration) after its start a server that may have lost
            leases (its marker :attr:`marker_key` missing or naming another server run)
            refuses free keys with ``RestartGraceError``, so that every holder of a lost lease
            hears of it first; set it to the longest ttl in use (0: off). Default: the URL's,
            else 0 (the Celery settings default to ``lease_default_ttl``). Not on a Cluster.

    Raises:
        LeaseConfigError: for a bad URL, client, prefix, ``min_replicas``,
            ``replica_timeout`` or ``restart_grace``.
    """

    _logger = logger

    def __init__(
        self,
        client_or_url: str | redis.Redis | redis.cluster.RedisCluster,
        *,
        prefix: str = DEFAULT_PREFIX,
        min_replicas: int | None = None,
        replica_timeout: Duration | None = None,
        restart_grace: Duration | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise LeaseConfigError(
                f"prefix={prefix!r} must be a non-empty string without '{{' or '}}' (the key is "
                "wrapped in a Redis Cluster hash tag)"
            )
        self._prefix = prefix
        self._slot_widths = SlotWidths()
        self._sentinel: redis.sentinel.Sentinel | None = None
        self._client: redis.Redis | redis.cluster.RedisCluster
        options: dict[str, object] = {}
        if isinstance(client_or_url, str):
            self._client, self._sentinel, options = client_from_url(
                client_or_url, redis.Redis, Sentinel, Retry
            )
            self._owns_client = True
        elif isinstance(client_or_url, (redis.Redis, redis.cluster.RedisCluster)):
            self._client = client_or_url
            self._owns_client = False
            _warn_about_client_retries(client_or_url)
        else:
            raise LeaseConfigError(
                f"client_or_url={client_or_url!r} must be a redis.Redis, a "
                "redis.cluster.RedisCluster or a redis://, rediss://, unix:// or "
                "redis+sentinel:// URL"
            )
        kwargs = self._client.get_connection_kwargs()
        self._socket_timeout = socket_timeout_of(kwargs)
        pool = getattr(self._client, "connection_pool", None)
        self._sentinel_pool: redis.sentinel.SentinelConnectionPool | None = (
            pool
            if isinstance(pool, redis.sentinel.SentinelConnectionPool) and pool.is_master
            else None
        )
        cluster = isinstance(self._client, redis.cluster.RedisCluster)
        self._min_replicas = min_replicas_of(
            min_replicas, options, self._sentinel_pool is not None, cluster
        )
        self._replica_timeout = replica_timeout_of(
            replica_timeout, options, self._min_replicas, self._socket_timeout
        )
        self._restart_grace = restart_grace_of(restart_grace, options, cluster)
        self._secrets = _secrets_of(self._client)
        # Sentinel (its master check), WAIT and Cluster routing need redis-py's machinery.
        self._fast: FastConnection | None = None
        if self._min_replicas == 0 and self._sentinel_pool is None:
            self._fast = fast_path_for(self._client)
        self._cluster: ClusterFanOut | None = None
        if isinstance(self._client, redis.cluster.RedisCluster):
            self._cluster = ClusterFanOut(
                self._client, self._socket_timeout, self._eval, self._where, self._redact
            )
        self._encoding = str(kwargs.get("encoding") or "utf-8")
        self._encoding_errors = str(kwargs.get("encoding_errors") or "strict")
        # The constant items of the fast path's acquire and release requests, packed once: an
        # acquire's marker key (after its two keys, with a restart grace) and its last
        # arguments; a key's release's last two arguments (see _acquire_request).
        try:
            _, keys, args = self._acquire_call(ACQUIRE, "k", "", 0)
            self._acquire_marker = self._pack(keys[2:])
            self._acquire_tail = self._pack(args[2:])
            self._release_tail = self._pack(self._release_call("k", "")[1][1:])
        except (UnicodeError, LookupError) as exc:  # every key of the store would fail so
            raise LeaseConfigError(
                f"prefix={prefix!r}: the client's encoding={self._encoding!r}"
                f" (encoding_errors={self._encoding_errors!r}) cannot encode it ({exc}); use a"
                " prefix the client's encoding can write, or a client with encoding='utf-8'"
            ) from exc

    def _pack(self, items: Sequence[str | int]) -> bytes:
        """``items`` as packed request items (text encoded as the client encodes it)."""
        return pack_request(b"", items, self._encoding, self._encoding_errors)

    @property
    def client(self) -> redis.Redis | redis.cluster.RedisCluster:
        """The redis-py client the store talks through."""
        return self._client

    def _eval(self, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One EVALSHA; on NOSCRIPT load the script and evaluate it again."""
        fast = self._fast
        if script.fast and fast is not None:
            try:
                reply = fast.call(self._fast_request(script, keys, args))
            except NoScriptError:  # EVAL with the source on the same connection (no second
                # one: on a slow link a cold start must fit in a ttl)
                reply = fast.call(self._fast_request(script, keys, args, cold=True))
            if reply is not BUSY:  # BUSY: another thread is using the fast connection
                return reply
        return self._eval_pooled(script, keys, args)

    def _eval_pooled(self, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One EVALSHA through redis-py's pool; on NOSCRIPT load the script and evaluate again."""
        try:
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._client.script_load(script.source)
            return self._client.evalsha(script.sha, len(keys), *keys, *args)

    def _fast_request(
        self, script: Script, keys: Sequence[str], args: Sequence[str | int], cold: bool = False
    ) -> bytes:
        """The packed EVALSHA request (``cold``: EVAL with the source) of ``script``."""
        head = script.head_for(len(keys), len(args), cold=cold)
        return pack_request(head, (*keys, *args), self._encoding, self._encoding_errors)

    def _acquire_request(self, script: Script, key: str, owner: str, ttl_ms: int) -> bytes:
        """The packed EVALSHA request of an acquire ``script`` (a key of :data:`WITH_GRACE`),
        byte for byte the :meth:`_fast_request` of :meth:`_acquire_call`'s call: the same
        strings encoded, in the same order (and raising as it raises), its constant items packed
        at start-up."""
        if type(owner) is not str:
            return self._fast_request(*self._acquire_call(script, key, owner, ttl_ms))
        base = self._base(key)
        ttl = b"%d" % int(ttl_ms)
        enc, errors = self._encoding, self._encoding_errors
        lease = (base + ":lease").encode(enc, errors)
        token = (base + ":token").encode(enc, errors)
        who = owner.encode(enc, errors)
        head = WITH_GRACE[script].head if self._restart_grace else script.head
        return b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n%s$%d\r\n%s\r\n$%d\r\n%s\r\n%s" % (
            head,
            len(lease),
            lease,
            len(token),
            token,
            self._acquire_marker,
            len(who),
            who,
            len(ttl),
            ttl,
            self._acquire_tail,
        )

    def _release_request(self, key: str, owner: str, cold: bool = False) -> bytes:
        """The packed EVALSHA request (``cold``: EVAL with the source) of :data:`RELEASE`,
        byte for byte the :meth:`_fast_request` of :meth:`_release_call`'s call; for a key (not
        a slot) and a ``str`` owner its constant items packed at start-up."""
        if type(key) is not str or SLOT_MARK in key or type(owner) is not str:
            return self._fast_request(RELEASE, *self._release_call(key, owner), cold=cold)
        base = self._base(key)
        enc, errors = self._encoding, self._encoding_errors
        lease = (base + ":lease").encode(enc, errors)
        signal = (base + ":signal").encode(enc, errors)
        who = owner.encode(enc, errors)
        return b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n%s" % (
            RELEASE.cold_head if cold else RELEASE.head,
            len(lease),
            lease,
            len(signal),
            signal,
            len(who),
            who,
            self._release_tail,
        )

    def _eval_acquire(
        self, script: Script, key: str, owner: str, ttl_ms: int, request: bytes
    ) -> Any:
        """:meth:`_eval` of the acquire ``script``'s call, whose fast request (from
        :meth:`_acquire_request`) is ``request``; on the fast path only."""
        fast = self._fast
        assert fast is not None
        try:
            reply = fast.call(request)
        except NoScriptError:  # as _eval answers it
            reply = fast.call(
                self._fast_request(*self._acquire_call(script, key, owner, ttl_ms), True)
            )
        if reply is not BUSY:
            return reply
        return self._eval_pooled(*self._acquire_call(script, key, owner, ttl_ms))

    def _run_acquire(self, script: Script, key: str, owner: str, ttl_ms: int) -> Any:
        """:meth:`_call` of an acquire on the fast path: its raw reply, a refusal by a restart
        grace raised."""
        request = self._acquire_request(script, key, owner, ttl_ms)
        try:
            try:
                reply = self._eval_acquire(script, key, owner, ttl_ms, request)
            except RETRIED as exc:
                self._log_retry("acquire", key, exc)
                reply = _ASK_AGAIN
            if reply is _ASK_AGAIN:  # asked outside the handler, as _call asks
                reply = self._eval_acquire(script, key, owner, ttl_ms, request)
        except RedisError as exc:
            raise self._error("acquire", key, failed(exc)) from exc
        if reply is None or (type(reply) is bytes and reply[:1] != b"~"):  # not in_grace
            return reply
        return self._outside_grace(key, reply)

    def _eval_many(self, script: Script, calls: Calls, *, every_node: bool = False) -> list[Any]:
        """Many EVALSHA pipelined (per node on a cluster: ``ClusterFanOut.eval_many``, with
        ``every_node``): replies or error replies in place; on one server a connection error
        or timeout raises."""
        if self._cluster is not None:
            return self._cluster.eval_many(script, calls, every_node=every_node)
        assert isinstance(self._client, redis.Redis)
        return pipelined(self._client, script, calls, errors_in_place=True)[0] if calls else []

    def _write(self, script: Script, calls: Calls) -> tuple[list[Any], int | None]:
        """Run write scripts on the current master (following a Sentinel failover): their
        replies and the replicas' acks (None without WAIT, the calls and WAIT pipelined)."""
        if self._sentinel_pool is not None:
            follow_master(self._sentinel_pool, self._no_sentinel if self._min_replicas else None)
        wait = self._wait_args()
        client = self._client
        if wait is None and len(calls) == 1:
            return [self._eval(script, *calls[0])], None
        assert isinstance(client, redis.Redis)  # a cluster's batches go through _eval_many
        return pipelined(client, script, calls, wait)

    def _no_sentinel(self, exc: Exception) -> None:
        logger.warning(
            "Redis store %s: no Sentinel answered (%s); going on with the known master, "
            "every write confirmed by %d replicas",
            self._where(),
            self._redact(str(exc)),
            self._min_replicas,
        )

    def _call(self, operation: str, fn: Callable[[], _T], key: str | None = None) -> _T:
        """Run ``fn``, once more after a connection error; Redis errors raise StoreUnavailable."""
        try:
            try:
                return fn()
            except RETRIED as exc:
                self._log_retry(operation, key, exc)
            return fn()
        except RedisError as exc:
            raise self._error(operation, key, failed(exc)) from exc

    def _failed_in_place(self, operation: str, key: str, exc: Exception) -> Exception:
        """The ``StoreUnavailableError`` answered in place of ``key``, caused by ``exc``."""
        error = self._error(operation, key, failed(exc))
        error.__cause__ = exc
        return error

    def _where(self) -> str:
        """The store's address for messages (server, Sentinel service or cluster nodes)."""
        client = self._client
        if isinstance(client, redis.cluster.RedisCluster):
            nodes = sorted(client.nodes_manager.startup_nodes)
            return f"Redis Cluster (nodes {', '.join(nodes)})"
        return describe_pool(client.connection_pool, self._sentinel_pool, redis.SSLConnection)

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return int_or_none(self._take(ACQUIRE, key, owner, ttl_ms))

    def acquire_or_holder(self, key: str, owner: str, ttl_ms: int) -> tuple[int | None, str | None]:
        """:meth:`acquire`; when refused, ``(None, owner of the live lease)``, read by the same
        script (one round trip: a unique task's duplicate call needs no second one).

        Raises:
            RestartGraceError: the key is free but a restart grace refuses it.
        """
        reply = self._take(ACQUIRE_OR_HOLDER, key, owner, ttl_ms)
        if refused(reply):
            return None, self._decode(reply)[len(HELD_MARK) :]
        return int(reply), None

    def send_acquire(self, key: str, owner: str, ttl_ms: int) -> Callable[[], int | None] | None:
        """Send the acquire :meth:`acquire` would run now, on the fast path (``None`` elsewhere,
        or when not sent: the caller acquires as usual); the returned function reads its reply,
        once (see :class:`~celery_lease.stores.base.SupportsSentAcquire`). Sent as EVALSHA: a
        NOSCRIPT reply (nothing ran) is answered by :meth:`acquire`'s call, as is a reply lost
        with the connection (retried once, as :meth:`acquire` is)."""
        fast = self._fast
        if fast is None:
            return None
        sent = _SentAcquire(self, fast, key, owner, ttl_ms)
        if not fast.send_deferred(sent.request, sent.take):
            return None
        return sent.read

    def _decode(self, value: bytes | str) -> str:
        """A reply's text, decoded as the client encodes (``str`` replies as they are)."""
        if isinstance(value, bytes):
            return value.decode(self._encoding, self._encoding_errors)
        return value

    def _take(self, script: Script, key: str, owner: str, ttl_ms: int) -> Any:
        """Run an acquire ``script``; its raw reply (a token, or the script's refusal).
        Raises RestartGraceError when a restart grace refused a free key."""
        if self._fast is not None:  # standalone, no WAIT, no Sentinel: one EVALSHA, as is
            return self._run_acquire(script, key, owner, ttl_ms)
        script, keys, args = self._acquire_call(script, key, owner, ttl_ms)
        return self._take_confirmed(script, keys, args, key, owner, None)

    def _take_confirmed(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        key: str,
        owner: str,
        limit: int | None,
    ) -> Any:
        """Run the acquire ``script`` on the master, asked again until the replicas confirm it
        (see CONFIRM_WINDOW), else its lease released (the slot it took, with a ``limit``) and
        the error raised. Its raw reply; RestartGraceError when a grace refused a free key."""
        calls = [(keys, args)]
        started = SYSTEM_CLOCK.monotonic()
        asks = 0
        while True:
            replies, acks = self._call("acquire", lambda: self._write(script, calls), key)
            asks += 1
            reply = replies[0]
            taken = grants(reply)
            if not taken or self._confirmed(acks):
                if asks > 1:
                    logger.info(
                        "Redis store %s: acquire %r confirmed by the replicas at ask %d",
                        self._where(),
                        key,
                        asks,
                    )
                return self._outside_grace(key, reply)
            # A replica a moment behind confirms a later ask (see CONFIRM_WINDOW).
            if SYSTEM_CLOCK.monotonic() - started < CONFIRM_WINDOW:
                continue
            # A failover now could hand the key to a second owner: give this attempt's lease up.
            assert acks is not None
            taken_key = key if limit is None else slot_key(key, slot_reply(reply)[0])
            try:
                self.release(taken_key, owner)
            except StoreUnavailableError as exc:
                raise self._given_up(key, acks, asks, exc) from None
            raise self._given_up(key, acks, asks, None)

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        """Take the lowest free slot of ``key`` below ``limit`` when fewer than ``limit`` of its
        slots are live: one script, one round trip, whatever the limit (see
        :class:`~celery_lease.stores.base.SupportsSlots`; the script: ``ACQUIRE_SLOT_SCRIPT``).
        The script declares the slot leases it reads: the slots below the limit, or below the
        key's width (1 + the highest slot given) when this store last saw a larger one; told of
        a larger width (a limit lowered, or slots taken by another client under a larger
        limit), the store asks once more, declaring as many.

        Raises:
            LeaseConfigError: (a ``ValueError``) for a ``limit`` outside 1 ..
                :data:`~celery_lease.stores.slots.MAX_LIMIT` or a bad ``key``, before any I/O.
            RestartGraceError: a free slot refused by the restart grace.
        """
        width: int | None = 0
        while width is not None:  # again only when the key is wider than the slots declared
            script, keys, args, n = self._slot_call(key, owner, ttl_ms, limit, width)
            if self._fast is not None:
                reply = self._call("acquire", partial(self._eval, script, keys, args), key)
                reply = self._outside_grace(key, reply)
            else:
                reply = self._take_confirmed(script, keys, args, key, owner, limit)
            width = self._wider("acquire", key, limit, n, reply)
        return self._granted_slot(key, limit, reply)

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        """Ask the live holder of ``key`` to stop: its stored owner id gets
        :data:`~celery_lease.stores.slots.REPLACED_MARK` appended (one script; see
        :class:`~celery_lease.stores.base.SupportsReplace`). A ticket drawn here is written to
        the key's token counter, so every later token of ``key`` is larger. A lease key of
        another type raises ``StoreUnavailableError`` (left as it is, nothing drawn). Sent to
        the current master, not confirmed by replicas: a mark a failover loses leaves the
        holder renewing until the replacing call asks again."""
        calls = [self._mark_call(key, ticket, holder)]
        replies, _ = self._call("mark replaced", lambda: self._write(MARK_REPLACED, calls), key)
        return self._mark_reply(ticket, replies[0])

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        calls = [((self.lease_key(key),), (owner, int(ttl_ms)))]
        if self._fast is not None:
            return bool(self._call("renew", partial(self._eval, RENEW, *calls[0]), key))
        replies, acks = self._call("renew", lambda: self._write(RENEW, calls), key)
        return self._renewed(key, replies[0], acks)

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool | Exception]:
        """Renew each ``(key, owner, ttl_ms)`` in one pipelined round trip; results in order.

        On a single server one script call per :data:`RENEW_CHUNK` leases (a batch ``WAIT``
        does not confirm raises as a whole); on a Cluster a failing node or key gets a
        ``StoreUnavailableError`` in its place. A key of another type: ``False``.
        """
        operation = f"renew {len(items)} leases"
        if self._cluster is not None:
            calls = [((self.lease_key(k),), (o, int(t))) for k, o, t in items]
            results = self._call(operation, lambda: self._eval_many(RENEW, calls))
            return [
                self._failed_in_place("renew", key, r) if isinstance(r, Exception) else bool(r)
                for (key, _, _), r in zip(items, results, strict=True)
            ]
        chunks: list[tuple[Sequence[str], Sequence[str | int]]] = []
        for start in range(0, len(items), RENEW_CHUNK):
            chunk = items[start : start + RENEW_CHUNK]
            keys = [self.lease_key(k) for k, _, _ in chunk]
            args: list[str | int] = []
            for _, owner, ttl_ms in chunk:
                args += (owner, int(ttl_ms))
            chunks.append((keys, args))
        if not chunks:
            return []
        replies, acks = self._call(operation, lambda: self._write(RENEW_MANY, chunks))
        results = [bool(r) for reply in replies for r in reply]
        if any(results) and not self._confirmed(acks):
            assert acks is not None
            raise self._unconfirmed(
                operation, None, acks, "their holders keep their last confirmed expiry"
            )
        return results

    def release(self, key: str, owner: str) -> None:
        # The reply is read before this returns: the key is free before the caller goes on.
        if self._fast is None:
            call = partial(self._eval, RELEASE, *self._release_call(key, owner))
            self._call("release", call, key)
            return
        request = self._release_request(key, owner)
        try:  # _call, inline
            try:
                self._eval_release(key, owner, request)
                return
            except RETRIED as exc:
                self._log_retry("release", key, exc)
            self._eval_release(key, owner, request)
        except RedisError as exc:
            raise self._error("release", key, failed(exc)) from exc

    def _eval_release(self, key: str, owner: str, request: bytes) -> Any:
        """:meth:`_eval` of :data:`RELEASE`'s call, whose fast request (from
        :meth:`_release_request`) is ``request``; on the fast path only."""
        fast = self._fast
        assert fast is not None
        try:
            reply = fast.call(request)
        except NoScriptError:  # as _eval answers it
            reply = fast.call(self._release_request(key, owner, cold=True))
        if reply is not BUSY:
            return reply
        return self._eval_pooled(RELEASE, *self._release_call(key, owner))

    def release_owned_slots(self, key: str, owner: str) -> None:
        """Release the slot of ``key`` that ``owner`` holds, whichever it is (see
        :class:`~celery_lease.stores.base.SupportsOwnedSlotsRelease`): one script
        (``RELEASE_OWNERS_SLOT_SCRIPT``), again when the key is wider than the slots it
        declared. An owner holds at most one slot of a key (``acquire_slot`` gives a holder
        asking again its own slot)."""
        width: int | None = 0
        while width is not None:
            keys, args, n = self._owners_slot_call(key, owner, 1, width)
            call = partial(self._eval, RELEASE_OWNERS_SLOT, keys, args)
            width = self._wider("release", key, 1, n, self._call("release", call, key))

    def release_deferred(self, key: str, owner: str) -> bool:
        """Send the release of ``key`` without waiting for its reply; False when not sent (only
        on the fast path). The reply is read, and its outcome logged, before the next reply on
        that connection or by :meth:`flush_deferred`. Sent as ``EVAL`` with the source: a
        NOSCRIPT reply would come after the next request had run.
        """
        fast = self._fast
        if fast is None:
            return False
        request = self._release_request(key, owner, cold=True)
        return fast.send_deferred(request, partial(self._released, key, owner))

    def renew_deferred(self, key: str, owner: str, ttl_ms: int) -> bool:
        """As :meth:`release_deferred`, for a renewal (a refusal or failure is logged; the
        renewer renews again at its next round)."""
        fast = self._fast
        if fast is None:
            return False
        request = self._fast_request(RENEW, (self.lease_key(key),), (owner, int(ttl_ms)), cold=True)
        return fast.send_deferred(request, partial(self._renewed_late, key))

    def _renewed_late(self, key: str, reply: Any) -> None:
        """Take the reply of a deferred renewal (see :meth:`renew_deferred`)."""
        if isinstance(reply, BaseException):
            error = self._error("renew", key, f"got no answer: {type(reply).__name__}: {reply}")
            logger.warning("%s; renewed again at the next round", error)
        elif not reply:
            logger.warning("Redis store %s: renew %r refused: no longer held", self._where(), key)

    def flush_deferred(self) -> None:
        """Read the replies of deferred releases now (see :meth:`release_deferred`)."""
        if self._fast is not None:
            self._fast.flush()

    def _released(self, key: str, owner: str, reply: Any) -> None:
        """Take the reply of a deferred release (see :meth:`release_deferred`)."""
        if isinstance(reply, RedisConnectionError):
            # It may or may not have run: release again (owner-checked, so harmless), as
            # release() retries once.
            try:
                self.release(key, owner)
            except Exception as exc:
                logger.warning(
                    "%s; the key expires within its ttl",
                    self._error("release", key, f"got no reply ({reply}), then failed: {exc}"),
                )
        elif isinstance(reply, BaseException):
            error = self._error("release", key, f"failed: {type(reply).__name__}: {reply}")
            logger.warning("%s; the key expires within its ttl", error)
        # 0 (no live lease) is ignored, as release() ignores it.

    def wait_for_release(self, key: str, timeout: float) -> bool:
        """Block up to ``timeout`` seconds on the release-signal list of ``key`` (BLPOP, in
        slices shorter than ``socket_timeout``). One waiter wakes per release; a signal nobody
        took stays up to 60 s (a later waiter may wake spuriously, which is allowed)."""
        signal = self.signal_key(key)
        client = self._client
        if timeout <= 0:
            return self._call("poll a release of", lambda: client.lpop(signal), key) is not None
        for wait in blpop_waits(timeout, self._socket_timeout, SYSTEM_CLOCK.monotonic):
            got = self._call("wait for a release of", partial(client.blpop, [signal], wait), key)
            if got is not None:
                return True
        return False

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        """Live leases whose key starts with ``prefix``, sorted by key (SCAN; every master of a
        cluster)."""
        # A slot's lease hash has U+001F after the hash tag: match the part of prefix before it.
        pattern = glob_escape(f"{self._prefix}{{{prefix.partition(SLOT_MARK)[0]}") + "*:lease"
        client, cluster = self._client, self._cluster
        if cluster is not None:
            try:
                found = cluster.scan(pattern)
            except RedisError as exc:
                raise self._error("list leases", None, failed(exc)) from exc
        else:
            found = self._call(
                "list leases",
                lambda: {text(k) for k in client.scan_iter(match=pattern, count=1000)},
            )
        listed = sorted(k for k in map(self._store_key, found) if k is not None)
        keys = [k for k in listed if k.startswith(prefix) and k]
        results = self._call(
            "list leases",
            lambda: self._eval_many(
                INSPECT, [((self.lease_key(k),), ()) for k in keys], every_node=True
            ),
        )
        infos: list[LeaseInfo] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, Exception):
                if not not_a_lease(result):
                    raise self._failed_in_place("list leases: read", key, result)
                logger.warning(
                    "Redis store %s: %s is not a lease (%s); left out of the listing",
                    self._where(),
                    self.lease_key(key),
                    result,
                )
                continue
            info = lease_info(key, result, self._decode)
            if info is not None:
                infos.append(info)
        return infos

    def get(self, key: str) -> LeaseInfo | None:
        """The live lease on ``key``, or ``None`` when it is free."""
        keys = (self.lease_key(key),)
        reply = self._call("read the lease", lambda: self._eval(INSPECT, keys, ()), key)
        return lease_info(key, reply, self._decode)

    def last_token(self, key: str) -> int | None:
        """The last fencing token issued for ``key``, or ``None`` (counter never set, or dropped
        after 7 days without an acquire, or lost with a server restart or an eviction). For a
        slot's store key (or :func:`~celery_lease.stores.slots.counter_key`): the last token
        issued to any slot of its key."""
        counted = self._counted_key(key)
        client = self._client
        if counted is not None:  # a slot, or a key's slot counter: the key's slot counter
            slots = self.slots_key(counted)
            read = partial(client.hget, slots, "token")
        else:
            read = partial(client.get, self.token_key(key))
        return int_or_none(self._call("read the last token of", read, key))

    def force_release(self, key: str) -> LeaseInfo | None:
        """Delete the live lease on ``key`` whoever holds it; returns it. The counter is kept."""
        keys, args = self._force_release_call(key)
        result = self._call("force-release", lambda: self._eval(FORCE_RELEASE, keys, args), key)
        return lease_info(key, result, self._decode)

    def close(self) -> None:
        """Close the fast connection, and the client if the store built it from a URL."""
        if self._fast is not None:
            self._fast.close()
        if not self._owns_client:
            return
        self._client.close()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                sentinel.close()

    def __repr__(self) -> str:
        return f"RedisLockStore({self._client!r}, prefix={self._prefix!r})"


_ASK_AGAIN: Any = object()  # an acquire's first ask failed with a retried error


class _SentAcquire:
    """An acquire sent on the fast connection: its request, its reply (kept by whichever call
    on the connection reads it: :meth:`take`) and the read answering it (:meth:`read`)."""

    __slots__ = ("fast", "got", "key", "owner", "reply", "request", "store", "ttl_ms")

    def __init__(
        self, store: RedisLockStore, fast: FastConnection, key: str, owner: str, ttl_ms: int
    ) -> None:
        self.request = store._acquire_request(ACQUIRE, key, owner, ttl_ms)
        self.store, self.fast, self.key, self.owner, self.ttl_ms = store, fast, key, owner, ttl_ms
        self.got = False
        self.reply: Any = None

    def take(self, reply: Any) -> None:
        self.reply, self.got = reply, True

    def read(self) -> int | None:
        """The answer: the reply (read now if no other call has), else the acquire asked again
        (after NOSCRIPT, nothing ran; or once more after a connection error, as ``_call``
        retries), read as :meth:`RedisLockStore.acquire` reads it. An error reply raises, as
        does a ``ConnectionError`` when the connection failed before the reply came."""
        store, key = self.store, self.key
        try:
            try:
                if not self.got:
                    fast = self.fast
                    fast.flush()
                    if not self.got:  # another thread is handing it over, or this process forked
                        fast.flush(wait=True)
                    if not self.got:
                        raise RedisConnectionError(
                            "the connection was lost before the acquire's reply"
                        )
                reply = self.reply
                if isinstance(reply, BaseException):
                    if not isinstance(reply, NoScriptError):
                        raise reply
                    reply = self._ask()  # nothing ran
            except RETRIED as exc:
                store._log_retry("acquire", key, exc)
                reply = _ASK_AGAIN
            if reply is _ASK_AGAIN:  # asked outside the handler, as _call asks
                reply = self._ask()
        except RedisError as exc:
            raise store._error("acquire", key, failed(exc)) from exc
        if reply is None:
            return None
        if type(reply) is bytes and reply[:1] != b"~":  # a token (not in_grace)
            return int(reply)
        return int_or_none(store._outside_grace(key, reply))

    def _ask(self) -> Any:
        return self.store._eval_acquire(ACQUIRE, self.key, self.owner, self.ttl_ms, self.request)


def _secrets_of(client: redis.Redis | redis.cluster.RedisCluster) -> tuple[str, ...]:
    """Every password the client may send (master, Sentinels), to keep out of messages."""
    if isinstance(client, redis.cluster.RedisCluster):
        return pool_secrets(client.nodes_manager.connection_kwargs)
    pool = client.connection_pool
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        return pool_secrets(pool.connection_kwargs, pool.sentinel_manager.sentinels)
    return pool_secrets(pool.connection_kwargs)


def _warn_about_client_retries(client: redis.Redis | redis.cluster.RedisCluster) -> None:
    """Warn when the client's own retries can stretch a failing call past a lease's ttl
    (redis-py 8 retries 10 times by default: about 18 s against a silent server)."""
    get_retry = getattr(client, "get_retry", None)  # redis-py 8's RedisCluster has none
    try:
        retry = get_retry() if callable(get_retry) else None
    except AttributeError:  # redis-py 5's RedisCluster has one, reading a missing attribute
        retry = None
    retries = client_retries(retry) if retry is not None else 0
    if retries > 1:
        logger.warning(
            "RedisLockStore: the client retries failed commands %d times; against a silent "
            "server a lease call then blocks for many seconds. Build the store from a URL, or "
            "pass a client made with retry=Retry(NoBackoff(), 0) and a socket_timeout.",
            retries,
        )
