"""The store protocol: three operations, each atomic per key, time read from the store's clock.

A store keeps, per key, at most one live lease ``{owner, expires}`` and a fencing-token counter
that only grows. Optional capabilities (:class:`SupportsReleaseNotify`,
:class:`SupportsBatchRenew`, :class:`SupportsInspection`) are detected with :func:`conforms`;
:class:`AsyncLockStore` is the asyncio twin of :class:`LockStore`.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from celery_lease.stores._typing_compat import is_protocol

__all__ = [
    "AsyncLockStore",
    "AsyncSupportsOwnedSlotsRelease",
    "AsyncSupportsSlots",
    "LeaseInfo",
    "LockStore",
    "LoopBinding",
    "SupportsAcquireOrHolder",
    "SupportsBatchRenew",
    "SupportsDeferredRelease",
    "SupportsDeferredRenew",
    "SupportsInspection",
    "SupportsOwnedSlotsRelease",
    "SupportsReleaseNotify",
    "SupportsReplace",
    "SupportsSentAcquire",
    "SupportsSlots",
    "conforms",
    "redact_url",
]


@runtime_checkable
class LockStore(Protocol):
    """The contract every store implements; each method is atomic per key."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        """Take ``key`` for ``owner`` for ``ttl_ms`` milliseconds if no live lease exists.

        Returns a fencing token greater than every token this store ever returned for ``key``
        (also across expiry, release and reuse), or ``None`` when another owner holds a live
        lease on the key. A repeated acquire by ``owner`` while its own lease is live is
        idempotent: it returns that lease's existing token (no new token, the counter is not
        bumped) and sets its expiry to now + ``ttl_ms`` (set, never add, as ``renew`` does).
        Owner ids are unique per acquisition attempt, so this makes a retry after a lost reply
        safe: the retry gets its own lease back instead of leaving an orphan that blocks the key
        for a ttl. Once the lease expired or was released, the same owner gets a new, larger
        token. Raises ``StoreUnavailableError`` when the store fails.
        """
        ...

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        """Set the expiry of ``owner``'s live lease to now + ``ttl_ms`` (set, never add).

        Returns ``False`` when the key has no live lease of ``owner``.
        """
        ...

    def release(self, key: str, owner: str) -> None:
        """Delete the lease on ``key`` only if it belongs to ``owner``; otherwise do nothing."""
        ...


@runtime_checkable
class SupportsReleaseNotify(Protocol):
    """A store that can wake waiters when a key is released."""

    def wait_for_release(self, key: str, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a release of ``key``; True if one was signalled.

        A spurious True is allowed (the caller retries ``acquire``); so is a timeout while the key
        expired without a release (the caller polls anyway).
        """
        ...


@runtime_checkable
class SupportsAcquireOrHolder(Protocol):
    """A store whose refused acquire also names the holder, read in the same atomic step.

    A duplicate call of a unique task needs the holder's task id: with this, one round trip
    instead of an :meth:`~LockStore.acquire` and then an inspection ``get`` (which can also find
    the key freed in between, and must then try again).
    """

    def acquire_or_holder(self, key: str, owner: str, ttl_ms: int) -> tuple[int | None, str | None]:
        """:meth:`~LockStore.acquire`, and on refusal the owner of the live lease that refused it.

        Returns ``(token, None)`` when ``owner`` took (or, holding it, re-took) the key, exactly as
        ``acquire`` would, and ``(None, holder)`` when ``holder`` holds a live lease on it (which
        is left as it was). Store errors raise ``StoreUnavailableError``, as ``acquire``'s do
        (a Redis store in its restart grace raises its subclass ``RestartGraceError``).
        """
        ...


@runtime_checkable
class SupportsDeferredRelease(Protocol):
    """A store that can send a release without waiting for its reply (see the Redis store).

    The caller promises that nothing it publishes depends on the key being free until it has
    called :meth:`flush_deferred` (or the store's next call, which reads the reply first).
    """

    def release_deferred(self, key: str, owner: str) -> bool:
        """Send the owner-checked release of ``key``; True when sent, False when the caller
        must :meth:`~LockStore.release` as usual. Its outcome is logged when the reply is read:
        a failure leaves the key to expire within its ttl, as a failed release does."""
        ...

    def flush_deferred(self) -> None:
        """Read the replies of releases sent by :meth:`release_deferred` (blocks until read)."""
        ...


@runtime_checkable
class SupportsSentAcquire(Protocol):
    """A store that can send an acquire now and read its reply later (see the Redis store), so
    the round trip overlaps the caller's own work."""

    def send_acquire(self, key: str, owner: str, ttl_ms: int) -> Callable[[], int | None] | None:
        """Send :meth:`~LockStore.acquire` ``(key, owner, ttl_ms)``; ``None`` when not sent (the
        caller acquires as usual). Else a function that reads the reply, once: what ``acquire``
        would have returned or raised (a lost reply is asked again once, as ``acquire`` asks
        again after a connection error). Until it is read, the store's other calls on that
        connection read it first and keep it."""
        ...


@runtime_checkable
class SupportsDeferredRenew(Protocol):
    """A store that can send a renewal without waiting for its reply (see the Redis store)."""

    def renew_deferred(self, key: str, owner: str, ttl_ms: int) -> bool:
        """Send ``renew(key, owner, ttl_ms)``; True when sent (its reply is read before the next
        reply of the store's connection, and a refusal or failure is logged then), False when
        the caller must renew the usual way."""
        ...


@runtime_checkable
class SupportsBatchRenew(Protocol):
    """A store that renews many leases in one round trip."""

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> Sequence[bool | Exception]:
        """Renew each ``(key, owner, ttl_ms)``; one answer per item, in order.

        Each slot holds what :meth:`LockStore.renew` would answer for that key alone: ``True``,
        ``False`` (not held by ``owner``), or the exception renewing it alone would raise (an
        error of one key fails that lease only). Raise only when the whole batch failed (the
        connection, the transaction): the renewer retries the batch as one, never key by key,
        which against a dead store would multiply its timeout. An answer of another length
        than ``items`` fails the whole batch.
        """
        ...


@runtime_checkable
class SupportsSlots(Protocol):
    """A store that keeps up to ``limit`` leases of one key at once, each in its own slot.

    Slot ``i`` of ``key`` is the ordinary lease on :func:`~celery_lease.stores.slots.slot_key`
    ``(key, i)``: renew, release, inspect and force-release it with the :class:`LockStore` and
    :class:`SupportsInspection` methods on that store key. Its release wakes the waiters of
    ``wait_for_release(key)``.
    """

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        """Take a free slot of ``key`` for ``owner`` for ``ttl_ms`` ms if fewer than ``limit`` of
        its slots hold live leases; one atomic step.

        Every live slot of ``key`` counts, also one at or above ``limit`` (taken under a larger
        limit): a lowered limit refuses new holders until the count is below it and never frees
        a holder. Returns ``(slot, token)``: the lowest free slot in ``0 .. limit - 1`` and a token
        greater than every token this store issued to any slot of ``key`` (also across expiry,
        release and reuse), or ``None`` when ``limit`` or more slots are held. A repeated call by
        ``owner`` while it holds a live slot of ``key`` returns that slot and its token and sets
        its expiry to now + ``ttl_ms`` (as :meth:`LockStore.acquire` does for a key), whatever
        ``limit``. Raises ``StoreUnavailableError`` when the store fails, ``ValueError`` for a
        ``limit`` under 1 or a ``key`` holding :data:`~celery_lease.stores.slots.SLOT_MARK`.
        """
        ...


@runtime_checkable
class AsyncSupportsSlots(Protocol):
    """The async twin of :class:`SupportsSlots` (same data, same semantics)."""

    async def acquire_slot(
        self, key: str, owner: str, ttl_ms: int, limit: int
    ) -> tuple[int, int] | None:
        """As :meth:`SupportsSlots.acquire_slot`."""
        ...


@runtime_checkable
class SupportsOwnedSlotsRelease(Protocol):
    """A store that frees, in one call, the slots of a key one owner holds (optional: without
    it, a caller releases :func:`~celery_lease.stores.slots.slot_key` ``(key, i)`` one by one)."""

    def release_owned_slots(self, key: str, owner: str) -> None:
        """Release every slot of ``key`` held by ``owner``, whatever its index, owner-checked,
        in one atomic step; nothing held: nothing happens. The key
        itself (a lease of its own) is left alone. Frees waiters of ``wait_for_release(key)``
        as a release does. Undoes a slot acquire whose reply never came (owner ids are unique
        per attempt). Raises ``StoreUnavailableError`` when the store fails."""
        ...


@runtime_checkable
class AsyncSupportsOwnedSlotsRelease(Protocol):
    """The async twin of :class:`SupportsOwnedSlotsRelease` (same semantics)."""

    async def release_owned_slots(self, key: str, owner: str) -> None:
        """As :meth:`SupportsOwnedSlotsRelease.release_owned_slots`."""
        ...


@runtime_checkable
class SupportsReplace(Protocol):
    """A store that can ask the holder of a key to stop (``on_held="replace"``).

    A holder asked to stop keeps its lease until it releases it or the lease expires (so no
    second holder starts while it may still run), but its stored owner id gets
    :data:`~celery_lease.stores.slots.REPLACED_MARK` appended: ``renew(key, owner)`` answers
    ``False`` from then on, ``release(key, owner)`` still deletes it (and wakes waiters),
    another owner's acquire is still refused, and ``get`` / ``list`` / ``acquire_or_holder`` show
    the marked owner id.
    """

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        """Ask the live holder of ``key`` (a key, not a slot) to stop; one atomic step.

        ``ticket``: ``None`` draws one from ``key``'s token counter (greater than every token
        issued for ``key`` so far; every later token is greater still); else it is returned as
        given. ``holder``: when given, only a live lease of that owner id (unmarked) is asked.
        Returns ``(ticket, holder, asked)``: the ticket, the owner id (without the mark) of the
        live lease on ``key`` (``None`` when it is free), and whether that lease is now marked
        (by this call or an earlier one); ``asked`` is False when the key is free or another
        owner than ``holder`` holds it (left as it was). Raises ``StoreUnavailableError``.
        """
        ...


class LoopBinding:
    """The event loop a native async store belongs to (that of its first call): its clients
    would hang or fail obscurely in another. ``what`` names them, for the error."""

    __slots__ = ("_loop", "_what")

    def __init__(self, what: str) -> None:
        self._what = what
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None

    def check(self, store: object) -> None:
        """Bind to the running loop on the first call; ``RuntimeError`` from another loop."""
        loop = asyncio.get_running_loop()
        bound = self._loop
        if bound is None:
            self._loop = weakref.ref(loop)
        elif bound() is not loop:
            raise RuntimeError(
                f"{store!r} was first used in another event loop: {self._what} belong to that"
                " loop. Build one store per event loop (at its start-up) and"
                " 'await store.aclose()' in it at shutdown"
            )

    def release(self) -> None:
        """Forget the loop (nothing of it is left): another loop may use the store now."""
        self._loop = None


@runtime_checkable
class AsyncLockStore(Protocol):
    """The async twin of :class:`LockStore`: the same semantics per method, as coroutines.

    Atomic per key, tokens only grow, a same-owner acquire is idempotent, renew and release are
    owner-checked, and a failure raises ``StoreUnavailableError``, never a silent success. It
    works on the SAME data as its synchronous twin :attr:`sync`, so sync and async processes
    (and the renewer thread, which renews through :attr:`sync`) exclude each other.

    Implementations: :class:`celery_lease.stores.threaded.ThreadedAsyncStore` (any sync store, its
    short calls run on a thread), ``celery_lease.stores.redis_async.AsyncRedisLockStore``
    (``redis.asyncio``) and ``celery_lease.stores.postgres_async.AsyncPostgresLockStore``
    (psycopg's async connection). :func:`~celery_lease.async_store_from_url` picks one from a URL.
    """

    @property
    def sync(self) -> LockStore:
        """A synchronous store on the same data; the renewer thread renews through it (off the
        event loop, so a busy loop does not lose a lease). The same object at every access:
        each store object has a renewer thread of its own."""
        ...

    async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        """As :meth:`LockStore.acquire`: a token greater than every earlier one, or ``None``."""
        ...

    async def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        """As :meth:`LockStore.renew`: ``False`` when the key has no live lease of ``owner``."""
        ...

    async def release(self, key: str, owner: str) -> None:
        """As :meth:`LockStore.release`: delete the lease only if it belongs to ``owner``."""
        ...

    async def wait_for_release(self, key: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a release signal on ``key``; True if one came.

        A hint only: the caller tries ``acquire`` again either way (a spurious True and a
        timeout while the key merely expired are both allowed). Cancelling the awaiting task
        stops the wait.
        """
        ...

    async def aclose(self) -> None:
        """Close the store's connections (the :attr:`sync` twin's too, when the store built it)."""
        ...


@dataclass(frozen=True)
class LeaseInfo:
    """A live lease as seen by an inspection call (``expires_in``: seconds, by the store's
    clock at the time of the call)."""

    key: str
    owner: str
    token: int
    expires_in: float


@runtime_checkable
class SupportsInspection(Protocol):
    """A store whose leases can be listed and force-released (used by the ``celery lease`` CLI)."""

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        """Live leases whose key starts with ``prefix``, sorted by key."""
        ...

    def get(self, key: str) -> LeaseInfo | None:
        """The live lease on ``key``, or ``None`` when it is free."""
        ...

    def last_token(self, key: str) -> int | None:
        """The last fencing token issued for ``key``, or ``None`` if the store has none recorded."""
        ...

    def force_release(self, key: str) -> LeaseInfo | None:
        """Delete the live lease on ``key`` whoever holds it; returns what was removed.

        The counter is kept, so the next acquirer still gets a higher token.
        """
        ...


def conforms(obj: object, protocol: type) -> bool:
    """Whether ``obj`` offers every member of ``protocol`` (any ``typing.Protocol``): each
    method as a callable attribute, each property as an attribute.

    Read with ``getattr``, so a wrapper delegating through ``__getattr__`` conforms to what it
    wraps, on every Python (``isinstance`` stopped seeing such attributes in 3.12). Reading a
    property runs it. A class having every member itself is remembered (one dict look-up).
    """
    cls = type(obj)
    if (cls, protocol) in _STATIC:
        return True
    methods, others = _members(protocol)
    if all(callable(getattr(cls, name, None)) for name in methods) and all(
        hasattr(cls, name) for name in others
    ):
        _STATIC.add((cls, protocol))
        return True
    return all(callable(getattr(obj, name, None)) for name in methods) and all(
        hasattr(obj, name) for name in others
    )


_STATIC: set[tuple[type, type]] = set()
_MEMBERS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _members(protocol: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(methods, other members)`` of ``protocol`` and its protocol bases, public names only."""
    known = _MEMBERS.get(protocol)
    if known is not None:
        return known
    if not is_protocol(protocol):
        raise TypeError(f"conforms() needs a typing.Protocol class, not {protocol!r}")
    methods: set[str] = set()
    others: set[str] = set()
    for base in protocol.__mro__:
        if base in (object, Protocol) or not is_protocol(base):
            continue
        found: dict[str, Any] = dict.fromkeys(inspect.get_annotations(base))
        found.update(base.__dict__)
        for name, value in found.items():
            if name.startswith("_"):
                continue
            (methods if callable(value) else others).add(name)
    known = _MEMBERS[protocol] = (tuple(sorted(methods)), tuple(sorted(others)))
    return known


_SCHEME_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/+")
# A parameter whose name ends in "password" (libpq's password=, ?sentinel_password=...): its
# value, quoted (perhaps unterminated) or up to the next " name=", "&", ";" or the end.
_PARAM_PASSWORD = re.compile(
    r"""(password\s*=\s*)('(?:[^'\\]|\\.)*'?|.*?)(?=\s+[A-Za-z_][A-Za-z0-9_]*\s*=|[&;]|$)""",
    re.IGNORECASE | re.DOTALL,
)


def secrets_among(found: Iterable[object]) -> tuple[str, ...]:
    """The passwords among ``found``, longest first (one containing another is masked whole)."""
    return tuple(sorted({s for s in found if isinstance(s, str) and s}, key=len, reverse=True))


def mask_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def redact_url(url: str) -> str:
    """``url`` (or a libpq ``key=value`` DSN) with every password replaced by ``***``: the
    userinfo's (up to the last ``@``, whatever the scheme) and every ``...password=`` parameter's,
    quoted or not. It masks too much rather than too little.
    """
    text = url
    at = text.rfind("@")  # the last one: a password may hold "@", "/" or "?" unencoded
    if at >= 0:
        scheme = _SCHEME_PREFIX.match(text)
        begin = scheme.end() if scheme is not None else 0
        colon = text.find(":", begin, at)
        if colon >= 0:
            text = text[: colon + 1] + "***" + text[at:]
    return _PARAM_PASSWORD.sub(r"\1***", text)
