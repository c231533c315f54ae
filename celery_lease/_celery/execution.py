"""The run engine: :func:`run_locked` builds the key, takes the lease, runs the body, applies
``on_held`` / ``on_lost`` and releases (or keeps for ``cooldown``) before the result is stored.
Which thread runs what, and fork resets: ``docs/internals.md``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, TypeVar, cast

from celery.exceptions import Retry
from celery.utils.dispatch import Signal

from celery_lease import signals
from celery_lease._celery import compat, deferral, early_acquire, on_held, replace
from celery_lease._celery import request as _request  # `request`: the execution's, here
from celery_lease._celery import unique as _unique
from celery_lease._celery.interrupt import AsyncLockLost, Interrupter
from celery_lease._celery.protocols import can_release_deferred
from celery_lease._celery.settings import LeaseSettings, get_settings
from celery_lease._celery.spec import Spec
from celery_lease._core.arguments import check_slot_store, key_with_slot_mark
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.options import LockOptions, call_limit, replace_wait
from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS, owner_field
from celery_lease.errors import LeaseConfigError, LockLostError, LockNotAcquiredError
from celery_lease.stores.base import LockStore, SupportsDeferredRelease
from celery_lease.stores.slots import SLOT_MARK

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest, UniqueTask
    from celery_lease.clock import Clock

logger = logging.getLogger("celery_lease.engine")

_R = TypeVar("_R")


class _Run:
    """One locked execution; ``requests``: all its body may see (:func:`adopt_request`)."""

    __slots__ = (
        "awaiting_request",
        "context",
        "interrupter",
        "key",
        "lease",
        "options",
        "released",
        "released_early",
        "requests",
        "task",
        "task_id",
    )

    def __init__(
        self, task: CeleryTask | None, request: TaskRequest | None, key: str, options: LockOptions
    ) -> None:
        self.task = task
        self.task_id: str | None = getattr(request, "id", None) if request is not None else None
        self.requests: list[TaskRequest] = [] if request is None else [request]
        self.key = key
        self.options = options
        self.lease: Lease | None = None
        self.context: LeaseContext | None = None
        self.released = False
        self.released_early = False
        self.awaiting_request = False
        # Only a revoking execution can be interrupted: the others skip building one per run.
        self.interrupter: Interrupter | None = (
            Interrupter(key, f"{getattr(task, 'name', task)}[{self.task_id}]")
            if options.on_lost == "revoke"
            else None
        )
        if request is not None:  # as adopt() sets them, none held yet
            request.lock_key = key
            request.lock_token = request.lock_slot = request.lease = None
            request.lock_waited = False
            request._lease_run = _request.CLAIMED

    def adopt(self, request: TaskRequest) -> None:
        """Set this execution's lock attributes on ``request`` (always overwritten)."""
        for adopted in self.requests:
            if adopted is request:
                break
        else:
            self.requests.append(request)
        held = self.lease
        request.lock_key = self.key
        request.lock_token = None if held is None else held.token
        request.lock_slot = None if held is None else held.slot
        request.lock_waited = False if held is None else held.waited
        request.lease = held
        request._lease_run = _request.CLAIMED

    def acquired(self, context: LeaseContext, held: Lease) -> None:
        """The lease is held: note it on the requests; listen for its loss unless re-entered."""
        self.context, self.lease = context, held
        token, slot, waited = held.token, held.slot, held.waited
        for request in self.requests:  # adopted already: only what the acquire decided
            request.lock_token = token
            request.lock_slot = slot
            request.lock_waited = waited
            request.lease = held
        if context.on_lost is None and not context.reentered:
            held.add_loss_listener(self.on_lost)  # else the context attached it at acquire

    def start_body(self) -> None:
        """Arm the interrupt; a lease lost already makes ``start()`` raise (listener first)."""
        interrupter = self.interrupter
        if interrupter is not None and self.context is not None:
            if not self.context.reentered:
                assert self.lease is not None
                self.lease.add_loss_listener(self.interrupt, immediate=True)
            interrupter.start()

    def end_body(self) -> None:
        """No interrupt may land from now on (``end()`` is called again if one lands inside it)."""
        interrupter = self.interrupter
        if interrupter is not None:
            try:
                interrupter.end()
            except AsyncLockLost:
                raise
            except BaseException:
                interrupter.end()
                raise

    @property
    def interrupted(self) -> bool:
        """Whether this run fired an interrupt."""
        return self.interrupter is not None and self.interrupter.fired

    def interrupt(self, held: Lease) -> None:
        """Immediate listener: stop the body; not for an early release (RETRY stays RETRY)."""
        if not held.released_early and self.interrupter is not None:
            self.interrupter.fire(held.lost_reason or "lost")

    def on_lost(self, held: Lease) -> None:
        """Dispatched listener: ``lock_lost`` and ``on_lock_lost``; not for an early release."""
        if held.released_early:
            # Not ``self.released_early``: set before the early release is recorded, it would
            # hide a real loss recorded just before.
            return
        self._send(signals.lock_lost, held, reason=held.lost_reason or "lost")
        hook = getattr(self.task, "on_lock_lost", None)
        if hook is not None:
            try:
                hook(held)
            except Exception:
                logger.exception(
                    "celery-lease: on_lock_lost of %s raised", getattr(self.task, "name", "?")
                )

    def _send(self, signal: Signal, held: Lease, **named: object) -> None:
        signals.send(
            signal,
            self.task,
            key=held.key,
            token=held.token,
            task_id=self.task_id,
            slot=held.slot,
            **named,
        )

    def release_early(self) -> None:
        """The execution re-sends itself: mark the lease lost (``"released"``), free the key,
        once."""
        context, held = self.context, self.lease
        if self.released or self.released_early or context is None or held is None:
            return
        if context.reentered:  # the enclosing execution's lease
            return
        held_seconds = held.held_seconds
        self.released_early = True
        if context.release_early("released"):
            self._send(signals.lock_released, held, held_seconds=held_seconds)

    def release(self, exc: BaseException | None) -> None:
        """Release (or keep for cooldown) once; after an early release only the frame is popped.
        Then the run lets go of its lease, context and requests: its loss listeners (which
        still report a loss told later) no longer close a cycle through them."""
        context, held = self.context, self.lease
        if self.released or context is None or held is None:
            return
        self.released = True
        try:
            if self.released_early:
                context.__exit__(None, None, None)
                return
            held_seconds = held.held_seconds if signals.lock_released.receivers else 0.0
            try:
                if exc is None:
                    context.__exit__(None, None, None)
                else:
                    context.__exit__(type(exc), exc, exc.__traceback__)
            finally:
                # A lost lease was not ours to release any more: lock_lost already said so.
                if signals.lock_released.receivers and not context.reentered and not held.lost:
                    self._send(signals.lock_released, held, held_seconds=held_seconds)
        finally:
            self.context = self.lease = None
            self.requests.clear()


_active: ContextVar[tuple[_Run, ...]] = ContextVar("celery_lease_runs", default=())


def current_run(task_id: str | None) -> _Run | None:
    """The innermost running execution (in this context) with ``task_id``, if any."""
    if task_id is None:
        return None
    for run in reversed(_active.get()):
        if run.task_id == task_id:
            return run
    return None


def active_runs() -> tuple[_Run, ...]:
    """The locked executions running in this context, outermost first."""
    return _active.get()


def adopt_request(task: object, request: TaskRequest) -> None:
    """``push_request``: give the request the innermost run of ``task`` awaits its attributes."""
    runs = _active.get()
    if runs:
        run = runs[-1]
        if run.awaiting_request and run.task is task:
            run.awaiting_request = False
            run.adopt(request)


def _publishes_nothing(task: CeleryTask | None, request: TaskRequest | None) -> bool:
    """:func:`deferral.publishes_nothing`, and not a nested run (its caller goes on after it)."""
    return not _active.get() and deferral.publishes_nothing(task, request)


class _ReleasedForRetry(Exception):
    """Marks a release for a re-sent task (never a cooldown)."""


_RELEASE_FOR_RETRY = _ReleasedForRetry()


def run_locked(
    task: CeleryTask | None,
    request: TaskRequest | None,
    spec: Spec,
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
    body: Callable[[], _R],
    *,
    adopt: bool = False,
    unclaimed: bool = False,
) -> _R | None:
    """Run ``body`` under the lease of this execution and apply the policies. ``task`` is
    ``None`` outside Celery, ``request`` ``None`` for a direct call; with ``adopt``, the first
    request ``task`` pushes while ``body`` runs gets the lock attributes too; ``unclaimed``:
    the caller found ``request`` claimed by no execution (:func:`request.is_claimed`), so it is
    not asked again."""
    saved = None
    if not unclaimed and request is not None and _request.is_claimed(request):
        # An enclosing execution's request (a ``@locked`` helper called from its body).
        saved = _request.save(request)
    try:
        options = spec.options
        app = task.app if task is not None else compat.get_current_app()
        resolved = spec.kept(app)  # what the last execution resolved, if nothing changed since
        settings = get_settings(app) if resolved is None else resolved.settings
        if request is not None:  # overwrite what a message header may have put there
            request.lock_key = request.lock_token = request.lock_slot = request.lease = None
            request.lock_waited = False
        key = settings.key_prefix + spec.key_function(args, kwargs)
        if SLOT_MARK in key:
            raise LeaseConfigError(key_with_slot_mark(key, f" of {_name(task, spec)}"))
        limit = spec.limit
        if limit is not None and not isinstance(limit, int):
            limit = call_limit(limit, args, kwargs, where=_name(task, spec), key=key)
        run = _Run(task, request, key, options)
        if resolved is None:
            resolved = spec.resolve(app, settings, key)
        ttl, wait, store = resolved.ttl, resolved.wait, resolved.store
        # "replace" tries once per step of its own loop (celery_lease._celery.replace)
        context = (
            early_acquire.take(request, key, store, ttl, wait, run.on_lost)
            if early_acquire.parked is not None
            else None
        ) or _lease_context(
            run, request, store, resolved.clock, ttl, 0.0 if options.on_held == "replace" else wait
        )
        if limit is not None:  # one of the key's slots (a callable's 1 too: counted alike)
            check_slot_store(limit, store, None)
            context.limit = limit
        arrival = None  # a debounced copy's claim on its tombstone key, freed when this run ends
        if options.unique is not None and request is not None:
            # A superseded debounced copy ends here (Ignore).
            arrival = _unique.on_arrival(
                cast("CeleryTask", task), request, store, key, settings, options.unique, ttl, wait
            )
            # The refusal names its holder in one step: a redelivery of a running copy is told from
            # a rejection even if that copy ends just after.
            context.names_holder = _unique.names_holder(store)
        try:
            return _run_arrived(run, request, context, store, settings, ttl, body, adopt, arrival)
        finally:
            # Always: a claim left held would make later calls duplicates of a copy that is over.
            if arrival is not None:
                arrival.leave()
    finally:
        if saved is not None:
            _request.restore(cast("TaskRequest", request), saved)


def _name(task: CeleryTask | None, spec: Spec) -> str:
    """The task's name for an error message (a ``@locked`` function outside Celery: its key)."""
    name = getattr(task, "name", None)
    return f"task {name!r}" if name else f"the lock of key {spec.options.key!r}"


def _run_arrived(
    run: _Run,
    request: TaskRequest | None,
    context: LeaseContext,
    store: LockStore,
    settings: LeaseSettings,
    ttl: float,
    body: Callable[[], _R],
    adopt: bool,
    arrival: _unique.Arrival | None,
) -> _R | None:
    task, key, options = run.task, run.key, run.options
    try:
        if options.on_held == "replace":
            wait = replace_wait(run.options, ttl, _option_name(task, "wait"))
            context, held = replace.take_over(context, wait, option=_option_name(task, "on_held"))
        else:
            held = context.__enter__()
    except replace.Superseded as exc:
        nested = current_run(getattr(request, "id", None)) is not None
        on_held.superseded(task, request, key, exc.holder, nested=nested)  # raises, or None
        return None
    except LockNotAcquiredError as exc:
        _rejected(run, request, store, settings, ttl, exc, context.refused_by)  # raises, or None
        return None
    runs_token = None
    queued = None  # an until_done copy's queued lease, kept while the body runs
    # In a run of its own id (none runs: not nested, without asking).
    nested = bool(_active.get()) and current_run(getattr(request, "id", None)) is not None
    try:
        try:
            # Held from here: anything raised before the body (a receiver's BaseException, which
            # Celery's robust send lets through) releases it below.
            run.acquired(context, held)
            if arrival is not None:
                # Superseded while it waited (its claim lapsed): Ignore, released below.
                arrival.confirm(cast("CeleryTask", task), cast("TaskRequest", request))
            if options.unique is not None and request is not None:
                queued = _queued_hold(run, request, store, settings, ttl)
            if signals.lock_acquired.receivers and not context.reentered:
                _send_acquired(run, held)
            runs_token = _active.set((*_active.get(), run))
            # The body, with the interrupt armed (a revoking run only), adopting the next
            # pushed request with ``adopt``.
            revoking = run.interrupter is not None
            if revoking:
                run.start_body()
            run.awaiting_request = adopt
            try:
                result = body()
            finally:
                run.awaiting_request = False
                if revoking:
                    run.end_body()
        except AsyncLockLost as exc:
            if not run.interrupted:
                # An enclosing run's interrupt landed in this nested body: release, pass it on.
                run.release(exc)
                raise
            lost = LockLostError(key, held.lost_reason or "lost")
            run.release(lost)
            raise lost from None
        except Retry:
            # Eager retries publish nothing; a lease lost before the retry still retries.
            with contextlib.suppress(LockLostError):
                run.release(_RELEASE_FOR_RETRY)
            raise
        except BaseException as exc:
            run.release(exc)  # raises LockLostError from exc when the lease was lost
            raise
    except BaseException as exc:
        if queued is not None:  # after the run lease: a new copy never meets it still held
            queued.end(False)
        if isinstance(exc, LockLostError) and _revoked_as_replaced(run, held, exc):
            on_held.replaced(task, request, exc, nested=nested)  # raises Ignore, or None
        raise
    finally:
        if runs_token is not None:
            _active.reset(runs_token)
    if queued is None:
        _release(run, request, context, settings)
    else:
        _release_with_queued(run, request, context, held, queued, settings)
    if held.lost:
        _log_lost_after_success(run, held)
    return result


def _revoked_as_replaced(run: _Run, held: Lease, error: LockLostError) -> bool:
    """Whether ``error`` ends a revoking run whose own lease a newer call replaced."""
    return (
        run.options.on_lost == "revoke"
        and error.reason == "replaced"
        and error.key == run.key
        and held.lost_reason == "replaced"
    )


def _option_name(task: CeleryTask | None, option: str) -> str:
    """The lock option ``option`` as its task names it, for an error."""
    return f"lock_{option} of task {getattr(task, 'name', None)!r}"


def _lease_context(
    run: _Run,
    request: TaskRequest | None,
    store: LockStore,
    clock: Clock,
    ttl: float,
    wait: float,
) -> LeaseContext:
    """``lease()`` without its checks; ``run.on_lost`` attaches before the renewer knows it."""
    options = run.options
    node = getattr(request, "hostname", None) if request is not None else None
    name, task_id = getattr(run.task, "name", None), run.task_id
    most = MAX_OWNER_FIELD_CHARS
    if not (  # as most are: each None or a str short enough, used as it is
        (node is None or (type(node) is str and len(node) <= most))
        and (name is None or (type(name) is str and len(name) <= most))
        and (task_id is None or (type(task_id) is str and len(task_id) <= most))
    ):
        node, name, task_id = owner_field(node), owner_field(name), owner_field(task_id)
    return LeaseContext(
        run.key,
        store,
        ttl,
        wait,
        options.max_hold,
        options.cooldown,
        run.on_lost,
        None,  # cancel
        clock,
        None,  # label; then node, task, task_id: positional, see LeaseContext.__init__
        node,
        name,
        task_id,
    )


def _rejected(
    run: _Run,
    request: TaskRequest | None,
    store: LockStore,
    settings: LeaseSettings,
    ttl: float,
    exc: LockNotAcquiredError,
    refused_by: str | None = None,
) -> None:
    """Past ``wait``: free a unique copy's queued key, then apply ``on_held``."""
    task, key, options = run.task, run.key, run.options
    if options.unique is not None:
        # Its queued key, if any; a second delivery of its own running copy is re-sent
        # for later and ends here (Ignore), whatever on_held says.
        _unique.on_rejected(
            request,
            store,
            key,
            settings,
            task=cast("UniqueTask | None", task),  # lock_unique: a LockedTask
            ttl=ttl,
            policy=options.on_held,
            refused_by=refused_by,
        )
    nested = current_run(getattr(request, "id", None)) is not None
    on_held.apply_policy(task, request, key, options, exc, nested=nested, store=store, ttl=ttl)


def _queued_hold(
    run: _Run, request: TaskRequest, store: LockStore, settings: LeaseSettings, ttl: float
) -> _unique.QueuedHold | None:
    """Hand a unique copy's queued key over; what an ``until_done`` copy keeps, else ``None``."""
    options = run.options
    assert options.unique is not None
    task = cast("UniqueTask", run.task)  # lock_unique is an option of LockedTask: a task runs
    return _unique.on_start(
        task, request, store, run.key, settings, options.unique, ttl, options.cooldown
    )


def _send_acquired(run: _Run, held: Lease) -> None:
    """``lock_acquired`` (the caller checked someone listens and the lease is not re-entered)."""
    signals.send(
        signals.lock_acquired,
        run.task,
        key=run.key,
        token=held.token,
        waited=held.waited,
        wait_seconds=held.wait_seconds,
        task_id=run.task_id,
        slot=held.slot,
    )


def _release(
    run: _Run, request: TaskRequest | None, context: LeaseContext, settings: LeaseSettings
) -> None:
    """Release (or keep for ``cooldown``), unanswered where nothing depends on the reply; a
    deferral decision that fails releases and waits."""
    try:
        if (
            settings.defer_release
            and can_release_deferred(context.store)  # first: the cheaper question
            and _publishes_nothing(run.task, request)
        ):
            deferral.defer_on(context)
    except Exception:
        logger.exception("celery-lease: deciding whether to release without waiting failed")
    run.release(None)


def _release_with_queued(
    run: _Run,
    request: TaskRequest | None,
    context: LeaseContext,
    held: Lease,
    queued: _unique.QueuedHold,
    settings: LeaseSettings,
) -> None:
    """Release an ``until_done`` copy's run lease, then its queued key, in order (unanswered
    where the store can)."""
    deferred = settings.defer_release and deferral.only_ours(signals.lock_released)
    if deferred:
        deferral.defer_on(context)
    try:
        run.release(None)
    finally:
        sent = deferred and context.defer_release
        try:
            queued.end(not held.lost, defer=sent)
        finally:
            if sent and not _publishes_nothing(run.task, request):
                cast(SupportsDeferredRelease, context.store).flush_deferred()


def _log_lost_after_success(run: _Run, held: Lease) -> None:
    name = getattr(run.task, "name", "?")
    if run.released_early:
        logger.info(
            "celery-lease: %s[%s] went on after releasing its lease on %r early (it re-sent"
            " its own id)",
            name,
            run.task_id,
            run.key,
        )
    else:
        logger.warning(
            "celery-lease: %s[%s] succeeded although its lease on %r was lost (%s)",
            name,
            run.task_id,
            run.key,
            held.lost_reason,
        )
