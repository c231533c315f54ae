"""The run engine: one locked execution of a task body, and the publish hook for retries.

:func:`run_locked` is what :class:`~celery_lease.LockedTask` and :func:`~celery_lease.locked`
both call: it builds the key, takes the lease (waiting as configured), sets the request
attributes, runs the body, applies the ``on_held`` / ``on_lost`` policies and releases the lease
(or keeps it for ``cooldown``) before the result is stored. A running task that publishes a
message with its own id (``retry()``, ``replace()``) releases its lease first, in a
``before_task_publish`` receiver, so the new copy never finds its own lease held.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery._state import get_current_app
from celery.app.task import Context
from celery.exceptions import Retry
from celery.signals import before_task_publish

from celery_lease import config, signals
from celery_lease import request as _request  # noqa: F401  (defines the request attributes)
from celery_lease import worker as _worker
from celery_lease.errors import LockLostError, LockNotAcquiredError
from celery_lease.interrupt import AsyncLockLost, Interrupter
from celery_lease.keys import KeyFunction
from celery_lease.lease import Lease, _LeaseContext, lease
from celery_lease.options import LockOptions, retry_countdown
from celery_lease.stores.base import LockStore, store_from_url

__all__ = ["Spec", "run_locked"]

logger = logging.getLogger(__name__)


# Stores --------------------------------------------------------------------------------------

_url_stores: dict[str, LockStore] = {}


def _store_for(option: str | LockStore | None, app: Any) -> LockStore:
    """The store of an execution: the task's option (URL resolved once per process) or the app's."""
    if option is None:
        return config.get_store(app)
    if isinstance(option, str):
        return config.cached(_url_stores, option, lambda: store_from_url(option))
    return option


def _forget_url_stores() -> None:
    _url_stores.clear()


_worker.on_process_reset(_forget_url_stores)


# One execution -------------------------------------------------------------------------------


class _Run:
    """The state of one locked execution: its lease, its interrupter, whether it was released."""

    def __init__(self, task: Any, request: Any, key: str, options: LockOptions) -> None:
        self.task = task
        self.request = request
        self.key = key
        self.options = options
        self.lease: Lease | None = None
        self.context: _LeaseContext | None = None
        self.released = False
        describe = f"{getattr(task, 'name', task)}[{getattr(request, 'id', None)}]"
        self.interrupter = Interrupter(key, describe)

    def start_body(self) -> None:
        """Prepare the interrupt (``on_lost="revoke"``) and mark the body running."""
        if self.options.on_lost == "revoke":
            self.interrupter.start()

    def end_body(self) -> None:
        """The body returned or raised: no interrupt may land from now on."""
        if self.options.on_lost == "revoke":
            self.interrupter.end()

    @property
    def interrupted(self) -> bool:
        """Whether this run fired an interrupt."""
        return self.interrupter.fired

    # Called in the renewer thread --------------------------------------------------------------

    def on_lost(self, held: Lease) -> None:
        """The lease is lost: mark the request, send ``lock_lost``, run the hook, maybe revoke."""
        self.request.lock_lost = True
        reason = held.lost_reason or "lost"
        signals.send(
            signals.lock_lost,
            self.task,
            key=held.key,
            token=held.token,
            reason=reason,
            task_id=getattr(self.request, "id", None),
        )
        hook = getattr(self.task, "on_lock_lost", None)
        if hook is not None:
            try:
                hook(held)
            except Exception:
                logger.exception("celery-lease: on_lock_lost of %s raised", self.task.name)
        if self.options.on_lost == "revoke":
            self.interrupter.fire(reason)

    # Release ------------------------------------------------------------------------------------

    def release(self, exc: BaseException | None) -> None:
        """Release the lease (or keep it for cooldown after success), once; send lock_released."""
        if self.released or self.context is None or self.lease is None:
            return
        self.released = True
        held = self.lease
        held_seconds = held.held_seconds
        try:
            if exc is None:
                self.context.__exit__(None, None, None)
            else:
                self.context.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            # A lost lease was not ours to release any more: lock_lost already said so.
            if not self.context._reentered and not held.lost:
                signals.send(
                    signals.lock_released,
                    self.task,
                    key=held.key,
                    token=held.token,
                    held_seconds=held_seconds,
                    task_id=getattr(self.request, "id", None),
                )


_active: ContextVar[tuple[_Run, ...]] = ContextVar("celery_lease_runs", default=())


def _release_before_retry(headers: Mapping[str, Any] | None = None, **_: Any) -> None:
    """A running locked task publishes a message with its own id (``retry()``, ``replace()``):
    release its lease first, so the new message can never find its own lease still held."""
    runs = _active.get()
    if not runs or not headers:
        return
    task_id = headers.get("id")
    for run in reversed(runs):
        if task_id is not None and getattr(run.request, "id", None) == task_id:
            _release_quietly(run)


before_task_publish.connect(
    _release_before_retry, weak=False, dispatch_uid="celery_lease.release_before_retry"
)


def _release_quietly(run: _Run) -> None:
    with contextlib.suppress(LockLostError):  # lost before the retry: nothing left to release
        run.release(_RELEASE_FOR_RETRY)


class _ReleasedForRetry(Exception):
    """Marks a release done because the task is re-sending itself (never a cooldown)."""


_RELEASE_FOR_RETRY = _ReleasedForRetry()


# The engine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What an execution needs from its task definition: options and the key function."""

    options: LockOptions
    key_function: KeyFunction


def run_locked(
    task: Any,
    request: Any,
    spec: Spec,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    body: Callable[[], Any],
) -> Any:
    """Run ``body`` under the lease of this execution and apply the policies.

    Args:
        task: the Task object (signal sender; ``retry()``, hooks), or ``None`` outside Celery.
        request: the execution's request (a ``Context``), or ``None``.
        spec: the task's validated options and key function.
        args, kwargs: the arguments the key is built from (as the task is called).
        body: runs the task's body.
    """
    options = spec.options
    app = task.app if task is not None else get_current_app()
    settings = config.get_settings(app)
    key = settings.key_prefix + spec.key_function(args, kwargs)
    store = _store_for(options.store, app)
    if request is not None:
        request.lock_key = key
        request.lock_token = None
        request.lock_waited = False
        request.lock_lost = False
        request.lease = None
    run = _Run(task, request if request is not None else Context(), key, options)
    context = lease(
        key,
        store=store,
        ttl=config.pick(options.ttl, settings.default_ttl, config.BUILTIN_TTL),
        wait=config.pick(options.wait, settings.default_wait, config.BUILTIN_WAIT),
        max_hold=options.max_hold,
        cooldown=options.cooldown,
        on_lost=run.on_lost,
    )
    try:
        held = context.__enter__()
    except LockNotAcquiredError as exc:
        return _on_held(task, request, key, options, exc)
    run.context, run.lease = context, held
    if request is not None:
        request.lock_token = held.token
        request.lock_waited = held.waited
        request.lease = held
    if not context._reentered:
        signals.send(
            signals.lock_acquired,
            task,
            key=key,
            token=held.token,
            waited=held.waited,
            wait_seconds=held.wait_seconds,
            task_id=getattr(request, "id", None),
        )
    runs_token = _active.set((*_active.get(), run))
    try:
        try:
            run.start_body()
            try:
                result = body()
            finally:
                run.end_body()
        except AsyncLockLost:
            if not run.interrupted:
                raise  # an outer run's interrupt
            lost = LockLostError(key, held.lost_reason or "lost")
            run.release(lost)
            raise lost from None
        except Retry:
            _release_quietly(run)  # eager retries publish nothing; a lost lease still retries
            raise
        except BaseException as exc:
            run.release(exc)  # raises LockLostError from exc when the lease was lost
            raise
    finally:
        _active.reset(runs_token)
        if request is not None:
            request.lock_lost = held.lost
    run.release(None)
    if held.lost and request is not None:
        request.lock_lost = True
    if held.lost:
        logger.warning(
            "celery-lease: %s[%s] succeeded although its lease on %r was lost (%s)",
            getattr(task, "name", "?"),
            getattr(request, "id", None),
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
        return None
    if policy == "retry" and task is not None and request is not None:
        retries = int(getattr(request, "retries", 0) or 0)
        raise task.retry(countdown=retry_countdown(options, retries), exc=exc)
    raise exc
