"""Redis store: one Lua script per operation, one round trip each, Redis Cluster ready.

Keys, for the user key ``account:42`` and the default prefix::

    celery-lease:{account:42}:lease    hash {owner, token}, PEXPIRE = ttl (Redis expires it)
    celery-lease:{account:42}:token    the last token issued, a decimal string
    celery-lease:{account:42}:signal   a list holding one element after each release, for a waiter
    celery-lease:marker                hash {boot, started, cause}, no expiry: the grace's marker

The hash tag ``{account:42}`` puts the three keys of a lease in one Redis Cluster slot, so every
script touches a single slot. The prefix (no braces allowed) keeps them apart from the keys of
Celery and kombu (``celery-task-meta-*``, ``_kombu.*``, queue names).

Fencing tokens: the next token is ``max(counter + 1, server TIME in microseconds)``, computed in
the script. The counter alone would restart from 1 when the server restarts without persistence,
fails over to a replica that missed the last increments, or evicts the counter; the server clock
keeps the tokens increasing in those cases, **assuming the Redis servers' clocks do not jump
back** (keep them on NTP; a promoted replica's clock must not be behind the old master's by more
than the time between two acquires of one key). Values stay far below 2**53, where Lua numbers
are exact.

Sentinel: before every acquire and every renewal call the store asks a Sentinel which server is
the master now (``SENTINEL GET-MASTER-ADDR-BY-NAME``, one round trip to a Sentinel) and, when it
changed, drops the pooled connections to the old one, so renewals move to the new master at the
first sweep after Sentinel switched (the old master stays writable until Sentinel demotes it,
about 10 s later). With ``min_replicas`` (1 by default for Sentinel-managed stores) every acquire
and renewal is followed by ``WAIT`` in the same pipeline (still one round trip) and counts only
when that many replicas acknowledged it: a renewal a failover would lose is never trusted, so a
holder is either renewed on the master that takes over or told its lease is lost within its ttl.
docs/stores.md (Redis) says exactly what is and is not guaranteed.

Restart grace: a server that lost its data (restarted without persistence, flushed) forgets
every lease before its holders hear of it. With ``restart_grace`` set, the acquire script itself
(atomically, no extra round trip) compares the marker hash with the server's current run
(``INFO server``'s ``run_id``): a marker missing or naming another run means the server may
have lost leases, and free keys are refused (``RestartGraceError``) until ``restart_grace``
after the server STARTED, so that no second holder gets a key its old holder may still believe
it holds (Chubby's lock-delay). Every store and process sees the same grace; a server up longer
than the grace refuses nothing. docs/stores.md says what that leaves open.

Nothing read from Redis is ever unpickled: values are plain strings and integers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.durations import Duration, to_seconds
from celery_lease.errors import (
    LeaseConfigError,
    ReplicaLagError,
    RestartGraceError,
    StoreUnavailableError,
)
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
    MARKER,
    RELEASE,
    RELEASE_SCRIPT,
    RENEW,
    RENEW_CHUNK,
    RENEW_MANY,
    RENEW_MANY_SCRIPT,
    RENEW_SCRIPT,
    REPLICA_TIMEOUT,
    RETRIED,
    SIGNAL_TTL_MS,
    SOCKET_TIMEOUT,
    TOKEN_TTL_MS,
    WITH_GRACE,
    Grace,
    Script,
    SentinelURL,
    blpop_slice,
    check_restart_grace,
    describe_sentinel_master,
    describe_server,
    error_text,
    failed,
    glob_escape,
    host_port,
    in_grace,
    int_or_none,
    lease_info,
    master_address,
    no_master_message,
    not_a_lease,
    not_confirmed,
    parse_sentinel_url,
    redact_secrets,
    refused,
    secrets_among,
    sentinel_connection_kwargs,
    socket_timeout_of,
    split_store_options,
    text,
    what,
)
from celery_lease.stores._redis_compat import (
    client_retries,
    request_slot_refresh,
    run_requested_slot_refresh,
)
from celery_lease.stores._redis_fast import BUSY, FastConnection, fast_path_for
from celery_lease.stores.base import LeaseInfo

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


_Calls = Sequence[tuple[Sequence[str], Sequence[str | int]]]

_NODE_THREAD = "celery-lease-redis-node"
"""The name of the threads that run a cluster batch's node shares (numbered within the batch)."""


class _NodeWorkers:
    """Runs the nodes' shares of one cluster store's batch at once.

    The first share runs in the calling thread, each other one on a daemon thread of its own,
    started for that batch and ended with it (a batch comes every ttl/3 at most per store, so
    a thread per node and batch costs little): no pool to keep, to reset after a fork (a
    child, with or without Python's at-fork hooks, starts its own threads) or to shut down,
    and a share stuck on a hung node never holds up the interpreter's exit.
    """

    def run(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
        """Run every job at once; their results in order, once every job has returned. A job
        that raises: the first such error in job order is raised, after all have ended."""
        if not jobs:
            return []
        results: list[_T | None] = [None] * len(jobs)
        errors: list[BaseException | None] = [None] * len(jobs)

        def share(index: int) -> None:
            try:
                results[index] = jobs[index]()
            except BaseException as exc:  # handed to the caller below
                errors[index] = exc

        threads = []
        for index in range(1, len(jobs)):
            thread = threading.Thread(
                target=share, args=(index,), name=f"{_NODE_THREAD}-{index}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (the interpreter is exiting): run it here
                share(index)
                continue
            threads.append(thread)
        share(0)
        for thread in threads:
            thread.join()
        for error in errors:
            if error is not None:
                raise error
        return cast("list[_T]", results)

    def close(self) -> None:
        """Nothing to end: a batch's threads end with it."""


_SLOTS_THREAD = "celery-lease-redis-slots"
"""The name of the thread that refreshes a cluster store's slot table after an error."""


class _SlotRefresh:
    """Runs one cluster store's slot-table refreshes on a daemon thread of their own, one at a
    time (per process), so a batch waits for one only as long as its deadline allows and a
    refresh stuck on a hung node holds up nobody.

    A refresh asked for while one runs joins it (the running one reads the cluster as it is
    now). The thread is started for one refresh and ends with it: nothing to reset after a
    fork (a child sees its parent's refresh as not running, by the process id, and starts its
    own).
    """

    def __init__(self, refresh: Callable[[], None]) -> None:
        self._refresh = refresh
        self._guard = threading.Lock()  # held for a few lines, never across the refresh
        self._running: tuple[int, threading.Event] | None = None

    def start(self) -> threading.Event:
        """Start a refresh unless one is running; the event set once the running one ended."""
        pid = os.getpid()
        with self._guard:
            running = self._running
            if running is not None and running[0] == pid and not running[1].is_set():
                return running[1]
            done = threading.Event()
            self._running = (pid, done)

        def run() -> None:
            try:
                self._refresh()
            finally:
                done.set()

        thread = threading.Thread(target=run, name=_SLOTS_THREAD, daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (the interpreter is exiting): run it here
            run()
        return done


def _before(deadline: float, job: Callable[[], _T]) -> tuple[bool, _T | None]:
    """Run ``job`` on a daemon thread of its own and wait for it until ``deadline``
    (``time.monotonic()``): ``(True, its result)``, or ``(False, None)`` when it had not ended
    then (it goes on alone; its result is dropped). A job that raises: raised here."""
    outcome: list[_T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(job())
        except BaseException as exc:  # handed to the caller below
            error.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=_SLOTS_THREAD, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had (the interpreter is exiting): run it here
        run()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        return False, None
    if error:
        raise error[0]
    return True, outcome[0]


class RedisLockStore:
    """A :class:`~celery_lease.LockStore` on Redis (standalone, Sentinel-managed or Cluster).

    Implements the protocol, :class:`~celery_lease.SupportsReleaseNotify` (waiters block on a
    list, one waiter wakes per release), :class:`~celery_lease.SupportsBatchRenew` (one
    pipelined round trip) and :class:`~celery_lease.SupportsInspection`.

    Every operation is one EVALSHA round trip; when the server does not know the script
    (``NOSCRIPT``, e.g. after a restart or ``SCRIPT FLUSH``) it is loaded and the call redone.
    A connection error or timeout is retried once (a connection dropped by a server restart, or
    a reply lost after the server ran the command: every script is safe to run twice, acquire
    included, which gives the retry its own lease back); then, like any other Redis error, it
    raises ``StoreUnavailableError`` naming the store (host, port and db; Sentinel hosts,
    service and master; or cluster nodes; never a password), the operation, the key and the
    server's own message, with the driver's error chained. redis-py's connection pools reconnect
    after ``fork()``, so one store can be created before Celery forks its pool workers.

    On a plain standalone client (stock pool and connection class, no Sentinel, no
    ``min_replicas``, no client-side cache) acquire, renew and release skip redis-py's command
    machinery: they go over one connection of the store's own per process, opened by
    redis-py's connection class with the client's settings, as pre-packed EVALSHA requests
    (about 60-80 us less per call here; see :mod:`celery_lease.stores._redis_fast`). A thread
    that finds it busy uses the client's pool instead. Every reply is read before the call
    returns (a release has freed the key on the server when ``release`` returns).

    On a Sentinel-managed client, acquire and renewals first ask a Sentinel for the current
    master (one more round trip, to the Sentinel) and leave the old master as soon as Sentinel
    names another. With ``min_replicas`` > 0, acquire and renewals are pipelined with ``WAIT``
    (no extra round trip; the reply waits for the replicas' acknowledgement, about one
    master-replica round trip): an acquire not acknowledged in time is asked again (the same
    owner's acquire, idempotent) for up to ``CONFIRM_WINDOW`` (1 s), then released and raised
    as ``ReplicaLagError`` (a ``StoreUnavailableError`` that :func:`~celery_lease.lease` retries
    within its wait); a renewal not acknowledged raises ``StoreUnavailableError``, so the holder
    keeps counting from its last confirmed renewal and the lease is reported lost if none gets
    through within its ttl.

    Args:
        client_or_url: a ``redis.Redis`` (also one from ``Sentinel.master_for``) or a
            ``redis.cluster.RedisCluster`` (used as is; its ``socket_timeout`` should exceed a
            few seconds), or a URL: ``redis://``, ``rediss://`` (TLS), ``unix://``, or
            ``redis+sentinel://[[user]:password@]host1:26379[,host2:26379]/service[/db]``
            (see :func:`parse_sentinel_url`). Clients built from a URL get
            ``socket_timeout`` and ``socket_connect_timeout`` of 5 s unless the URL sets them,
            ``decode_responses=False`` and no redis-py retries (the store retries once itself).
            Every URL may also carry ``min_replicas`` and ``replica_timeout`` in its query.
        prefix: prepended to every key (default ``"celery-lease:"``); must not contain ``{`` or
            ``}``, which would break the Cluster hash tag.
        min_replicas: replicas that must acknowledge (``WAIT``) an acquire or a renewal before
            it counts. Default (``None``): the URL's ``min_replicas``, else 1 for a
            Sentinel-managed master and 0 (no ``WAIT``) otherwise. Not supported on a Cluster.
        replica_timeout: how long (a duration: seconds, ``"250ms"``) one ``WAIT`` may block.
            Default: the URL's ``replica_timeout``, else 0.2 s; must be shorter than the
            client's ``socket_timeout``.
        restart_grace: how long (a duration), counted from the server's start, a server
            that may have lost leases (its marker hash :attr:`marker_key` missing: restarted
            without persistence, flushed, new; or naming another server run: restarted from
            a snapshot or AOF, failed over) refuses free keys with ``RestartGraceError``, so
            that every holder of a lost lease hears of the loss first; set it to the longest
            ttl in use in production (0 turns it off). Default: the URL's ``restart_grace``,
            else 0 (off: a library primitive does what it is told; a store built from the
            Celery settings defaults to ``lease_default_ttl``). Not supported on a Cluster.

    Raises:
        LeaseConfigError: for a bad URL, client, prefix, ``min_replicas``,
            ``replica_timeout`` or ``restart_grace``.
    """

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
        self._sentinel: redis.sentinel.Sentinel | None = None
        self._client: redis.Redis | redis.cluster.RedisCluster
        options: dict[str, object] = {}
        if isinstance(client_or_url, str):
            self._client, self._sentinel, options = _client_from_url(client_or_url)
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
        self._socket_timeout = socket_timeout_of(self._client.get_connection_kwargs())
        pool = getattr(self._client, "connection_pool", None)
        self._sentinel_pool: redis.sentinel.SentinelConnectionPool | None = (
            pool
            if isinstance(pool, redis.sentinel.SentinelConnectionPool) and pool.is_master
            else None
        )
        self._min_replicas = self._resolve_min_replicas(min_replicas, options)
        self._replica_timeout = self._resolve_replica_timeout(replica_timeout, options)
        self._restart_grace = self._resolve_restart_grace(restart_grace, options)
        self._grace_until = 0.0  # the end of the last grace logged (server seconds)
        self._secrets = _secrets_of(self._client)
        # acquire / renew / release of a plain standalone client skip redis-py's command
        # machinery (see celery_lease.stores._redis_fast); Sentinel (its master check), WAIT
        # and Cluster routing need redis-py.
        self._fast: FastConnection | None = None
        if self._min_replicas == 0 and self._sentinel_pool is None:
            self._fast = fast_path_for(self._client)
        self._node_workers = _NodeWorkers()
        self._slot_refresh = _SlotRefresh(self._refresh_slots)
        kwargs = self._client.get_connection_kwargs()
        self._encoding = str(kwargs.get("encoding") or "utf-8")
        self._encoding_errors = str(kwargs.get("encoding_errors") or "strict")

    def _resolve_min_replicas(self, value: object, options: dict[str, object]) -> int:
        if value is None and "min_replicas" in options:
            value = options["min_replicas"]
            if isinstance(value, str):
                if not value.isdigit():
                    raise LeaseConfigError(
                        f"min_replicas={value!r} (URL option) must be a non-negative integer"
                    )
                value = int(value)
        if value is None:
            value = 1 if self._sentinel_pool is not None else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LeaseConfigError(f"min_replicas={value!r} must be a non-negative integer")
        if value and isinstance(self._client, redis.cluster.RedisCluster):
            raise LeaseConfigError(
                f"min_replicas={value!r} is not supported on a Redis Cluster (WAIT cannot ride "
                "along its per-node script pipelines); use min_replicas=0"
            )
        return value

    def _resolve_replica_timeout(self, value: object, options: dict[str, object]) -> float:
        if value is None and "replica_timeout" in options:
            value = options["replica_timeout"]
        if value is None:
            value = REPLICA_TIMEOUT
        seconds = to_seconds(value, name="replica_timeout", minimum=0.001)
        timeout = self._socket_timeout
        if self._min_replicas and timeout is not None and seconds >= timeout:
            raise LeaseConfigError(
                f"replica_timeout={value!r} must be shorter than the client's "
                f"socket_timeout ({timeout:g} s), or the socket times out first"
            )
        return seconds

    def _resolve_restart_grace(self, value: object, options: dict[str, object]) -> float:
        if value is None:
            value = options.get("restart_grace")
        cluster = isinstance(self._client, redis.cluster.RedisCluster)
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

    @property
    def restart_grace(self) -> float:
        """Seconds after its start a server that may have lost leases refuses free keys
        (0: no grace)."""
        return self._restart_grace

    @property
    def marker_key(self) -> str:
        """The Redis key of the store's marker hash: ``<prefix>marker``, ``{boot, started,
        cause}``.

        Written by the first acquire of each server run (``boot``: INFO's ``run_id``), never
        expiring: missing, or naming another run, it tells the acquire script that the server
        may have lost leases (see ``restart_grace``).
        """
        return self._prefix + MARKER

    @property
    def client(self) -> redis.Redis | redis.cluster.RedisCluster:
        """The redis-py client the store talks through."""
        return self._client

    @property
    def prefix(self) -> str:
        """The prefix of every key the store writes."""
        return self._prefix

    @property
    def min_replicas(self) -> int:
        """Replicas that must acknowledge an acquire or a renewal (0: no ``WAIT``)."""
        return self._min_replicas

    @property
    def replica_timeout(self) -> float:
        """Seconds one ``WAIT`` may block for :attr:`min_replicas` acknowledgements."""
        return self._replica_timeout

    # Keys ---------------------------------------------------------------------------------------

    def _base(self, key: str) -> str:
        if not isinstance(key, str) or not key or key.startswith("}"):
            # '{}' or '{}...' is no hash tag: the three keys would land in different slots.
            raise LeaseConfigError(f"key={key!r} must be a non-empty string not starting with '}}'")
        return f"{self._prefix}{{{key}}}"

    def lease_key(self, key: str) -> str:
        """The Redis key of the lease hash of ``key``: ``<prefix>{<key>}:lease``."""
        return self._base(key) + ":lease"

    def token_key(self, key: str) -> str:
        """The Redis key of the token counter of ``key``: ``<prefix>{<key>}:token``."""
        return self._base(key) + ":token"

    def signal_key(self, key: str) -> str:
        """The Redis key of the release-signal list of ``key``: ``<prefix>{<key>}:signal``."""
        return self._base(key) + ":signal"

    # Calls --------------------------------------------------------------------------------------

    def _eval(self, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One EVALSHA; on NOSCRIPT load the script and evaluate it again."""
        if script.head and self._fast is not None:
            reply = self._fast_eval(self._fast, script, keys, args)
            if reply is not BUSY:
                return reply
        try:
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._client.script_load(script.source)
            return self._client.evalsha(script.sha, len(keys), *keys, *args)

    def _fast_eval(
        self,
        fast: FastConnection,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
    ) -> Any:
        """One EVALSHA on the fast connection; on NOSCRIPT (a cold or flushed server) one EVAL
        with the source on the same connection, which also caches the script there (one round
        trip, no second connection: on a slow link a cold start must fit in a ttl).

        Returns the reply, or BUSY when another thread is using the connection.
        """
        try:
            return fast.call(self._fast_request(script, keys, args))
        except NoScriptError:
            return fast.call(self._fast_request(script, keys, args, cold=True))

    def _fast_request(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        cold: bool = False,
    ) -> bytes:
        """The packed EVALSHA request (``cold``: EVAL with the source) of ``script``."""
        encoding, errors = self._encoding, self._encoding_errors
        parts = [script.cold_head if cold else script.head]
        for item in (*keys, *args):
            data = item.encode(encoding, errors) if isinstance(item, str) else b"%d" % item
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return b"".join(parts)

    def _wait_args(self) -> tuple[int, int] | None:
        """``(numreplicas, timeout ms)`` of the WAIT that follows a write, or None (no WAIT)."""
        if not self._min_replicas:
            return None
        return self._min_replicas, max(1, round(self._replica_timeout * 1000))

    def _eval_many(self, script: Script, calls: _Calls) -> list[Any]:
        """Many EVALSHA in one pipelined round trip (one per node on a cluster), in order.

        Each call's reply, or in its place the exception its error reply stands for: one key
        the script refuses fails that key only. On a single server a connection error or
        timeout raises (it concerns every call). redis-py refuses EVALSHA in cluster pipelines,
        so on a cluster the calls are grouped by the node owning their slot and pipelined on
        that node's own client, every node's pipeline at the same time (the caller's thread and
        one thread per other node, started for the batch). A node that times out (a hung
        master), or whose connection fails twice (a dead one), gets that error in the place of
        each of its calls, and the other nodes' calls keep their replies: one batch takes about
        one socket timeout at most, whatever some nodes do. A call that meets a
        MOVED/ASK/TRYAGAIN reply (slots migrating) is redone alone through the cluster client,
        which follows the redirection.

        A failover moves slots without a redirection (the old master is gone), so the batch
        follows the cluster's slot table as redis-py's command path does, but never ahead of
        the renewals: the batch goes out on the table the client has; when calls of it met a
        node that failed or timed out, a ``CLUSTERDOWN`` reply or a slot the table does not
        cover, a refresh of the table starts on a thread of its own (:class:`_SlotRefresh`:
        redis-py paces refreshes, at least 1 s apart; redis-py 5 refreshes each time), and the
        failed calls whose slot the refreshed table gives to another node are sent there. The
        batch waits for both only until one socket timeout after it began: a hung node, in the
        batch or in the refresh, costs no more (the refresh goes on alone and serves the next
        batch). A call that fails again, or whose second try did not end in time, keeps its
        first error: nothing here turns a failure into a success.
        """
        if not calls:
            return []
        client = self._client
        if not isinstance(client, redis.cluster.RedisCluster):
            return _pipelined(client, script, calls, errors_in_place=True)[0]
        deadline = time.monotonic() + (self._socket_timeout or SOCKET_TIMEOUT)
        results: list[Any] = [None] * len(calls)
        sent_to = self._send_by_node(client, script, calls, range(len(calls)), results)
        stale = [i for i in sent_to if _stale_route(results[i])]
        if not stale:
            return results
        refreshed = self._slot_refresh.start()
        if not refreshed.wait(max(0.0, deadline - time.monotonic())):
            return results
        moved = [i for i in stale if _node_of(client, calls[i][0][0]) not in (None, sent_to[i])]
        if not moved:
            return results
        logger.info(
            "Redis store %s: the cluster's slot table changed; sending %d calls again "
            "to the nodes now serving their slots",
            self._where(),
            len(moved),
        )

        def resend() -> list[Any]:
            again: list[Any] = [None] * len(calls)
            self._send_by_node(client, script, calls, moved, again)
            return again

        ended, again = _before(deadline, resend)
        if ended and again is not None:
            for index in moved:
                results[index] = again[index]
        return results

    def _refresh_slots(self) -> None:
        """Refresh the cluster's slot table after an error (the refresh requested, once due);
        whatever a refresh raises is logged and leaves the table in use (the calls it would
        have moved keep their errors). Run by :class:`_SlotRefresh`, one at a time."""
        client = self._client
        assert isinstance(client, redis.cluster.RedisCluster)
        try:
            run_requested_slot_refresh(client)
        except Exception as exc:  # redis-py 5 raises RedisClusterException, no RedisError
            logger.info(
                "Redis store %s: refreshing the cluster's slot table failed: %s",
                self._where(),
                self._redact(f"{type(exc).__name__}: {exc}"),
            )

    def _send_by_node(
        self,
        client: redis.cluster.RedisCluster,
        script: Script,
        calls: _Calls,
        indices: Sequence[int],
        results: list[Any],
    ) -> dict[int, str | None]:
        """Run the calls at ``indices`` on the nodes serving their slots, all nodes at once;
        their replies or errors go to ``results`` in place. Returns the node each one was sent
        to (None: the slot table names no node for its slot, whose error is its result)."""
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        sent_to: dict[int, str | None] = {}
        for index in indices:
            try:
                node = client.get_node_from_key(calls[index][0][0])  # type: ignore[no-untyped-call]
            except SlotNotCoveredError as exc:
                request_slot_refresh(client)
                results[index] = exc
                sent_to[index] = None
                continue
            groups.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(index)
            sent_to[index] = node.name
        jobs = [
            partial(self._node_share, name, node_client, script, [calls[i] for i in share])
            for name, (node_client, share) in groups.items()
        ]
        replies = self._node_workers.run(jobs)
        for (_, share), answers in zip(groups.values(), replies, strict=True):
            for index, answer in zip(share, answers, strict=True):
                results[index] = answer
        return sent_to

    def _node_share(
        self, name: str, node_client: redis.Redis, script: Script, calls: _Calls
    ) -> list[Any]:
        """One cluster node's share of :meth:`_eval_many`: its replies in order, a redirected
        call redone through the cluster client, errors in place (a ``CLUSTERDOWN`` reply asks
        for a slot-table refresh)."""
        replies = self._node_pipeline(name, node_client, script, calls)
        for position, reply in enumerate(replies):
            if isinstance(reply, (AskError, TryAgainError)):  # MovedError is an AskError
                try:
                    replies[position] = self._eval(script, *calls[position])
                except RedisError as exc:
                    replies[position] = exc
        if any(isinstance(reply, ClusterDownError) for reply in replies):
            client = self._client
            assert isinstance(client, redis.cluster.RedisCluster)
            request_slot_refresh(client)
        return replies

    def _node_pipeline(
        self, name: str, node_client: redis.Redis, script: Script, calls: _Calls
    ) -> list[Any]:
        """The node's pipelined replies (errors in place), or that error once per call when the
        node times out (not asked again: a hung node would cost another socket timeout) or
        cannot be reached twice in a row (a refused connection fails fast); either asks for a
        slot-table refresh that queries this node last."""
        try:
            return _pipelined(node_client, script, calls, errors_in_place=True)[0]
        except RedisTimeoutError as exc:
            self._node_failed(name)
            return [exc] * len(calls)
        except RedisConnectionError as exc:
            logger.info(
                "Redis store %s: retrying %d calls on node %s once after %s: %s",
                self._where(),
                len(calls),
                name,
                type(exc).__name__,
                self._redact(str(exc)),
            )
        try:
            return _pipelined(node_client, script, calls, errors_in_place=True)[0]
        except RETRIED as exc:
            self._node_failed(name)
            return [exc] * len(calls)

    def _node_failed(self, name: str) -> None:
        """Ask for a slot-table refresh after cluster node ``name`` failed (queried last)."""
        client = self._client
        assert isinstance(client, redis.cluster.RedisCluster)
        request_slot_refresh(client, name)

    def _write(self, script: Script, calls: _Calls) -> tuple[list[Any], int | None]:
        """Run write scripts on the current master: their replies and the replicas' acks.

        Follows a Sentinel failover first. One call without ``min_replicas`` is a plain
        EVALSHA; otherwise the calls and a WAIT go in one pipeline. Acks are None without WAIT.
        """
        self._follow_master()
        wait = self._wait_args()
        client = self._client
        if wait is None and len(calls) == 1:
            return [self._eval(script, *calls[0])], None
        assert isinstance(client, redis.Redis)  # a cluster's batches go through _eval_many
        return _pipelined(client, script, calls, wait)

    def _follow_master(self) -> None:
        """On a Sentinel-managed client, make sure the pool talks to the master named now.

        One ``SENTINEL GET-MASTER-ADDR-BY-NAME``; when the answer differs from the pool's
        master, the pool re-discovers it and disconnects its idle connections, so this call and
        the next ones reach the new master. Connections busy in other threads are dropped when
        they come back to the pool.

        When no Sentinel answers: with ``min_replicas`` the call goes on to the master the pool
        knows (WAIT still refuses a write a failover would lose); without, it fails, since
        nothing else tells a stale master from the current one.
        """
        pool = self._sentinel_pool
        if pool is None:
            return
        known = pool.master_address
        try:
            address = _ask_sentinels(pool.sentinel_manager, pool.service_name)
        except redis.sentinel.MasterNotFoundError as exc:
            if not self._min_replicas or known is None:
                raise
            logger.warning(
                "Redis store %s: no Sentinel answered (%s); going on with the known master, "
                "every write confirmed by %d replicas",
                self._where(),
                self._redact(str(exc)),
                self._min_replicas,
            )
            return
        if address != known:
            # Stores built from a URL discover with the same command (_Sentinel), so the pool
            # moves now; a stock Sentinel (SENTINEL MASTERS) follows ~50-100 ms later.
            pool.get_master_address()  # type: ignore[no-untyped-call]
            if known is not None and pool.master_address != known:
                logger.warning(
                    "Redis store: Sentinel names %s as master of %r instead of %s:%s; "
                    "leaving the old master",
                    host_port({"host": address[0], "port": address[1]}),
                    pool.service_name,
                    known[0],
                    known[1],
                )

    def _call(self, operation: str, fn: Callable[[], _T], key: str | None = None) -> _T:
        """Run ``fn``, once more after a connection error; Redis errors raise StoreUnavailable."""
        try:
            try:
                return fn()
            except RETRIED as exc:
                logger.info(
                    "Redis store %s: retrying %s once after %s: %s",
                    self._where(),
                    what(operation, key),
                    type(exc).__name__,
                    self._redact(str(exc)),
                )
                return fn()
        except RedisError as exc:
            raise self._error(operation, key, failed(exc)) from exc

    def _failed_in_place(self, operation: str, key: str, exc: Exception) -> Exception:
        """The ``StoreUnavailableError`` answered in the place of ``key`` when its call failed
        (``exc``, a driver error, kept as its cause)."""
        error = self._error(operation, key, failed(exc))
        error.__cause__ = exc
        return error

    def _error(self, operation: str, key: str | None, detail: str) -> StoreUnavailableError:
        return StoreUnavailableError(
            self._redact(error_text(self._where(), operation, key, detail))
        )

    def _unconfirmed(
        self, operation: str, key: str | None, acks: int, after: str, asks: int = 0
    ) -> StoreUnavailableError:
        """The error of a write too few replicas acknowledged: a :class:`ReplicaLagError` for
        an acquire asked ``asks`` times (retried within the caller's wait), else a plain
        ``StoreUnavailableError``."""
        detail = (
            f"{not_confirmed(acks, self._min_replicas, self._replica_timeout, max(asks, 1))} "
            f"(min_replicas={self._min_replicas}; 0 accepts writes a failover may lose); {after}"
        )
        message = self._redact(error_text(self._where(), operation, key, detail))
        return ReplicaLagError(message) if asks else StoreUnavailableError(message)

    def _redact(self, message: str) -> str:
        return redact_secrets(message, self._secrets)

    def _where(self) -> str:
        """The store's address for messages: ``redis://host:port/db``, the Sentinel hosts,
        service, db and current master, or the cluster's nodes. Never a password."""
        client = self._client
        if isinstance(client, redis.cluster.RedisCluster):
            nodes = sorted(client.nodes_manager.startup_nodes)
            return f"Redis Cluster (nodes {', '.join(nodes)})"
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        sentinel_pool = self._sentinel_pool
        if sentinel_pool is not None:
            return describe_sentinel_master(
                (
                    s.connection_pool.connection_kwargs
                    for s in sentinel_pool.sentinel_manager.sentinels
                ),
                sentinel_pool.service_name,
                kwargs.get("db", 0),
                sentinel_pool.master_address,
            )
        return describe_server(kwargs, ssl=issubclass(pool.connection_class, redis.SSLConnection))

    # Protocol -----------------------------------------------------------------------------------

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

    def _decode(self, value: bytes | str) -> str:
        """A reply's text, decoded as the client encodes (its ``encoding``, ``encoding_errors``);
        a client with ``decode_responses`` (or RESP3's verbatim text) hands over ``str``."""
        if isinstance(value, bytes):
            return value.decode(self._encoding, self._encoding_errors)
        return value

    def _take(self, script: Script, key: str, owner: str, ttl_ms: int) -> Any:
        """Run an acquire ``script``; its raw reply (a token, or the script's refusal).

        Raises:
            RestartGraceError: a restart grace refused a free key.
        """
        base = self._base(key)
        keys: tuple[str, ...] = (base + ":lease", base + ":token")
        args: tuple[str | int, ...] = (owner, int(ttl_ms), TOKEN_TTL_MS)
        if self._restart_grace:
            script = WITH_GRACE[script]
            keys += (self.marker_key,)
            args += (round(self._restart_grace * 1_000_000),)
        if self._fast is not None:  # standalone, no WAIT, no Sentinel: one EVALSHA, as is
            reply = self._call("acquire", partial(self._eval, script, keys, args), key)
            return self._outside_grace(key, reply)
        calls = [(keys, args)]
        started = SYSTEM_CLOCK.monotonic()
        asks = 0
        while True:
            replies, acks = self._call("acquire", lambda: self._write(script, calls), key)
            asks += 1
            reply = replies[0]
            taken = reply is not None and not refused(reply) and not in_grace(reply)
            if not taken or acks is None or acks >= self._min_replicas:
                if asks > 1:
                    logger.info(
                        "Redis store %s: acquire %r confirmed by the replicas at ask %d",
                        self._where(),
                        key,
                        asks,
                    )
                return self._outside_grace(key, reply)
            # Not confirmed yet: a replica a moment behind confirms a later ask (the same
            # owner's acquire again: it re-sets the expiry, a new write for WAIT to count).
            if SYSTEM_CLOCK.monotonic() - started < CONFIRM_WINDOW:
                continue
            # A failover now could lose this lease and hand the key to a second owner: give it
            # up (it is this attempt's own owner id, never anyone else's) and say why.
            try:
                self.release(key, owner)
                after = "the lease was released"
            except StoreUnavailableError as exc:
                logger.warning("Redis store: releasing an unconfirmed lease failed: %s", exc)
                after = "releasing it failed too: it expires within its ttl"
            error = self._unconfirmed("acquire", key, acks, after, asks)
            logger.warning("%s; asked again within the caller's wait", error)
            raise error

    def _outside_grace(self, key: str, reply: Any) -> Any:
        """``reply``; a refusal of a free key by a restart grace raised (logged once a grace)."""
        if not in_grace(reply):
            return reply
        grace = Grace.parse(reply)
        error = RestartGraceError(
            self._redact(
                error_text(
                    self._where(),
                    "acquire",
                    key,
                    grace.explain(self._restart_grace, SYSTEM_CLOCK.time()),
                )
            ),
            grace.until,
        )
        if grace.until != self._grace_until:
            self._grace_until = grace.until
            logger.warning("%s", error)
        raise error

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if self._fast is not None:
            args = (owner, int(ttl_ms))
            call = partial(self._eval, RENEW, (self.lease_key(key),), args)
            return bool(self._call("renew", call, key))
        calls = [((self.lease_key(key),), (owner, int(ttl_ms)))]
        replies, acks = self._call("renew", lambda: self._write(RENEW, calls), key)
        renewed = bool(replies[0])
        if renewed and acks is not None and acks < self._min_replicas:
            raise self._unconfirmed(
                "renew", key, acks, "its holder keeps its last confirmed expiry"
            )
        return renewed

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool | Exception]:
        """Renew each ``(key, owner, ttl_ms)`` in one pipelined round trip; results in order.

        On a single server the batch goes as one script call per :data:`RENEW_CHUNK` leases
        (and one WAIT with ``min_replicas``: a batch not acknowledged raises
        ``StoreUnavailableError`` as a whole); on a Cluster, whose keys live in many slots, as
        one call per lease, pipelined per node: a node that fails (a dead master) or a key whose
        call fails puts a ``StoreUnavailableError`` in the place of each of its keys, and the
        keys of the other nodes get their results. After a failover the batch follows the
        cluster's refreshed slot table to the promoted replica as redis-py's commands do (see
        ``_eval_many``). A lease key holding another type than a lease hash (a foreign
        writer's value) is not renewed: ``False``.
        """
        operation = f"renew {len(items)} leases"
        if isinstance(self._client, redis.cluster.RedisCluster):
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
        if any(results) and acks is not None and acks < self._min_replicas:
            raise self._unconfirmed(
                operation, None, acks, "their holders keep their last confirmed expiry"
            )
        return results

    def release(self, key: str, owner: str) -> None:
        base = self._base(key)
        keys = (base + ":lease", base + ":signal")
        # The reply is read before this returns: the key is free on the server before the
        # caller goes on (e.g. to publish a task's result).
        self._call("release", partial(self._eval, RELEASE, keys, (owner, SIGNAL_TTL_MS)), key)

    def release_deferred(self, key: str, owner: str) -> bool:
        """Send the release of ``key`` without waiting for its reply; False when not sent.

        Only on the fast path (a standalone server). The reply is read before the next reply on
        that connection (the server answers in order), or by :meth:`flush_deferred`; its
        outcome is logged then: an error reply, or a connection that failed before the reply,
        leaves the key to expire within its ttl, as a failed :meth:`release` does. It is sent
        as ``EVAL`` with the script's source, never ``EVALSHA``: a NOSCRIPT reply (a cold or
        flushed script cache) would come after the next request had already run, with the key
        still taken. The caller must let nothing depend on the key being free (publish a task's
        result) before :meth:`flush_deferred` or its next call on this store.
        """
        fast = self._fast
        if fast is None:
            return False
        base = self._base(key)
        keys = (base + ":lease", base + ":signal")
        request = self._fast_request(RELEASE, keys, (owner, SIGNAL_TTL_MS), cold=True)
        return fast.send_deferred(request, partial(self._released, key, owner))

    def renew_deferred(self, key: str, owner: str, ttl_ms: int) -> bool:
        """Send the renewal of ``key`` without waiting for its reply; False when not sent.

        As :meth:`release_deferred` (the fast path only, ``EVAL``, read in order before the next
        reply). A refusal (the owner holds no live lease) or a failure is logged when the reply
        is read; the caller's renewer renews the lease at its next round as usual.
        """
        fast = self._fast
        if fast is None:
            return False
        request = self._fast_request(RENEW, (self.lease_key(key),), (owner, int(ttl_ms)), cold=True)
        return fast.send_deferred(request, partial(self._renewed, key))

    def _renewed(self, key: str, reply: Any) -> None:
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
            # It may or may not have run (a connection the server closed while the body ran
            # takes the write and then fails): release again the usual way, as release()
            # retries once. Owner-checked, so running twice frees nobody else's lease; on this
            # thread's own busy fast connection it goes through redis-py's pool.
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
        # 1: released; 0: the owner held no live lease (lost or expired), ignored as release()
        # ignores it: the loss was reported when it happened.

    def wait_for_release(self, key: str, timeout: float) -> bool:
        """Block up to ``timeout`` seconds on the release-signal list of ``key`` (BLPOP).

        Each release leaves one element, so one waiter wakes per release and the others keep
        waiting. A release seen by nobody leaves its signal for up to 60 s, which may wake a
        later waiter spuriously (allowed: the caller retries ``acquire``). The wait is cut into
        slices shorter than the client's ``socket_timeout`` so the socket never times out first.
        """
        signal = self.signal_key(key)
        if timeout <= 0:
            popped = self._call("poll a release of", lambda: self._client.lpop(signal), key)
            return popped is not None
        deadline = SYSTEM_CLOCK.monotonic() + timeout
        step = blpop_slice(self._socket_timeout)
        while True:
            left = deadline - SYSTEM_CLOCK.monotonic()
            if left <= 0:
                return False
            # BLPOP takes seconds with millisecond precision; 0 would block forever.
            wait = max(0.001, round(min(left, step), 3))
            got = self._call(
                "wait for a release of", partial(self._client.blpop, [signal], wait), key
            )
            if got is not None:
                return True

    # Inspection ---------------------------------------------------------------------------------

    def _user_key(self, lease_key: str) -> str:
        return lease_key[len(self._prefix) + 1 : -len("}:lease")]

    def _scan_node(
        self, name: str, node_client: redis.Redis, pattern: str
    ) -> list[str] | RedisError:
        """The keys matching ``pattern`` on one cluster node, or the error that stopped the
        scan; retried once after a connection error (fast), never after a timeout (a hung node
        would cost another socket timeout). A node that fails asks for a slot-table refresh."""
        try:
            try:
                return [text(k) for k in node_client.scan_iter(match=pattern, count=1000)]
            except RedisConnectionError as exc:
                logger.info(
                    "Redis store %s: retrying the key scan of node %s once after %s: %s",
                    self._where(),
                    name,
                    type(exc).__name__,
                    self._redact(str(exc)),
                )
            return [text(k) for k in node_client.scan_iter(match=pattern, count=1000)]
        except RETRIED as exc:
            self._node_failed(name)
            return exc
        except RedisError as exc:
            return exc

    def _scan_cluster(self, client: redis.cluster.RedisCluster, pattern: str) -> set[str]:
        """The keys matching ``pattern`` on every master the slot table names, all at once.

        The scan goes out on the table the client has. When a master fails, a slot-table
        refresh starts (:class:`_SlotRefresh`); when every failure was a refused connection
        (fast) and the refresh ends within one socket timeout of the listing's start, the
        masters the refreshed table names that were not scanned yet (a replica promoted in a
        dead master's place) are scanned. A master that still fails then, or one that timed
        out, fails the listing (the refresh goes on alone and serves the next listing).
        """
        deadline = time.monotonic() + (self._socket_timeout or SOCKET_TIMEOUT)
        found: set[str] = set()
        scanned: set[str] = set()
        for attempt in (1, 2):
            masters = [
                node
                for node in client.get_primaries()  # type: ignore[no-untyped-call]
                if node.name not in scanned
            ]
            jobs = [
                partial(self._scan_node, node.name, client.get_redis_connection(node), pattern)
                for node in masters
            ]
            failures: list[RedisError] = []
            for node, keys in zip(masters, self._node_workers.run(jobs), strict=True):
                if isinstance(keys, RedisError):
                    failures.append(keys)
                else:
                    scanned.add(node.name)
                    found.update(keys)
            if not failures:
                return found
            if attempt == 2:
                raise failures[0]
            refreshed = self._slot_refresh.start()
            if any(not isinstance(f, RedisConnectionError) for f in failures):
                raise failures[0]
            if not refreshed.wait(max(0.0, deadline - time.monotonic())):
                raise failures[0]
        raise AssertionError("unreachable")  # pragma: no cover

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        """Live leases whose key starts with ``prefix``, sorted by key (SCAN; on a cluster every
        master at once, each on its own client, like a batch: a master that times out is not
        asked again and fails the listing after about one socket timeout; a master that fails
        starts a slot-table refresh after the scan, never before it, and when the master could
        not be reached and the refresh ends within one socket timeout of the listing's start,
        the masters it names now are scanned, so the listing follows a failover as a batch
        does)."""
        pattern = glob_escape(f"{self._prefix}{{{prefix}") + "*}:lease"
        client = self._client
        if isinstance(client, redis.cluster.RedisCluster):
            try:
                found = self._scan_cluster(client, pattern)
            except RedisError as exc:
                raise self._error("list leases", None, failed(exc)) from exc
        else:
            found = self._call(
                "list leases",
                lambda: {text(k) for k in client.scan_iter(match=pattern, count=1000)},
            )
        listed = sorted(self._user_key(k) for k in found)
        keys = [k for k in listed if k.startswith(prefix) and k]
        results = self._call(
            "list leases",
            lambda: self._eval_many(INSPECT, [((self.lease_key(k),), ()) for k in keys]),
        )
        infos: list[LeaseInfo] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, Exception):
                if not_a_lease(result):
                    logger.warning(
                        "Redis store %s: %s is not a lease (%s); left out of the listing",
                        self._where(),
                        self.lease_key(key),
                        result,
                    )
                    continue
                raise self._failed_in_place("list leases: read", key, result)
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
        after 7 days without an acquire, or lost with a server restart or an eviction)."""
        token_key = self.token_key(key)
        return int_or_none(
            self._call("read the last token of", lambda: self._client.get(token_key), key)
        )

    def force_release(self, key: str) -> LeaseInfo | None:
        """Delete the live lease on ``key`` whoever holds it; returns it. The counter is kept."""
        keys = (self.lease_key(key), self.signal_key(key))
        result = self._call(
            "force-release", lambda: self._eval(FORCE_RELEASE, keys, (SIGNAL_TTL_MS,)), key
        )
        return lease_info(key, result, self._decode)

    def close(self) -> None:
        """Close the client's connections if the store built the client from a URL, and let the
        cluster node threads end (a later batch starts new ones).

        A client passed in belongs to the caller, who closes it.
        """
        if self._fast is not None:
            self._fast.close()
        self._node_workers.close()
        if not self._owns_client:
            return
        self._client.close()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                sentinel.close()

    def __repr__(self) -> str:
        return f"RedisLockStore({self._client!r}, prefix={self._prefix!r})"


# Helpers ----------------------------------------------------------------------------------------


def _pipelined(
    client: redis.Redis,
    script: Script,
    calls: _Calls,
    wait: tuple[int, int] | None = None,
    *,
    errors_in_place: bool = False,
) -> tuple[list[Any], int | None]:
    """EVALSHA each call in one pipeline; on NOSCRIPT load the script and redo the batch once.

    With ``wait`` (``(numreplicas, timeout ms)``) a ``WAIT`` ends the pipeline and its reply,
    the number of replicas that acknowledged every write before it, is returned second (None
    without). Replies that are redirections (cluster slots migrating) are returned for the caller
    to redo; any other error reply is raised, or with ``errors_in_place`` returned in its call's
    place. A connection error or a timeout raises.
    """
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        if wait is not None:
            pipe.execute_command("WAIT", *wait)  # type: ignore[no-untyped-call]
        results: list[Any] = pipe.execute(raise_on_error=False)
        acks: Any = results.pop() if wait is not None else None
        if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
            client.script_load(script.source)
            continue
        for result in results:
            if isinstance(result, RETRIED) or (
                isinstance(result, Exception)
                and not errors_in_place
                and not isinstance(result, (AskError, TryAgainError))
            ):
                raise result
        if isinstance(acks, Exception):
            raise acks
        return results, None if acks is None else int(acks)
    raise AssertionError("unreachable")  # pragma: no cover


def _stale_route(result: object) -> bool:
    """Whether a cluster call's ``result`` may come from a slot table the cluster has left
    behind: its node refused the connection or timed out, the cluster was down (a failover
    under way), or the table named no node for its slot."""
    return isinstance(result, (*RETRIED, ClusterDownError, SlotNotCoveredError))


def _node_of(client: redis.cluster.RedisCluster, key: str) -> str | None:
    """The name of the node the client's slot table names for ``key`` (None: no node)."""
    try:
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
    except SlotNotCoveredError:
        return None
    return str(node.name)


def _secrets_of(client: redis.Redis | redis.cluster.RedisCluster) -> tuple[str, ...]:
    """Every password the client may send (master, Sentinels), to keep out of messages."""
    found: list[object] = []
    if isinstance(client, redis.cluster.RedisCluster):
        found.append(client.nodes_manager.connection_kwargs.get("password"))
    else:
        pool = client.connection_pool
        found.append(pool.connection_kwargs.get("password"))
        if isinstance(pool, redis.sentinel.SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                found.append(sentinel.connection_pool.connection_kwargs.get("password"))
    return secrets_among(found)


def _ask_sentinels(manager: redis.sentinel.Sentinel, service: str) -> tuple[str, int]:
    """The ``(host, port)`` the first answering Sentinel names as master of ``service``.

    Raises:
        MasterNotFoundError: (a ``ConnectionError``) when no Sentinel names one, with each
            Sentinel's reason.
    """
    problems: list[str] = []
    for sentinel in list(manager.sentinels):
        where = host_port(sentinel.connection_pool.connection_kwargs)
        try:
            reply = sentinel.execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL GET-MASTER-ADDR-BY-NAME", service
            )
        except (RedisConnectionError, RedisTimeoutError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        address = master_address(reply)
        if address is not None:
            return address
        problems.append(f"{where}: no such service")
    raise redis.sentinel.MasterNotFoundError(no_master_message(service, problems))


def _warn_about_client_retries(client: redis.Redis | redis.cluster.RedisCluster) -> None:
    """Warn once per client when its own retries can stretch a failing call past a lease's ttl.

    redis-py 8 clients retry a failed command 10 times with backoff by default: against a
    silent server one acquire then takes about 18 s instead of failing within its timeout.
    """
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


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


class _Sentinel(redis.sentinel.Sentinel):
    """A Sentinel manager that discovers the master with ``SENTINEL GET-MASTER-ADDR-BY-NAME``.

    redis-py's own discovery reads ``SENTINEL MASTERS``, which keeps naming the old master until
    the failover's last step (``+switch-master``); ``GET-MASTER-ADDR-BY-NAME`` names the promoted
    replica as soon as Sentinel starts reconfiguring the other servers (50-100 ms earlier in our
    runs). Using one command for both the store's check and the pool's discovery makes them
    agree, so the pool moves at the first check that sees the new master.
    """

    def discover_master(self, service_name: str) -> tuple[str, int]:
        return _ask_sentinels(self, service_name)


def _client_from_url(
    url: str,
) -> tuple[redis.Redis, redis.sentinel.Sentinel | None, dict[str, object]]:
    """The client a URL names, its Sentinel manager (or None), and the store's URL options."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "redis+sentinel":
        spec = parse_sentinel_url(url)
        # redis.sentinel ships without annotations before redis-py 8.2.
        sentinel = _Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
            list(spec.sentinels),
            sentinel_kwargs=sentinel_connection_kwargs(spec, _no_retry()),
            socket_timeout=spec.socket_timeout,
            socket_connect_timeout=spec.socket_connect_timeout,
            retry=_no_retry(),
        )
        client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]
            spec.service_name,
            db=spec.db,
            username=spec.username,
            password=spec.password,
            decode_responses=False,
        )
        options: dict[str, object] = {}
        if spec.min_replicas is not None:
            options["min_replicas"] = spec.min_replicas
        if spec.replica_timeout is not None:
            options["replica_timeout"] = spec.replica_timeout
        if spec.restart_grace is not None:
            options["restart_grace"] = spec.restart_grace
        return client, sentinel, options
    if scheme not in ("redis", "rediss", "unix"):
        raise LeaseConfigError(
            f"url={url!r} is not a Redis URL; supported: redis://, rediss://, unix://, "
            "redis+sentinel://"
        )
    plain, options = split_store_options(url)
    try:
        # Options in the URL's query win over these keyword arguments.
        client = redis.Redis.from_url(
            plain,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=SOCKET_TIMEOUT,
            decode_responses=False,
            retry=_no_retry(),
        )
    except ValueError as exc:
        raise LeaseConfigError(f"url={url!r} is not a valid Redis URL: {exc}") from exc
    return client, None, options
