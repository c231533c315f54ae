"""The run engine: the lifecycle of one locked execution of a task body.

:func:`run_locked` is what :class:`~celery_lease.LockedTask` and :func:`~celery_lease.locked`
both call: it builds the key, takes the lease (waiting as configured), sets the request
attributes, runs the body, applies the ``on_held`` / ``on_lost`` policies and releases the lease
(or keeps it for ``cooldown``) before the result is stored. ``_run_locked`` is the skeleton
(acquire, run the body, release in the ``finally`` path or hand the lease over); each step is a
function of its own below it.

Loss: ``lock_lost`` and ``on_lock_lost`` are user code and run on the core's dispatcher thread
(a plain loss listener); the ``on_lost="revoke"`` interrupt is an immediate listener, run on the
thread that recorded the loss. Neither runs on the renewer or the watchdog.

Early release: a running task that publishes a message with its own id (``retry()``,
``replace()``, ``apply_async(task_id=self.request.id)``) releases its lease first
(:meth:`_Run.release_early`, called by :mod:`celery_lease._celery.early_release`).

``on_held``: :mod:`celery_lease._celery.on_held`.

Deferred release replies: see :mod:`celery_lease._celery.deferral`.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, TypeVar, cast

from celery.exceptions import Retry
from celery.utils.dispatch import Signal

from celery_lease import signals
from celery_lease._celery import compat, deferral, on_held
from celery_lease._celery import request as _request  # `request`: the execution's, here
from celery_lease._celery import unique as _unique
from celery_lease._celery.interrupt import AsyncLockLost, Interrupter
from celery_lease._celery.settings import LeaseSettings, get_settings
from celery_lease._celery.spec import Spec
from celery_lease._celery.store_resolution import execution_store
from celery_lease._core.lease import Lease, LeaseContext, clock_of
from celery_lease._core.options import LockOptions
from celery_lease._core.owners import MAX_OWNER_FIELD_CHARS
from celery_lease.errors import LockLostError, LockNotAcquiredError
from celery_lease.stores.base import LockStore, SupportsDeferredRelease

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest, UniqueTask

__all__ = ["active_runs", "adopt_request", "current_run", "run_locked"]

logger = logging.getLogger("celery_lease.engine")

_R = TypeVar("_R")


# One execution -------------------------------------------------------------------------------


class _Run:
    """The state of one locked execution: its lease, requests, interrupter, how it ended.

    ``requests`` are the requests this execution's body may see: the one the worker's tracer
    pushed (or the one a direct call pushed), plus any that ``Task.__call__`` pushes further
    down the class order (:func:`adopt_request`). The lock attributes are set on all of them.
    ``task_id`` is the id of the execution (``None`` for a direct call): a message published
    with it re-sends this execution.
    """

    def __init__(
        self, task: CeleryTask | None, request: TaskRequest | None, key: str, options: LockOptions
    ) -> None:
        self.task = task
        self.task_id: str | None = getattr(request, "id", None) if request is not None else None
        self.requests: list[TaskRequest] = []
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
        if request is not None:
            self.adopt(request)

    def adopt(self, request: TaskRequest) -> None:
        """Set this execution's lock attributes on ``request`` (always overwritten)."""
        if not any(r is request for r in self.requests):
            self.requests.append(request)
        held = self.lease
        request.lock_key = self.key
        request.lock_token = None if held is None else held.token
        request.lock_waited = False if held is None else held.waited
        request.lease = held
        request._lease_run = _request.CLAIMED

    def acquired(self, context: LeaseContext, held: Lease) -> None:
        """The lease is held: note it on every request, listen for its loss on the dispatcher.

        A re-entered lease (an enclosing execution holds the same key) is the enclosing
        holder's: its loss is reported, and its ``on_lost`` policy applied, by that holder.
        """
        self.context, self.lease = context, held
        token, waited = held.token, held.waited
        for request in self.requests:  # adopted already: only what the acquire decided
            request.lock_token = token
            request.lock_waited = waited
            request.lease = held
        if not context.reentered and context.on_lost is None:
            held.add_loss_listener(self.on_lost)  # else the context attached it at acquire

    def start_body(self) -> None:
        """Prepare the interrupt (``on_lost="revoke"``) and mark the body running.

        The listener is added first: a lease lost already fires at once, before ``start()``,
        and ``start()`` then raises ``AsyncLockLost`` (the body must not run).
        """
        interrupter = self.interrupter
        if interrupter is not None and self.context is not None:
            if not self.context.reentered:
                assert self.lease is not None
                self.lease.add_loss_listener(self.interrupt, immediate=True)
            interrupter.start()

    def end_body(self) -> None:
        """The body returned or raised: no interrupt may land from now on.

        ``end()`` may raise ``AsyncLockLost`` (the interrupt landed after the body's last
        bytecode: handled as the interrupt); if anything else lands inside it (a soft time
        limit), it is called again before that propagates.
        """
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

    # Loss listeners -----------------------------------------------------------------------------

    def interrupt(self, held: Lease) -> None:
        """Immediate listener (on the thread that recorded the loss): stop the body. Quick.

        Not for an early release: that is the body's own ``retry()`` / publish, and an interrupt
        landing between the publish and ``raise Retry`` would turn a RETRY into a FAILURE.
        """
        reason = held.lost_reason or "lost"
        if held.released_early or self.interrupter is None:
            return  # the loss is this execution's own early release (its record won)
        self.interrupter.fire(reason)

    def on_lost(self, held: Lease) -> None:
        """Dispatched listener (the core's dispatcher thread): ``lock_lost`` and ``on_lock_lost``.

        Not for an early release (``"released"``): the holder released the key itself, and
        ``lock_released`` says so.
        """
        reason = held.lost_reason or "lost"
        if held.released_early:
            # This execution let go itself ("released" by its own retry/publish). Not
            # ``self.released_early``: that is set before the early release is recorded, and a
            # real loss recorded just before it must still be reported.
            return
        self._send(signals.lock_lost, held, reason=reason)
        hook = getattr(self.task, "on_lock_lost", None)
        if hook is not None:
            try:
                hook(held)
            except Exception:
                logger.exception(
                    "celery-lease: on_lock_lost of %s raised", getattr(self.task, "name", "?")
                )

    # Release ------------------------------------------------------------------------------------

    def _send(self, signal: Signal, held: Lease, **named: object) -> None:
        """Send ``signal`` about ``held`` (its key and token, this execution's task id)."""
        signals.send(
            signal, self.task, key=held.key, token=held.token, task_id=self.task_id, **named
        )

    def release_early(self) -> None:
        """The execution re-sends itself while its body runs: free the key now, once.

        The lease is recorded lost with reason ``"released"`` before the key is free (the body
        reads ``lock_lost`` True, ``check()`` raises); ``lock_released`` is sent for it. A
        re-entered lease belongs to the enclosing holder and is left alone.
        """
        context, held = self.context, self.lease
        if self.released or self.released_early or context is None or held is None:
            return
        if context.reentered:
            return
        held_seconds = held.held_seconds
        self.released_early = True
        if context.release_early("released"):
            self._send(signals.lock_released, held, held_seconds=held_seconds)

    def release(self, exc: BaseException | None) -> None:
        """Release the lease (or keep it for cooldown after success), once; send lock_released.

        After an early release only the lease's frame is popped: nothing is released twice, and
        the body's own exception (``Retry`` among them) is kept as it is.
        """
        context, held = self.context, self.lease
        if self.released or context is None or held is None:
            return
        self.released = True
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
            if not context.reentered and not held.lost:
                self._send(signals.lock_released, held, held_seconds=held_seconds)


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
    """``task`` pushed ``request`` (``Task.__call__`` further down the class order): if the
    innermost execution of ``task`` waits for the request its body will see, set the lock
    attributes on it. Called by ``LockedTask.push_request``."""
    runs = _active.get()
    if runs:
        run = runs[-1]
        if run.awaiting_request and run.task is task:
            run.awaiting_request = False
            run.adopt(request)


def _release_quietly(run: _Run) -> None:
    with contextlib.suppress(LockLostError):  # lost before the retry: nothing left to release
        run.release(_RELEASE_FOR_RETRY)


def _publishes_nothing(task: CeleryTask | None, request: TaskRequest | None) -> bool:
    """:func:`~celery_lease._celery.deferral.publishes_nothing`, and not a nested run (its caller
    goes on after it)."""
    return not _active.get() and deferral.publishes_nothing(task, request)


class _ReleasedForRetry(Exception):
    """Marks a release done because the task is re-sending itself (never a cooldown)."""


_RELEASE_FOR_RETRY = _ReleasedForRetry()


# The engine ----------------------------------------------------------------------------------


def run_locked(
    task: CeleryTask | None,
    request: TaskRequest | None,
    spec: Spec,
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
    body: Callable[[], _R],
    *,
    adopt: bool = False,
) -> _R | None:
    """Run ``body`` under the lease of this execution and apply the policies.

    Args:
        task: the Task object (signal sender; ``retry()``, hooks), or ``None`` outside Celery.
        request: the execution's request (a ``Context``), or ``None`` (a direct call whose
            request ``body`` pushes, or no Celery at all).
        spec: the task's validated options and key function.
        args, kwargs: the arguments the key is built from (as the task is called).
        body: runs the task's body.
        adopt: the body pushes the request its task body sees (``Task.__call__`` further down
            the class order): the first request ``task`` pushes while ``body`` runs gets the
            lock attributes too (see :func:`adopt_request`).
    """
    if request is not None and _request.is_claimed(request):
        # The request of an execution running around this one (a ``@locked`` helper called
        # from its body runs on it): that execution's attributes come back when this one ends.
        saved = _request.save(request)
        try:
            return _run_locked(task, request, spec, args, kwargs, body, adopt)
        finally:
            _request.restore(request, saved)
    return _run_locked(task, request, spec, args, kwargs, body, adopt)


def _described(value: object) -> str | None:
    """A holder field of the owner id from what Celery gives (any id it accepts: a UUID object,
    a very long string): it only describes the holder, so it never fails the acquisition."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_OWNER_FIELD_CHARS]


def _run_locked(
    task: CeleryTask | None,
    request: TaskRequest | None,
    spec: Spec,
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
    body: Callable[[], _R],
    adopt: bool,
) -> _R | None:
    """One execution: acquire, run the body, then release (or hand the lease over); the steps
    are the functions below, in the order they run."""
    options = spec.options
    app = task.app if task is not None else compat.get_current_app()
    settings = get_settings(app)
    if request is not None:
        _clear_lock_attributes(request)  # overwrite what a message header may have put there
    key = settings.key_prefix + spec.key_function(args, kwargs)
    run = _Run(task, request, key, options)
    ttl, wait = spec.durations(settings)
    store = execution_store(options.store, app, key)
    context = _lease_context(run, request, store, ttl, wait)
    arrival = None  # a debounced copy's claim on its tombstone key, freed when this run ends
    if options.unique is not None and request is not None:
        # A superseded debounced copy ends here (Ignore), before it could hold the run key.
        arrival = _unique.on_arrival(
            cast("CeleryTask", task), request, store, key, settings, options.unique, ttl, wait
        )
        # A refusal names its holder in the same step where the store can: a second delivery
        # of a running copy is told from a rejection even if that copy ends just after.
        context.names_holder = _unique.names_holder(store)
    try:
        return _run_arrived(run, request, context, store, settings, ttl, body, adopt, arrival)
    finally:
        # With or without its body, whatever raised: the claim is this arrival's own, and a
        # claim left held would make the calls of its ttl duplicates of a copy that is over.
        _unique.leave(arrival)


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
    """The run lease, the body and the release, for a copy that was not superseded."""
    task, key = run.task, run.key
    try:
        held = context.__enter__()
    except LockNotAcquiredError as exc:
        _rejected(run, request, store, settings, ttl, exc, context.refused_by)  # raises, or None
        return None
    runs_token = None
    queued = None  # an until_done copy's queued lease, kept while the body runs
    try:
        try:
            # Held from here: whatever raises before the body (a lock_acquired receiver raising
            # a BaseException, which Celery's robust send lets through; an asynchronous
            # exception) releases it below.
            run.acquired(context, held)
            if arrival is not None:
                # Superseded while it waited for the run lease (its claim lapsed): Ignore,
                # and the run lease is released below before the newer copy may need it.
                arrival.confirm(cast("CeleryTask", task), cast("TaskRequest", request))
            queued = _queued_hold(run, request, store, settings, ttl)
            _send_acquired(run, context, held)
            runs_token = _active.set((*_active.get(), run))
            result = _run_body(run, body, adopt)
        except AsyncLockLost as exc:
            if not run.interrupted:
                # An enclosing run's interrupt, landed in this (nested) body: this body is over
                # too. Leave this run's lease (and its frame) before passing it on.
                run.release(exc)
                raise
            lost = LockLostError(key, held.lost_reason or "lost")
            run.release(lost)
            raise lost from None
        except Retry:
            _release_quietly(run)  # eager retries publish nothing; a lost lease still retries
            raise
        except BaseException as exc:
            run.release(exc)  # raises LockLostError from exc when the lease was lost
            raise
    except BaseException:
        if queued is not None:  # after the run lease: a new copy never meets it still held
            queued.end(False)
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


def _clear_lock_attributes(request: TaskRequest) -> None:
    request.lock_key = None
    request.lock_token = None
    request.lock_waited = False
    request.lease = None


def _lease_context(
    run: _Run, request: TaskRequest | None, store: LockStore, ttl: float, wait: float
) -> LeaseContext:
    """``lease()`` without its checks: the key is a non-empty str (key functions guarantee it),
    the durations and the store were validated when the task (and the settings) were read.

    ``run.on_lost`` goes in as the context's ``on_lost``: attached to a lease it acquires before
    the renewer knows it (no lock round), never to a re-entered one (the enclosing holder's).
    The owner id names the node, the task and the execution (:mod:`celery_lease._core.owners`).
    """
    options = run.options
    return LeaseContext(
        run.key,
        store,
        ttl,
        wait,
        options.max_hold,
        options.cooldown,
        run.on_lost,
        None,
        clock_of(store),  # the store's own clock (a FakeClock under the pytest fixtures)
        node=_described(getattr(request, "hostname", None) if request is not None else None),
        task=_described(getattr(run.task, "name", None)),
        task_id=_described(run.task_id),
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
    """The key stayed held past ``wait``: a unique copy frees its queued key, then the
    ``on_held`` policy decides (:func:`celery_lease._celery.on_held.apply_policy`).
    ``refused_by``: the holder the last refused attempt named, where the store names it."""
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
    run: _Run,
    request: TaskRequest | None,
    store: LockStore,
    settings: LeaseSettings,
    ttl: float,
) -> _unique.QueuedHold | None:
    """A unique copy about to run its body hands its queued key over
    (:func:`celery_lease._celery.unique.on_start`): the queued lease an ``until_done`` copy
    keeps while it runs, else ``None``."""
    options = run.options
    if options.unique is None or request is None:
        return None
    task = cast("UniqueTask", run.task)  # lock_unique is an option of LockedTask: a task runs
    return _unique.on_start(
        task, request, store, run.key, settings, options.unique, ttl, options.cooldown
    )


def _send_acquired(run: _Run, context: LeaseContext, held: Lease) -> None:
    """``lock_acquired``, when someone listens (not for a re-entered lease: the enclosing
    holder's)."""
    if signals.lock_acquired.receivers and not context.reentered:
        signals.send(
            signals.lock_acquired,
            run.task,
            key=run.key,
            token=held.token,
            waited=held.waited,
            wait_seconds=held.wait_seconds,
            task_id=run.task_id,
        )


def _run_body(run: _Run, body: Callable[[], _R], adopt: bool) -> _R:
    """Run the body with the interrupt armed (``on_lost="revoke"``) and, with ``adopt``, the
    next request its task pushes taking the lock attributes."""
    run.start_body()
    run.awaiting_request = adopt
    try:
        return body()
    finally:
        run.awaiting_request = False
        run.end_body()


def _release(
    run: _Run, request: TaskRequest | None, context: LeaseContext, settings: LeaseSettings
) -> None:
    """After the body returned: release the lease (or keep it for ``cooldown``), without
    waiting for the reply where the store can and nothing may depend on it."""
    if settings.defer_release and _publishes_nothing(run.task, request):
        deferral.defer_on(context)
    run.release(None)


def _release_with_queued(
    run: _Run,
    request: TaskRequest | None,
    context: LeaseContext,
    held: Lease,
    queued: _unique.QueuedHold,
    settings: LeaseSettings,
) -> None:
    """After the body of an ``until_done`` copy returned: release the run lease, then its
    queued key.

    Where the store can, both go out without waiting, in order on one connection
    (``QueuedHold.end`` never lets the queued key's overtake the run lease's); then, unless
    this execution publishes nothing (both read as a lone run lease's is), one wait answers
    both before it returns. Not while a user's ``lock_released`` receiver would run in between.
    """
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
    """The body returned although the lease was lost (or released early by its own publish)."""
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
