"""The caller's side: ``apply_async`` of a unique task takes the queued lease, then publishes
(or answers as a duplicate); a running copy's retry waits again under its own lease."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

from celery.utils import uuid

from celery_lease._celery.protocols import is_inspectable
from celery_lease._celery.settings import get_settings
from celery_lease._celery.spec import Spec
from celery_lease._celery.store_resolution import store_for
from celery_lease._celery.unique import common
from celery_lease._celery.unique.call import Call, InspectableStore
from celery_lease._celery.unique.common import header_owner, logger, ms, queue_ttl, queued_key
from celery_lease._celery.unique.debounce import debounced
from celery_lease._celery.unique.hold import holding
from celery_lease._core.owners import is_queued_owner, parse_owner
from celery_lease.errors import LeaseConfigError
from celery_lease.stores.base import LockStore, SupportsAcquireOrHolder

if TYPE_CHECKING:
    from celery_lease._celery.protocols import AsyncResultLike, UniqueTask

    class _NamesHolder(LockStore, SupportsAcquireOrHolder, Protocol):
        """A store whose refused acquire names the holder."""


_USES_ACQUIRE_OR_HOLDER: dict[type, bool] = {}  # store class -> whether names_holder holds


def apply_unique(
    task: UniqueTask,
    spec: Spec,
    args: Iterable[object] | None,
    kwargs: Mapping[str, object] | None,
    task_id: str | None,
    options: dict[str, Any],  # apply_async options: values of any kind
) -> AsyncResultLike:
    """``apply_async`` of a task with ``lock_unique``: publish at most one copy; return its
    result, or the holder's for a duplicate. Raises ``AlreadyQueuedError``
    (``on_duplicate="raise"``, or callbacks) or ``StoreUnavailableError`` (nothing published)."""
    unique = spec.options.unique
    assert unique is not None
    app = task.app
    if app.conf.task_always_eager:
        return task.publish_copy(args, kwargs, task_id, **options)
    settings = get_settings(app)
    store = _inspectable(store_for(spec.options.store, app), task)
    prefix = settings.key_prefix
    key = prefix + spec.key_function(tuple(args or ()), dict(kwargs or {}))
    call = Call(
        task=task,
        unique=unique,
        store=store,
        key=key,
        qkey=queued_key(key, prefix),
        prefix=prefix,
        task_id=task_id or uuid(),
        args=args,
        kwargs=kwargs,
        options=options,
        now=common.clock.time(),
        queue_ttl=queue_ttl(unique, settings),
    )
    stack = task.request_stack  # not task.request: that one builds a default request
    request = stack.top if stack is not None else None
    if getattr(request, "id", None) == call.task_id and not getattr(
        request, "called_directly", True
    ):
        return _resend(call)
    if unique.debounce is not None:
        return debounced(call)
    return _take_and_publish(call)


def _take_and_publish(call: Call) -> AsyncResultLike:
    """Take the queued lease (``queue_ttl`` from the eta) and publish, or answer as a duplicate."""
    store, qkey, owner = call.store, call.qkey, call.owner()
    ttl_ms = ms(call.queue_ttl + _delay(call.options, call.now))
    if names_holder(store):  # one round trip for a duplicate, the holder read atomically
        token, held_by = store.acquire_or_holder(qkey, owner, ttl_ms)
        if token is None:
            return call.duplicate(parse_owner(held_by).task_id if held_by is not None else None)
        return call.publish(owner, fail=True)
    for _ in range(common.TRIES):
        if store.acquire(qkey, owner, ttl_ms) is None:
            info = store.get(qkey)
            if info is None:
                continue  # freed in between: try again
            return call.duplicate(parse_owner(info.owner).task_id)
        return call.publish(owner, fail=True)
    return call.duplicate(None)


def _inspectable(store: LockStore, task: UniqueTask) -> InspectableStore:
    if not is_inspectable(store):  # cached per store type
        raise LeaseConfigError(
            f"lock_unique of task {getattr(task, 'name', task)!r} needs a store that can read a"
            f" key's holder (SupportsInspection.get); {type(store).__name__} cannot"
        )
    return cast(InspectableStore, store)


def _delay(options: Mapping[str, Any], now: float) -> float:
    """Seconds from now until the copy's eta (``countdown`` or ``eta``), at least 0."""
    countdown = options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return max(0.0, eta.timestamp() - now)


def names_holder(store: LockStore) -> TypeGuard[_NamesHolder]:
    """Whether a copy's leases are taken with ``acquire_or_holder`` (the refusal names its holder
    atomically): only where the class of ``acquire`` or a subclass defines it and the instance
    does not replace ``acquire``, so a wrapper overriding ``acquire`` is never bypassed.
    Cached per class."""
    if "acquire" in getattr(store, "__dict__", ()):
        return False
    kind = type(store)
    known = _USES_ACQUIRE_OR_HOLDER.get(kind)
    if known is None:
        known = _USES_ACQUIRE_OR_HOLDER[kind] = _defines_both(kind)
    return known


def _defines_both(kind: type) -> bool:
    taking = next((c for c in kind.__mro__ if "acquire_or_holder" in vars(c)), None)
    plain = next((c for c in kind.__mro__ if "acquire" in vars(c)), None)
    return taking is not None and plain is not None and issubclass(taking, plain)


def _resend(call: Call) -> AsyncResultLike:
    """A running copy's retry waits under its own queued lease, never its own duplicate
    (``"until_done"``: the held key gets the retry's ``queue_ttl``)."""
    task, store, qkey, task_id = call.task, call.store, call.qkey, call.task_id
    owner = header_owner(task.request, task_id, qkey) or _own_queued_owner(store, qkey, task_id)
    if owner is None:
        owner = call.owner()
    ttl_ms = ms(call.queue_ttl + _delay(call.options, call.now))
    if store.acquire(qkey, owner, ttl_ms) is None:
        logger.info(
            "celery-lease: retry of %s[%s] published beside the waiting copy holding %r",
            task.name,
            task_id,
            qkey,
        )
        return call.send()
    hold = holding.get(task_id)
    result = call.publish(owner, free=hold is None)
    if hold is not None:
        hold.retry_ttl_ms = ttl_ms
    return result


def _own_queued_owner(store: InspectableStore, qkey: str, task_id: str) -> str | None:
    """The queued lease's owner if it names this task id (a retry whose request lost its header)."""
    info = store.get(qkey)
    if info is None or not is_queued_owner(info.owner):
        return None
    return info.owner if parse_owner(info.owner).task_id == task_id else None
