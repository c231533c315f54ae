"""``lease()``: acquire a key (waiting if asked), keep it renewed while the body runs, release it.

::

    with lease("account:42", store=store, ttl="30s", wait="5s") as held:
        write(balance, fence=held.token)     # the resource rejects tokens lower than its last
        held.check()                          # raises LockLostError once the lease is lost

The lease of the innermost ``with`` in the current context is what :func:`get_lock_token` and
:func:`current_lease` return, deep in the call stack and per thread (``contextvars``). A nested
``lease()`` on the same key and store in the same context, on the thread (or in the asyncio
task) that entered the held lease, reuses it (re-entrancy, as an ``RLock``'s); code of a copied
context running on another thread or in another task acquires like anyone else. The store
contract itself stays strict. After ``fork`` the child ignores the leases of its parent: they
are not its current lease, not re-entered, and never renewed or released from the child,
whether or not the fork ran Python's at-fork hooks (:func:`celery_lease._forking.generation`).

Loss is one record kept by the renewer (:mod:`celery_lease._core.renewer`); user callbacks run on
the
dispatcher (:mod:`celery_lease._core.dispatch`), never on the renewer or the watchdog.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from asyncio import _get_running_loop, current_task  # asyncio exports both (asyncio.__all__)
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeVar, cast

from celery_lease import _forking as forking
from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS, make_owner
from celery_lease._core.renewer import DRIFT_FACTOR, DRIFT_MARGIN, Entry, Renewer, get_renewer
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.durations import Duration, to_seconds
from celery_lease.errors import (
    LeaseConfigError,
    LockLostError,
    LockNotAcquiredError,
    ReplicaLagError,
    RestartGraceError,
)
from celery_lease.stores.base import (
    AsyncLockStore,
    LockStore,
    SupportsAcquireOrHolder,
    SupportsDeferredRelease,
    SupportsReleaseNotify,
    conforms,
)

__all__ = ["Lease", "clock_of", "current_lease", "get_lock_token", "lease", "new_owner_id"]

logger = logging.getLogger("celery_lease.lease")

F = TypeVar("F", bound=Callable[..., Any])

POLL_FIRST = 0.05
"""Seconds before the first re-try of a held key; doubles after each try."""

POLL_MAX = 1.0
"""The longest interval, in seconds, between two tries of a held key."""

MIN_TTL = DRIFT_MARGIN / (1 - DRIFT_FACTOR)
"""Seconds (about 2.02 ms) a ttl must exceed to leave the lease any local validity."""


class Frame:
    """One held lease in this context's stack of leases: a linked list, O(1) to push and pop.

    ``gen`` is the fork generation of the process that pushed it (its lease's): a forked child
    inherits the context variables of its parent, and ignores the frames whose generation is not
    its own.
    ``origin`` is the frame the pushing context holds (itself, or the frame a copy stands for).
    """

    __slots__ = ("gen", "lease", "origin", "parent")

    def __init__(self, lease: Lease, parent: Frame | None) -> None:
        self.lease = lease
        self.parent = parent
        self.gen = lease._gen  # the frame of a lease this process holds: this process's
        self.origin = self  # a copy made by an out-of-order pop keeps the original's identity


current_frame: ContextVar[Frame | None] = ContextVar("celery_lease_current", default=None)
_events_lock = threading.Lock()  # makes a Lease's loss event on first wait (renewed after fork)

# Frames and leases record the fork generation of the process that made them
# (celery_lease._forking.generation): those of an ancestor carry a smaller one than the child's,
# so the child never takes them for its own, whether or not the fork ran Python's at-fork hooks.
# Generations of siblings may be equal, but siblings share no memory.


def _after_fork_in_child() -> None:
    global _events_lock
    _events_lock = threading.Lock()


forking.on_fork_child(_after_fork_in_child, name="lease: events lock")


def offers(obj: object, protocol: type, method: str) -> bool:
    """Whether ``obj`` conforms to ``protocol``, whose ``method`` its class must define: the
    class test first, since the protocol check of a class that does not conform is not cached
    and costs a full ``isinstance()`` per call (on a task's hot path)."""
    return hasattr(type(obj), method) and conforms(obj, protocol)


_CLOCK_METHODS = ("monotonic", "time", "wait")
_CLOCK_CLASSES: set[type] = set()  # classes found to define every clock method (positives only)
_CLOCK_RAISED: set[type] = set()  # store classes whose ``clock`` raised (warned once each)


def is_clock(obj: object) -> bool:
    """Whether ``obj`` is a real clock: its class itself defines (or inherits) ``monotonic``,
    ``time`` and ``wait`` (:class:`~celery_lease.clock.Clock`), as ``SystemClock``,
    ``FakeClock`` and a user's clock class do.

    Stricter than ``isinstance(obj, Clock)``, which an object answering every attribute passes
    (a ``Mock``, a ``__getattr__`` proxy), and than ``isinstance(obj, FakeClock)``, which
    ``Mock(spec=FakeClock)`` passes: the class is read without running any ``__getattr__``.
    """
    cls = type(obj)
    if cls in _CLOCK_CLASSES:
        return True
    found = all(callable(inspect.getattr_static(cls, name, None)) for name in _CLOCK_METHODS)
    if found:
        _CLOCK_CLASSES.add(cls)
    return found


def clock_of(store: object, default: Clock = SYSTEM_CLOCK) -> Clock:
    """The clock a lease in ``store`` runs on: the store's own (``clock``, the memory and SQLite
    stores take one) when it is a real clock (:func:`is_clock`), else ``default`` (the system
    clock). Never raises.

    The lease's renewer sleeps on it and its validity is counted on it, as the store counts the
    lease's expiry: on a ``MemoryLockStore`` over a ``FakeClock`` (the pytest plugin's
    ``lease_store``) the task's renewer wakes when the test moves that clock, never on real time
    the store does not see. A ``clock`` that is no real clock (a ``Mock``'s, or whatever a
    ``__getattr__`` proxy answers) is ignored; one whose reading raises is ignored too, with a
    WARNING once per store class. A wrapper store that forwards ``clock`` to the store it wraps
    gives that store's clock.

    A wait for a held key of ``store`` is measured and slept on this clock too, with the lease's
    ``clock=`` as ``default``: a memory store's ``wait_for_release`` sleeps on its clock, and the
    holder's lease expires by it, so a deadline read from another clock is never reached when
    the store's is a ``FakeClock`` nobody advances (a task's ``lock_wait`` on the pytest
    plugin's ``lease_store``). (An ``async with`` counts its wait on that clock while it sleeps
    on its event loop.)
    """
    try:
        own = getattr(store, "clock", None)
    except Exception as exc:
        cls = type(store)
        if cls not in _CLOCK_RAISED:
            _CLOCK_RAISED.add(cls)
            logger.warning(
                "celery-lease: reading the clock of %s.%s raised %s: %s; its leases run on %r",
                cls.__module__,
                cls.__qualname__,
                type(exc).__name__,
                exc,
                default,
            )
        return default
    return own if own is not None and is_clock(own) else default


def new_owner_id(
    *,
    node: str | None = None,
    task: str | None = None,
    task_id: str | None = None,
    label: str | None = None,
) -> str:
    """A fresh owner id: ``host/pid/<16 hex>`` plus holder fields (see ``make_owner``).

    Unique per call (per acquisition attempt): a store's idempotent re-acquire by the same owner
    relies on it. ``node``, ``task``, ``task_id`` and ``label`` are recorded in the id, readable
    with :func:`~celery_lease._core.owners.parse_owner` (``celery lease list`` shows them).
    """
    return make_owner(node=node, task=task, task_id=task_id, label=label)


def to_ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class _CancelBody:
    """The value ``lease()`` keeps for ``on_lost="cancel"``: a marker, and a no-op listener.

    The cancel itself is an immediate loss listener installed by ``async with`` for the task
    that entered (:mod:`celery_lease._core.aio`); this object only stands in the context's
    ``on_lost`` slot (where a plain callable is expected), so calling it does nothing.
    """

    __slots__ = ()

    def __call__(self, lease: Lease) -> None:
        return None

    def __repr__(self) -> str:
        return "'cancel'"


CANCEL = _CancelBody()
"""What ``lease(on_lost="cancel")`` stores as its ``on_lost`` (a sync ``with`` refuses it)."""


def is_async_store(store: object) -> bool:
    """True for an :class:`~celery_lease.stores.base.AsyncLockStore` (cached per class, but for
    a class delegating through ``__getattr__``)."""
    cls = type(store)
    known = _ASYNC_CLASSES.get(cls)
    if known is None:
        known = conforms(store, AsyncLockStore)
        if not hasattr(cls, "__getattr__"):  # a delegating wrapper answers per wrapped store
            _ASYNC_CLASSES[cls] = known
    return known


_ASYNC_CLASSES: dict[type, bool] = {}


def split_async_store(store: Any) -> tuple[AsyncLockStore | None, Any]:
    """``(store, store.sync)`` for an AsyncLockStore given to ``lease()``, else ``(None, store)``.

    Raises:
        LeaseConfigError: when the async store's ``sync`` is not a synchronous LockStore.
    """
    if not is_async_store(store):
        return None, store
    twin = store.sync
    if not conforms(twin, LockStore) or is_async_store(twin):
        raise LeaseConfigError(
            f"store={store!r} is an AsyncLockStore whose .sync ({twin!r}) is not a synchronous"
            " LockStore: the renewer thread renews through it"
        )
    return store, twin


class AsyncPath(NamedTuple):
    """The awaiting half of ``async with`` on a :class:`LeaseContext`.

    :mod:`celery_lease._core.aio` provides it and ``celery_lease._core`` installs it when the
    package is imported (:func:`install_async_path`): the async code builds on this module's
    steps, so this module cannot import it.
    """

    aenter: Callable[[LeaseContext], Awaitable[tuple[Lease, object]]]
    """Enter ``ctx``: returns the lease and what ``aexit`` is given back for this block."""
    aexit: Callable[[LeaseContext, object, BaseException | None], Awaitable[bool]]
    """Exit ``ctx``, given what ``aenter`` returned for the block and the block's exception."""


_async_path: AsyncPath | None = None


def install_async_path(path: AsyncPath) -> None:
    """Make ``path`` what ``async with`` on every :class:`LeaseContext` awaits."""
    global _async_path
    _async_path = path


def _installed_async_path() -> AsyncPath:
    if _async_path is None:  # pragma: no cover - celery_lease._core installs it on import
        raise RuntimeError("'async with lease(...)' needs celery_lease._core.aio, not installed")
    return _async_path


LossListener = Callable[["Lease"], object]


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

    A lease belongs to the process that acquired it: in a forked child it reads as lost
    (``lost_reason`` ``"forked"``) and is never renewed or released from there.
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
        # Made by the first wait_lost() only (most leases are never waited on); _notified says
        # the loss was announced, so an event made after the announcement starts set.
        self._lost_event: threading.Event | None = None
        self._notified = False
        self._released_early = False  # release_early() ended it ("released" by its own holder)
        self._listeners: list[tuple[LossListener, bool]] | None = None
        self._gen = forking.generation()
        self._task: weakref.ref[Any] | None = None  # the asyncio task that entered it, if any
        self._thread: int | None = None  # the thread that entered it outside any task

    @property
    def lost(self) -> bool:
        """True once the lease is lost: renewal refused, validity ran out, ``max_hold`` reached,
        or released early by its holder.

        It reads the one record the renewer keeps of how the lease ended; a lease found past
        its local validity (or ``max_hold``) is recorded lost by the first reader to see it, so
        once True it stays True. After a normal exit it reads False.
        """
        if self._gen != forking.generation():
            return True  # the parent's lease, seen from a forked child
        entry = self._entry
        if entry is None:
            return False
        closed = entry.closed  # read before lost_reason: see Entry
        if entry.lost_reason is not None:
            return True
        if closed:
            return False
        now = self._clock.monotonic()
        if now < entry.valid_until and (entry.max_hold_at is None or now < entry.max_hold_at):
            return False
        renewer = entry.renewer
        return renewer is not None and renewer.expire_if_due(entry) is not None

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost, or ``None`` while it is held (or after a normal exit).

        ``"taken"`` (the store no longer records this owner), ``"expired"`` (not renewed within
        its validity), ``"max_hold"``, ``"released"`` (released early by its holder, see
        :meth:`LeaseContext.release_early`), or ``"forked"`` (read in a forked child: the lease
        is its parent's).
        """
        if self._gen != forking.generation():
            return "forked"
        entry = self._entry
        if entry is None or not self.lost:
            return None
        return entry.lost_reason

    @property
    def released_early(self) -> bool:
        """True once its holder ended it with :meth:`LeaseContext.release_early` (the end that
        call recorded as its loss, ``lost_reason`` ``"released"`` by default), not the store or
        the renewer."""
        return self._released_early

    def _reenterable_by(self, task: object) -> bool:
        """Whether code running in ``task`` (None: outside any asyncio task), on this thread,
        may re-enter it: re-entry belongs to whoever entered it, as an ``RLock``'s does.

        Entered in a task: that task only; the tasks created in its block copy its context but
        run concurrently with it, and so does code it hands to another thread
        (``asyncio.to_thread``: no task there). Entered outside any task: code on the thread
        that entered it (the tasks of an event loop that its body runs on that thread
        included); code of a copied context on another thread (``asyncio.to_thread``,
        ``copy_context().run``, asgiref's ``sync_to_async``) runs concurrently with the holder.

        The thread is ``threading.get_ident()`` read at each call: under gevent or eventlet
        monkey-patching that is the greenlet's id, so greenlets sharing one OS thread are told
        apart. An id is reused only once its thread (greenlet) ended, and the one that entered
        a lease is alive while its block runs.
        """
        ref = self._task
        if ref is None:
            return self._thread == threading.get_ident()
        entered_in = ref()
        return entered_in is not None and entered_in is task

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

        Returns whether it is lost. It returns once the loss is recorded; listeners on the
        dispatcher may still be running.
        """
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        while not self.lost:
            now = self._clock.monotonic()
            entry = self._entry
            if deadline is not None and now >= deadline:
                return False
            limits = [deadline] if deadline is not None else []
            if entry is not None and not entry.closed:
                limits.append(entry.valid_until)
                if entry.max_hold_at is not None:
                    limits.append(entry.max_hold_at)
            self._clock.wait(self._loss_event(), (min(limits) - now) if limits else None)
        return True

    @property
    def _lost(self) -> threading.Event:
        """The event set when the loss is announced (for waiters and tests)."""
        return self._loss_event()

    def _loss_event(self) -> threading.Event:
        """The event set when the loss is announced, made on first use (set if it already was)."""
        event = self._lost_event
        if event is None:
            with _events_lock:
                event = self._lost_event
                if event is None:
                    event = self._lost_event = threading.Event()
                    if self._notified:
                        event.set()
        return event

    def add_loss_listener(self, fn: LossListener, *, immediate: bool = False) -> None:
        """Call ``fn(lease)`` once, when the lease is lost (at once if it already is).

        Args:
            fn: the listener; what it returns is ignored, what it raises is logged.
            immediate: False (default): ``fn`` runs on the dispatcher, a thread of its own, so
                it may block without delaying anything else. True: ``fn`` runs on the thread
                that recorded the loss (the renewer, the watchdog, or a thread that read
                ``lost`` or called ``release_early``), right after the record and after the
                dispatched listeners were handed over; it must be quick and never block (set
                a flag, send a signal, schedule a callback).

        Raises:
            LeaseConfigError: when ``fn`` is not callable.
        """
        if not callable(fn):
            raise LeaseConfigError(f"fn={fn!r} must be a callable taking the Lease")
        entry = self._entry
        renewer = None if entry is None else entry.renewer
        if not self.lost:
            if entry is None or renewer is None:
                self._append_listener(fn, immediate)
                return
            # The loss is recorded under the renewer's lock, where this runs: none is missed.
            append = functools.partial(self._append_listener, fn, immediate)
            if renewer.run_unless_lost(entry, append):
                return
        if immediate:
            self._call_immediate(fn)
        else:
            get_dispatcher().submit(fn, self, f"loss listener {fn!r} of {self.key!r}")

    def _append_listener(self, fn: LossListener, immediate: bool) -> None:
        if self._listeners is None:
            self._listeners = []
        self._listeners.append((fn, immediate))

    def _notify_lost(self, reason: str) -> None:
        """The loss is recorded (once): wake waiters, dispatch listeners, run immediate ones.

        The immediate listeners run last, so one that interrupts this very thread cannot keep
        the others from being handed over.
        """
        log = logger.info if self._released_early else logger.warning
        log("celery-lease: lease on %r (token %d) lost: %s", self.key, self.token, reason)
        with _events_lock:
            self._notified = True
            event = self._lost_event
        if event is not None:
            event.set()
        listeners = self._listeners
        if not listeners:
            return
        dispatcher = get_dispatcher()
        for fn, immediate in listeners:
            if not immediate:
                dispatcher.submit(fn, self, f"loss listener {fn!r} of {self.key!r}")
        stop: BaseException | None = None
        for fn, immediate in listeners:
            if immediate:
                try:
                    self._call_immediate(fn)
                except BaseException as exc:  # SystemExit, an interrupt: after the others ran
                    stop = stop or exc
        if stop is not None:
            raise stop

    def _call_immediate(self, fn: LossListener) -> None:
        try:
            fn(self)
        except Exception:
            logger.exception("celery-lease: immediate loss listener of %r raised", self.key)

    def __repr__(self) -> str:
        state = f"lost:{self.lost_reason}" if self.lost else "held"
        return f"<Lease key={self.key!r} token={self.token} owner={self.owner!r} {state}>"


class LeaseContext:
    """The object :func:`lease` returns: a context manager (``with`` and ``async with``), and a
    decorator.

    ``with`` and ``async with`` take the same steps and differ only in how they wait for the
    store: the steps that decide (which lease a nested block re-enters, building and renewing
    an acquired lease, how the exit ends it and what it raises) are the public methods below
    the context-manager ones, which the awaiting half (:mod:`celery_lease._core.aio`) calls
    between its awaits. Application code has no need of them.

    Attributes:
        async_store: the :class:`~celery_lease.stores.base.AsyncLockStore` ``async with``
            awaits: the one given to :func:`lease`, else an adapter of ``store`` made on first
            use (``None`` until then).
    """

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
        *,
        label: str | None = None,
        node: str | None = None,
        task: str | None = None,
        task_id: str | None = None,
        wait_clock: Clock | None = None,
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
        # The clock a wait for a held key is measured and slept on: None for the store's own
        # clock where it has one, else ``clock`` (see clock_of).
        self.wait_clock = wait_clock
        # Recorded in the owner id of each acquisition (celery_lease._core.owners.make_owner): the
        # label is lease()'s holder= text.
        self.label = label
        self.node = node
        self.task = task
        self.task_id = task_id
        self._lease: Lease | None = None
        self._frame: Frame | None = None  # the frame this context pushed
        self._reentered = False
        self._entered = False
        self._cooling = False  # the cooldown was begun (an interrupted exit must not release)
        self._released_early = False  # release_early() recorded the end: the exit raises nothing
        self.async_store: AsyncLockStore | None = None
        self._async_state: object = None  # what the async path's aenter gave for its aexit
        # The caller publishes nothing that depends on the key being free until the store's
        # deferred replies are read (celery_lease._celery.deferral decides): the release may then
        # go out
        # without waiting for its reply (SupportsDeferredRelease).
        self.defer_release = False
        # The caller needs to know who refused the key (a unique copy telling a second delivery
        # of itself from a rejection; celery_lease._celery.unique decides which stores may
        # answer through acquire_or_holder): each attempt then goes through
        # SupportsAcquireOrHolder.acquire_or_holder, and ``refused_by`` is the owner id the
        # last refused attempt named, read in the same atomic step as the refusal.
        self.names_holder = False
        self.refused_by: str | None = None

    # Decorator --------------------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        if self._decorates_async(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with self.fresh():
                    return await func(*args, **kwargs)

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.fresh():
                return func(*args, **kwargs)

        return cast(F, wrapper)

    def _decorates_async(self, func: object) -> bool:
        """True when ``func`` must be wrapped with ``async with`` (an ``async def``).

        Raises:
            LeaseConfigError: for an async generator function (a lease held only while the
                generator object is made would hold nothing), or ``on_lost="cancel"`` on a
                function that is not ``async def`` (there is no task to cancel).
        """
        if inspect.isasyncgenfunction(func):
            raise LeaseConfigError(
                f"@lease cannot decorate the async generator function {func!r}: use"
                " 'async with lease(...)' inside it"
            )
        if inspect.iscoroutinefunction(func):
            return True
        if self.on_lost is CANCEL:
            raise LeaseConfigError(
                f"on_lost='cancel' needs an async def function (it cancels an asyncio task);"
                f" {func!r} is not one"
            )
        return False

    def fresh(self) -> LeaseContext:
        """A new, unentered context with the same arguments: one per decorated call."""
        context = LeaseContext(
            self.key,
            self.store,
            self.ttl,
            self.wait,
            self.max_hold,
            self.cooldown,
            self.on_lost,
            self.cancel,
            self.clock,
            label=self.label,
            node=self.node,
            task=self.task,
            task_id=self.task_id,
            wait_clock=self.wait_clock,
        )
        context.async_store = self.async_store
        return context

    @property
    def reentered(self) -> bool:
        """True when this context, once entered, re-entered the lease of an enclosing one (same
        key and store): the lease is the enclosing context's, and this exit leaves it held."""
        return self._reentered

    @property
    def released_early(self) -> bool:
        """True once :meth:`release_early` ended the lease (recorded its end): the exit then
        releases nothing and raises nothing for the loss."""
        return self._released_early

    # Context manager --------------------------------------------------------------------------

    def __enter__(self) -> Lease:
        if self.on_lost is CANCEL:
            raise LeaseConfigError(
                f"on_lost={self.on_lost!r} is for 'async with lease(...)' (or @lease on an async"
                " def): a plain 'with' has no asyncio task to cancel; pass a callable instead"
            )
        self.mark_entered()
        task = _running_task()
        outer = self.reenter(task)
        if outer is not None:
            return outer
        held = self._acquire()
        try:
            self.push(held, task)
        except BaseException:
            # An asynchronous exception (the interrupt of an enclosing lease, a soft time
            # limit) after the acquire: the ``with`` never runs its exit, so end the lease here.
            self._end_interrupted(held)
            raise
        return held

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        held = self._lease
        assert held is not None
        if self._reentered or held._gen != forking.generation():
            pop_frame(self._frame)
            return False  # the outer context (or, after a fork, the parent) owns the lease
        entry = held._entry
        assert entry is not None and entry.renewer is not None
        renewer = entry.renewer
        try:
            pop_frame(self._frame)
            settled, final, lapsed = renewer.remove(entry)
            reason = entry.lost_reason
            if final:
                self._finish(held, entry, succeeded=exc is None, settled=settled)
        except BaseException:
            # An asynchronous exception landed in this bookkeeping: the lease must end all
            # the same (not renewed for ever, not left on the stack), then it propagates.
            self._end_interrupted(held)
            raise
        if lapsed is not None:  # validity ran out before the renewer noticed; told after release
            Renewer.notify(entry, lapsed)
        error = self.loss_error(exc, reason)
        if error is not None:
            raise error from exc
        return False

    def _end_interrupted(self, held: Lease, *, pop: bool = True) -> None:
        """End ``held`` after an asynchronous exception cut its enter, exit or early release short.

        Pops this context's frame (``pop``: not for an early release, whose body still runs in
        the ``with`` block), stops the renewal whatever state the entry was left in,
        and releases the key owner-checked (again, if the release was under way: a release is
        idempotent) unless a cooldown was begun. Never raises: the exception that brought us
        here is the one to propagate.
        """
        try:
            if pop:
                pop_frame(self._frame)
            entry = held._entry
            reason = None
            if entry is not None and entry.renewer is not None:
                reason = entry.renewer.abandon(entry)
            if not self._cooling:
                self.send_release(held)
            if reason is not None and entry is not None:
                Renewer.notify(entry, reason)
        except BaseException:  # pragma: no cover - a second interrupt: the first one goes on
            logger.exception("celery-lease: ending the interrupted lease %r failed", held.key)

    def release_early(self, reason: str = "released") -> bool:
        """End the held lease now, while the body may still run; the exit then only pops it.

        For the Celery layer when a running task re-sends its own id (``retry``): the new
        message must not find the key held by this execution. In order: records the loss with
        ``reason`` (so ``lost`` reads True and ``check()`` raises before the key is free),
        waits for a renewal of this lease already in flight (see
        :meth:`~celery_lease._core.renewer.Renewer.settle`), releases the key owner-checked, and
        runs
        the loss listeners. A later ``__exit__`` releases nothing and raises nothing for it.

        A release the store fails is logged, not raised: the key then frees itself within its
        ttl (nobody renews it any more).

        Args:
            reason: the ``lost_reason`` to record (default ``"released"``).

        Returns:
            True when this call ended the lease; False when its end was already recorded (lost
            before, released early before, or exited), or in a forked child (the lease is the
            parent's). A lease already lost is still released owner-checked, once.

        Raises:
            RuntimeError: when the context was never entered.
            LeaseConfigError: when ``reason`` is not a non-empty string.
        """
        if not isinstance(reason, str) or not reason:
            raise LeaseConfigError(f"reason={reason!r} must be a non-empty string")
        held = self._lease
        if not self._entered or held is None:
            raise RuntimeError("release_early() needs an entered lease() context")
        if held._gen != forking.generation():
            return False
        entry = held._entry
        assert entry is not None and entry.renewer is not None
        renewer = entry.renewer
        recorded = renewer.record(entry, reason)
        if recorded:  # this call notifies, below: its log line says the holder let go
            held._released_early = True
        self._released_early = self._released_early or recorded
        try:
            if recorded:
                renewer.settle(entry)
            if renewer.claim_final(entry):
                self.send_release(held)
        except BaseException:
            self._end_interrupted(held, pop=False)  # an interrupt cut the release short: again
            raise
        if recorded:
            Renewer.notify(entry, reason)
        return recorded

    def send_release(self, held: Lease) -> None:
        """Release the key owner-checked; a store error is logged (the key expires by itself).

        A :class:`LockLostError` is not a store error: it is the interrupt of an enclosing
        lease's body (``on_lost="revoke"``) delivered inside the call, and it propagates.
        """
        try:
            store = self.store
            if (
                self.defer_release
                and conforms(store, SupportsDeferredRelease)
                and cast(SupportsDeferredRelease, store).release_deferred(held.key, held.owner)
            ):
                return
            store.release(held.key, held.owner)
        except LockLostError:
            raise
        except Exception as exc:
            logger.warning(
                "celery-lease: releasing %r failed (%s); it expires within its ttl", held.key, exc
            )

    def _finish(self, held: Lease, entry: Entry, *, succeeded: bool, settled: bool) -> None:
        """Release the key, or keep it for ``cooldown`` after a success; never raise a store error.

        When a renewal was still in flight (``settled`` False), the cooldown is fenced: set again
        right after that renewal returns, since it may have landed after the cooldown.
        """
        if not (succeeded and self.cooldown > 0 and entry.lost_reason is None):
            self.send_release(held)
            return
        self._cooling = True
        until = self.clock.monotonic() + self.cooldown
        self._cool_down(held, until)
        if not settled:
            redo = functools.partial(self._cool_down, held, until)
            assert entry.renewer is not None
            if not entry.renewer.fence(entry, redo):
                redo()

    def _cool_down(self, held: Lease, until: float) -> None:
        """Keep the key taken until ``until`` (clock seconds); never raise."""
        left = until - self.clock.monotonic()
        try:
            if left <= 0:
                self.store.release(held.key, held.owner)
            elif not self.store.renew(held.key, held.owner, to_ms(left)):
                logger.warning(
                    "celery-lease: the cooldown of %r was not applied: the store no longer"
                    " records this holder (%s), so the key may already be free or taken",
                    held.key,
                    held.owner,
                )
        except LockLostError:
            raise  # an interrupt delivered inside the call, not a store error: see _release
        except Exception as exc:
            logger.warning(
                "celery-lease: setting the cooldown of %r failed (%s); the key frees itself"
                " within its ttl",
                held.key,
                exc,
            )

    def _acquire(self) -> Lease:
        clock, store = self.clock, self.store
        owner = self.new_owner()
        ttl_ms = to_ms(self.ttl)
        started = clock.monotonic()
        deadline = started + self.wait
        interval = POLL_FIRST
        # Looked up at the first held answer only: a free key (the usual case) needs neither.
        notify: bool | None = None
        waits_on: Clock | None = None
        idle = self.cancel
        tries = 0
        lagging: ReplicaLagError | RestartGraceError | None = None
        while True:
            if self.cancel is not None and self.cancel.is_set():
                raise LockNotAcquiredError(self.key, "cancelled")
            sent_at = clock.monotonic()
            try:
                if self.names_holder:
                    token, self.refused_by = cast(SupportsAcquireOrHolder, store).acquire_or_holder(
                        self.key, owner, ttl_ms
                    )
                else:
                    token = store.acquire(self.key, owner, ttl_ms)
                lagging = None
            except (ReplicaLagError, RestartGraceError) as exc:
                # The replicas did not confirm it and the store released it, or a restart
                # grace refused the key: asked again within the wait like a held key, raised
                # when the wait runs out.
                token, lagging = None, exc
                if self.names_holder:
                    self.refused_by = None  # refused by the replicas, not by a holder
            except BaseException:
                # The attempt may have taken effect and lost its reply: free it (the owner id
                # is this attempt's own, so this can never free someone else's lease). On the
                # dispatcher, so a store that just timed out does not make the caller wait for
                # a second timeout before it sees the error.
                get_dispatcher().submit(
                    self.abandon_attempt, owner, f"clean-up of acquire {self.key!r}"
                )
                raise
            if token is not None:
                break
            tries += 1
            if waits_on is None:
                waits_on = self.wait_clock or clock_of(store, clock)
                if waits_on is not clock:  # what the first attempts took counts against wait
                    deadline = waits_on.monotonic() + self.wait - (clock.monotonic() - started)
            remaining = deadline - waits_on.monotonic()
            if remaining <= 0:
                if lagging is not None:
                    get_dispatcher().submit(
                        self.abandon_attempt, owner, f"clean-up of acquire {self.key!r}"
                    )
                    raise lagging
                raise LockNotAcquiredError(self.key)
            pause = min(interval, remaining)
            if notify is None:  # the store's notification sleeps on the store's clock
                notify = conforms(store, SupportsReleaseNotify) and (
                    getattr(store, "clock", waits_on) is waits_on
                )
            if notify:
                cast(SupportsReleaseNotify, store).wait_for_release(self.key, pause)
            else:
                if idle is None:
                    idle = threading.Event()
                waits_on.wait(idle, pause)
            interval = min(interval * 2, POLL_MAX)
        try:
            return self.hold(owner, token, tries=tries, started=started, sent_at=sent_at)
        except BaseException:
            self.abandon_attempt(owner)
            raise

    def _hold(self, owner: str, token: int, tries: int, started: float, sent_at: float) -> Lease:
        """Build the Lease of an acquisition (the caller starts renewing it)."""
        held = Lease(
            key=self.key,
            owner=owner,
            token=token,
            waited=tries > 0,
            wait_seconds=sent_at - started,
            store=self.store,
            clock=self.clock,
            acquired_at=sent_at,
        )
        if self.on_lost is not None:
            held._listeners = [(self.on_lost, False)]
        max_hold_at = None if self.max_hold is None else sent_at + self.max_hold
        held._entry = Entry(
            store=self.store,
            key=self.key,
            owner=owner,
            ttl=self.ttl,
            sent_at=sent_at,
            max_hold_at=max_hold_at,
            on_lost=held._notify_lost,
            token=token,
        )
        return held

    def abandon_attempt(self, owner: str) -> None:
        """Best-effort release of an attempt that failed (or whose reply was lost)."""
        try:
            self.store.release(self.key, owner)
        except LockLostError:
            raise  # an interrupt delivered inside the call, not a store error: see _release
        except Exception as exc:
            logger.warning(
                "celery-lease: acquiring %r failed, and releasing that attempt failed too (%s);"
                " if it took effect, it expires within its ttl",
                self.key,
                exc,
            )

    def __repr__(self) -> str:
        return f"lease({self.key!r}, store={self.store!r}, ttl={self.ttl:g}, wait={self.wait:g})"

    # asyncio: ``async with`` (the awaiting half is celery_lease._core.aio's: see AsyncPath)
    # ----

    async def __aenter__(self) -> Lease:
        held, self._async_state = await _installed_async_path().aenter(self)
        return held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return await _installed_async_path().aexit(self, self._async_state, exc)

    # The steps ``with`` and ``async with`` share: entering --------------------------------------

    def mark_entered(self) -> None:
        """Note that the context is entered.

        Raises:
            RuntimeError: when it was entered before (a context is entered once).
        """
        if self._entered:
            raise RuntimeError("a lease() context cannot be entered twice; call lease() again")
        self._entered = True

    def reenter(self, task: object) -> Lease | None:
        """Re-enter the lease of an enclosing block on the same key and store, if there is one.

        The innermost one of this process's that code running in ``task`` (the asyncio task, or
        ``None`` outside any) may re-enter, and that is neither lost nor ended: it is pushed as
        this context's and returned, and the exit leaves it held. ``None`` when there is none
        (the caller acquires).
        """
        top = current_frame.get()
        frame = top
        if frame is None:
            return None
        mine = forking.generation()
        # Frames below the first foreign one are foreign too (pushed before the fork). A frame
        # whose lease has ended (left behind by an exit that an interrupt cut short) is never
        # re-entered: its key may be another holder's by now.
        while frame is not None and frame.gen == mine:
            outer = frame.lease
            if (
                outer.key == self.key
                and outer.store is self.store
                and outer._reenterable_by(task)
                and not outer.lost
                and not (outer._entry is not None and outer._entry.closed)
            ):
                self._reentered = True
                self._lease = outer
                try:
                    self._frame = Frame(outer, top)
                    current_frame.set(self._frame)
                except BaseException:
                    pop_frame(self._frame)
                    raise
                return outer
            frame = frame.parent
        return None

    def new_owner(self) -> str:
        """A fresh owner id for one acquisition attempt, naming this context's holder fields."""
        return make_owner(
            node=self.node,
            task=self.task,
            task_id=self.task_id,
            label=self.label,
            ttl_ms=to_ms(self.ttl),
            cooldown_ms=to_ms(self.cooldown) if self.cooldown > 0 else None,
        )

    def hold(
        self,
        owner: str,
        token: int,
        *,
        tries: int,
        started: float,
        sent_at: float,
        immediate_listener: LossListener | None = None,
    ) -> Lease:
        """Build the Lease of an acquisition that got ``token`` and start renewing it.

        Args:
            owner: the owner id the acquisition sent.
            token: the token the store answered.
            tries: how many tries found the key held first.
            started: when acquiring started (clock seconds).
            sent_at: when the attempt that got it was sent (clock seconds).
            immediate_listener: an immediate loss listener that takes the place of the
                context's ``on_lost`` (the cancel of an ``on_lost="cancel"`` block); attached
                before the renewer knows the lease.

        If this fails (an interrupt), the renewal is stopped and the error raised; the caller
        then releases the attempt (:meth:`abandon_attempt`).
        """
        held: Lease | None = None
        try:
            held = self._hold(owner, token, tries, started, sent_at)
            if immediate_listener is not None:
                held._listeners = [(immediate_listener, True)]
            assert held._entry is not None
            get_renewer(self.clock, held._entry.store).add(held._entry)
        except BaseException:
            entry = None if held is None else held._entry
            if entry is not None and entry.renewer is not None:
                entry.renewer.abandon(entry)  # add() was cut short: never renew it
            raise
        return held

    def push(self, held: Lease, task: object) -> None:
        """Make ``held``, just acquired in ``task`` (``None``: outside any asyncio task), this
        context's lease and the current one; only ``task`` (outside a task: this thread) may
        re-enter it."""
        if task is None:
            held._thread = threading.get_ident()
        else:
            held._task = weakref.ref(task)
        self._lease = held
        self._frame = Frame(held, current_frame.get())
        current_frame.set(self._frame)

    # Exiting --------------------------------------------------------------------------------

    def pop(self) -> Lease | None:
        """Take this context's lease off the current ones; return it when this exit ends it.

        ``None`` when the exit leaves it alone: it was re-entered (the enclosing context ends
        it), or it is read in a forked child (it is the parent's).
        """
        held = self._lease
        assert held is not None
        pop_frame(self._frame)
        if self._reentered or held._gen != forking.generation():
            return None
        return held

    def exit_waits(self, *, succeeded: bool) -> bool:
        """Whether ending the lease may block: a renewal of it is in flight (the exit waits for
        its answer), or a cooldown follows a body that succeeded (it may be fenced against
        such a renewal). :meth:`end` then ends it on a thread that may block; otherwise
        :meth:`stop_renewing` returns at once and the caller releases the key."""
        entry = self._held_entry()
        return entry.inflight or (succeeded and self.cooldown > 0 and entry.lost_reason is None)

    def stop_renewing(self) -> tuple[bool, bool, str | None]:
        """Record the end of the lease with the renewer: ``(settled, final, lapsed)``.

        As :meth:`~celery_lease._core.renewer.Renewer.remove`: ``final`` says this exit sends
        the release (or cooldown), ``lapsed`` is a loss recorded now, told with
        :meth:`report_loss` after the release.
        """
        entry = self._held_entry()
        assert entry.renewer is not None
        return entry.renewer.remove(entry)

    def end(self, *, succeeded: bool) -> None:
        """The exit's steps after the pop, blocking: stop renewing, release the key (or keep it
        for ``cooldown`` after a success, fenced against a renewal in flight), tell a lapse."""
        held = self._lease
        assert held is not None
        entry = self._held_entry()
        settled, final, lapsed = self.stop_renewing()
        if final:
            self._finish(held, entry, succeeded=succeeded, settled=settled)
        if lapsed is not None:
            Renewer.notify(entry, lapsed)

    @property
    def end_reason(self) -> str | None:
        """The loss the renewer recorded for this context's lease, ``None`` while it is held
        or when it ended normally (read after :meth:`stop_renewing` or :meth:`end`)."""
        return self._held_entry().lost_reason

    def report_loss(self, reason: str) -> None:
        """Tell the lease's listeners of a loss the exit recorded (``lapsed`` of
        :meth:`stop_renewing`)."""
        Renewer.notify(self._held_entry(), reason)

    def loss_error(self, exc: BaseException | None, reason: str | None) -> LockLostError | None:
        """The :class:`LockLostError` the exit raises from ``exc`` (what the body raised), or
        ``None``.

        Raised for an ``Exception`` from a body whose lease was lost (``reason``), unless the
        holder released it early or the body raised a ``LockLostError`` itself. A
        ``BaseException`` (Ctrl-C, ``SystemExit``, ``GeneratorExit``) stays what it is.
        """
        if (
            isinstance(exc, Exception)
            and reason is not None
            and not self._released_early
            and not isinstance(exc, LockLostError)
        ):
            held = self._lease
            assert held is not None
            return LockLostError(held.key, reason)
        return None

    def _held_entry(self) -> Entry:
        held = self._lease
        assert held is not None and held._entry is not None
        return held._entry


def check_ttl(seconds: float, given: object, *, name: str) -> None:
    """Raise :class:`LeaseConfigError` unless a ttl of ``seconds`` can ever be held.

    A lease counts :data:`~celery_lease._core.renewer.DRIFT_MARGIN` and
    :data:`~celery_lease._core.renewer.DRIFT_FACTOR` of its ttl off its validity, so a ttl of
    :data:`MIN_TTL` or less would be lost the moment it is acquired. ``given`` is the value as
    the user wrote it and ``name`` the parameter, both for the message.
    """
    if seconds <= MIN_TTL:
        raise LeaseConfigError(
            f"{name}={given!r} must be more than {MIN_TTL * 1000:.2f} ms: a lease counts"
            f" {DRIFT_MARGIN * 1000:g} ms and {DRIFT_FACTOR:.0%} of its ttl off its validity for"
            " clock drift, so a shorter one would be lost the moment it is acquired"
        )


def lease(
    key: str,
    *,
    store: LockStore | AsyncLockStore,
    ttl: Duration = 30,
    wait: Duration = 0,
    max_hold: Duration | None = None,
    on_lost: Callable[[Lease], object] | Literal["cancel"] | None = None,
    cancel: threading.Event | None = None,
    clock: Clock | None = None,
    cooldown: Duration = 0,
    holder: str | None = None,
) -> LeaseContext:
    """Hold ``key`` in ``store`` while a block (or decorated function) runs.

    Args:
        key: the key to hold (a non-empty string).
        store: the :class:`~celery_lease.LockStore` to hold it in, or an
            :class:`~celery_lease.stores.base.AsyncLockStore` (for ``async with``; a sync
            ``with`` then uses its ``sync`` twin, which renews it in either case). A sync store
            works with ``async with`` too: its calls then run on a thread (see
            :mod:`celery_lease._core.aio`).
        ttl: lease duration (default 30 s); renewed every ttl/3 while the body runs, so a
            crashed holder frees the key within one ttl.
        wait: how long to wait for another holder (default 0: fail at once). Waiting wakes on the
            store's release notification where it has one, else polls from 50 ms doubling to 1 s.
            It is counted on ``clock`` when given, else on the store's own clock when the store
            was built with one (a ``MemoryLockStore`` on a ``FakeClock``: the test advances it),
            else on the system clock.
        max_hold: stop renewing after this long (default: never); the lease is then lost.
        on_lost: ``on_lost(lease)``, called exactly once when the lease is lost, on the
            dispatcher (a thread of its own: it may block without delaying other leases). See
            :meth:`Lease.add_loss_listener` for more listeners and quick immediate ones.
            ``"cancel"`` (``async with`` and ``async def`` only): cancel the task running the
            body; the block then ends with :class:`LockLostError`.
        cancel: a ``threading.Event``; setting it aborts the wait (within one poll interval)
            with ``LockNotAcquiredError(key, "cancelled")``.
        clock: time source (default: the system clock); a ``FakeClock`` in tests.
        cooldown: after a body that succeeded, keep the key taken this long (counted from the
            end) instead of releasing it (default 0).
        holder: a label naming who holds the key (``"nightly import"``), recorded in the owner
            id next to host and pid (and, inside a worker, node and task), shown by
            ``celery lease list``; default none. At most
            :data:`~celery_lease._core.owners.MAX_OWNER_FIELD_CHARS` characters.

    Durations are seconds, ``timedelta`` or strings like ``"250ms"``, ``"30s"``, ``"5m"``.
    Everything is validated here, before anything is acquired.

    Raises:
        LeaseConfigError: (a ``ValueError``) for a bad argument, naming it.
        LockNotAcquiredError: on entry, when the key stays held past ``wait``.
        LockLostError: on exit, when the body raised an ``Exception`` after the lease was
            lost (chained); not for a lease the holder released early itself, and not for a
            ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``), which propagates as is.
        StoreUnavailableError: when the store cannot be reached to acquire. The attempt may
            have taken effect with its reply lost, so it is released (owner-checked, best
            effort) on the dispatcher, right after the error is raised (so a store that just
            timed out does not delay the error by a second timeout).
    """
    if not isinstance(key, str) or not key:
        raise LeaseConfigError(f"key={key!r} must be a non-empty string")
    astore: AsyncLockStore | None = None
    if hasattr(type(store), "aclose"):  # an AsyncLockStore: held through it, renewed via .sync
        astore, store = split_async_store(store)
    if not conforms(store, LockStore):
        hint = (
            " (build one with store_from_url(url) or async_store_from_url(url) once)"
            if isinstance(store, str)
            else ""
        )
        raise LeaseConfigError(
            f"store={store!r} is not a LockStore: it needs acquire(), renew() and release(){hint}"
        )
    ttl_s = to_seconds(ttl, name="ttl", inclusive=False)
    check_ttl(ttl_s, ttl, name="ttl")
    wait_s = to_seconds(wait, name="wait")
    max_hold_s = (
        None if max_hold is None else to_seconds(max_hold, name="max_hold", inclusive=False)
    )
    cooldown_s = to_seconds(cooldown, name="cooldown")
    if isinstance(on_lost, str) and on_lost == "cancel":
        on_lost = CANCEL
    elif on_lost is not None and not callable(on_lost):
        raise LeaseConfigError(
            f"on_lost={on_lost!r} must be a callable taking the Lease, 'cancel' (async with"
            " only), or None"
        )
    if cancel is not None and not (hasattr(cancel, "is_set") and hasattr(cancel, "wait")):
        raise LeaseConfigError(f"cancel={cancel!r} must be a threading.Event or None")
    if clock is not None and not conforms(clock, Clock):
        raise LeaseConfigError(f"clock={clock!r} must provide monotonic(), time() and wait()")
    if holder is not None and not (
        isinstance(holder, str) and 0 < len(holder) <= MAX_OWNER_FIELD_CHARS
    ):
        raise LeaseConfigError(
            f"holder={holder!r} must be a non-empty str of at most {MAX_OWNER_FIELD_CHARS}"
            " characters, or None"
        )
    context = LeaseContext(
        key,
        cast(LockStore, store),  # checked above (an async store's sync twin)
        ttl_s,
        wait_s,
        max_hold_s,
        cooldown_s,
        on_lost,
        cancel,
        clock if clock is not None else SYSTEM_CLOCK,
        label=holder,
        wait_clock=clock,  # a clock given here is the one waited on, whatever the store's
    )
    if astore is not None:
        context.async_store = astore
    return context


def _running_task() -> object | None:
    """The asyncio task running in this thread, or None (no event loop runs here)."""
    if _get_running_loop() is None:  # unlike current_task(), does not raise without a loop
        return None
    task: object = current_task()
    return task


def pop_frame(pushed: Frame | None) -> None:
    """Remove the frame ``pushed`` (or the copy that replaced it) from this context's stack.

    Idempotent (a frame already removed, or ``None``, is left alone), so an exit cut short by an
    asynchronous exception can safely pop again. O(1) when contexts are exited in order (the
    usual case); right, if slower, when they are not.
    """
    if pushed is None:
        return
    top = current_frame.get()
    if top is not None and top.origin is pushed:
        current_frame.set(top.parent)
        return
    frames: list[Frame] = []
    frame = top
    while frame is not None and frame.origin is not pushed:
        frames.append(frame)
        frame = frame.parent
    if frame is None:
        return
    rebuilt = frame.parent
    for above in reversed(frames):
        rebuilt = Frame(above.lease, rebuilt)
        rebuilt.gen = above.gen
        rebuilt.origin = above.origin
    current_frame.set(rebuilt)


def current_lease() -> Lease | None:
    """The innermost lease held in the current context, or ``None`` outside any lease.

    In a forked child the parent's leases are not the child's: they are not returned.
    """
    top = current_frame.get()
    return None if top is None or top.gen != forking.generation() else top.lease


def get_lock_token() -> int | None:
    """The fencing token of the innermost lease held in the current context, else ``None``."""
    held = current_lease()
    return None if held is None else held.token
