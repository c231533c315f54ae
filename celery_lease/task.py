"""``LockedTask`` and ``@locked``: a Celery task body runs only while it holds a renewed lease.

Both forms share one engine (:func:`run_locked`) and the same options::

    @app.task(base=LockedTask, lock_key="account:{account_id}", lock_ttl="30s", lock_wait=0)
    def update_balance(account_id, amount): ...

    @app.task(bind=True)
    @locked(key="nightly-report", on_held="skip", cooldown="1h")
    def nightly_report(self): ...

The lease is taken where the task runs (so ``send_task``, beat, canvas and acks_late redelivery
all go through it), renewed by the process's renewer thread while the body runs, and released
when the body ends (before the result is stored), or kept for ``cooldown`` after a success.

While the body runs, ``self.request`` carries ``lock_key``, ``lock_token``, ``lock_waited``,
``lock_lost`` and ``lease``; :func:`celery_lease.get_lock_token` returns the token anywhere in
the call stack. These attributes are defined on :class:`celery.app.task.Context` itself, so they
are never re-sent as custom headers by ``retry()``, and they are always overwritten, so a message
header of the same name cannot forge them.

What each pool does when the lease is lost with ``on_lost="revoke"``:

- prefork (a child's main thread) and solo (the main thread): the renewer thread sends
  ``SIGUSR1`` to the main thread with ``signal.pthread_kill``; our handler raises
  ``LockLostError`` in the body at once (a blocking ``sleep`` or socket read is interrupted).
  The task ends in FAILURE with ``LockLostError``. In a prefork child, a body still running
  :data:`REVOKE_GRACE` seconds later (stuck in C code) gets its child terminated with ``SIGTERM``,
  as ``revoke(terminate=True)`` does: FAILURE with ``WorkerLostError`` (or a redelivery with
  ``acks_late`` + ``task_reject_on_worker_lost``).
- threads: ``PyThreadState_SetAsyncExc`` raises ``LockLostError`` in the task's thread when it
  next runs Python bytecode (not inside a blocking C call): FAILURE with ``LockLostError``.
- gevent: the task's greenlet is thrown ``LockLostError`` at its next switch (any I/O or sleep):
  FAILURE with ``LockLostError``. A CPU-bound greenlet also starves the renewer; fencing protects.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import signal
import sys
import threading
import types
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from celery import Task
from celery._state import _task_stack, get_current_app, get_current_task
from celery.app.task import Context
from celery.exceptions import Retry
from celery.signals import before_task_publish

from celery_lease import config, signals
from celery_lease import worker as _worker
from celery_lease.errors import LeaseConfigError, LockLostError, LockNotAcquiredError
from celery_lease.keys import KeyFunction, make_key_function, validate_template
from celery_lease.lease import Lease, _LeaseContext, lease
from celery_lease.options import (
    ON_HELD,
    ON_LOST,
    OPTIONS,
    LockOptions,
    retry_countdown,
    validate_options,
)
from celery_lease.stores.base import LockStore, store_from_url

__all__ = [
    "ON_HELD",
    "ON_LOST",
    "OPTIONS",
    "REVOKE_GRACE",
    "LockOptions",
    "LockedTask",
    "locked",
    "run_locked",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

REVOKE_GRACE = 2.0
"""Seconds a prefork child's body has to stop after ``LockLostError`` before it is terminated."""

# Request attributes, defined on Celery's Context class so that they are never treated as custom
# headers (retry() re-sends those) and always have a value.
Context.lock_key = None
Context.lock_token = None
Context.lock_waited = False
Context.lease = None
Context._lease_run = None
Context._lock_lost_mark = False


def _get_lock_lost(request: Any) -> bool:
    held = request.__dict__.get("lease")
    return bool(request.__dict__.get("_lock_lost_mark")) or (held is not None and held.lost)


def _set_lock_lost(request: Any, value: bool) -> None:
    request.__dict__["_lock_lost_mark"] = bool(value)


# A data descriptor: live from the lease (no lag behind the renewer), and a message header of
# the same name cannot shadow it.
Context.lock_lost = property(_get_lock_lost, _set_lock_lost)


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


# Interrupting a body whose lease is lost (on_lost="revoke") -----------------------------------


class _AsyncLockLost(LockLostError):
    """Raised inside a body by the interrupt; turned into ``LockLostError(key, reason)``."""

    def __init__(self, key: str = "?", reason: str = "lost") -> None:
        super().__init__(key, reason)


_main_thread_runs: list[_Run] = []
_signal_lock = threading.Lock()
_previous_sigusr1: Any = None
_our_signals = 0


def _on_sigusr1(signum: int, frame: types.FrameType | None) -> None:
    """SIGUSR1 in the main thread: raise in a lost body, or hand over to the previous handler."""
    global _our_signals
    with _signal_lock:
        ours = _our_signals > 0
        if ours:
            _our_signals -= 1
        target = next((r for r in reversed(_main_thread_runs) if r.due_interrupt()), None)
    if target is not None:
        raise _AsyncLockLost(target.key, "revoked")
    if not ours and callable(_previous_sigusr1):
        _previous_sigusr1(signum, frame)


def _install_sigusr1() -> bool:
    """Install our SIGUSR1 handler (main thread only); False where that is impossible."""
    global _previous_sigusr1
    if not hasattr(signal, "pthread_kill") or not hasattr(signal, "SIGUSR1"):
        return False
    current = signal.getsignal(signal.SIGUSR1)
    if current is not _on_sigusr1:
        _previous_sigusr1 = current
        signal.signal(signal.SIGUSR1, _on_sigusr1)
    return True


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


class _Run:
    """The state of one locked execution: who to interrupt and whether the body still runs."""

    def __init__(self, task: Any, request: Any, key: str, options: LockOptions) -> None:
        self.task = task
        self.request = request
        self.key = key
        self.options = options
        self.lease: Lease | None = None
        self.context: _LeaseContext | None = None
        self.released = False
        self._lock = threading.Lock()
        self._running = False
        self._fired = False
        self._delivered = False
        self._mode = ""
        self._target: Any = None

    # Called in the task's thread ---------------------------------------------------------------

    def start_body(self) -> None:
        """Prepare the interrupt of this thread or greenlet (``on_lost="revoke"``); mark running."""
        if self.options.on_lost == "revoke":
            if _gevent_patched():
                import gevent

                self._mode, self._target = "gevent", gevent.getcurrent()
            elif threading.current_thread() is threading.main_thread() and _install_sigusr1():
                self._mode, self._target = "signal", threading.main_thread().ident
                _main_thread_runs.append(self)
            else:
                self._mode, self._target = "thread", threading.get_ident()
        with self._lock:
            self._running = True

    def end_body(self) -> None:
        """The body returned or raised: no interrupt may land from now on."""
        with self._lock:
            self._running = False
            if self._mode == "thread" and self._fired and not self._delivered:
                self._delivered = True
                _set_async_exc(self._target, None)  # cancel it if not delivered yet
        if self._mode == "signal":
            with _signal_lock:
                if self in _main_thread_runs:
                    _main_thread_runs.remove(self)

    def due_interrupt(self) -> bool:
        """True once, when a fired interrupt should now raise in the body (signal handler)."""
        with self._lock:
            if self._running and self._fired and not self._delivered:
                self._delivered = True
                return True
            return False

    @property
    def interrupted(self) -> bool:
        """Whether this run fired an interrupt."""
        return self._fired

    # Called in the renewer thread --------------------------------------------------------------

    def on_lost(self, held: Lease) -> None:
        """The lease is lost: mark the request, send ``lock_lost``, run the hook, maybe revoke."""
        global _our_signals
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
        if self.options.on_lost != "revoke":
            return
        with self._lock:
            if not self._running or self._fired:
                return
            self._fired = True
            mode, target = self._mode, self._target
        logger.warning(
            "celery-lease: stopping %s[%s]: its lease on %r was lost (%s)",
            getattr(self.task, "name", self.task),
            getattr(self.request, "id", None),
            held.key,
            reason,
        )
        if mode == "thread":
            _set_async_exc(target, _AsyncLockLost)
        elif mode == "signal":
            with _signal_lock:
                _our_signals += 1
            signal.pthread_kill(target, signal.SIGUSR1)
            if _worker.in_pool_child():
                threading.Thread(
                    target=self._terminate_if_stuck, name="celery-lease-revoke", daemon=True
                ).start()
        elif mode == "gevent":
            import gevent

            gevent.get_hub().loop.run_callback(self._throw_into_greenlet)

    def _throw_into_greenlet(self) -> None:
        with self._lock:
            if not self._running or self._delivered:
                return
            self._delivered = True
        self._target.throw(_AsyncLockLost(self.key, "revoked"))

    def _terminate_if_stuck(self) -> None:
        import os
        import time

        deadline = time.monotonic() + REVOKE_GRACE
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return
            time.sleep(0.05)
        logger.error(
            "celery-lease: %s[%s] ignored LockLostError for %.1fs; terminating its process",
            getattr(self.task, "name", self.task),
            getattr(self.request, "id", None),
            REVOKE_GRACE,
        )
        os.kill(os.getpid(), signal.SIGTERM)

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
class _Spec:
    """What an execution needs from its task definition: options and the key function."""

    options: LockOptions
    key_function: KeyFunction


def run_locked(
    task: Any,
    request: Any,
    spec: _Spec,
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
        except _AsyncLockLost:
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


def _body_signature(run: Any, *, bound: bool) -> inspect.Signature | None:
    """The signature of a body as called (without ``self`` for a bound body), if it has one."""
    func = run.__func__ if isinstance(run, (staticmethod, classmethod)) else run
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if bound and not isinstance(run, staticmethod):
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


# LockedTask ----------------------------------------------------------------------------------


class LockedTask(Task):  # type: ignore[misc]
    """A Celery task whose body runs only while holding a lease (options: ``lock_<name>``).

    Options (class attributes, or keywords to ``@app.task(base=LockedTask, ...)``):

    - ``lock_key``: template (``"account:{account_id}"``), callable called as the task is and
      returning a str, or ``None`` (default: ``"<task name>:<digest of bound arguments>"``).
    - ``lock_ttl`` (default ``lease_default_ttl``, else 30 s), ``lock_wait`` (default
      ``lease_default_wait``, else 0), ``lock_max_hold`` (default none), ``lock_cooldown``
      (seconds the key stays taken after a success; default 0).
    - ``lock_store``: a ``LockStore``, a store URL, or ``None`` (the app's store).
    - ``lock_on_held``: ``"raise"`` (default), ``"skip"`` or ``"retry"``;
      ``lock_retry_countdown`` (default exponential from 1 s, jittered, capped at 60 s).
    - ``lock_on_lost``: ``"mark"`` (default) or ``"revoke"``.

    Unknown ``lock_*`` attributes and bad values raise :class:`LeaseConfigError` when the class
    is created. Override :meth:`on_lock_lost` and :meth:`on_lock_rejected` to react.
    """

    lock_key: Any = None
    lock_ttl: Any = None
    lock_wait: Any = None
    lock_max_hold: Any = None
    lock_cooldown: Any = None
    lock_store: Any = None
    lock_on_held: Any = None
    lock_retry_countdown: Any = None
    lock_on_lost: Any = None

    _lock_options: LockOptions = LockOptions()
    _lock_spec: _Spec | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr in list(cls.__dict__):
            if attr.startswith("lock_") and attr[5:] not in OPTIONS:
                raise LeaseConfigError(
                    f"{attr}={cls.__dict__[attr]!r} on task {cls._lock_where()} is not a lock"
                    f" option; the options are: {', '.join('lock_' + o for o in OPTIONS)}"
                )
        key = cls.__dict__.get("lock_key")
        if isinstance(key, types.FunctionType):
            cls.lock_key = staticmethod(key)  # called with the task's arguments, not bound
        cls._lock_configure()

    @classmethod
    def _lock_where(cls) -> str:
        return repr(cls.__dict__.get("name") or getattr(cls, "name", None) or cls.__qualname__)

    @classmethod
    def _lock_configure(cls) -> None:
        """Validate the ``lock_*`` options and the key template against the body's signature."""
        where = cls._lock_where()
        cls._lock_options = validate_options(
            {o: getattr(cls, f"lock_{o}") for o in OPTIONS}, where=f"task {where}", prefix="lock_"
        )
        cls._lock_spec = None
        key = cls._lock_options.key
        if isinstance(key, str):
            sig = cls._lock_body_signature()
            if sig is not None:
                validate_template(key, sig, task=where.strip("'"))

    @classmethod
    def _lock_body_signature(cls) -> inspect.Signature | None:
        run = inspect.getattr_static(cls, "run")
        if run is Task.__dict__.get("run"):
            return None
        return _body_signature(run, bound=True)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Re-validate options after Celery applied task annotations; expected errors at INFO."""
        super().on_bound(app)
        cls._lock_configure()
        if cls._lock_options.on_held in ("raise", "retry") and LockNotAcquiredError not in (
            cls.throws or ()
        ):
            cls.throws = (*(cls.throws or ()), LockNotAcquiredError)

    def _lock_get_spec(self) -> _Spec:
        cls = type(self)
        spec = cls.__dict__.get("_lock_spec")
        if spec is None:
            sig = inspect.signature(self.run)
            spec = _Spec(
                cls._lock_options,
                make_key_function(cls._lock_options.key, sig, task=self.name),
            )
            cls._lock_spec = spec
        return cast(_Spec, spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the lease (worker, eager and direct calls alike)."""
        top = self.request_stack.top
        # Called directly (task(...)) or recursively: push a request as Task.__call__ does.
        own_request = top is None or top.called_directly or top._lease_run is not None
        if own_request:
            _task_stack.push(self)
            self.push_request(args=args, kwargs=kwargs)
        try:
            request = self.request
            request._lease_run = True
            return run_locked(
                self,
                request,
                self._lock_get_spec(),
                args,
                kwargs,
                lambda: self.run(*args, **kwargs),
            )
        finally:
            if own_request:
                self.pop_request()
                _task_stack.pop()

    def on_lock_lost(self, lease: Lease) -> None:
        """Called once, from the renewer thread, when the running body's lease is lost."""

    def on_lock_rejected(self, key: str) -> None:
        """Called in the task's thread when ``key`` stayed held past ``wait`` (body not run)."""


# @locked -------------------------------------------------------------------------------------


def locked(
    *,
    key: str | Callable[..., str] | None = None,
    ttl: object = None,
    wait: object = None,
    max_hold: object = None,
    cooldown: object = None,
    store: str | LockStore | None = None,
    on_held: str = "raise",
    retry_countdown: object = None,
    on_lost: str = "mark",
) -> Callable[[F], F]:
    """Decorate a task function (below ``@app.task``) so that its body runs under a lease.

    Takes the options of :class:`LockedTask` as keywords (``key``, ``ttl``, ``wait``,
    ``max_hold``, ``cooldown``, ``store``, ``on_held``, ``retry_countdown``, ``on_lost``), with
    the same defaults. Works with ``bind=True`` (the key is built from the arguments after
    ``self``) and without. Options and templates are checked here, at decoration time.

    Raises:
        LeaseConfigError: naming the option, the value and what is allowed.
    """
    raw = {
        "key": key,
        "ttl": ttl,
        "wait": wait,
        "max_hold": max_hold,
        "cooldown": cooldown,
        "store": store,
        "on_held": on_held,
        "retry_countdown": retry_countdown,
        "on_lost": on_lost,
    }

    def decorate(func: F) -> F:
        where = getattr(func, "__qualname__", repr(func))
        options = validate_options(raw, where=f"@locked {where}")
        full = inspect.signature(func)
        if isinstance(options.key, str):
            validate_template(options.key, full, task=where)
        specs: dict[tuple[str, bool], _Spec] = {}

        def spec_for(name: str, bound: bool) -> _Spec:
            spec = specs.get((name, bound))
            if spec is None:
                sig = _body_signature(func, bound=bound) or full
                spec = specs[(name, bound)] = _Spec(
                    options, make_key_function(options.key, sig, task=name)
                )
            return spec

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            task = get_current_task()
            bound = task is not None and bool(args) and args[0] is task
            key_args = args[1:] if bound else args
            request = task.request if task is not None else None
            name = task.name if task is not None else f"{func.__module__}.{func.__qualname__}"
            return run_locked(
                task,
                request,
                spec_for(name, bound),
                key_args,
                kwargs,
                lambda: func(*args, **kwargs),
            )

        wrapper.__signature__ = full  # type: ignore[attr-defined]  # Celery ignores __wrapped__
        return cast(F, wrapper)

    return decorate
