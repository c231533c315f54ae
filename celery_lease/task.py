"""``LockedTask`` and ``@locked``: a Celery task body runs only while it holds a renewed lease.

Both forms share one engine (:func:`celery_lease.engine.run_locked`) and the same options::

    @app.task(base=LockedTask, lock_key="account:{account_id}", lock_ttl="30s", lock_wait=0)
    def update_balance(account_id, amount): ...

    @app.task(bind=True)
    @locked(key="nightly-report", on_held="skip", cooldown="1h")
    def nightly_report(self): ...

The lease is taken where the task runs (so ``send_task``, beat, canvas and acks_late redelivery
all go through it), renewed by the process's renewer thread while the body runs, and released
when the body ends (before the result is stored), or kept for ``cooldown`` after a success.

While the body runs, ``self.request`` carries ``lock_key``, ``lock_token``, ``lock_waited``,
``lock_lost`` and ``lease`` (see :mod:`celery_lease.request`); :func:`celery_lease.get_lock_token`
returns the token anywhere in the call stack. What each pool does when the lease is lost with
``on_lost="revoke"`` is described in :mod:`celery_lease.interrupt`.

This module is the thin Celery-facing layer: options, validation at class creation and
decoration time, and the ``__call__`` that hands each execution to the engine.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

from celery import Task
from celery._state import _task_stack, get_current_task

from celery_lease.engine import Spec as _Spec
from celery_lease.engine import run_locked
from celery_lease.errors import LeaseConfigError, LockNotAcquiredError
from celery_lease.interrupt import REVOKE_GRACE
from celery_lease.keys import make_key_function, validate_template
from celery_lease.lease import Lease
from celery_lease.options import (
    ON_HELD,
    ON_LOST,
    OPTIONS,
    LockOptions,
    validate_options,
)
from celery_lease.stores.base import LockStore

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

F = TypeVar("F", bound=Callable[..., Any])


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
