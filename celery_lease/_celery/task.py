"""``LockedTask`` and ``@locked``: their options, validation and the ``__call__`` that hands
each execution to the engine (:mod:`~celery_lease._celery.execution`). Guide: ``docs/celery.md``.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

from celery import Task
from celery.exceptions import Retry
from celery.result import AsyncResult

from celery_lease._celery import compat, wiring
from celery_lease._celery import unique as _unique
from celery_lease._celery.execution import adopt_request, current_run, run_locked
from celery_lease._celery.interrupt import REVOKE_GRACE
from celery_lease._celery.on_held import skip_quietly
from celery_lease._celery.request import is_claimed as _is_claimed
from celery_lease._celery.spec import Spec as _Spec
from celery_lease._celery.spec import register_spec_of_task
from celery_lease._core.keys import make_key_function, validate_template
from celery_lease._core.lease import Lease
from celery_lease._core.options import ON_HELD, ON_LOST, OPTIONS, LockOptions, validate_options
from celery_lease.errors import LeaseConfigError, LockLostError, LockNotAcquiredError
from celery_lease.stores.base import LockStore
from celery_lease.types import Duration, OnDuplicate, OnHeld, OnLost, Unique

if TYPE_CHECKING:
    from pydantic import BaseModel

    from celery_lease._celery.protocols import CeleryApp, CeleryTask

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

wiring.install()  # Celery's signals, the request attributes, `inspect leases`: before any fork

F = TypeVar("F", bound=Callable[..., object])

# Call arguments to the arguments the body receives.
_Validate = Callable[
    [tuple[object, ...], Mapping[str, object]], tuple[tuple[object, ...], dict[str, object]]
]


def _body_signature(run: object, *, bound: bool) -> inspect.Signature | None:
    """The signature of a body as called (without ``self`` for a bound body), if it has one."""
    func = run.__func__ if isinstance(run, (staticmethod, classmethod)) else run
    try:
        sig = inspect.signature(cast("Callable[..., object]", func))  # else TypeError: None
    except (TypeError, ValueError):
        return None
    if bound and not isinstance(run, staticmethod):
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


def _model_annotation(annotation: object, value: object) -> type[BaseModel] | None:
    """The pydantic model class Celery validates ``value`` with for ``annotation``, or None."""
    from pydantic import BaseModel

    if value is not None and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(others) == 1:
            annotation = others[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _pydantic_validator(cls: type, task: CeleryTask) -> _Validate | None:
    """For a ``pydantic=True`` task (else ``None``): turn call arguments into the models Celery's
    ``pydantic_wrapper`` passes the body, so the key is built from them. Uses the wrapper's
    helpers (5.7), else validates as Celery does (5.6: resolved hints; 5.5: raw ones). A failing
    argument is keyed as it came (the body then raises)."""
    run = inspect.getattr_static(cls, "run", None)
    bound = not isinstance(run, staticmethod)
    func = run.__func__ if isinstance(run, (staticmethod, classmethod)) else run
    free = compat.pydantic_wrapper_closure(func)
    if free is None:
        return None
    signature = free.get("task_signature") or inspect.signature(func)
    get_model = free.get("get_argument_model")
    validate_argument = free.get("validate_argument")
    hints = free.get("type_hints") or {}
    strict = bool(free.get("strict", False))
    context = {**(free.get("context") or {}), "celery_app": task.app, "celery_task_name": task.name}

    def model_for(name: str, value: object) -> type[BaseModel] | None:
        if get_model is not None:
            return get_model(name, value)
        annotation = hints.get(name, signature.parameters[name].annotation)
        return _model_annotation(annotation, value)

    def validate_one(model: type[BaseModel], value: object) -> object:
        if validate_argument is not None:
            return validate_argument(model, value)
        return model.model_validate(value, strict=strict, context=context)

    def validate(
        args: tuple[object, ...], kwargs: Mapping[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        try:
            bound_args = (
                signature.bind(task, *args, **kwargs) if bound else signature.bind(*args, **kwargs)
            )
        except TypeError:
            return args, dict(kwargs)  # the key function raises the call's own TypeError
        for name, value in list(bound_args.arguments.items()):
            if bound and name == next(iter(signature.parameters)):
                continue  # self
            try:
                model = model_for(name, value)
                if model is not None:
                    bound_args.arguments[name] = validate_one(model, value)
            except Exception:  # keyed as it came; the body's validation raises the error
                continue
        positional = tuple(bound_args.args)
        return (positional[1:] if bound else positional), dict(bound_args.kwargs)

    return validate


class LockedTask(Task):  # type: ignore[misc]
    """A Celery task whose body runs only while holding a lease.

    Options are the ``lock_<name>`` attributes below, as class attributes or
    ``@app.task(base=LockedTask, ...)`` keywords (``lock_key`` ``None``: ``"<task name>:<digest
    of arguments>"``); defaults and meaning: ``docs/celery.md#options``. Unknown ``lock_*``
    attributes and bad values raise :class:`LeaseConfigError` when the class is created.
    Override :meth:`on_lock_lost` and :meth:`on_lock_rejected` to react.
    """

    # Typed for subclasses (``lock_on_held = "skp"`` is a mypy error there); ``None``: unset.
    lock_key: str | Callable[..., str] | None = None
    lock_ttl: Duration | None = None
    lock_wait: Duration | None = None
    lock_max_hold: Duration | None = None
    lock_cooldown: Duration | None = None
    lock_store: str | LockStore | None = None
    lock_on_held: OnHeld | None = None
    lock_retry_countdown: Duration | None = None
    lock_on_lost: OnLost | None = None
    lock_limit: int | Callable[..., int] | None = None
    lock_unique: Unique | None = None
    lock_on_duplicate: OnDuplicate | None = None
    lock_queue_ttl: Duration | None = None
    lock_debounce: Duration | None = None
    lock_debounce_max: Duration | None = None

    _lock_options: LockOptions = LockOptions()
    _lock_spec: _Spec | None = None
    _lock_calls_through = False
    """Whether another class in the MRO defines ``__call__`` (run it under the lease)."""
    _lock_call_is_ours = True
    """Whether ``__call__`` is LockedTask's: a call reaches ``run_locked`` (none before it may
    answer without it)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
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
        limit = cls.__dict__.get("lock_limit")
        if isinstance(limit, types.FunctionType):
            cls.lock_limit = staticmethod(limit)  # as lock_key
        cls._lock_calls_through = any(
            "__call__" in vars(klass)
            for klass in cls.__mro__
            if klass not in (LockedTask, Task, object)
        )
        cls._lock_call_is_ours = cls.__call__ is LockedTask.__call__
        cls._lock_configure()

    @classmethod
    def _lock_where(cls) -> str:
        return repr(cls.__dict__.get("name") or getattr(cls, "name", None) or cls.__qualname__)

    @classmethod
    def _lock_configure(cls) -> None:
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
    def on_bound(cls, app: CeleryApp) -> None:
        """Re-validate after Celery applied task annotations; expected errors at INFO."""
        super().on_bound(app)
        cls._lock_configure()
        raises = cls._lock_options.on_held in ("raise", "retry", "replace")
        if raises and LockNotAcquiredError not in (cls.throws or ()):
            cls.throws = (*(cls.throws or ()), LockNotAcquiredError)

    def _lock_get_spec(self) -> _Spec:
        cls = type(self)
        spec = cls.__dict__.get("_lock_spec")
        if spec is None:
            sig = inspect.signature(self.run)
            key_function = make_key_function(cls._lock_options.key, sig, task=self.name)
            validate = _pydantic_validator(cls, self)
            limit = cls._lock_options.limit
            if validate is not None:
                by_arguments = key_function

                def key_function(args: tuple[object, ...], kwargs: Mapping[str, object]) -> str:
                    return by_arguments(*validate(args, kwargs))

                if callable(limit):
                    limit_of = limit

                    def limit(*args: object, **kwargs: object) -> int:  # the body's arguments
                        valid_args, valid_kwargs = validate(args, kwargs)
                        return limit_of(*valid_args, **valid_kwargs)

            plain = validate is None and not callable(cls._lock_options.key)
            spec = _Spec(cls._lock_options, key_function, limit, plain_key=plain)
            cls._lock_spec = spec
        return cast(_Spec, spec)

    def __call__(self, *args: object, **kwargs: object) -> Any:  # Any: what the body returns
        """Run the body under the lease (worker, eager and direct calls alike), around the rest
        of the MRO: a mixin's ``__call__`` after ``LockedTask`` runs once, inside it. The key
        is built from the arguments received here (after pydantic validation)."""
        top = self.request_stack.top
        # The tracer's (or apply()'s) request, unclaimed (no message header can carry the mark).
        claimed = top is not None and not top.called_directly and not _is_claimed(top)
        cls = type(self)
        spec = cls.__dict__.get("_lock_spec") or self._lock_get_spec()
        if cls._lock_calls_through:
            return run_locked(
                self,
                top if claimed else None,
                spec,
                args,
                kwargs,
                functools.partial(super().__call__, *args, **kwargs),
                adopt=True,
                unclaimed=claimed,
            )
        if claimed:
            body = functools.partial(self.run, *args, **kwargs)
            return run_locked(self, top, spec, args, kwargs, body, unclaimed=True)
        # Called directly (task(...)) or recursively: push a request as Task.__call__ does.
        compat.task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            body = functools.partial(self.run, *args, **kwargs)
            return run_locked(self, self.request, spec, args, kwargs, body)
        finally:
            self.pop_request()
            compat.task_stack.pop()

    def apply_async(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        task_id: str | None = None,
        producer: object = None,
        link: object = None,
        link_error: object = None,
        shadow: str | None = None,
        **options: Any,  # Celery's publish options: values of any kind
    ) -> AsyncResult:
        """Celery's ``apply_async``; with ``lock_unique``, at most one queued copy per key."""
        if type(self)._lock_options.unique is None:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        return _unique.apply_unique(
            self,
            self._lock_get_spec(),
            args,
            kwargs,
            task_id,
            {
                "producer": producer,
                "link": link,
                "link_error": link_error,
                "shadow": shadow,
                **options,
            },
        )

    def publish_copy(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        task_id: str | None = None,
        **options: Any,  # Celery's publish options: values of any kind
    ) -> AsyncResult:
        """Celery's ``apply_async`` past ``lock_unique``'s checks (for the unique code)."""
        return super().apply_async(args, kwargs, task_id, **options)

    def push_request(self, *args: object, **kwargs: object) -> None:
        """As Celery; a request pushed for a running execution's body gets its lock attributes."""
        super().push_request(*args, **kwargs)
        adopt_request(self, self.request)

    def retry(
        self,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,  # Celery's publish options: values of any kind
    ) -> Retry:
        """Celery's ``retry()``, published after this execution's lease was released early. With
        ``throw=False`` and ``lock_on_lost="revoke"`` the ``Retry`` is raised anyway (the body
        may not run on without its lease); eager mode keeps the lease. An execution whose lease
        a newer ``on_held="replace"`` call replaced is never retried (its retry would take the
        key back): ``LockLostError(key, "replaced")`` is raised instead, nothing published (a
        worker execution under ``lock_on_lost="revoke"`` then ends REVOKED)."""
        run = current_run(getattr(self.request, "id", None))
        if run is not None and run.task is self and not run.released_early:
            held = run.lease
            if held is not None and held.lost_reason == "replaced":
                raise LockLostError(held.key, "replaced") from exc
        retry = super().retry(
            args=args,
            kwargs=kwargs,
            exc=exc,
            throw=throw,
            eta=eta,
            countdown=countdown,
            max_retries=max_retries,
            **options,
        )
        run = current_run(getattr(self.request, "id", None))
        if (
            run is not None
            and run.task is self
            and run.released_early
            and run.options.on_lost == "revoke"
        ):
            raise retry
        return retry

    def on_lock_lost(self, lease: Lease) -> None:
        """Called once when the running body's lease is lost (not after an early release), on the
        dispatcher thread: it may block; ``self.request`` there is not that execution's, use
        ``lease``."""

    def on_lock_rejected(self, key: str) -> None:
        """Called in the task's thread when ``key`` stayed held past ``wait`` (body not run)."""


def _spec_if_calls_reach_the_engine(task: object) -> _Spec | None:
    """``task``'s spec when it is a LockedTask whose ``__call__`` is LockedTask's (each call
    reaches ``run_locked``), else None (see :data:`spec.spec_of_task`)."""
    if not isinstance(task, LockedTask):
        return None
    cls = task.__class__  # a task's proxy (before the app is finalized) answers for its task
    if not cls._lock_call_is_ours:
        return None
    return cast("_Spec | None", cls.__dict__.get("_lock_spec")) or task._lock_get_spec()


register_spec_of_task(_spec_if_calls_reach_the_engine)


def _is_body_of(task: CeleryTask, wrapper: Callable[..., object]) -> bool:
    """Whether ``wrapper`` is ``task``'s body (maybe under the pydantic wrapper), not a helper."""
    run: object = task.run
    for _ in range(4):  # run -> pydantic wrapper -> ours: a short chain
        run = getattr(run, "__func__", run)
        if run is wrapper:
            return True
        run = getattr(run, "__wrapped__", None)
        if run is None:
            return False
    return False


def locked(
    *,
    key: str | Callable[..., str] | None = None,
    ttl: Duration | None = None,
    wait: Duration | None = None,
    max_hold: Duration | None = None,
    cooldown: Duration | None = None,
    store: str | LockStore | None = None,
    on_held: OnHeld = "raise",
    retry_countdown: Duration | None = None,
    on_lost: OnLost = "mark",
    limit: int | Callable[..., int] | None = None,
    unique: Unique | None = None,
    on_duplicate: OnDuplicate | None = None,
    queue_ttl: Duration | None = None,
    debounce: Duration | None = None,
    debounce_max: Duration | None = None,
) -> Callable[[F], F]:
    """Decorate a task function (below ``@app.task``) so that its body runs under a lease.

    Takes :class:`LockedTask`'s options without ``lock_`` (``LeaseConfigError`` naming a bad
    one), except ``unique`` (a decorator cannot reach ``apply_async``). With ``bind=True`` the
    key is built from the arguments after ``self``. ``limit`` (an int 1 .. MAX_LIMIT, or a
    callable; 1 too) holds one of the key's slots, ``None`` (default) the key itself: two lock
    spaces that do not exclude each other (docs/celery.md, "Limits").
    """
    raw = dict(locals())  # the options by name: the first statement sees the parameters only

    def decorate(func: F) -> F:
        where = getattr(func, "__qualname__", repr(func))
        options = validate_options(raw, where=f"@locked {where}")
        if options.unique is not None:
            raise LeaseConfigError(
                f"unique={options.unique.unique!r} of @locked {where} is not supported: a"
                " function decorator cannot de-duplicate at enqueue (that happens in the task"
                " class's apply_async); use @app.task(base=LockedTask, lock_unique=...)"
            )
        full = inspect.signature(func)
        if isinstance(options.key, str):
            validate_template(options.key, full, task=where)
        specs: dict[tuple[str, bool], _Spec] = {}
        # Ends as a skip when turned away: "replace" when a newer call overtook it.
        skips = options.on_held in ("skip", "replace")

        def spec_for(name: str, bound: bool) -> _Spec:
            spec = specs.get((name, bound))
            if spec is None:
                sig = _body_signature(func, bound=bound) or full
                spec = specs[(name, bound)] = _Spec(
                    options, make_key_function(options.key, sig, task=name), options.limit
                )
            return spec

        @functools.wraps(func)
        def wrapper(*args: object, **kwargs: object) -> object:
            task = compat.get_current_task()
            bound = task is not None and bool(args) and args[0] is task
            key_args = args[1:] if bound else args
            request = task.request if task is not None else None
            name = task.name if task is not None else f"{func.__module__}.{func.__qualname__}"
            # A helper called from a running body: a skip (or an overtaken replace) returns
            # None to that body.
            helper = skips and task is not None and not _is_body_of(task, wrapper)
            quiet = skip_quietly.set(True) if helper else None
            try:
                return run_locked(
                    task,
                    request,
                    spec_for(name, bound),
                    key_args,
                    kwargs,
                    lambda: func(*args, **kwargs),
                )
            finally:
                if quiet is not None:
                    skip_quietly.reset(quiet)

        wrapper.__signature__ = full  # type: ignore[attr-defined]  # Celery ignores __wrapped__
        wrapper._lock_options = options  # type: ignore[attr-defined]  # read by startup.check_worker
        return cast(F, wrapper)

    return decorate
