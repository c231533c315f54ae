"""The run engine: one locked execution of a task body, and the publish hook for retries.

:func:`run_locked` is what :class:`~celery_lease.LockedTask` and :func:`~celery_lease.locked`
both call: it builds the key, takes the lease (waiting as configured), sets the request
attributes, runs the body, applies the ``on_held`` / ``on_lost`` policies and releases the lease
(or keeps it for ``cooldown``) before the result is stored.

Loss: ``lock_lost`` and ``on_lock_lost`` are user code and run on the core's dispatcher thread
(a plain loss listener); the ``on_lost="revoke"`` interrupt is an immediate listener, run on the
thread that recorded the loss. Neither runs on the renewer or the watchdog.

Early release: a running task that publishes a message with its own id (``retry()``,
``replace()``, ``apply_async(task_id=self.request.id)``) releases its lease first, in a
``before_task_publish`` receiver, so the new copy never finds its own lease held. The lease is
then lost with reason ``"released"``: the body, if it runs on, reads ``request.lock_lost`` True
and ``check()`` raises; ``lock_released`` is sent (once), ``lock_lost`` and ``on_lock_lost`` are
not (the holder let go itself), and no interrupt is fired from the publish (the usual
``raise self.retry()`` must end in RETRY). ``LockedTask.retry(throw=False)`` with
``on_lost="revoke"`` raises the ``Retry`` instead of letting the body run on.

Deferred release replies: see :mod:`celery_lease._celery.deferral`.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, cast

from celery.exceptions import Ignore, Retry
from celery.signals import before_task_publish

from celery_lease import signals
from celery_lease._celery import compat, deferral
from celery_lease._celery import request as _request  # defines the request attributes
from celery_lease._celery import settings as config
from celery_lease._celery import unique as _unique
from celery_lease._celery.interrupt import AsyncLockLost, Interrupter
from celery_lease._celery.spec import Spec
from celery_lease._celery.store_resolution import store_for
from celery_lease._core.lease import Lease, LeaseContext, conforms, lease
from celery_lease._core.options import LockOptions, retry_countdown
from celery_lease._core.owners import MAX_FIELD_CHARS
from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.errors import LockLostError, LockNotAcquiredError
from celery_lease.stores.base import LockStore, SupportsDeferredRelease

__all__ = ["adopt_request", "current_run", "run_locked"]

logger = logging.getLogger("celery_lease.engine")


# One execution -------------------------------------------------------------------------------


class _Run:
    """The state of one locked execution: its lease, requests, interrupter, how it ended.

    ``requests`` are the requests this execution's body may see: the one the worker's tracer
    pushed (or the one a direct call pushed), plus any that ``Task.__call__`` pushes further
    down the class order (:func:`adopt_request`). The lock attributes are set on all of them.
    ``task_id`` is the id of the execution (``None`` for a direct call): a message published
    with it re-sends this execution.
    """

    def __init__(self, task: Any, request: Any, key: str, options: LockOptions) -> None:
        self.task = task
        self.task_id: str | None = getattr(request, "id", None) if request is not None else None
        self.requests: list[Any] = []
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

    def adopt(self, request: Any) -> None:
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
        if not context._reentered and context.on_lost is None:
            held.add_loss_listener(self.on_lost)  # else the context attached it at acquire

    def start_body(self) -> None:
        """Prepare the interrupt (``on_lost="revoke"``) and mark the body running.

        The listener is added first: a lease lost already fires at once, before ``start()``,
        and ``start()`` then raises ``AsyncLockLost`` (the body must not run).
        """
        interrupter = self.interrupter
        if interrupter is not None and self.context is not None:
            if not self.context._reentered:
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
        if held._released_early or self.interrupter is None:
            return  # the loss is this execution's own early release (its record won)
        self.interrupter.fire(reason)

    def on_lost(self, held: Lease) -> None:
        """Dispatched listener (the core's dispatcher thread): ``lock_lost`` and ``on_lock_lost``.

        Not for an early release (``"released"``): the holder released the key itself, and
        ``lock_released`` says so.
        """
        reason = held.lost_reason or "lost"
        if held._released_early:
            # This execution let go itself ("released" by its own retry/publish). Not
            # ``self.released_early``: that is set before the early release is recorded, and a
            # real loss recorded just before it must still be reported.
            return
        signals.send(
            signals.lock_lost,
            self.task,
            key=held.key,
            token=held.token,
            reason=reason,
            task_id=self.task_id,
        )
        hook = getattr(self.task, "on_lock_lost", None)
        if hook is not None:
            try:
                hook(held)
            except Exception:
                logger.exception(
                    "celery-lease: on_lock_lost of %s raised", getattr(self.task, "name", "?")
                )

    # Release ------------------------------------------------------------------------------------

    def _send_released(self, held: Lease, held_seconds: float) -> None:
        if not signals.lock_released.receivers:
            return
        signals.send(
            signals.lock_released,
            self.task,
            key=held.key,
            token=held.token,
            held_seconds=held_seconds,
            task_id=self.task_id,
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
        if context._reentered:
            return
        held_seconds = held.held_seconds
        self.released_early = True
        if context.release_early("released"):
            self._send_released(held, held_seconds)

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
            if not context._reentered and not held.lost:
                self._send_released(held, held_seconds)


_active: ContextVar[tuple[_Run, ...]] = ContextVar("celery_lease_runs", default=())


def current_run(task_id: str | None) -> _Run | None:
    """The innermost running execution (in this context) with ``task_id``, if any."""
    if task_id is None:
        return None
    for run in reversed(_active.get()):
        if run.task_id == task_id:
            return run
    return None


def adopt_request(task: Any, request: Any) -> None:
    """``task`` pushed ``request`` (``Task.__call__`` further down the class order): if the
    innermost execution of ``task`` waits for the request its body will see, set the lock
    attributes on it. Called by ``LockedTask.push_request``."""
    runs = _active.get()
    if runs:
        run = runs[-1]
        if run.awaiting_request and run.task is task:
            run.awaiting_request = False
            run.adopt(request)


def _release_before_publish(
    headers: Mapping[str, Any] | None = None, body: Any = None, **_: Any
) -> None:
    """A running locked task publishes a message with its own id (``retry()``, ``replace()``,
    ``apply_async(task_id=...)``): release its lease first (early), so the new message can
    never find its own lease still held.

    The id is in the headers (task protocol 2) or in the body (``task_protocol = 1``).
    Any deferred release of this process is answered first (see the module docstring).
    """
    if deferral.deferring:
        deferral.flush_deferred_releases()
    runs = _active.get()
    if not runs:
        return
    task_id = headers.get("id") if headers else None
    if task_id is None and isinstance(body, Mapping):
        task_id = body.get("id")
    if task_id is None:
        return
    for run in reversed(runs):
        if run.task_id == task_id:
            run.release_early()


before_task_publish.connect(
    _release_before_publish, weak=False, dispatch_uid="celery_lease.release_before_retry"
)


def _release_quietly(run: _Run) -> None:
    with contextlib.suppress(LockLostError):  # lost before the retry: nothing left to release
        run.release(_RELEASE_FOR_RETRY)


def _publishes_nothing(task: Any, request: Any) -> bool:
    """:func:`~celery_lease._celery.deferral.publishes_nothing`, and not a nested run (its caller
    goes
    on after it)."""
    return not _active.get() and deferral.publishes_nothing(task, request)


class _ReleasedForRetry(Exception):
    """Marks a release done because the task is re-sending itself (never a cooldown)."""


_RELEASE_FOR_RETRY = _ReleasedForRetry()


# The engine ----------------------------------------------------------------------------------


def run_locked(
    task: Any,
    request: Any,
    spec: Spec,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    body: Callable[[], Any],
    *,
    adopt: bool = False,
) -> Any:
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
    return text[:MAX_FIELD_CHARS]


def _run_locked(
    task: Any,
    request: Any,
    spec: Spec,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    body: Callable[[], Any],
    adopt: bool,
) -> Any:
    options = spec.options
    app = task.app if task is not None else compat.get_current_app()
    settings = config.get_settings(app)
    if request is not None:  # overwrite what a message header may have put there
        request.lock_key = None
        request.lock_token = None
        request.lock_waited = False
        request.lease = None
    key = settings.key_prefix + spec.key_function(args, kwargs)
    run = _Run(task, request, key, options)
    ttl, wait = spec.durations(settings)
    store = store_for(options.store, app)
    if hasattr(type(store), "aclose"):  # an AsyncLockStore: a task holds it through .sync
        from celery_lease._core import aio

        store = aio.split_async_store(store)[1]
    if not conforms(store, LockStore):
        lease(key, store=store)  # raises the error lease() gives for it
    # lease() without its checks: the key is a non-empty str (key functions guarantee it), the
    # durations and the store were validated when the task (and the settings) were read.
    # run.on_lost goes in as the context's on_lost: attached to a lease it acquires before the
    # renewer knows it (no lock round), never to a re-entered one (the enclosing holder's).
    # The owner id names the node, the task and the execution (celery_lease._core.owners).
    context = LeaseContext(
        key,
        store,
        ttl,
        wait,
        options.max_hold,
        options.cooldown,
        run.on_lost,
        None,
        SYSTEM_CLOCK,
        node=_described(getattr(request, "hostname", None) if request is not None else None),
        task=_described(getattr(task, "name", None)),
        task_id=_described(run.task_id),
    )
    try:
        held = context.__enter__()
    except LockNotAcquiredError as exc:
        if options.unique is not None:
            # Its queued key, if any; a second delivery of its own running copy is re-sent
            # for later and ends here (Ignore), whatever on_held says.
            _unique.on_rejected(
                request, store, key, settings, task=task, ttl=ttl, policy=options.on_held
            )
        return _on_held(task, request, key, options, exc)
    runs_token = None
    queued = None  # an until_done copy's queued lease, kept while the body runs
    try:
        try:
            # Held from here: whatever raises before the body (a lock_acquired receiver raising
            # a BaseException, which Celery's robust send lets through; an asynchronous
            # exception) releases it below.
            run.acquired(context, held)
            if options.unique is not None and request is not None:
                queued = _unique.on_start(
                    task, request, store, key, settings, options.unique, ttl, options.cooldown
                )
            if signals.lock_acquired.receivers and not context._reentered:
                signals.send(
                    signals.lock_acquired,
                    task,
                    key=key,
                    token=held.token,
                    waited=held.waited,
                    wait_seconds=held.wait_seconds,
                    task_id=run.task_id,
                )
            runs_token = _active.set((*_active.get(), run))
            run.start_body()
            run.awaiting_request = adopt
            try:
                result = body()
            finally:
                run.awaiting_request = False
                run.end_body()
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
        if settings.defer_release and _publishes_nothing(task, request):
            deferral.defer_on(context)
        run.release(None)
    else:
        # The queued key's release follows on this thread. Where the store can, both go out
        # without waiting, in order on one connection (QueuedHold.end never lets the queued
        # key's overtake the run lease's); then, unless this execution publishes nothing (both
        # read as a lone run lease's is), one wait answers both before it returns. Not while a
        # user's lock_released receiver would run in between.
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
                if sent and not _publishes_nothing(task, request):
                    cast(SupportsDeferredRelease, context.store).flush_deferred()
    if not held.lost:
        return result
    if run.released_early:
        logger.info(
            "celery-lease: %s[%s] went on after releasing its lease on %r early (it re-sent"
            " its own id)",
            getattr(task, "name", "?"),
            run.task_id,
            key,
        )
    else:
        logger.warning(
            "celery-lease: %s[%s] succeeded although its lease on %r was lost (%s)",
            getattr(task, "name", "?"),
            run.task_id,
            key,
            held.lost_reason,
        )
    return result


def _on_held(
    task: Any, request: Any, key: str, options: LockOptions, exc: LockNotAcquiredError
) -> Any:
    signals.send(signals.lock_rejected, task, key=key, task_id=getattr(request, "id", None))
    hook = getattr(task, "on_lock_rejected", None)
    if hook is not None:
        hook(key)
    policy = options.on_held
    if policy == "skip":
        logger.info(
            "celery-lease: %s[%s] skipped: %r is held by another execution",
            getattr(task, "name", "?"),
            getattr(request, "id", None),
            key,
        )
        if _marks_skipped(task, request):
            _mark_skipped(task, request, key)  # raises Ignore: the REVOKED state stays
        return None
    if policy == "retry" and task is not None and request is not None:
        retries = int(getattr(request, "retries", 0) or 0)
        raise task.retry(countdown=retry_countdown(options, retries), exc=exc)
    raise exc


# A skipped run, visible as skipped ---------------------------------------------------------

skip_quietly: ContextVar[bool] = ContextVar("celery_lease_skip_quietly", default=False)
"""True while a ``@locked`` helper that is not its task's body runs (set by
:func:`celery_lease.locked`): a skip there returns ``None`` to the calling body, which goes on,
instead of marking the whole execution skipped."""


def _marks_skipped(task: Any, request: Any) -> bool:
    """Whether a skip ends a worker execution (marked REVOKED) rather than returning ``None``.

    Only the execution's own body: not a direct call, an eager run (``apply()``, ``always
    eager``), a ``@locked`` helper called from a body, nor a run nested in another locked run of
    the same execution.
    """
    if task is None or request is None or getattr(request, "id", None) is None:
        return False
    if getattr(request, "called_directly", True) or getattr(request, "is_eager", False):
        return False
    return not skip_quietly.get() and current_run(request.id) is None


def _mark_skipped(task: Any, request: Any, key: str) -> None:
    """End a skipped worker execution as REVOKED, with a reason that says skipped.

    Stored in the result backend as Celery stores a revoked task (``AsyncResult.get()`` raises
    ``TaskRevokedError(reason)`` at once), announced with a ``task-revoked`` event (Flower shows
    the task REVOKED), then ``Ignore`` so that the tracer stores nothing over it and the message
    is acknowledged. A backend error propagates (the run then fails, never a silent success); a
    failed event is logged. The event goes out from the process that ran the task, as
    ``Task.send_event`` sends it (Celery's own ``task-revoked`` comes from the main process,
    which never learns of this one), also when the worker runs without ``-E`` (Flower turns
    events on remotely, and the pool process cannot tell); ``send_events = False`` on the task
    turns it off.
    """
    reason = f"skipped: {key!r} held by another execution (on_held='skip')"
    if compat.get_actual_ignore_result is not None:
        ignore_result = bool(compat.get_actual_ignore_result(task, request))
    else:  # an older Celery without the helper
        ignore_result = bool(getattr(request, "ignore_result", False) or task.ignore_result)
    task.backend.mark_as_revoked(
        request.id,
        reason,
        request=request,
        store_result=not ignore_result or bool(task.store_errors_even_if_ignored),
    )
    if task.send_events:
        try:
            task.send_event(
                "task-revoked", terminated=False, signum=None, expired=False, reason=reason
            )
        except Exception:
            logger.warning(
                "celery-lease: could not send task-revoked for skipped %s[%s]",
                getattr(task, "name", "?"),
                request.id,
                exc_info=True,
            )
    raise Ignore(reason)
