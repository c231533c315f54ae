"""Redis store for asyncio: the ``redis.asyncio`` twin of the sync Redis store.

It runs the scripts of :mod:`~celery_lease.stores._redis_common` on the same keys, so sync and
async holders of a key exclude each other. Cancelled acquires: docs/asyncio.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import redis.asyncio
import redis.asyncio.sentinel
from redis.asyncio.retry import Retry
from redis.exceptions import NoScriptError, RedisError

from celery_lease.durations import to_seconds
from celery_lease.errors import LeaseConfigError, StoreUnavailableError
from celery_lease.stores._redis_common import (
    ACQUIRE,
    CONFIRM_WINDOW,
    DEFAULT_PREFIX,
    MARK_REPLACED,
    RELEASE,
    RELEASE_OWNERS_SLOT,
    RENEW,
    RETRIED,
    Script,
    SlotWidths,
    StoreBase,
    blpop_waits,
    check_slot_request,
    failed,
    grants,
    slot_reply,
    socket_timeout_of,
    width_wanted,
)
from celery_lease.stores._redis_sentinel import (
    GET_MASTER,
    client_from_url,
    describe_pool,
    log_master_change,
    master_of,
    no_master_message,
    pool_secrets,
)
from celery_lease.stores.base import LockStore, LoopBinding, redact_url
from celery_lease.stores.redis import RedisLockStore
from celery_lease.stores.slots import slot_key

__all__ = ["AsyncRedisLockStore"]

logger = logging.getLogger("celery_lease.stores.redis_async")

_T = TypeVar("_T")

_UNDO_TIMEOUT = 5.0  # seconds a release undoing a cancelled acquire may take


AsyncClient = redis.asyncio.Redis


class _Sentinel(redis.asyncio.sentinel.Sentinel):
    """Discovers the master with :data:`GET_MASTER`, as the sync ``Sentinel`` (see there)."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        problems: list[str] = []
        for sentinel in list(self.sentinels):
            try:
                reply = await sentinel.execute_command(GET_MASTER, service_name)  # type: ignore[no-untyped-call]
            except RETRIED as exc:
                reply = exc
            address = master_of(sentinel, reply, problems)
            if address is not None:
                return address
        raise redis.asyncio.sentinel.MasterNotFoundError(no_master_message(service_name, problems))


class AsyncRedisLockStore(StoreBase):
    """An :class:`~celery_lease.stores.base.AsyncLockStore` on Redis (standalone or Sentinel),
    with :class:`~celery_lease.stores.base.AsyncSupportsSlots` and ``mark_replaced``.

    The same scripts, keys and semantics as :class:`~celery_lease.stores.redis.RedisLockStore`
    through ``redis.asyncio``: every call is one round trip, retried once after a connection
    error or timeout, then raised as ``StoreUnavailableError``. Use it from one event loop and
    ``await store.aclose()`` at the end (a connection belongs to the loop it was opened in).

    Args:
        client_or_url: a ``redis://``, ``rediss://``, ``unix://`` or ``redis+sentinel://`` URL
            (the forms and query options :class:`RedisLockStore` takes; ``socket_timeout`` and
            ``socket_connect_timeout`` default to 5 s), or a ``redis.asyncio.Redis`` (used as
            is, closed by its owner; then ``sync`` is required).
        prefix: prepended to every key (default: ``sync``'s prefix, else ``"celery-lease:"``).
        sync: the synchronous twin on the same server and prefix. Default: a
            :class:`RedisLockStore` built from the same URL and options (closed by
            :meth:`aclose`). A twin passed in is the caller's to close.
        min_replicas: replicas that must acknowledge an acquire or a renewal (``WAIT``), as in
            :class:`RedisLockStore` (default: the URL's, else 1 under Sentinel, else 0).
        replica_timeout: how long one ``WAIT`` may block (a duration), as in
            :class:`RedisLockStore`.
        restart_grace: how long after its start a server that may have lost leases refuses
            free keys (a duration), as in :class:`RedisLockStore` (default: the twin's).

    Raises:
        LeaseConfigError: for a bad URL, client, prefix, twin or replica option (as the sync
            store reports them).
    """

    _logger = logger

    def __init__(
        self,
        client_or_url: str | AsyncClient,
        *,
        prefix: str | None = None,
        sync: RedisLockStore | None = None,
        min_replicas: int | None = None,
        replica_timeout: Any = None,
        restart_grace: Any = None,
    ) -> None:
        if sync is not None and not isinstance(sync, RedisLockStore):
            raise LeaseConfigError(f"sync={sync!r} must be a RedisLockStore (or None)")
        if prefix is None:
            prefix = sync.prefix if sync is not None else DEFAULT_PREFIX
        if sync is not None and sync.prefix != prefix:
            raise LeaseConfigError(
                f"prefix={prefix!r} differs from the prefix of sync ({sync.prefix!r}): the two "
                "would use different keys and not exclude each other"
            )
        self._owns_sync = sync is None
        self._sentinel: redis.asyncio.sentinel.Sentinel | None = None
        self._client: AsyncClient
        if isinstance(client_or_url, str):
            # The sync store validates the URL, prefix and replica options (the same checks).
            if sync is None:
                sync = RedisLockStore(
                    client_or_url,
                    prefix=prefix,
                    min_replicas=min_replicas,
                    replica_timeout=replica_timeout,
                    restart_grace=restart_grace,
                )
            self._client, self._sentinel, _ = client_from_url(
                client_or_url, redis.asyncio.Redis, _Sentinel, Retry
            )
        elif not isinstance(client_or_url, redis.asyncio.Redis):
            raise LeaseConfigError(
                f"client_or_url={client_or_url!r} must be a redis.asyncio.Redis or a redis://, "
                "rediss://, unix:// or redis+sentinel:// URL"
            )
        elif sync is None:
            raise LeaseConfigError(
                "sync=None: with a redis.asyncio.Redis client pass sync=RedisLockStore(...) "
                "on the same server (the renewer thread renews through it)"
            )
        else:
            self._client = client_or_url
        self._owns_client = isinstance(client_or_url, str)
        self._sync = sync
        self._prefix = prefix
        self._slot_widths = SlotWidths()
        self._min_replicas = _same_as_twin("min_replicas", min_replicas, sync.min_replicas, None)
        if not self._owns_sync:  # the twin's values are the ones used: set them there
            wait = partial(to_seconds, name="replica_timeout", minimum=0.001)
            _same_as_twin("replica_timeout", replica_timeout, sync.replica_timeout, wait)
            grace = partial(to_seconds, name="restart_grace")
            _same_as_twin("restart_grace", restart_grace, sync.restart_grace, grace)
        self._replica_timeout = sync.replica_timeout
        self._restart_grace = sync.restart_grace
        self._socket_timeout = socket_timeout_of(self._client.connection_pool.connection_kwargs)
        sentinels = self._sentinel.sentinels if self._sentinel is not None else ()
        self._secrets = pool_secrets(self._client.connection_pool.connection_kwargs, sentinels)
        self._loop = LoopBinding("its redis.asyncio connections")  # the loop of its first call
        # Releases waiting for the late reply of a cancelled acquire (awaited by aclose).
        self._late_undos: set[asyncio.Future[None]] = set()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AsyncRedisLockStore:
        """``AsyncRedisLockStore(url, **options)`` (what ``async_store_from_url`` calls)."""
        return cls(url, **options)

    @property
    def sync(self) -> LockStore:
        """The synchronous :class:`RedisLockStore` on the same server and prefix."""
        return self._sync

    async def _eval(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        wait: tuple[int, int] | None = None,
    ) -> tuple[Any, int | None]:
        """One EVALSHA, with ``WAIT *wait`` pipelined after it (see ``_wait_args``); on
        NOSCRIPT load the script and evaluate again. Returns ``(reply, acks or None)``."""
        client = self._client
        if wait is None:
            try:
                return await client.evalsha(script.sha, len(keys), *keys, *args), None
            except NoScriptError:
                await client.script_load(script.source)
                return await client.evalsha(script.sha, len(keys), *keys, *args), None
        for attempt in (1, 2):
            pipe = client.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", *wait)
            reply, acks = await pipe.execute(raise_on_error=False)
            if attempt == 1 and isinstance(reply, NoScriptError):
                await client.script_load(script.source)
                continue
            for result in (reply, acks):
                if isinstance(result, Exception):
                    raise result
            return reply, int(acks)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(
        self, operation: str, fn: Callable[[], Awaitable[_T]], key: str | None = None
    ) -> _T:
        """Await ``fn()``, again after a connection error or timeout; else StoreUnavailableError."""
        try:
            try:
                return await fn()
            except RETRIED as exc:
                self._log_retry(operation, key, exc)
            return await fn()
        except RedisError as exc:
            raise self._error(operation, key, failed(exc)) from exc

    async def _write(self, script: Script, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """:meth:`_eval` on the master a Sentinel names now: ``(reply, acks or None)``."""
        pool = self._client.connection_pool
        if isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool):
            known = pool.master_address
            try:
                address = await pool.sentinel_manager.discover_master(pool.service_name)
            except redis.asyncio.sentinel.MasterNotFoundError:
                if not self._min_replicas or known is None:
                    raise
                address = known
            if address != known:
                await pool.get_master_address()  # type: ignore[no-untyped-call]  # moves the pool and drops connections to the old
                if known is not None:
                    log_master_change(address, pool.service_name, known)
        return await self._eval(script, keys, args, self._wait_args())

    def _redact(self, message: str) -> str:
        message = super()._redact(message)
        return redact_url(message) if "://" in message else message

    @property
    def client(self) -> AsyncClient:
        """The ``redis.asyncio`` client the store talks through."""
        return self._client

    def _where(self) -> str:
        """``redis://host:port/db`` (or the Sentinel hosts and service, or the socket path)."""
        pool = self._client.connection_pool
        managed = isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool)
        return describe_pool(pool, pool if managed else None, redis.asyncio.SSLConnection)

    async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        """As :meth:`RedisLockStore.acquire`. Cancelled, it waits for the command's reply and
        releases what it took before the cancellation propagates."""
        self._loop.check(self)
        script, keys, args = self._acquire_call(ACQUIRE, key, owner, ttl_ms)
        reply = await self._take(script, keys, args, key, owner, None)
        return None if reply is None else int(reply)

    async def acquire_slot(
        self, key: str, owner: str, ttl_ms: int, limit: int
    ) -> tuple[int, int] | None:
        """As :meth:`RedisLockStore.acquire_slot` (one script, one round trip). Cancelled, it
        waits for the reply and releases the slot it took (without a reply: the slot of
        ``key`` its owner holds, if any) before the cancellation propagates."""
        check_slot_request(key, limit)
        self._loop.check(self)
        width: int | None = 0
        while width is not None:  # again only when the key is wider than the slots declared
            script, keys, args, n = self._slot_call(key, owner, ttl_ms, limit, width)
            reply = await self._take(script, keys, args, key, owner, limit)
            width = self._wider("acquire", key, limit, n, reply)
        return self._granted_slot(key, limit, reply)

    async def _take(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        key: str,
        owner: str,
        limit: int | None,
    ) -> Any:
        """Run the acquire ``script`` (a slot's with a ``limit``) on the master until the
        replicas confirm it (see CONFIRM_WINDOW); its reply, None when refused."""
        started = time.monotonic()
        asks = 0
        while True:
            # Shielded: a cancel must not cut the command off in flight (redis-py would drop
            # the connection, and a release sent on another one could reach the server first).
            attempt = asyncio.ensure_future(
                self._call("acquire", lambda: self._write(script, keys, args), key)
            )
            try:
                reply, acks = await asyncio.shield(attempt)
            except asyncio.CancelledError:
                await self._settle_cancelled_acquire(attempt, key, owner, limit)
                raise
            asks += 1
            if reply is None or width_wanted(reply) is not None:
                return reply
            reply = self._outside_grace(key, reply)
            if self._confirmed(acks):
                return reply
            # A replica a moment behind confirms a later ask (see CONFIRM_WINDOW).
            if time.monotonic() - started < CONFIRM_WINDOW:
                continue
            try:
                await self.release(_taken_key(key, reply, limit), owner)
            except StoreUnavailableError as exc:
                raise self._given_up(key, acks, asks, exc) from None
            raise self._given_up(key, acks, asks, None)

    async def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        """As :meth:`RedisLockStore.mark_replaced` (one script)."""
        keys, args = self._mark_call(key, ticket, holder)
        self._loop.check(self)
        reply, _ = await self._call(
            "mark replaced", lambda: self._write(MARK_REPLACED, keys, args), key
        )
        return self._mark_reply(ticket, reply)

    async def _settle_cancelled_acquire(
        self,
        attempt: asyncio.Future[tuple[Any, int | None]],
        key: str,
        owner: str,
        limit: int | None,
    ) -> None:
        """The caller of an acquire was cancelled: wait (at most ``_UNDO_TIMEOUT``, further
        cancels included) for the attempt's reply, then release what it took. The release is
        sent only after the reply, so it cannot overtake the acquire on the way to the server."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _UNDO_TIMEOUT
        while not attempt.done():
            left = deadline - loop.time()
            if left <= 0:
                # Late: the cancellation goes on now, the release follows the reply in a task.
                undo = asyncio.ensure_future(self._undo_after_reply(attempt, key, owner, limit))
                self._late_undos.add(undo)
                undo.add_done_callback(self._late_undos.discard)
                return
            with contextlib.suppress(asyncio.CancelledError):  # re-raised by our caller
                await asyncio.wait({attempt}, timeout=left)
        await self._undo_after_reply(attempt, key, owner, limit)

    async def _undo_after_reply(
        self,
        attempt: asyncio.Future[tuple[Any, int | None]],
        key: str,
        owner: str,
        limit: int | None,
    ) -> None:
        """Wait for the cancelled acquire's end (reply or error), then release what it may have
        taken; without a ``socket_timeout`` the attempt is cut off after 15 s and released
        anyway (owner checked, so at worst a no-op)."""
        wait = 2 * (self._socket_timeout or _UNDO_TIMEOUT) + _UNDO_TIMEOUT
        await asyncio.wait({attempt}, timeout=wait)
        if not attempt.done():
            attempt.cancel()
            await asyncio.wait({attempt})
        if not attempt.cancelled() and attempt.exception() is None:
            reply = attempt.result()[0]
            if not grants(reply):
                return  # it took nothing
            why = "cancelled after it took the lease"
            await self._undo_acquire(_taken_key(key, reply, limit), owner, why)
            return
        why = "cancelled before its reply came"
        if limit is None:
            await self._undo_acquire(key, owner, why)
        else:  # which slot it may have taken is not known: the one its owner holds
            await self._undo_acquire(key, owner, why, partial(self._release_owners_slot, limit))

    async def _undo_acquire(
        self,
        key: str,
        owner: str,
        why: str,
        release: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        """Release what an interrupted acquire of ``owner`` (unique per attempt) may have taken
        (``release``: how; default :meth:`release`'s way), shielded and bounded in time; a
        failure is logged (it expires within its ttl)."""
        undo = (release or self._release)(key, owner)
        task = asyncio.ensure_future(asyncio.wait_for(undo, _UNDO_TIMEOUT))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning(
                "Redis store %s: acquire of %r was %s, and releasing what it may have taken "
                "failed (%s); it expires within its ttl",
                self._where(),
                key,
                why,
                self._redact(str(exc)),
            )

    async def _release_owners_slot(self, limit: int, key: str, owner: str) -> None:
        """Release the slot of ``key`` that ``owner`` holds, whichever it is (one script; again
        when the key is wider than the slots it declared)."""
        width: int | None = 0
        while width is not None:
            keys, args, n = self._owners_slot_call(key, owner, limit, width)
            call = partial(self._eval, RELEASE_OWNERS_SLOT, keys, args)
            reply, _ = await self._call("release", call, key)
            width = self._wider("release", key, limit, n, reply)

    async def release_owned_slots(self, key: str, owner: str) -> None:
        """As :meth:`RedisLockStore.release_owned_slots` (one script)."""
        self._loop.check(self)
        await self._release_owners_slot(1, key, owner)

    async def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        """As :meth:`RedisLockStore.renew`."""
        self._loop.check(self)
        keys, args = (self.lease_key(key),), (owner, int(ttl_ms))
        reply, acks = await self._call("renew", lambda: self._write(RENEW, keys, args), key)
        return self._renewed(key, reply, acks)

    async def release(self, key: str, owner: str) -> None:
        """As :meth:`RedisLockStore.release` (owner checked, signals one waiter)."""
        self._loop.check(self)
        await self._release(key, owner)

    async def _release(self, key: str, owner: str) -> None:
        # No WAIT: a release a failover loses lets the lease expire within its ttl.
        keys, args = self._release_call(key, owner)
        await self._call("release", lambda: self._eval(RELEASE, keys, args), key)

    async def wait_for_release(self, key: str, timeout: float) -> bool:
        """As :meth:`RedisLockStore.wait_for_release` (BLPOP on the key's signal list, one waiter
        woken per release), in slices shorter than the socket timeout. Cancelling the awaiting
        task stops the wait (redis-py drops the connection that was blocked)."""
        self._loop.check(self)
        signal = self.signal_key(key)
        client = self._client
        if timeout <= 0:
            popped = await self._call("poll a release of", lambda: client.lpop(signal), key)
            return popped is not None
        for wait in blpop_waits(timeout, self._socket_timeout, time.monotonic):
            got = await self._call(
                "wait for a release of",
                lambda wait=wait: client.blpop([signal], wait),  # type: ignore[misc]
                key,
            )
            if got is not None:
                return True
        return False

    async def aclose(self) -> None:
        """Close the async client and the sync twin when this store built them, once the
        releases that follow late replies of cancelled acquires are done."""
        if self._late_undos:
            await asyncio.wait(set(self._late_undos))
        if self._owns_client:
            await self._client.aclose()
            if self._sentinel is not None:
                for sentinel in self._sentinel.sentinels:
                    await sentinel.aclose()
        if self._owns_sync:
            self._sync.close()
        self._loop.release()  # no connection is left: another loop may use the client now

    def __repr__(self) -> str:
        return f"AsyncRedisLockStore({self._where()}, prefix={self._prefix!r})"


def _taken_key(key: str, reply: Any, limit: int | None) -> str:
    """The store key an acquire of ``key`` answered ``reply`` took: ``key``, or with a
    ``limit`` the slot the reply names."""
    return key if limit is None else slot_key(key, slot_reply(reply)[0])


def _same_as_twin(name: str, value: Any, twin: Any, convert: Callable[[Any], float] | None) -> Any:
    """The twin's ``name``; LeaseConfigError if ``value`` (in seconds: ``convert``) differs."""
    if value is None:
        return twin
    if value != twin if convert is None else abs(convert(value) - twin) > 1e-9:
        raise LeaseConfigError(
            f"{name}={value!r} differs from sync's ({twin:g}): set it on the twin, which both use"
        )
    return twin
