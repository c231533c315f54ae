"""``lease()``: acquire a key (waiting if asked), keep it renewed while the body runs, release it.

::

    with lease("account:42", store=store, ttl="30s", wait="5s") as held:
        write(balance, fence=held.token)     # the resource rejects tokens lower than its last
        held.check()                          # raises LockLostError once the lease is lost

The lease of the innermost ``with`` in the current context is what :func:`get_lock_token` and
:func:`current_lease` return, deep in the call stack and per thread (``contextvars``). A nested
``lease()`` on the same key and store in the same context reuses the held lease (re-entrancy);
the store contract itself stays strict.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.durations import to_seconds
from celery_lease.errors import LeaseConfigError, LockLostError, LockNotAcquiredError
from celery_lease.renewer import Entry, get_renewer
from celery_lease.stores.base import LockStore, SupportsReleaseNotify

__all__ = ["Lease", "current_lease", "get_lock_token", "lease", "new_owner_id"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

POLL_FIRST = 0.05
"""Seconds before the first re-try of a held key; doubles after each try."""

POLL_MAX = 1.0
"""The longest interval, in seconds, between two tries of a held key."""


class _Frame:
    """One held lease in this context's stack of leases: a linked list, O(1) to push and pop."""

    __slots__ = ("lease", "parent")

    def __init__(self, lease: Lease, parent: _Frame | None) -> None:
        self.lease = lease
        self.parent = parent


_current: ContextVar[_Frame | None] = ContextVar("celery_lease_current", default=None)
_HOST = socket.gethostname()
_CONFORMS: dict[tuple[type, type], bool] = {}


def _conforms(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` for a runtime-checkable protocol, cached per class.

    The protocol check inspects every member on each call (tens of microseconds); a class that
    conforms once conforms always, so only instances of classes that do not are checked again.
    """
    cache_key = (type(obj), protocol)
    if _CONFORMS.get(cache_key):
        return True
    result = isinstance(obj, protocol)
    if result:
        _CONFORMS[cache_key] = True
    return result


def new_owner_id() -> str:
    """A fresh, random owner id: ``host/pid/random``, readable in ``celery lease list``."""
    return f"{_HOST}/{os.getpid()}/{secrets.token_hex(8)}"


class Lease:
    """A held lease, as yielded by :func:`lease`.

    Attributes:
        key: the key held.
        owner: the random owner id this acquisition used.
        token: the fencing token: larger than every earlier token of this key.
        waited: True when it was acquired only after another holder released or expired (that
            holder may just have done the same work).
        wait_seconds: how long acquiring took, in seconds of the lease's clock.
        store: the store it is held in.
    """

    def __init__(
        self,
        *,
        key: str,
        owner: str,
        token: int,
        waited: bool,
        wait_seconds: float,
        store: LockStore,
        clock: Clock,
        acquired_at: float,
    ) -> None:
        self.key = key
        self.owner = owner
        self.token = token
        self.waited = waited
        self.wait_seconds = wait_seconds
        self.store = store
        self.acquired_at = acquired_at
        self._clock = clock
        self._entry: Entry | None = None
        self._lost = threading.Event()
        self._lost_reason: str | None = None
        self._lost_lock = threading.Lock()
        self._callbacks: list[Callable[[Lease], object]] = []

    @property
    def lost(self) -> bool:
        """True once the lease is lost: renewal refused, validity ran out, or ``max_hold``."""
        if self._lost_reason is not None:
            return True
        entry = self._entry
        return (
            entry is not None
            and not entry.closed
            and self._clock.monotonic() >= (entry.valid_until)
        )

    @property
    def lost_reason(self) -> str | None:
        """``"expired"``, ``"taken"`` or ``"max_hold"`` once lost, else ``None``."""
        if self._lost_reason is None and self.lost:
            return "expired"
        return self._lost_reason

    @property
    def held_seconds(self) -> float:
        """Seconds (of the lease's clock) since the lease was acquired."""
        return self._clock.monotonic() - self.acquired_at

    def check(self) -> None:
        """Raise :class:`LockLostError` if the lease is lost; return quietly otherwise."""
        if self.lost:
            raise LockLostError(self.key, self.lost_reason or "lost")

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds (``None``: forever) until the lease is lost.

        Returns whether it is lost.
        """
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        while not self.lost:
            now = self._clock.monotonic()
            entry = self._entry
            limits = [t for t in (deadline, entry.valid_until if entry else None) if t is not None]
            if deadline is not None and now >= deadline:
                return False
            self._clock.wait(self._lost, (min(limits) - now) if limits else None)
        return True

    def _mark_lost(self, reason: str) -> None:
        """Record the loss and run the callbacks, exactly once."""
        with self._lost_lock:
            if self._lost_reason is not None:
                return
            self._lost_reason = reason
        logger.warning(
            "celery-lease: lease on %r (token %d) lost: %s", self.key, self.token, reason
        )
        try:
            for callback in self._callbacks:
                try:
                    callback(self)
                except Exception:
                    logger.exception("celery-lease: on_lost callback for %r raised", self.key)
        finally:
            self._lost.set()  # after the callbacks, so wait_lost() returns once they ran

    def __repr__(self) -> str:
        state = f"lost:{self.lost_reason}" if self.lost else "held"
        return f"<Lease key={self.key!r} token={self.token} owner={self.owner!r} {state}>"


class _LeaseContext:
    """The object :func:`lease` returns: a context manager, and a decorator."""

    def __init__(
        self,
        key: str,
        store: LockStore,
        ttl: float,
        wait: float,
        max_hold: float | None,
        cooldown: float,
        on_lost: Callable[[Lease], object] | None,
        cancel: threading.Event | None,
        clock: Clock,
    ) -> None:
        self.key = key
        self.store = store
        self.ttl = ttl
        self.wait = wait
        self.max_hold = max_hold
        self.cooldown = cooldown
        self.on_lost = on_lost
        self.cancel = cancel
        self.clock = clock
        self._lease: Lease | None = None
        self._reentered = False
        self._entered = False

    # Decorator --------------------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return cast(F, wrapper)

    def _fresh(self) -> _LeaseContext:
        """A new, unentered context with the same arguments: one per decorated call."""
        return _LeaseContext(
            self.key,
            self.store,
            self.ttl,
            self.wait,
            self.max_hold,
            self.cooldown,
            self.on_lost,
            self.cancel,
            self.clock,
        )

    # Context manager --------------------------------------------------------------------------

    def __enter__(self) -> Lease:
        if self._entered:
            raise RuntimeError("a lease() context cannot be entered twice; call lease() again")
        self._entered = True
        top = _current.get()
        frame = top
        while frame is not None:
            outer = frame.lease
            if outer.key == self.key and outer.store is self.store and not outer.lost:
                self._reentered = True
                self._lease = outer
                _current.set(_Frame(outer, top))
                return outer
            frame = frame.parent
        held = self._acquire()
        self._lease = held
        _current.set(_Frame(held, top))
        return held

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        held = self._lease
        assert held is not None
        _pop(held)
        if self._reentered:
            return False
        entry = held._entry
        if entry is not None:
            lapsed = held.lost and held._lost_reason is None
            get_renewer(self.clock).remove(entry)
            if lapsed:
                held._mark_lost("expired")  # validity ran out before the renewer noticed
        self._finish(held, succeeded=exc is None)
        if exc is not None and held.lost and not isinstance(exc, LockLostError):
            raise LockLostError(held.key, held.lost_reason or "lost") from exc
        return False

    def _finish(self, held: Lease, *, succeeded: bool) -> None:
        """Release the key, or keep it for ``cooldown`` after a success; never raise."""
        try:
            if succeeded and self.cooldown > 0 and not held.lost:
                self.store.renew(held.key, held.owner, max(1, round(self.cooldown * 1000)))
            else:
                self.store.release(held.key, held.owner)
        except Exception as exc:
            logger.warning(
                "celery-lease: releasing %r failed (%s); it expires within its ttl", held.key, exc
            )

    def _acquire(self) -> Lease:
        clock, store = self.clock, self.store
        owner = new_owner_id()
        ttl_ms = max(1, round(self.ttl * 1000))
        started = clock.monotonic()
        deadline = started + self.wait
        interval = POLL_FIRST
        notify = _conforms(store, SupportsReleaseNotify)
        idle = self.cancel if self.cancel is not None else threading.Event()
        tries = 0
        while True:
            if self.cancel is not None and self.cancel.is_set():
                raise LockNotAcquiredError(self.key, "cancelled")
            sent_at = clock.monotonic()
            token = store.acquire(self.key, owner, ttl_ms)
            if token is not None:
                break
            tries += 1
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                raise LockNotAcquiredError(self.key)
            pause = min(interval, remaining)
            if notify:
                cast(SupportsReleaseNotify, store).wait_for_release(self.key, pause)
            else:
                clock.wait(idle, pause)
            interval = min(interval * 2, POLL_MAX)
        held = Lease(
            key=self.key,
            owner=owner,
            token=token,
            waited=tries > 0,
            wait_seconds=sent_at - started,
            store=store,
            clock=clock,
            acquired_at=sent_at,
        )
        if self.on_lost is not None:
            held._callbacks.append(self.on_lost)
        max_hold_at = None if self.max_hold is None else sent_at + self.max_hold
        held._entry = Entry(
            store=store,
            key=self.key,
            owner=owner,
            ttl=self.ttl,
            sent_at=sent_at,
            max_hold_at=max_hold_at,
            on_lost=held._mark_lost,
        )
        get_renewer(clock).add(held._entry)
        return held

    def __repr__(self) -> str:
        return f"lease({self.key!r}, store={self.store!r}, ttl={self.ttl:g}, wait={self.wait:g})"


def lease(
    key: str,
    *,
    store: LockStore,
    ttl: object = 30,
    wait: object = 0,
    max_hold: object = None,
    on_lost: Callable[[Lease], object] | None = None,
    cancel: threading.Event | None = None,
    clock: Clock | None = None,
    cooldown: object = 0,
) -> _LeaseContext:
    """Hold ``key`` in ``store`` while a block (or decorated function) runs.

    Args:
        key: the key to hold (a non-empty string).
        store: the :class:`~celery_lease.LockStore` to hold it in.
        ttl: lease duration (default 30 s); renewed every ttl/3 while the body runs, so a
            crashed holder frees the key within one ttl.
        wait: how long to wait for another holder (default 0: fail at once). Waiting wakes on the
            store's release notification where it has one, else polls from 50 ms doubling to 1 s.
        max_hold: stop renewing after this long (default: never); the lease is then lost.
        on_lost: ``on_lost(lease)``, called exactly once, from the renewer thread, when the lease
            is lost.
        cancel: a ``threading.Event``; setting it aborts the wait (within one poll interval)
            with ``LockNotAcquiredError(key, "cancelled")``.
        clock: time source (default: the system clock); a ``FakeClock`` in tests.
        cooldown: after a body that succeeded, keep the key taken this long (counted from the
            end) instead of releasing it (default 0).

    Durations are seconds, ``timedelta`` or strings like ``"250ms"``, ``"30s"``, ``"5m"``.
    Everything is validated here, before anything is acquired.

    Raises:
        LeaseConfigError: (a ``ValueError``) for a bad argument, naming it.
        LockNotAcquiredError: on entry, when the key stays held past ``wait``.
        LockLostError: on exit, when the body raised after the lease was lost (chained).
        StoreUnavailableError: when the store cannot be reached to acquire.
    """
    if not isinstance(key, str) or not key:
        raise LeaseConfigError(f"key={key!r} must be a non-empty string")
    if not _conforms(store, LockStore):
        hint = " (build one with store_from_url(url) once)" if isinstance(store, str) else ""
        raise LeaseConfigError(
            f"store={store!r} is not a LockStore: it needs acquire(), renew() and release(){hint}"
        )
    ttl_s = to_seconds(ttl, name="ttl", inclusive=False)
    if ttl_s < 0.001:
        raise LeaseConfigError(f"ttl={ttl!r} must be at least 1 ms")
    wait_s = to_seconds(wait, name="wait")
    max_hold_s = (
        None if max_hold is None else to_seconds(max_hold, name="max_hold", inclusive=False)
    )
    cooldown_s = to_seconds(cooldown, name="cooldown")
    if on_lost is not None and not callable(on_lost):
        raise LeaseConfigError(f"on_lost={on_lost!r} must be a callable taking the Lease, or None")
    if cancel is not None and not (hasattr(cancel, "is_set") and hasattr(cancel, "wait")):
        raise LeaseConfigError(f"cancel={cancel!r} must be a threading.Event or None")
    if clock is not None and not _conforms(clock, Clock):
        raise LeaseConfigError(f"clock={clock!r} must provide monotonic(), time() and wait()")
    return _LeaseContext(
        key,
        store,
        ttl_s,
        wait_s,
        max_hold_s,
        cooldown_s,
        on_lost,
        cancel,
        clock if clock is not None else SYSTEM_CLOCK,
    )


def _pop(held: Lease) -> None:
    """Remove the innermost frame of ``held`` from this context's stack of leases.

    O(1) when contexts are exited in order (the usual case); right, if slower, when they are not.
    """
    top = _current.get()
    if top is not None and top.lease is held:
        _current.set(top.parent)
        return
    frames: list[_Frame] = []
    frame = top
    while frame is not None and frame.lease is not held:
        frames.append(frame)
        frame = frame.parent
    if frame is None:
        return
    rebuilt = frame.parent
    for above in reversed(frames):
        rebuilt = _Frame(above.lease, rebuilt)
    _current.set(rebuilt)


def current_lease() -> Lease | None:
    """The innermost lease held in the current context, or ``None`` outside any lease."""
    top = _current.get()
    return None if top is None else top.lease


def get_lock_token() -> int | None:
    """The fencing token of the innermost lease held in the current context, else ``None``."""
    held = current_lease()
    return None if held is None else held.token
