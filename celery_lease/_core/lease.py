"""``lease()``: acquire a key (waiting if asked), keep it renewed while the body runs, release it.

::

    with lease("account:42", store=store, ttl="30s", wait="5s") as held:
        write(balance, fence=held.token)     # the resource rejects tokens lower than its last
        held.check()                          # raises LockLostError once the lease is lost

With ``limit=n`` up to ``n`` holders share the key, each in its own slot (``held.slot``), a lease
of its own on ``held.store_key``; a waiter is woken by any slot's release.

:func:`current_lease` returns the innermost lease of the current context (``contextvars``). A
nested ``lease()`` on the same key and store, in the thread (or asyncio task) that entered the
held one, re-enters it, as an ``RLock`` does; a forked child ignores its parent's leases.
Threads, locks and fork resets: ``docs/internals.md``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import threading
import weakref
from asyncio import _get_running_loop  # asyncio exports it (asyncio.__all__)
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

from celery_lease import _forking as forking
from celery_lease._core import aio
from celery_lease._core.acquire_plan import (
    GRANTED,
    POLL_MAX,
    AcquirePlan,
    Failed,
    Hold,
    Pause,
    Reply,
    SentTry,
    Try,
    abandon_later,
    check_cancel,
    to_ms,
)
from celery_lease._core.arguments import (
    CANCEL,
    check_slot_store,
    check_ttl,
    checked_arguments,
    checked_limit,
)
from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.held_key import HeldKey
from celery_lease._core.owners import make_owner
from celery_lease._core.renewer import Entry
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.durations import Duration
from celery_lease.errors import LeaseConfigError, LockLostError
from celery_lease.stores.base import (
    AsyncLockStore,
    LockStore,
    SupportsAcquireOrHolder,
    SupportsDeferredRelease,
    SupportsReleaseNotify,
    SupportsSentAcquire,
    SupportsSlots,
    conforms,
)
from celery_lease.stores.slots import release_owner_slots, slot_key, split_slot

# POLL_MAX and check_ttl: read from here by the Celery layer and tests (their home is above).
__all__ = [
    "POLL_MAX",
    "Lease",
    "LeaseContext",
    "check_ttl",
    "clock_of",
    "current_lease",
    "get_lock_token",
    "lease",
    "offers",
]

logger = logging.getLogger("celery_lease.lease")

F = TypeVar("F", bound=Callable[..., Any])


class Frame:
    """One held lease in the context's stack (a linked list); ``gen``: the pushing process's
    fork generation; ``origin``: the frame a copy stands for, None for the frame itself (not
    itself: a frame in a cycle would wait for the cyclic garbage collector)."""

    __slots__ = ("gen", "lease", "origin", "parent")

    def __init__(self, lease: Lease, parent: Frame | None) -> None:
        self.lease = lease
        self.parent = parent
        self.gen = lease._gen
        self.origin: Frame | None = None


current_frame: ContextVar[Frame | None] = ContextVar("celery_lease_current", default=None)
_events_lock = threading.Lock()  # makes a Lease's loss event on first wait (renewed after fork)


def _after_fork_in_child() -> None:
    global _events_lock
    _events_lock = threading.Lock()


forking.on_fork_child(_after_fork_in_child, name="lease: events lock")


def offers(obj: object, protocol: type, method: str) -> bool:
    """Whether ``obj`` conforms to ``protocol`` (its class defines ``method``: checked first)."""
    return hasattr(type(obj), method) and conforms(obj, protocol)


_CLOCK_METHODS = ("monotonic", "time", "wait")
_CLOCK_CLASSES: set[type] = set()  # classes found to define every clock method (positives only)
_CLOCK_RAISED: set[type] = set()  # store classes whose ``clock`` raised (warned once each)


def is_clock(obj: object) -> bool:
    """Whether ``obj``'s class itself defines ``monotonic``, ``time`` and ``wait`` (unlike
    ``isinstance(obj, Clock)``, not passed by a ``Mock`` or a ``__getattr__`` proxy)."""
    cls = type(obj)
    if cls in _CLOCK_CLASSES:
        return True
    found = all(callable(inspect.getattr_static(cls, name, None)) for name in _CLOCK_METHODS)
    if found:
        _CLOCK_CLASSES.add(cls)
    return found


def clock_of(store: object, default: Clock = SYSTEM_CLOCK) -> Clock:
    """The clock a lease in ``store`` runs on (renewal, validity, waits): the store's own
    ``clock`` when it is a real clock (:func:`is_clock`), else ``default``. Never raises (a
    ``clock`` that raises is ignored, with a WARNING once per store class)."""
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
    if own is None:
        return default
    # is_clock's cache read here first: a store's clock is asked about once per task
    return own if type(own) in _CLOCK_CLASSES or is_clock(own) else default


LossListener = Callable[["Lease"], object]


class Lease:
    """A held lease, as yielded by :func:`lease`.

    Attributes:
        key: the key held (as asked for, also when held in a slot).
        slot: the slot held, ``0 .. limit - 1`` with ``lease(..., limit=n)``; 0 without a limit.
        store_key: the key as the store holds it: the slot's key
            (:func:`~celery_lease.stores.slots.slot_key`) with a limit, else ``key``.
        owner: the random owner id this acquisition used.
        token: the fencing token: larger than every earlier token of this key (with a limit:
            of any of its slots).
        waited: True when it was acquired only after another holder released or expired (that
            holder may just have done the same work).
        wait_seconds: how long acquiring took, in seconds of the lease's clock.
        store: the store it is held in.

    A lease belongs to the process that acquired it: in a forked child it reads as lost
    (``lost_reason`` ``"forked"``) and is never renewed or released from there.
    """

    # Positional too: a class called with keywords costs several times a positional call, and
    # the lease's enter makes one per lease.
    def __init__(
        self,
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
        self._key: HeldKey  # set by LeaseContext._hold (its entry is _entry)
        # Made by the first wait_lost(); one made after the loss was announced starts set.
        self._lost_event: threading.Event | None = None
        self._notified = False
        self._released_early = False  # release_early() ended it ("released" by its own holder)
        self._listeners: list[tuple[LossListener, bool]] | None = None
        self._gen = forking.generation()
        self._task: weakref.ref[Any] | None = None  # the asyncio task that entered it, if any
        self._thread: int | None = None  # the thread that entered it outside any task

    @property
    def store_key(self) -> str:
        """The key as the store holds it: the slot's key with a limit, else :attr:`key`."""
        return self._key.key

    @property
    def slot(self) -> int:
        """The slot held: ``0 .. limit - 1`` with a limit, else 0."""
        store_key = self._key.key
        if store_key is self.key:
            return 0
        return split_slot(store_key)[1] or 0

    @property
    def lost(self) -> bool:
        """True once the lease is lost (renewal refused, validity ran out, ``max_hold``, or
        released early); once True it stays True. False after a normal exit."""
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
        """Why the lease was lost, or ``None`` while held (or after a normal exit): ``"taken"``
        (the store no longer records this owner), ``"replaced"`` (a newer ``on_held="replace"``
        execution asked it to stop; the key stays held until this holder's exit), ``"expired"``,
        ``"max_hold"``, ``"released"`` (:meth:`LeaseContext.release_early`), or ``"forked"``
        (read in a forked child)."""
        if self._gen != forking.generation():
            return "forked"
        entry = self._entry
        if entry is None or not self.lost:
            return None
        return entry.lost_reason

    @property
    def released_early(self) -> bool:
        """True once its holder ended it with :meth:`LeaseContext.release_early`."""
        return self._released_early

    def _reenterable_by(self, task: object) -> bool:
        """Whether code in ``task`` (None: no asyncio task) on this thread may re-enter it:
        entered in a task, that task only; else this thread (not a copied context on another,
        as ``asyncio.to_thread`` makes; under gevent, the greenlet, its id reused once ended)."""
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
        """Block up to ``timeout`` seconds (``None``: forever) until the lease is lost; whether
        it is. Returns once the loss is recorded (dispatched listeners may still run)."""
        deadline = None if timeout is None else self._clock.monotonic() + timeout
        while not self.lost:
            now = self._clock.monotonic()
            entry = self._entry
            if deadline is not None and now >= deadline:
                return False
            limits = [deadline] if deadline is not None else []
            if entry is not None and not entry.closed:
                limits.append(entry._cap(entry.valid_until))  # validity or max_hold

            self._clock.wait(self._loss_event(), (min(limits) - now) if limits else None)
        return True

    def _loss_event(self) -> threading.Event:
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
            fn: the listener; its result is ignored, what it raises is logged.
            immediate: False (default): ``fn`` runs on the dispatcher, so it may block. True: on
                the thread that recorded the loss, after the dispatched ones were handed over;
                it must be quick and never block (set a flag, schedule a callback).

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
        """Wake waiters, dispatch listeners, then run the immediate ones (one that interrupts
        this thread cannot keep the others back)."""
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
        built = hasattr(self, "_key")  # not while the lease is being built
        slot = f" slot={self.slot}" if built and self.store_key != self.key else ""
        return f"<Lease key={self.key!r}{slot} token={self.token} owner={self.owner!r} {state}>"


class LeaseContext:
    """What :func:`lease` returns: a context manager (``with``, ``async with``) and a decorator
    (a fresh context per call).

    Attributes:
        key, store, ttl, wait, max_hold, cooldown, on_lost, cancel, clock: :func:`lease`'s
            arguments, checked (seconds; ``store`` is the synchronous store).
        async_store: what ``async with`` awaits: the one given, else an adapter of ``store``
            made on first use.
        names_holder: set by the Celery layer: tries use ``acquire_or_holder``, and
            ``refused_by`` is the owner id the last refusal named.
        limit: ``None`` (default): the key itself is held; an int (1 .. MAX_LIMIT): one of up
            to ``limit`` slots of the key, through the store's ``acquire_slot`` (set by
            :func:`lease` for a limit given, by the Celery layer for a task's ``limit``).
        store_key: the key as the store holds the lease: ``key``, or with a limit the key of
            the slot the last granted try got (what the exit releases).
    """

    limit: int | None = None
    # An unentered context's state (what :meth:`_unentered` sets again on a fresh copy): class
    # defaults, so that making a context (one per task) assigns none of them.
    names_holder = False
    refused_by: str | None = None
    _lease: Lease | None = None
    _frame: Frame | None = None  # the frame this context pushed
    _reentered = False
    _entered = False
    _cooling = False  # the cooldown was begun (an interrupted exit must not release)
    _released_early = False
    _defer_release = False
    _canceller: aio.Canceller | None = None  # of an on_lost="cancel" async block

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that overrides :meth:`enter` gets it as its ``__enter__`` too (this
        class's ``__enter__`` is its own ``enter``, bound when the class was made), so ``with``
        runs the override."""
        super().__init_subclass__(**kwargs)
        if "enter" in cls.__dict__ and "__enter__" not in cls.__dict__:
            cls.__enter__ = cls.enter

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
        # Positional too (the Celery layer makes one per task: a class called with keywords
        # costs several times a positional call).
        label: str | None = None,
        node: str | None = None,
        task: str | None = None,
        task_id: str | None = None,
        wait_clock: Clock | None = None,
    ) -> None:
        self.key = self.store_key = key
        self.store = store
        self.ttl = ttl
        self.wait = wait
        self.max_hold = max_hold
        self.cooldown = cooldown
        self.on_lost = on_lost
        self.cancel = cancel
        self.clock = clock
        self.wait_clock = wait_clock  # None: clock_of(store, clock)
        self.label = label  # label, node, task, task_id: recorded in each owner id
        self.node = node
        self.task = task
        self.task_id = task_id
        self.async_store: AsyncLockStore | None = None
        # Set by the Celery layer (``on_held="replace"``): recorded as each owner id's ``rt``.
        self.replace_ticket: int | None = None

    def _unentered(self) -> None:
        """Set the unentered state (the class defaults) on this instance: for a copy."""
        self.names_holder = False
        self.refused_by = None
        self._lease = None
        self._frame = None
        self._reentered = False
        self._entered = False
        self._cooling = False  # the cooldown was begun (an interrupted exit must not release)
        self._released_early = False
        self._defer_release = False
        self._canceller = None

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
        """True for an ``async def``; LeaseConfigError for an async generator function, or for
        ``on_lost="cancel"`` on a function that is not ``async def``."""
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
        context = copy.copy(self)
        context.store_key = context.key
        context._unentered()
        return context

    @property
    def reentered(self) -> bool:
        """True when this context re-entered an enclosing one's lease (its exit leaves it held)."""
        return self._reentered

    @property
    def released_early(self) -> bool:
        """True once :meth:`release_early` recorded the end: the exit releases, raises nothing."""
        return self._released_early

    @property
    def defer_release(self) -> bool:
        """True once :meth:`release_without_reply` was called."""
        return self._defer_release

    def release_without_reply(self) -> None:
        """Send the release without waiting for its reply where the store can
        (:class:`~celery_lease.stores.base.SupportsDeferredRelease`)."""
        self._defer_release = True

    def release_early(self, reason: str = "released") -> bool:
        """End the held lease now, while the body may still run (a task re-sending its own id);
        the exit then only pops it. In order: records the loss with ``reason`` (``check()``
        raises before the key is free), waits for a renewal in flight, releases owner-checked (a
        store failure is logged), runs the loss listeners.

        Args:
            reason: the ``lost_reason`` to record (default ``"released"``).

        Returns True when this call ended it; False when its end was recorded already (a lost
        lease is still released, once), or in a forked child.

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
        key = held._key
        recorded = key.record(reason)
        if recorded:  # read by the log line of the notification below
            held._released_early = True
        self._released_early = self._released_early or recorded
        try:
            if recorded:
                key.settle()
            if key.claim_final():
                self._send_release(held.owner)
        except BaseException:  # an interrupt cut the release short
            self._end_interrupted(held, pop=False)
            raise
        if recorded:
            key.notify(reason)
        return recorded

    def __repr__(self) -> str:
        limit = "" if self.limit is None else f", limit={self.limit}"
        return (
            f"lease({self.key!r}, store={self.store!r}, ttl={self.ttl:g}, wait={self.wait:g}"
            f"{limit})"
        )

    def send_first_try(self, store_checked: bool = False) -> SentTry | None:
        """Send the first try now, for :meth:`enter` to read later (its lease's validity counts
        from now); ``None`` when not sent (the store cannot, a limit, ``names_holder``): the
        enter tries as usual. One never entered with must go to :meth:`abandon_sent`.
        ``store_checked``: the caller found the store offers ``send_acquire``
        (:class:`SupportsSentAcquire`), so it is not asked again."""
        store = self.store
        if (
            self.limit is not None
            or self.names_holder
            or not (store_checked or offers(store, SupportsSentAcquire, "send_acquire"))
        ):
            return None
        owner, ttl_ms, started = self._first_try()
        read = cast(SupportsSentAcquire, store).send_acquire(self.key, owner, ttl_ms)
        return None if read is None else SentTry(owner, ttl_ms, started, read, forking.generation())

    def abandon_sent(self, sent: SentTry) -> None:
        """Give up ``sent`` (from :meth:`send_first_try`, not entered with): read its reply and
        release, owner-checked, what it took (also when it failed: it may have taken effect); a
        store error is logged. Nothing once read, nor in a forked child (the parent's)."""
        if sent.read is None or sent.gen != forking.generation():
            return
        reply = sent.reply()
        if reply is not None:  # a token, or Failed
            self._abandon_attempt(sent.owner)

    def enter(self, sent: SentTry | None = None) -> Lease:
        """``with``'s enter; ``sent``: its first try, sent earlier by :meth:`send_first_try`
        (its reply read here as the first try's)."""
        if self.on_lost is CANCEL:
            raise LeaseConfigError(
                f"on_lost={self.on_lost!r} is for 'async with lease(...)' (or @lease on an async"
                " def): a plain 'with' has no asyncio task to cancel; pass a callable instead"
            )
        if self._entered:  # as _mark_entered(), inline: once per task
            raise RuntimeError("a lease() context cannot be entered twice; call lease() again")
        self._entered = True
        # The running asyncio task (current_task() raises without a loop), or None.
        task: object = None if _get_running_loop() is None else asyncio.current_task()
        outer = self._reenter(task)
        if outer is not None:
            if sent is not None:
                self.abandon_sent(sent)
            return outer
        if sent is not None and sent.gen == forking.generation():
            owner, ttl_ms, started = sent.owner, sent.ttl_ms, sent.sent_at
        else:  # none, or a parent's try: the parent's
            sent = None
            owner, ttl_ms, started = self._first_try()
        # A try sent, neither refused nor made into a lease: an interrupt until the lease is
        # built releases it here, in this thread (the interrupt may end the process before a
        # daemon thread could). A failed try is the plan's to release.
        attempt: str | None = owner
        try:
            answer = None if sent is None else self._sent_reply(sent)
            if answer is _ASK_AGAIN:  # a grant read late: asked again under its own owner id
                started = self.clock.monotonic()
                reply = self._try(owner, ttl_ms)
            elif answer is None:  # nothing sent, or a refused sent try: the first try is now
                if sent is not None:
                    attempt = None
                    owner, ttl_ms, started = self._first_try()
                    attempt = owner
                reply = self._try(owner, ttl_ms)
            else:
                reply = cast(Reply, answer)
            if type(reply) is GRANTED:  # the usual answer: no plan needed
                held = self._hold(owner, reply, 0, started, started, None, abandon=False)
            else:
                if reply is None or isinstance(reply, Failed):  # else a token of an int subclass
                    attempt = None
                plan = self._plan(owner, ttl_ms, started)
                step = plan.send(reply)
                while type(step) is not Hold:
                    attempt = owner if type(step) is Try else None
                    reply = self._perform(cast("Try | Pause", step))
                    if reply is None or isinstance(reply, Failed):
                        attempt = None
                    step = plan.send(reply)
                held = self._hold(*step, None, abandon=False)
            attempt = None
        except BaseException:
            if attempt is not None:
                self._abandon_attempt(attempt)
            raise
        try:
            self._push(held, task)
        except BaseException:  # an interrupt after the acquire: the exit never runs
            self._end_interrupted(held)
            raise
        return held

    __enter__ = enter  # ``with``: no frame of its own

    def _sent_reply(self, sent: SentTry) -> Reply | object:
        """The reply of ``sent`` for the enter to use as its first try's; ``None``: the enter
        tries afresh (a refusal: the holder may have ended since); :data:`_ASK_AGAIN`: a grant
        read at or past the renewer's first renewal point (``ttl / 3`` from the send: the work
        since may have outlasted the ttl), to be asked again under the same owner id (the
        store's acquire is idempotent for it: the same token with a fresh ttl while still held,
        a refusal if another took the key after it expired, a new token if it is free; nothing
        released, so a failed release cannot leave it refusing its own new try). A failed try is
        used (the plan releases it and raises or tries again, as for any first try)."""
        reply = sent.reply()
        if reply is None or isinstance(reply, Failed):
            return reply
        if self.clock.monotonic() - sent.sent_at < self.ttl / 3:
            return reply
        return _ASK_AGAIN

    def _perform(self, step: Try | Pause) -> Reply:
        if isinstance(step, Try):
            return self._try(step.owner, step.ttl_ms)
        if step.clock is None:
            cast(SupportsReleaseNotify, self.store).wait_for_release(self.key, step.seconds)
        else:
            step.clock.wait(cast(threading.Event, step.event), step.seconds)
        return None

    def _try(self, owner: str, ttl_ms: int) -> Reply:
        try:
            if self.names_holder:
                self.refused_by = None  # a try that raises was refused by no holder
                token, self.refused_by = cast(
                    SupportsAcquireOrHolder, self.store
                ).acquire_or_holder(self.key, owner, ttl_ms)
                return token
            if self.limit is not None:
                return self._try_slot(owner, ttl_ms, self.limit)
            return self.store.acquire(self.key, owner, ttl_ms)
        except BaseException as exc:
            return Failed(exc)

    def _try_slot(self, owner: str, ttl_ms: int, limit: int) -> Reply:
        """A try for a slot: its token (its slot's key noted as :attr:`store_key`), or
        ``None``."""
        got = cast(SupportsSlots, self.store).acquire_slot(self.key, owner, ttl_ms, limit)
        if got is None:
            return None
        slot, token = got
        self.store_key = slot_key(self.key, slot)
        return token

    async def _atry_slot(self, astore: AsyncLockStore, owner: str, ttl_ms: int) -> Reply:
        """:meth:`_try_slot`, awaited on ``astore``."""
        got = await aio.try_acquire_slot(astore, self.key, owner, ttl_ms, cast(int, self.limit))
        if got is None or isinstance(got, Failed):
            return got
        slot, token = got
        self.store_key = slot_key(self.key, slot)
        return token

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
        try:
            pop_frame(self._frame)
            # Stop renewing, release the key (or keep it for cooldown); a lapse told below.
            key = held._key
            settled, final, lapsed = key.stop()
            if final:
                self._finish(held, exc is None, settled)
        except BaseException:  # an interrupt: the lease must end all the same, then it goes on
            self._end_interrupted(held)
            raise
        if lapsed is not None:  # told after the release
            key.notify(lapsed)
        if exc is not None:  # nothing to raise after a body that raised nothing
            self._raise_if_lost(exc, key.lost_reason)
        return False

    async def __aenter__(self) -> Lease:
        self._mark_entered()
        task = asyncio.current_task()
        outer = self._reenter(task)  # never for a task that only copied the context
        if outer is not None:
            return outer
        canceller: aio.Canceller | None = None
        if self.on_lost is CANCEL:
            if task is None:
                raise RuntimeError("on_lost='cancel' needs to run in an asyncio task")
            canceller = aio.Canceller(asyncio.get_running_loop(), task)
        astore = self._async_store()
        owner, ttl_ms, started = self._first_try()
        reply = await (
            aio.try_acquire(astore, self.key, owner, ttl_ms)
            if self.limit is None
            else self._atry_slot(astore, owner, ttl_ms)
        )
        immediate = None if canceller is None else canceller.on_lost
        if type(reply) is GRANTED:  # the usual answer: no plan needed
            held = self._hold(owner, reply, 0, started, started, immediate)
        else:
            plan = self._plan(owner, ttl_ms, started)
            step = plan.send(reply)
            while type(step) is not Hold:
                if type(step) is Pause:  # counted on the plan's clock, slept on the loop
                    await astore.wait_for_release(self.key, step.seconds)
                    reply = None
                else:
                    reply = await (
                        aio.try_acquire(astore, self.key, owner, ttl_ms)
                        if self.limit is None
                        else self._atry_slot(astore, owner, ttl_ms)
                    )
                step = plan.send(reply)
            held = self._hold(*step, immediate)
        self._push(held, task)
        if canceller is not None:
            canceller.active = True
            self._canceller = canceller
        return held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        canceller = self._canceller
        if canceller is not None:
            canceller.active = False  # from here on a loss cancels nothing
        held = self._pop()
        if held is None:
            return False  # the outer context (or, after a fork, the parent) owns the lease
        succeeded = exc is None
        ours = canceller is not None and canceller.fired
        outside = False
        if canceller is not None and ours:
            # Before the first await: a cancel landing in the release is the caller's
            canceller.fired = False
            outside = canceller.take_back(exc)
        await self._aend(held, succeeded)
        reason = held._key.lost_reason
        if ours:
            return aio.after_our_cancel(held.key, reason, exc, outside)
        self._raise_if_lost(exc, reason)
        return False

    def _end(self, held: Lease, succeeded: bool) -> None:
        """Stop renewing, release the key (or keep it for ``cooldown``); tell a lapse. (The
        exit does the same inline, telling a lapse after its checks.)"""
        key = held._key
        settled, final, lapsed = key.stop()
        if final:
            self._finish(held, succeeded, settled)
        if lapsed is not None:
            key.notify(lapsed)

    async def _aend(self, held: Lease, succeeded: bool) -> None:
        """Stop renewing and release, awaiting; a renewal in flight or a cooldown (which may
        be fenced) runs the sync steps on a thread, which finishes them even if cancelled."""
        key = held._key
        if key.inflight or (succeeded and self.cooldown > 0 and key.lost_reason is None):
            end = functools.partial(self._end, held, succeeded)
            await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, end))
            return
        _settled, final, lapsed = key.stop()  # one lock round, no wait
        try:
            if final:
                await aio.release(
                    self._async_store(), self.store_key, held.owner, self._send_release
                )
        finally:  # told after the release, also when a cancel cut it short
            if lapsed is not None:
                key.notify(lapsed)

    def _async_store(self) -> AsyncLockStore:
        astore = self.async_store
        if astore is None:
            astore = self.async_store = aio.ThreadedAsyncStore(self.store)
        return astore

    def _mark_entered(self) -> None:
        if self._entered:
            raise RuntimeError("a lease() context cannot be entered twice; call lease() again")
        self._entered = True

    def _reenter(self, task: object) -> Lease | None:
        """The innermost lease of this process on this key and store that ``task`` may
        re-enter, neither lost nor ended, pushed as this context's; else ``None``."""
        top = current_frame.get()
        frame = top
        if frame is None:
            return None
        mine = forking.generation()
        # Frames below a foreign one are foreign too; an ended lease's key may be another's now
        while frame is not None and frame.gen == mine:
            outer = frame.lease
            if (
                outer.key == self.key
                and outer.store is self.store
                and (outer.store_key != outer.key) is (self.limit is not None)  # same space
                and outer._reenterable_by(task)
                and not outer.lost
                and not outer._key.closed
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

    def _first_try(self) -> tuple[str, int, float]:
        """The first try's owner id, ttl in ms and start (clock seconds); raises if cancelled."""
        ttl_ms = to_ms(self.ttl)
        owner = make_owner(
            node=self.node,
            task=self.task,
            task_id=self.task_id,
            label=self.label,
            ttl_ms=ttl_ms,
            cooldown_ms=to_ms(self.cooldown) if self.cooldown > 0 else None,
            replace_ticket=self.replace_ticket,
        )
        if self.cancel is not None:  # most have none: no call
            check_cancel(self.cancel, self.key)
        return owner, ttl_ms, self.clock.monotonic()

    def _plan(self, owner: str, ttl_ms: int, started: float) -> AcquirePlan:
        return AcquirePlan(
            Try(self.key, owner, ttl_ms),
            started,
            self.wait,
            self.store,
            self.clock,
            self._wait_clock,
            self.cancel,
            self._abandon_attempt,
        )

    def _wait_clock(self) -> Clock:
        return self.wait_clock or clock_of(self.store, self.clock)

    def _hold(
        self,
        owner: str,
        token: int,
        tries: int,
        started: float,
        sent_at: float,
        immediate: LossListener | None,
        *,
        abandon: bool = True,
    ) -> Lease:
        """Build the Lease of a granted try and start renewing it; cut short, the attempt is
        abandoned on the dispatcher (``abandon``; else the caller releases it). ``immediate``:
        a loss listener in place of ``on_lost`` (``"cancel"``'s)."""
        try:
            store = self.store
            # positional: see Lease.__init__ and Entry.__init__ (key, owner, token, waited,
            # wait_seconds, store, clock, acquired_at)
            held = Lease(
                self.key, owner, token, tries > 0, sent_at - started, store, self.clock, sent_at
            )
            if immediate is not None:
                held._listeners = [(immediate, True)]
            elif self.on_lost is not None:
                held._listeners = [(self.on_lost, False)]
            max_hold = self.max_hold
            # store, key, owner, ttl, sent_at, max_hold_at, on_lost, token
            held._key = held._entry = key = HeldKey(
                store,
                self.store_key,
                owner,
                self.ttl,
                sent_at,
                None if max_hold is None else sent_at + max_hold,
                held._notify_lost,
                token,
            )
            key.start(self.clock)
        except BaseException:
            if abandon:
                abandon_later(self._abandon_attempt, self.key, owner)
            raise
        return held

    def _push(self, held: Lease, task: object) -> None:
        """Push ``held`` as this context's lease; only ``task`` (None: this thread) re-enters it."""
        if task is None:
            held._thread = threading.get_ident()
        else:
            held._task = weakref.ref(task)
        self._lease = held
        self._frame = Frame(held, current_frame.get())
        current_frame.set(self._frame)

    def _pop(self) -> Lease | None:
        """Pop this context's lease; return it when this exit ends it."""
        held = self._lease
        assert held is not None
        pop_frame(self._frame)
        if self._reentered or held._gen != forking.generation():
            return None
        return held

    def _raise_if_lost(self, exc: BaseException | None, reason: str | None) -> None:
        """Raise LockLostError from a body's ``Exception`` after a loss (not an early release)."""
        if (
            isinstance(exc, Exception)
            and reason is not None
            and not self._released_early
            and not isinstance(exc, LockLostError)
        ):
            assert self._lease is not None
            raise LockLostError(self._lease.key, reason) from exc

    def _end_interrupted(self, held: Lease, *, pop: bool = True) -> None:
        """End ``held`` after an interrupt cut its enter, exit or early release short: pop (not
        for an early release), stop renewing, release owner-checked (again) unless a cooldown
        began. Never raises: the interrupt goes on."""
        try:
            if pop:
                pop_frame(self._frame)
            key = held._key
            reason = key.abandon()
            if not self._cooling:
                self._send_release(held.owner)
            if reason is not None:
                key.notify(reason)
        except BaseException:  # pragma: no cover - a second interrupt: the first one goes on
            logger.exception("celery-lease: ending the interrupted lease %r failed", held.key)

    def _send_release(self, owner: str) -> None:
        """Release ``owner``'s key (unanswered where deferred: :meth:`release_without_reply`) as
        :meth:`_quietly` calls a store (one frame: once per task)."""
        store = self.store
        try:
            if not (
                self._defer_release
                and conforms(store, SupportsDeferredRelease)
                and cast(SupportsDeferredRelease, store).release_deferred(self.store_key, owner)
            ):
                store.release(self.store_key, owner)
        except LockLostError:
            raise
        except Exception as exc:
            logger.warning(
                "celery-lease: releasing %r failed (%s); it expires within its ttl", self.key, exc
            )

    def _quietly(self, failed: str, call: Callable[[str], object], owner: str) -> object:
        """``call(owner)``; a store error is logged (``failed``: %r the key, %s the error), a
        :class:`LockLostError` (an enclosing lease's interrupt) goes on."""
        try:
            return call(owner)
        except LockLostError:
            raise
        except Exception as exc:
            logger.warning("celery-lease: " + failed, self.key, exc)
            return None

    def _finish(self, held: Lease, succeeded: bool, settled: bool) -> None:
        """Release the key, or keep it for ``cooldown`` after a success (fenced when a renewal
        is in flight); never raises a store error."""
        key = held._key
        if not (succeeded and self.cooldown > 0 and key.lost_reason is None):
            self._send_release(held.owner)
            return
        self._cooling = True
        until = self.clock.monotonic() + self.cooldown
        self._cool_down(held.owner, until)
        if not settled:
            redo = functools.partial(self._cool_down, held.owner, until)
            if not key.fence(redo):
                redo()

    def _cool_down(self, owner: str, until: float) -> None:
        left = until - self.clock.monotonic()
        ms = to_ms(left)
        store, key = self.store, self.store_key
        renewed = self._quietly(
            "setting the cooldown of %r failed (%s); the key frees itself within its ttl",
            (lambda o: store.release(key, o)) if left <= 0 else (lambda o: store.renew(key, o, ms)),
            owner,
        )
        if renewed is False:
            logger.warning(
                "celery-lease: the cooldown of %r was not applied: the store no longer"
                " records this holder (%s), so the key may already be free or taken",
                self.key,
                owner,
            )

    def _abandon_attempt(self, owner: str) -> None:
        """Release owner-checked what the attempt of ``owner`` may have taken: the key, or with
        a limit each slot it could have got (owner ids are unique per attempt: no other
        holder's slot is touched)."""
        self._quietly(
            "acquiring %r failed, and releasing that attempt failed too (%s); if it took"
            " effect, it expires within its ttl",
            functools.partial(self.store.release, self.key)
            if self.limit is None
            else self._release_any_slot,
            owner,
        )

    def _release_any_slot(self, owner: str) -> None:
        """Release ``owner``'s slot of the key, whichever it took (the lowest free one below
        the limit): in one call when the store offers ``release_owned_slots``, else slot by
        slot, going on past a failed release; the first error is raised at the end (what was
        taken expires within its ttl)."""
        release_owner_slots(self.store, self.key, owner, cast(int, self.limit))


_ASK_AGAIN = object()  # see LeaseContext._sent_reply


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
    limit: int | None = None,
) -> LeaseContext:
    """Hold ``key`` in ``store`` while a block (or decorated function) runs: the core of
    :func:`celery_lease.lease`, whose docstring gives the arguments (all but ``app``), their
    defaults and what it raises. Every argument is checked here, before anything is acquired.
    """
    sync_store, astore, ttl_s, wait_s, max_hold_s, cooldown_s, listener, clock_ = checked_arguments(
        key, store, ttl, wait, max_hold, on_lost, cancel, clock, cooldown, holder
    )
    context = LeaseContext(
        key,
        sync_store,
        ttl_s,
        wait_s,
        max_hold_s,
        cooldown_s,
        listener,
        cancel,
        clock_,
        label=holder,
        wait_clock=clock,  # a clock given here is the one waited on, whatever the store's
    )
    context.async_store = astore
    if limit is not None:  # any limit given, 1 too: the key's slots
        slots = checked_limit(limit)
        check_slot_store(slots, sync_store, astore)
        context.limit = slots
    return context


def pop_frame(pushed: Frame | None) -> None:
    """Remove the frame ``pushed`` (or its copy) from this context's stack. Idempotent."""

    if pushed is None:
        return
    top = current_frame.get()
    if top is not None and (top is pushed or top.origin is pushed):
        current_frame.set(top.parent)
        return
    frames: list[Frame] = []
    frame = top
    while frame is not None and frame is not pushed and frame.origin is not pushed:
        frames.append(frame)
        frame = frame.parent
    if frame is None:
        return
    rebuilt = frame.parent
    for above in reversed(frames):
        rebuilt = Frame(above.lease, rebuilt)
        rebuilt.gen = above.gen
        rebuilt.origin = above if above.origin is None else above.origin
    current_frame.set(rebuilt)


def current_lease() -> Lease | None:
    """The innermost lease held in the current context (never a parent's), or ``None``."""
    top = current_frame.get()
    return None if top is None or top.gen != forking.generation() else top.lease


def get_lock_token() -> int | None:
    """The fencing token of the innermost lease held in the current context, else ``None``."""
    held = current_lease()
    return None if held is None else held.token
