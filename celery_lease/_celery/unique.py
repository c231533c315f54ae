"""Unique at enqueue (``lock_unique``): at most one queued copy per key, returned to every caller.

::

    @app.task(base=LockedTask, lock_key="report:{account_id}", lock_unique="until_done")
    def build_report(account_id): ...

    r1 = build_report.delay(7)
    r2 = build_report.delay(7)      # nothing published: r2.id == r1.id

How it is built, on the three store operations plus ``get`` (:class:`SupportsInspection`):

- **The queued lease** lives on its own key, the task's key with ``queued:`` after the
  ``lease_key_prefix`` (``queued:report:7``), owned by ``queued;t=<task>;i=<task id>;at=<ms>``
  (:func:`~celery_lease._core.owners.queued_owner`): the owner names the copy's task id. The caller
  takes
  it *before* publishing, for ``queue_ttl`` counted from the copy's eta; the message carries the key
  and the owner in its ``lease_queued`` header. A caller that finds it held reads the holder's task
  id (``get``) and returns that copy's ``AsyncResult`` (``on_duplicate="existing"``) or raises
  :class:`~celery_lease.AlreadyQueuedError` (``"raise"``); ``lock_duplicate`` is sent either way.
- **The hand-over.** When the copy starts, the worker first takes the run lease on the task's
  key, as for any locked task (it excludes bodies; its tokens are the fencing tokens, which keep
  increasing as today). Then ``"while_queued"`` releases the queued lease (owner-checked: only
  its own), and ``"until_done"`` keeps it under the same owner (the key is never free in
  between): the renewer renews it with the run lease's ttl (at once, then every ttl/3, off the
  task's thread; the first renewal, at start, is sent without waiting where the store can;
  a copy that started half its ``queue_ttl`` or more after its eta (its call, without one), by
  the caller's and the worker's wall clocks, takes the key back instead, answered before the
  body starts: its queued lease may have expired in the queue)
  until the body ended and the run lease was released; then it is released on the task's
  thread, answered before the execution returns (a call made after the result is seen
  enqueues a new copy; sent without waiting when the execution publishes nothing: see
  :mod:`celery_lease._celery.execution`), or kept for ``lock_cooldown`` after a success (a throttle:
  calls in the cooldown are duplicates of the finished copy; the keep is sent by the
  dispatcher, off the task's thread, the key staying taken meanwhile). A worker that dies
  mid-body stops renewing it: it frees itself within the run ttl.
- **Failed publish** releases the queued lease at once, stores the error as the copy's FAILURE
  (callers handed its ``AsyncResult`` meanwhile see it in ``get()``) and re-raises; also when
  the broker may have taken the message after all (then the run lease still excludes a second
  body, and a late result overwrites the FAILURE; a debounced copy's message then ends without
  its body, see Debounce). **Revoke** releases it
  when the worker sees the revoke (``task_revoked``, also for ``expires``); a purged queue, a lost
  message or a worker killed before the copy started leave it to expire after ``queue_ttl``.
- **Retries** (a running copy publishing its own task id: ``retry()``, ``on_held="retry"``) take
  the queued lease again for their own id before publishing, for ``queue_ttl`` from the retry's
  eta (an ``until_done`` copy holds it already: the key is never free in between), and are never
  duplicates of themselves; acks_late redelivery of a started copy finds its own lease (or a
  free key, taken again).
- **Debounce.** The call is published with ``countdown=debounce``. A call that finds a waiting
  copy supersedes it: it writes a tombstone lease ``superseded:<old id>`` (owner names the new
  id), releases the old copy's queued lease (owner-checked), takes it for itself and publishes
  with an eta ``debounce`` later, capped at ``debounce_max`` after the first call of the chain
  (kept in the owner's ``at``). A debounced copy releases its queued lease when it reaches a
  worker, also under ``"until_done"`` (whose callers then look at the run key too: a running copy
  is the existing one), so a call never supersedes a running body. The tombstone key is the right
  to free the waiting copy's lease: a caller that fails to take it never touches that lease (it is
  the duplicate of the caller that took it, or looks again when that caller's own copy is no
  longer waiting), and a starting copy, *before it takes the run lease* (:func:`on_arrival`),
  takes its own tombstone key for itself for the run lease's ttl plus ``lock_wait``: either a
  superseding call took it first (the copy ends) or none can supersede it any more. It releases
  its queued lease around that claim, in both modes: a call from then on finds the key free and is
  the next copy, or under ``"until_done"`` the duplicate of the copy that holds the run key (never
  of one that may still be refused it: such a copy ends without its body, and a call handed its id
  would lose its work). Once the run lease is held the claim is taken again
  (:meth:`Arrival.confirm`): one that lapsed meanwhile and was taken by a newer call ends the copy
  REVOKED before its body, the run lease released. The claim is freed when the execution ends,
  with or without its body (:meth:`Arrival.leave`): a retry the copy published then waits as any
  copy and a newer call supersedes it (while the body that published it runs, a call is that
  retry's duplicate). Two callers racing: one takes the key, the others return its
  ``AsyncResult``. The superseded copy, when it reaches a worker, finds its tombstone taken and
  ends without its body and without ever holding the run key, REVOKED in the result backend with
  the reason ``"superseded by <new id>"`` (``AsyncResult.get()`` raises ``TaskRevokedError`` at
  once; no errback fires): the newer copy, started a moment later on another slot, never meets the
  run key held by the copy it superseded. A failed publish of the newest call (or a store error
  while superseding) hands the key back to the waiting copy, which then runs, unless a newer call
  superseded the failed one meanwhile or took the key while it was free (then only that one runs):
  the failed call takes its own tombstone first (no call supersedes it from then on; its message,
  had the broker taken it after all, ends without its body), frees its queued lease, takes the key
  back under the waiting copy's owner and only then removes the waiting copy's tombstone; not for
  a waiting copy that has ended meanwhile (its worker started it and found its tombstone taken: it
  is REVOKED in the result backend, read before and after the key is taken back; a key taken back
  for it after it ended is freed again, by it or by the failed call). Any debounced call whose
  publish fails takes its own tombstone before it stores its error as its FAILURE: a message
  that finds its tombstone held by its own call (not a started claim) ends without its body and
  stores nothing (never "superseded by" itself); a call that finds it held by a newer call stores
  REVOKED ``"superseded by <newer>"`` instead (a superseded copy never ends FAILURE), and one
  that finds its own message started stores nothing (that copy stores its result). A call that
  loses the key to a third one after releasing the waiting copy's lease keeps the tombstone: that
  copy has no lease left, so only the winner runs. A call that wrote a tombstone and then
  publishes nothing (it lost the key to a third call) stores its own id REVOKED,
  ``"superseded by <winner>"``: a racing caller may have been handed that id meanwhile.

**A second delivery of a running copy** (acks_late redelivery, a duplicated message: same task
id) meets the run lease held by its own task id. It is not a duplicate of itself, and it may be
the only message left if that copy's worker dies: it stores nothing under the id (no FAILURE
over the running copy), leaves the queued key to the running body, and is re-sent with the same
id, arguments and headers plus ``lease_deferred`` (how often it was re-sent so), ``countdown`` =
the run lease's ttl (the longest a dead holder's run lease outlives it; one message per ttl, no
busy loop), then acked (``Ignore``). A delivery that carries ``lease_deferred`` never applies
``on_held``: it ends without its body when its copy is done (a ready state in the result
backend; not RETRY, which also shows while a retry attempt runs), and is re-sent again while
the run key is held (by its copy or a newer one) or the backend cannot answer. It runs the
body only when it found the run key free and its copy not done on two arrivals a ttl apart (its
copy's worker died); one such arrival may fall between the copy's release and its stored
result. Who refused the key comes from the refused acquire itself where the store names the
holder in the same step (:func:`names_holder`; the engine sets ``LeaseContext.names_holder``);
elsewhere it is read after the refusal, and the running copy may end in between: a delivery
that then finds the key free is handled as a second delivery all the same (who refused it
cannot be told any more). A delivery whose copy is done ends without the policy, nothing
stored, whoever holds the key. Without a stored result (``ignore_result``, no backend) a
finished copy cannot be told from a dead one: the body runs again, as acks_late promises (at
least once). A re-send that fails (not acks_late: the message was acked on arrival) stores the
publish error as the copy's FAILURE unless its own running copy refused it (see :func:`_defer`).

Eager mode (``task_always_eager``) publishes nothing and de-duplicates nothing. ``send_task`` by
name bypasses the task class: no de-duplication at enqueue (the run lease still excludes the
body). A duplicate call that carries callbacks (``link``, ``link_error``, a chain's next steps)
or is a group or chord member (``group_id``, ``chord``: its id is pre-assigned, and the group's
result and the chord's body wait for that id, whatever ``apply_async`` returns) raises
:class:`~celery_lease.AlreadyQueuedError` whatever ``on_duplicate`` says: they are never
dropped silently.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

from celery import states
from celery.exceptions import Ignore, Reject
from celery.signals import task_revoked
from celery.utils import uuid

from celery_lease import signals
from celery_lease._celery import settings as config
from celery_lease._celery.protocols import (
    can_release_deferred,
    can_renew_deferred,
    is_inspectable,
)
from celery_lease._celery.spec import Spec, options_of
from celery_lease._celery.store_resolution import store_for
from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.owners import is_queued_owner, parse_owner, queued_owner
from celery_lease._core.renewer import Entry, get_renewer
from celery_lease._core.unique_options import (
    BUILTIN_QUEUE_TTL,
    SUPERSEDED_NAMESPACE,
    UniqueOptions,
)
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.errors import AlreadyQueuedError, LeaseConfigError
from celery_lease.stores.base import LockStore, SupportsAcquireOrHolder, SupportsInspection

if TYPE_CHECKING:
    from celery_lease._celery.protocols import AsyncResultLike, CeleryTask, TaskRequest

    class _NamesHolder(LockStore, SupportsAcquireOrHolder, Protocol):
        """A store whose refused acquire names the holder."""


__all__ = [
    "DEFERRED",
    "HEADER",
    "NAMESPACE",
    "Arrival",
    "apply_unique",
    "checks_apply_async",
    "leave",
    "names_holder",
    "on_arrival",
    "on_rejected",
    "on_start",
    "queued_key",
    "superseded_key",
]

logger = logging.getLogger("celery_lease.unique")

HEADER = "lease_queued"
"""Message header of a unique copy: ``[queued key, owner id]`` of its queued lease."""

DEFERRED = "lease_deferred"
"""Message header (``True``) of a second delivery re-sent to wait for its own running copy."""

NAMESPACE = "queued:"
"""Inserted after ``lease_key_prefix`` to name a task key's queued lease."""

clock: Clock = SYSTEM_CLOCK
"""Where the caller reads the wall clock (eta, the debounce window); tests swap in a FakeClock."""

_TRIES = 8
"""Attempts when the key flips between free and held under our feet."""

_CALLBACKS = ("link", "link_error", "chain", "chord", "group_id")
"""Options of a call whose duplicate raises whatever ``on_duplicate`` says: callbacks, a
chain's next steps, and a group or chord member (published under its own pre-assigned id, which
its group's result and its chord's body wait for; Celery ignores what ``apply_async`` returns).
A chain's step raises even with ``chain`` empty: Celery publishes a chain's last step (from
the worker that ran the step before it, ``celery/app/trace.py``) with ``chain=[]``, under the id
the chain's result waits for."""

_USES_ACQUIRE_OR_HOLDER: dict[type, bool] = {}
"""Store class -> whether its acquire_or_holder may stand for its acquire
(:func:`_uses_acquire_or_holder`)."""


def queued_key(key: str, prefix: str) -> str:
    """The queued lease's key for the task key ``key`` (which starts with ``prefix``)."""
    return prefix + NAMESPACE + key[len(prefix) :]


def superseded_key(task_id: str, prefix: str) -> str:
    """The tombstone key of a superseded (debounced) copy."""
    return f"{prefix}{SUPERSEDED_NAMESPACE}{task_id}"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _inspectable(store: LockStore, task: CeleryTask) -> SupportsInspection:
    if not is_inspectable(store):  # cached per store type
        raise LeaseConfigError(
            f"lock_unique of task {getattr(task, 'name', task)!r} needs a store that can read a"
            f" key's holder (SupportsInspection.get); {type(store).__name__} cannot"
        )
    return store


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


def _queue_ttl(unique: UniqueOptions, settings: config.LeaseSettings) -> float:
    return config.pick(unique.queue_ttl, settings.default_queue_ttl, BUILTIN_QUEUE_TTL)


# The caller's side ---------------------------------------------------------------------------


def apply_unique(
    task: CeleryTask,
    spec: Spec,
    apply: Callable[..., AsyncResultLike],
    args: Iterable[object] | None,
    kwargs: Mapping[str, object] | None,
    task_id: str | None,
    options: dict[str, Any],  # apply_async options: values of any kind
) -> AsyncResultLike:
    """``apply_async`` of a task with ``lock_unique``: publish via ``apply`` at most one copy.

    Returns the published copy's ``AsyncResult``, or the holder's for a duplicate
    (``on_duplicate="existing"``).

    Raises:
        AlreadyQueuedError: a duplicate with ``on_duplicate="raise"``, or carrying callbacks.
        StoreUnavailableError: the store failed (nothing was published).
    """
    unique = spec.options.unique
    assert unique is not None
    app = task.app
    if app.conf.task_always_eager:
        return apply(args, kwargs, task_id, **options)
    settings = config.get_settings(app)
    store = store_for(spec.options.store, app)
    inspect = _inspectable(store, task)
    prefix = settings.key_prefix
    key = prefix + spec.key_function(tuple(args or ()), dict(kwargs or {}))
    qkey = queued_key(key, prefix)
    task_id = task_id or uuid()
    queue_ttl = _queue_ttl(unique, settings)
    now = clock.time()
    stack = task.request_stack  # not task.request: that one builds a default request
    request = stack.top if stack is not None else None
    if getattr(request, "id", None) == task_id and not getattr(request, "called_directly", True):
        return _resend(
            task, unique, apply, args, kwargs, task_id, options, store, qkey, queue_ttl, now
        )
    if unique.debounce is not None:
        return _debounced(
            task,
            unique,
            apply,
            args,
            kwargs,
            task_id,
            options,
            inspect,
            key,
            qkey,
            prefix,
            now,
            queue_ttl,
        )
    owner = queued_owner(task.name, task_id, int(now * 1000))
    ttl_ms = _ms(queue_ttl + _delay(options, now))
    if _uses_acquire_or_holder(store):  # one round trip for a duplicate, the holder read atomically
        token, held_by = store.acquire_or_holder(qkey, owner, ttl_ms)
        if token is None:
            existing = parse_owner(held_by).task_id if held_by is not None else None
            return _duplicate(task, unique, key, task_id, existing, options)
        return _publish(apply, args, kwargs, task_id, options, store, qkey, owner, failed_for=task)
    for _ in range(_TRIES):
        if store.acquire(qkey, owner, ttl_ms) is None:
            info = inspect.get(qkey)
            if info is None:
                continue  # freed in between: try again
            return _duplicate(task, unique, key, task_id, parse_owner(info.owner).task_id, options)
        return _publish(apply, args, kwargs, task_id, options, store, qkey, owner, failed_for=task)
    return _duplicate(task, unique, key, task_id, None, options)


def names_holder(store: LockStore) -> bool:
    """Whether the run lease of a unique copy is taken through ``store.acquire_or_holder``, so
    that a refusal names its holder atomically (:func:`on_rejected`'s ``refused_by``): the
    rule :func:`_uses_acquire_or_holder` applies to the queued lease."""
    return _uses_acquire_or_holder(store)


def _uses_acquire_or_holder(store: LockStore) -> TypeGuard[_NamesHolder]:
    """Whether ``store`` names the holder of a refused key (SupportsAcquireOrHolder) through
    the same code as its ``acquire``.

    ``acquire_or_holder`` is used only where it is the own method of the class that defines
    ``acquire`` (or of a subclass of it), and not where ``acquire`` was replaced on the
    instance: a subclass or a wrapper that overrides ``acquire`` (to inject faults, count,
    apply a policy) is not bypassed by an inherited or forwarded ``acquire_or_holder``. Such a
    store gets the two calls. Cached per class (the instance check is one dict lookup).
    """
    if "acquire" in getattr(store, "__dict__", ()):
        return False
    kind = type(store)
    known = _USES_ACQUIRE_OR_HOLDER.get(kind)
    if known is None:
        known = _USES_ACQUIRE_OR_HOLDER[kind] = _defines_both(kind)
    return known


def _defines_both(kind: type) -> bool:
    """``kind``'s ``acquire_or_holder`` comes from the class of its ``acquire`` or below it."""
    taking = next((c for c in kind.__mro__ if "acquire_or_holder" in vars(c)), None)
    plain = next((c for c in kind.__mro__ if "acquire" in vars(c)), None)
    return taking is not None and plain is not None and issubclass(taking, plain)


def _running_copy(inspect: SupportsInspection, key: str, task_id: str) -> str | None:
    """The task id of another copy holding the run key (running, or in its cooldown)."""
    info = inspect.get(key)
    if info is None:
        return None
    holding_task_id = parse_owner(info.owner).task_id
    return holding_task_id if holding_task_id not in (None, task_id) else None


def _duplicate(
    task: CeleryTask,
    unique: UniqueOptions,
    key: str,
    task_id: str,
    existing: str | None,
    options: Mapping[str, object],
) -> AsyncResultLike:
    signals.send(signals.lock_duplicate, task, key=key, task_id=task_id, existing_task_id=existing)
    logger.debug(
        "celery-lease: %s[%s] not published: %r held by %s", task.name, task_id, key, existing
    )
    if (
        unique.on_duplicate == "raise"
        or existing is None
        or any(options.get(c) for c in _CALLBACKS)
        or "chain" in options  # a chain's last step: Celery publishes it with chain=[]
    ):
        raise AlreadyQueuedError(key, existing)
    return task.AsyncResult(existing)


def _publish(
    apply: Callable[..., AsyncResultLike],
    args: Iterable[object] | None,
    kwargs: Mapping[str, object] | None,
    task_id: str,
    options: dict[str, Any],
    store: LockStore,
    qkey: str,
    owner: str,
    *,
    undo: Callable[[], None] | None = None,
    free: bool = True,
    failed_for: CeleryTask | None = None,
) -> AsyncResultLike:
    """Publish with the queued lease in the header; a failed publish frees the lease at once
    (unless ``free`` is False: a running copy's retry, whose end frees it).

    With ``failed_for`` (the task of a new copy), a failed publish is also stored as the
    copy's FAILURE in that task's result backend (looked up only then): the duplicates that
    were given its ``AsyncResult`` meanwhile see the error in ``get()`` instead of waiting
    forever for a message that was never sent.
    """
    headers = dict(options.get("headers") or {})
    headers[HEADER] = [qkey, owner]
    try:
        return apply(args, kwargs, task_id, **{**options, "headers": headers})
    except BaseException as exc:
        if free:
            _release_quietly(store, qkey, owner, "the publish failed")
        if undo is not None:
            undo()
        if failed_for is not None and isinstance(exc, Exception):
            _fail_quietly(failed_for, task_id, exc)
        raise


def _fail_quietly(task: CeleryTask, task_id: str, exc: Exception) -> None:
    try:
        task.backend.mark_as_failure(task_id, exc, call_errbacks=False)
    except Exception as error:  # no result backend, or it is down too: the caller has exc
        logger.debug("celery-lease: could not store the failed publish of %s: %s", task_id, error)


def _release_quietly(store: LockStore, key: str, owner: str, why: str) -> None:
    try:
        store.release(key, owner)
    except Exception as exc:
        logger.warning(
            "celery-lease: releasing %r (%s) failed (%s); it frees itself within its ttl",
            key,
            why,
            exc,
        )


def _resend(
    task: CeleryTask,
    unique: UniqueOptions,
    apply: Callable[..., AsyncResultLike],
    args: Iterable[object] | None,
    kwargs: Mapping[str, object] | None,
    task_id: str,
    options: dict[str, Any],
    store: LockStore,
    qkey: str,
    queue_ttl: float,
    now: float,
) -> AsyncResultLike:
    """A running copy publishes its own id (a retry): wait again under its own queued lease.

    Never a duplicate of itself. Under ``"until_done"`` the running copy holds the queued key
    already (renewed): it is set to the retry's ``queue_ttl`` here and again when the run ends
    (a renewal may land in between). When another copy holds the queued key (``"while_queued"``:
    one was enqueued while this one ran), the retry is published anyway, without a queued lease.
    """
    owner = _header_owner(task.request, task_id, qkey) or _own_queued_owner(store, qkey, task_id)
    if owner is None:
        owner = queued_owner(task.name, task_id, int(now * 1000))
    ttl_ms = _ms(queue_ttl + _delay(options, now))
    if store.acquire(qkey, owner, ttl_ms) is None:
        logger.info(
            "celery-lease: retry of %s[%s] published beside the waiting copy holding %r",
            task.name,
            task_id,
            qkey,
        )
        return apply(args, kwargs, task_id, **options)
    holding = _holding.get(task_id)
    result = _publish(
        apply, args, kwargs, task_id, options, store, qkey, owner, free=holding is None
    )
    if holding is not None:
        holding.retry_ttl_ms = ttl_ms
    return result


def _own_queued_owner(store: LockStore, qkey: str, task_id: str) -> str | None:
    """The queued lease's owner when it names this very task id (a retry whose request lost
    its header): the copy's own, since owners are unique per call and name the task id."""
    if not is_inspectable(store):
        return None
    info = store.get(qkey)
    if info is None or not is_queued_owner(info.owner):
        return None
    return info.owner if parse_owner(info.owner).task_id == task_id else None


def _debounced(
    task: CeleryTask,
    unique: UniqueOptions,
    apply: Callable[..., AsyncResultLike],
    args: Iterable[object] | None,
    kwargs: Mapping[str, object] | None,
    task_id: str,
    options: dict[str, Any],
    inspect: SupportsInspection,
    key: str,
    qkey: str,
    prefix: str,
    now: float,
    queue_ttl: float,
) -> AsyncResultLike:
    """Publish ``debounce`` from now, superseding the waiting copy (see the module docstring)."""
    debounce, cap = unique.debounce, unique.debounce_max
    assert debounce is not None and cap is not None
    store: LockStore = inspect  # type: ignore[assignment]  # checked to conform to both
    options = {k: v for k, v in options.items() if k not in ("eta", "countdown")}
    # Set once this call wrote a waiting copy's tombstone: from then on a racing caller may
    # have been handed this call's id (it found the tombstone ours and us not superseded), so
    # a call that ends up publishing nothing leaves a final state under its id (see _gave_way).
    superseding = False
    settled = False  # a failed publish (or store error) stored this call's final state
    started: str | None = None  # a copy seen started whose queued lease stayed held

    def gave_way(existing: str | None) -> AsyncResultLike:
        if superseding:
            _gave_way(task, task_id, existing)
        return _duplicate(task, unique, key, task_id, existing, options)

    try:
        for _ in range(_TRIES):
            owner = queued_owner(task.name, task_id, int(now * 1000))
            if store.acquire(qkey, owner, _ms(queue_ttl + debounce)) is not None:
                if unique.unique == "until_done":
                    running = _running_copy(inspect, key, task_id)
                    if running is not None:
                        store.release(qkey, owner)
                        return gave_way(running)
                try:
                    return _publish(
                        apply,
                        args,
                        kwargs,
                        task_id,
                        {**options, "countdown": debounce},
                        store,
                        qkey,
                        owner,
                        free=False,  # freed below, once no call can supersede this one
                    )
                except BaseException as exc:
                    # Its own tombstone first: from then on no call supersedes it (and its
                    # message, had the broker taken it after all, ends without its body), so
                    # the state stored below is never written over a "superseded" REVOKED.
                    own = _take_own_tomb(
                        store,
                        superseded_key(task_id, prefix),
                        queued_owner(task.name, task_id, int(now * 1000)),
                        _ms(queue_ttl + cap),
                    )
                    _release_quietly(store, qkey, owner, "the publish failed")
                    if isinstance(exc, Exception):
                        _store_failed_publish(task, task_id, exc, own)
                    raise
            info = inspect.get(qkey)
            if info is None:
                continue
            old = parse_owner(info.owner)
            if not is_queued_owner(info.owner) or old.task_id is None or old.task_id == task_id:
                return gave_way(old.task_id)
            first = old.taken_at if old.taken_at is not None else now
            delay = max(0.0, min(now + debounce, first + cap) - now)
            owner = queued_owner(task.name, task_id, int(first * 1000))
            tomb = superseded_key(old.task_id, prefix)
            tomb_ttl_ms = _ms(queue_ttl + cap)
            tomb_owner = queued_owner(task.name, task_id, int(now * 1000))
            if store.acquire(tomb, tomb_owner, tomb_ttl_ms) is None:
                # The tombstone is the right to free that copy's lease: it is another's.
                claimed = inspect.get(tomb)
                writer = parse_owner(claimed.owner).task_id if claimed is not None else None
                if (
                    claimed is not None
                    and writer == old.task_id
                    and _is_started_claim(claimed.owner)
                ):
                    # The copy has arrived at a worker (on_arrival): it frees its queued lease
                    # at once (a look again finds the key free; under "until_done" then the
                    # run key), unless its running body published its retry (which took the
                    # key back): the duplicate of that retry if the key is still its own
                    # after every try. Its claim goes when its execution ends: from then on
                    # a call supersedes the waiting retry.
                    started = old.task_id
                if writer is None or writer == old.task_id:
                    continue  # gone, or the copy claimed it itself (it started): look again
                if not _has_tomb(inspect, writer, prefix):
                    # A caller racing us supersedes it: we are that caller's duplicate.
                    return gave_way(writer)
                # The writer's own call is no longer waiting: superseded, started, or withdrawing
                # after a failed publish. Still the waiting copy's lease: the writer has handed it
                # back and is about to remove the tombstone (the copy runs: we are its
                # duplicate); else look again.
                again = inspect.get(qkey)
                if again is not None and again.owner == info.owner:
                    return gave_way(old.task_id)
                continue
            superseding = True
            withdraw = functools.partial(
                _withdraw,
                store,
                qkey,
                owner,
                superseded_key(task_id, prefix),
                tomb_ttl_ms,
                info.owner,
                _ms(info.expires_in),
                tomb,
                tomb_owner,
                functools.partial(_finished, task, old.task_id),
            )
            try:
                store.release(qkey, info.owner)  # owner-checked: only that waiting copy's lease
                taken = store.acquire(qkey, owner, _ms(queue_ttl + delay))
            except BaseException as exc:
                # Nothing replaces the waiting copy: it is handed its key back (see _withdraw), and
                # the caller gets the store's error (stored as this call's FAILURE, for a caller
                # handed its id meanwhile, unless a newer call superseded this one).
                own = withdraw()
                if isinstance(exc, Exception):
                    _store_failed_publish(task, task_id, exc, own)
                    settled = True
                raise
            if taken is None:
                # Another call took the key between our release and our acquire: the waiting
                # copy's lease is gone, so it stays superseded (its tombstone is kept) and only
                # the winner runs, never the old copy beside it.
                winner = inspect.get(qkey)
                if winner is None:
                    continue
                return gave_way(parse_owner(winner.owner).task_id)
            try:
                return _publish(
                    apply,
                    args,
                    kwargs,
                    task_id,
                    {**options, "countdown": delay},
                    store,
                    qkey,
                    owner,
                    free=False,  # withdraw frees it, in its own order
                )
            except BaseException as exc:
                own = withdraw()
                if isinstance(exc, Exception):
                    _store_failed_publish(task, task_id, exc, own)
                    settled = True
                raise
    except Exception as exc:
        # A store error once a caller may hold this call's id (superseding): stored as this
        # call's FAILURE, so that caller's get() raises it instead of waiting for ever (not
        # when the path that raised settled its state already).
        if superseding and not settled:
            _fail_quietly(task, task_id, exc)
        raise
    return gave_way(started)


def _gave_way(task: CeleryTask, task_id: str, existing: str | None) -> None:
    """A debounced call that wrote a waiting copy's tombstone publishes nothing after all: its
    id is stored REVOKED, ``"superseded by <existing>"``, in the task's result backend.

    A caller that found that tombstone while this call was still superseding was handed this
    call's ``AsyncResult``; its ``get()`` raises ``TaskRevokedError`` at once instead of waiting
    for a message that is never sent. Only stored: no event, no signal (no copy of this id ever
    reached a worker). A backend that fails is logged; the caller of this call still gets its
    duplicate answer.
    """
    reason = f"superseded by {existing}"
    try:
        task.backend.mark_as_revoked(task_id, reason)
    except Exception as error:
        logger.warning(
            "celery-lease: could not store %s[%s] as %s (%s): a caller handed its id waits",
            task.name,
            task_id,
            reason,
            error,
        )


def _has_tomb(inspect: SupportsInspection, task_id: str, prefix: str) -> bool:
    """Whether copy ``task_id`` has a tombstone: it was superseded, has started, or withdrew."""
    return inspect.get(superseded_key(task_id, prefix)) is not None


def _withdraw(
    store: LockStore,
    qkey: str,
    owner: str,
    own_tomb: str,
    tomb_ttl_ms: int,
    waiting_owner: str,
    waiting_ttl_ms: int,
    tomb: str,
    tomb_owner: str,
    waiting_ended: Callable[[], bool | None],
) -> tuple[bool, str | None]:
    """A superseding call was not published: hand the key back to the copy it superseded,
    unless a newer call superseded this one meanwhile, or that copy has ended. Never raises a
    store error. Returns what taking its own tombstone found (:func:`_take_own_tomb`), for
    :func:`_store_failed_publish`.

    In this order, each step deciding the next, so that exactly one copy stays to run:

    1. Take this call's own tombstone (``own_tomb``, owner naming itself): from here no call
       can supersede it. Refused: a newer call superseded it and stands in for the waiting
       copy, which stays superseded; nothing is touched.
    2. Free this call's queued lease (owner-checked).
    3. Ask the result backend whether the waiting copy has ended (``waiting_ended``: a ready
       state; its worker started it meanwhile, found its tombstone taken and stored itself
       REVOKED). Then nothing is handed back: a key taken for a copy that no longer runs would
       make every call until its ttl a duplicate of that dead copy.
    4. Take the key back for the waiting copy, under its owner (``waiting_owner``; the holder
       again if its lease was never freed). Refused: a new call took the free key and runs;
       the waiting copy stays superseded.
    5. Ask again: the copy may have ended between 3 and 4. If it has, free the key just taken
       for it (owner-checked: that copy's owner, nobody else's) and keep its tombstone.
    6. Remove the waiting copy's tombstone: it runs.

    A copy that ends superseded frees a lease under its own owner after storing its REVOKED
    state (:func:`on_start`), so a key taken back for it is freed either by it (taken before
    that release) or by step 5 (taken after: step 5 then reads the REVOKED state). Where the
    backend cannot tell (no result backend, a failed read: ``None``), the key is handed back as
    if the copy were still waiting.

    The own tombstone is kept (it expires): a message that reached the broker although the
    publish failed ends without its body when it starts. A store error keeps what is left:
    the waiting copy stays superseded (nothing may run) rather than two running.
    """
    own = _take_own_tomb(store, own_tomb, tomb_owner, tomb_ttl_ms)
    if not own[0]:
        return own
    try:
        store.release(qkey, owner)
        if waiting_ended():
            return own
        if store.acquire(qkey, waiting_owner, waiting_ttl_ms) is None:
            return own
        if waiting_ended():
            store.release(qkey, waiting_owner)
            return own
        store.release(tomb, tomb_owner)
    except Exception as exc:
        logger.warning(
            "celery-lease: handing %r back to the superseded copy failed (%s); it stays superseded",
            qkey,
            exc,
        )
    return own


def _take_own_tomb(
    store: LockStore, own_tomb: str, tomb_owner: str, ttl_ms: int
) -> tuple[bool, str | None]:
    """A debounced call whose publish failed takes its own tombstone key (``tomb_owner`` names
    its own id, no started label): from then on no call supersedes it, and its message, had the
    broker taken it after all, ends without its body (:meth:`Arrival.claim_or_end`). Never
    raises a store error.

    Returns ``(True, None)`` when taken (also when a store error left it unknown: handled as
    before, its error stored), else ``(False, holder)``: the owner of who holds it, a newer
    call that superseded this one, or this call's own message, started on a worker.
    """
    try:
        for _ in range(_TRIES):
            if store.acquire(own_tomb, tomb_owner, ttl_ms) is not None:
                return True, None
            holder = cast(SupportsInspection, store).get(own_tomb)
            if holder is not None:
                return False, holder.owner
    except Exception as exc:
        logger.warning("celery-lease: taking %r failed (%s)", own_tomb, exc)
    return True, None


def _store_failed_publish(
    task: CeleryTask, task_id: str, exc: Exception, own: tuple[bool, str | None]
) -> None:
    """Store the final state of a debounced call whose publish failed, once its own tombstone
    was taken or found held (``own``, :func:`_take_own_tomb`): the error as its FAILURE; but
    REVOKED ``"superseded by <newer>"`` when a newer call holds it (a superseded copy never
    ends FAILURE: its worker, had the broker taken the message, stores the same), and nothing
    when its own message started on a worker (it runs and stores its own result)."""
    taken, holder = own
    if not taken and holder is not None:
        newer = parse_owner(holder).task_id
        if newer == task_id and _is_started_claim(holder):
            return
        if newer not in (None, task_id):
            _gave_way(task, task_id, newer)
            return
    _fail_quietly(task, task_id, exc)


# The worker's side ---------------------------------------------------------------------------


def _header_owner(request: TaskRequest | None, task_id: str | None, qkey: str | None) -> str | None:
    """The queued lease's owner from the request's header, if it is this copy's own.

    A header is never trusted: the owner must be a queued owner naming this very task id (and
    the key, when given, the expected one), so nothing but this copy's lease can be released.
    """
    header = getattr(request, HEADER, None)
    return _checked(header, task_id, qkey)


def _checked(header: object, task_id: str | None, qkey: str | None) -> str | None:
    if not isinstance(header, (list, tuple)) or len(header) != 2 or task_id is None:
        return None
    hkey, owner = header
    if not isinstance(hkey, str) or not isinstance(owner, str) or not is_queued_owner(owner):
        return None
    if qkey is not None and hkey != qkey:
        return None
    if parse_owner(owner).task_id != task_id:
        return None
    return owner


class QueuedHold:
    """The queued lease an ``"until_done"`` copy keeps (renewed) while its body runs."""

    __slots__ = ("cooldown", "entry", "owner", "qkey", "retry_ttl_ms", "store", "task_id")

    def __init__(
        self, store: LockStore, qkey: str, owner: str, task_id: str, entry: Entry, cooldown: float
    ) -> None:
        self.store, self.qkey, self.owner, self.task_id = store, qkey, owner, task_id
        self.entry, self.cooldown = entry, cooldown
        self.retry_ttl_ms: int | None = None  # set when the body published its retry

    def end(self, succeeded: bool, defer: bool = False) -> None:
        """The body ended and the run lease is released: stop renewing, then free the key, or
        keep it for the retry's wait or for ``cooldown``. Never raises a store error.

        ``defer`` (:mod:`celery_lease._celery.execution` decides; a store that can,
        :class:`~celery_lease.stores.base.SupportsDeferredRelease`): the release goes out
        without waiting, on the one connection the run lease's release went out on just
        before, so the server runs them in that order; the caller reads the replies. If it
        cannot go that way, the replies still unread are read first, then it is released the
        usual way: never ahead of the run lease's release.
        """
        _holding.pop(self.task_id, None)
        entry = self.entry
        renewer = entry.renewer
        assert renewer is not None
        try:
            settled, _final, _lapsed = renewer.remove(entry)
        except BaseException:
            renewer.abandon(entry)
            raise
        keep = self.retry_ttl_ms
        if keep is None and succeeded and self.cooldown > 0:
            keep = _ms(self.cooldown)
        # The release is sent and answered here, on the task's thread, before the execution
        # returns: a caller that sees the result and calls again must find the key free (a
        # release left to another thread let such a call get the finished copy's id, and its
        # work was never enqueued). A renewal landing after the release finds no lease of ours
        # and creates nothing; one landing after a keep is fenced: the keep is set after it.
        if keep is None:
            store = self.store
            if defer and can_release_deferred(store):
                if store.release_deferred(self.qkey, self.owner):
                    return
                store.flush_deferred()  # the run lease's release answered first
            self._release(None)
            return
        action = functools.partial(_set_quietly, self.store, self.qkey, self.owner, keep)
        if settled or not renewer.fence(entry, action):  # fenced: the renewer sets it after
            get_dispatcher().submit(_run, action, f"keep of {self.qkey!r}")

    def _release(self, _: object) -> None:
        _release_quietly(self.store, self.qkey, self.owner, "the copy ended")


def _run(action: Callable[[], None]) -> None:
    action()


def _set_quietly(store: LockStore, key: str, owner: str, ttl_ms: int) -> None:
    try:
        if not store.renew(key, owner, ttl_ms):
            logger.warning("celery-lease: %r is no longer held by %s; not kept", key, owner)
    except Exception as exc:
        logger.warning("celery-lease: keeping %r failed (%s); it frees itself", key, exc)


def _queued_lost(key: str, reason: str) -> None:
    """Renewer callback (quick, no user code): the running copy's queued lease was lost."""
    logger.warning(
        "celery-lease: the queued key %r of a running copy was lost (%s): another copy may be"
        " enqueued meanwhile (the run lease still excludes its body)",
        key,
        reason,
    )


_holding: dict[str, QueuedHold] = {}
"""Task id -> the queued lease its running ``"until_done"`` body keeps (this process)."""


def on_start(
    task: CeleryTask,
    request: TaskRequest,
    store: LockStore,
    key: str,
    settings: config.LeaseSettings,
    unique: UniqueOptions,
    ttl: float,
    cooldown: float,
) -> QueuedHold | None:
    """The copy holds its run lease and its body is about to start: hand the queued key over.

    ``"until_done"`` (without debounce): the copy's own queued lease is taken over under its
    owner (the key is never free in between): handed to the renewer, which renews it with the
    run lease's ``ttl`` (off this thread, batched with the other renewals) at once, then every
    ``ttl``/3, until the body ends
    (:meth:`QueuedHold.end`). If a renewal finds the key no longer this copy's (it expired while
    queued and another copy took it), the loss is logged and the body runs all the same: the run
    lease still excludes bodies.
    Otherwise it is released (owner-checked). A debounced copy that was superseded ends here,
    REVOKED (``Ignore`` is raised).
    """
    if getattr(request, "is_eager", False):
        return None
    task_id = getattr(request, "id", None)
    deferred = _deferrals(request)
    if deferred and task_id is not None:
        # A second delivery of a copy, back with the run key free. It runs the body only when
        # the copy is not done and was seen so twice, one ttl apart: the first time may be the
        # instant between the copy's release and its stored result (or a backend that could
        # not answer); a copy whose worker died is still not done a ttl later.
        done = _finished(task, task_id)
        if done:
            _drop_finished(task, task_id)  # raises Ignore: the body ran already
        if done is None or deferred < 2:
            _defer(
                task,
                request,
                key,
                ttl,
                deferred + (done is False),
                unfinished=done is False,
                ends_copy=True,  # the run key was free: no copy is known to run
            )
    prefix = settings.key_prefix
    qkey = queued_key(key, prefix)
    owner = _header_owner(request, task_id, qkey)
    if owner is None or task_id is None:
        return None  # not published through apply_unique (send_task, or before lock_unique)
    if unique.debounce is not None:
        # Its queued lease was freed at its arrival, once its claim stood (on_arrival); under
        # "until_done" a call then finds the run key held by it from here.
        return None
    if unique.unique != "until_done":
        store.release(qkey, owner)
        return None
    # A copy that may have outlived its queued lease (a second delivery, or one that started
    # half its queue_ttl or more after its eta) takes the key back before its body starts: a
    # call made while the body runs must find it held. The holder again when the lease is still
    # its own (same token, expiry set to ttl).
    late = clock.time() >= _queued_since(owner, request) + _queue_ttl(unique, settings) / 2
    retaken = None
    if deferred or late:
        retaken = store.acquire(qkey, owner, _ms(ttl))
        if retaken is None:
            # Its queued lease expired and another copy took the key meanwhile: the renewal
            # below reports it lost; the run lease still excludes that copy's body.
            logger.info(
                "celery-lease: %r is held by another copy; %s runs all the same", qkey, task_id
            )
    now = SYSTEM_CLOCK.monotonic()
    entry = Entry(
        store=store,
        key=qkey,
        owner=owner,
        ttl=ttl,
        sent_at=now,
        max_hold_at=None,
        on_lost=functools.partial(_queued_lost, qkey),
        # Its owner id is the copy's, shared with a retry or a redelivered copy that takes the
        # key again: a loss must not free it under them; QueuedHold.end frees or keeps it.
        free_on_loss=False,
    )
    # Its expiry set to ``ttl`` now, so that from here a worker that dies mid-body leaves the
    # key to expire within ``ttl``, not within what was left of ``queue_ttl``: sent without
    # waiting where the store can (its reply is read with this copy's next store call; the
    # renewer then renews it from ttl/3 on, as any lease), else renewed at once on the
    # renewer's thread.
    if retaken is None and not (
        can_renew_deferred(store) and store.renew_deferred(qkey, owner, _ms(ttl))
    ):
        entry.due = now
    hold = QueuedHold(store, qkey, owner, task_id, entry, cooldown)
    get_renewer(SYSTEM_CLOCK, store).add(entry)
    _holding[task_id] = hold
    return hold


def on_arrival(
    task: CeleryTask,
    request: TaskRequest,
    store: LockStore,
    key: str,
    settings: config.LeaseSettings,
    unique: UniqueOptions,
    ttl: float,
    wait: float = 0.0,
) -> Arrival | None:
    """A debounced copy, before it takes the run lease: end here if a newer call superseded it.

    The copy frees its queued lease (owner-checked; both modes: from here a call finds the key
    free, and under ``"until_done"`` then looks at the run key), then claims its tombstone key
    for itself (owner: a started claim naming its task id, unique to this arrival) for the run
    lease's ``ttl`` plus ``wait`` (``lock_wait``: the longest it may wait for the run lease): a
    call superseding it must take that key before it may free the copy's queued lease. Either a
    call took it first (the copy ends here, REVOKED ``"superseded by <newer id>"``, ``Ignore``
    raised) or the claim stands and no call supersedes the copy from now on. Learnt before the
    run lease: a superseded copy never holds the run key, so the copy that superseded it,
    starting a moment later on another slot, never finds the key held by it. The queued lease
    is freed again once the claim stands: a superseding call whose publish failed may have
    handed it back in between (see :func:`_withdraw`).

    Returns the claim (:class:`Arrival`), which the engine re-asserts once the run lease is
    held (:meth:`Arrival.confirm`) and frees whenever the execution ends, with or without its
    body (:meth:`Arrival.leave`); ``None`` for a copy without debounce, an eager run, or a
    message not published through :func:`apply_unique`. A claim of an earlier attempt of this
    very copy still standing (a second delivery while its first runs) stands for this one.
    A claim whose acquire failed (a lost reply may have let it take effect) is freed before
    the error goes on: nothing of this arrival stays held.

    Raises:
        Ignore: the copy was superseded (its REVOKED state is stored).
    """
    if unique.debounce is None or getattr(request, "is_eager", False):
        return None
    task_id = getattr(request, "id", None)
    prefix = settings.key_prefix
    qkey = queued_key(key, prefix)
    owner = _header_owner(request, task_id, qkey)
    if owner is None or task_id is None:
        return None
    store.release(qkey, owner)
    claim = queued_owner(getattr(task, "name", "?"), task_id, int(clock.time() * 1000), STARTED)
    arrival = Arrival(store, superseded_key(task_id, prefix), claim, task_id, _ms(ttl + wait))
    arrival.qkey, arrival.owner = qkey, owner
    arrival.claim_or_end(task, request)
    _release_quietly(store, qkey, owner, "the copy started")
    return arrival


class Arrival:
    """A debounced copy's claim on its own tombstone key, from its arrival (:func:`on_arrival`)
    until its execution ends (:meth:`leave`)."""

    __slots__ = ("claim", "hold_ms", "owner", "qkey", "store", "taken", "task_id", "token", "tomb")

    def __init__(self, store: LockStore, tomb: str, claim: str, task_id: str, hold_ms: int):
        self.store, self.tomb, self.claim, self.task_id = store, tomb, claim, task_id
        self.hold_ms = hold_ms
        self.qkey: str | None = None  # the copy's queued lease: key and owner
        self.owner: str | None = None
        self.taken = False  # this arrival's own claim holds the key (not an earlier attempt's)
        self.token: int | None = None  # the claim's token when it was taken

    def claim_or_end(self, task: CeleryTask, request: TaskRequest) -> bool:
        """Take (or take again: the same owner is the holder again, same token, its expiry
        reset) the tombstone key; raise ``Ignore`` with the REVOKED state stored if a newer
        call holds it. Returns whether the claim is one taken afresh (a new token: it was
        not held by this arrival just before). A store error frees what this arrival may hold,
        then goes on."""
        before = self.token
        try:
            stands, newer = self._claim()
        except BaseException:
            self.taken = True  # it may have taken effect, its reply lost: freed, owner-checked
            self.leave()
            raise
        if stands:
            return self.token is None or self.token != before
        self.taken = False  # never ours, or lost: the tombstone is the newer call's
        if newer == self.task_id:
            # Its own call's tombstone: that call's publish raised although the broker took
            # this message, and the call took it (see _take_own_tomb). Not superseded (never by
            # itself): it ends without its body and stores nothing; the call stores its state.
            if self.qkey is not None and self.owner is not None:
                _release_quietly(self.store, self.qkey, self.owner, "its publish failed")
            logger.info(
                "celery-lease: %s[%s] its call's publish failed: body not run",
                getattr(task, "name", "?"),
                self.task_id,
            )
            raise Ignore("its publish failed")
        try:
            reason = _mark_superseded(task, request, newer)
        finally:
            if self.qkey is not None and self.owner is not None:
                # After the REVOKED state is stored: a superseding call whose publish failed
                # may hand the key back to this copy (see _withdraw); a lease under this
                # copy's own owner taken before this release is freed here, one taken after
                # it is freed by that call, which reads the state first.
                _release_quietly(self.store, self.qkey, self.owner, "the copy was superseded")
        raise Ignore(reason)

    def _claim(self) -> tuple[bool, str | None]:
        store, task_id = self.store, self.task_id
        for _ in range(_TRIES):
            token = store.acquire(self.tomb, self.claim, self.hold_ms)
            if token is not None:
                self.taken, self.token = True, token
                return True, None
            self.taken, self.token = False, None
            holder = store.get(self.tomb) if is_inspectable(store) else None
            if holder is None and is_inspectable(store):
                continue  # freed in between (a withdrawing call handed the key back): again
            newer = parse_owner(holder.owner).task_id if holder is not None else None
            return holder is not None and newer == task_id and _is_started_claim(
                holder.owner
            ), newer
        return False, None

    def confirm(self, task: CeleryTask, request: TaskRequest) -> None:
        """The run lease is held: re-assert the claim before the body starts. A claim that
        lapsed meanwhile (a wait for the run lease, a stall) and was taken by a superseding
        call ends the copy here, REVOKED (``Ignore``; the engine releases the run lease): the
        newer call runs, never both.

        A claim taken afresh here (it had lapsed, or it was an earlier attempt's) may follow a
        superseding call that handed the queued key back to this copy (see :func:`_withdraw`)
        while it had none: that key is freed (owner-checked), as at the arrival.

        Raises:
            Ignore: the copy was superseded while it waited for the run lease.
        """
        if self.claim_or_end(task, request) and self.qkey is not None and self.owner is not None:
            _release_quietly(self.store, self.qkey, self.owner, "the copy's claim was taken again")

    def leave(self) -> None:
        """The execution ends (its body ran, or it ends without it): free the claim
        (owner-checked: this arrival's own). From here a call may supersede a retry of this
        copy that waits in the queue (the retry then ends REVOKED). Never raises."""
        if self.taken:
            self.taken = False
            _release_quietly(self.store, self.tomb, self.claim, "the copy's execution ended")


def leave(arrival: Arrival | None) -> None:
    """:meth:`Arrival.leave` of an arrival, if any."""
    if arrival is not None:
        arrival.leave()


STARTED = "started"
"""The label of a debounced copy's claim on its own tombstone key (:func:`on_arrival`)."""


def _is_started_claim(owner: str) -> bool:
    """Whether ``owner`` is a copy's claim on its own tombstone (not a superseding call's)."""
    return is_queued_owner(owner) and parse_owner(owner).label == STARTED


def _queued_since(owner: str, request: TaskRequest) -> float:
    """When (wall clock, seconds) the copy's queued lease began to count its ``queue_ttl``: its
    eta (the request's ``eta``, which a ``countdown`` became), or its call (the owner's ``at``)
    when it has none or it lies before the call; ``-inf`` when neither is known (the copy counts
    as late)."""
    taken_at = parse_owner(owner).taken_at
    eta = _wall_time(getattr(request, "eta", None))
    if taken_at is None:
        return float("-inf")
    return taken_at if eta is None else max(taken_at, eta)


def _wall_time(value: object) -> float | None:
    """Seconds since the epoch of an ``eta`` (ISO 8601 text or a ``datetime``; naive: UTC);
    ``None`` for anything else."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def on_rejected(
    request: TaskRequest | None,
    store: LockStore,
    key: str,
    settings: config.LeaseSettings,
    *,
    task: CeleryTask | None = None,
    ttl: float | None = None,
    policy: str = "raise",
    refused_by: str | None = None,
) -> None:
    """The run lease stayed held and the copy ends without its body: free its queued key.

    Not for ``on_held="retry"`` (``policy``): the retry takes it again for itself before it is
    published. When the run lease is held by this very task id (a second delivery of the
    running copy), the queued key is the running body's; with ``task`` and ``ttl`` given (the
    engine's call) the delivery is re-sent to wait for that copy and ``Ignore`` is raised: the
    policy is not applied, nothing is stored under the id (see the module docstring).

    Who held it: ``refused_by``, the owner id the refused acquire itself named (the engine's
    call, on a store that answers it atomically: :func:`names_holder`), else the run key's
    holder read now. A key read free now may have been refused by this very copy, which ended
    in between: handled as a second delivery too. A delivery whose copy is done ends
    (``Ignore``, nothing stored) whoever holds the key.

    Raises:
        Ignore: a second delivery of the running copy, re-sent (or its copy finished).
        Reject: re-sending it failed (``requeue=True``: the broker keeps the message).
    """
    if request is None or getattr(request, "is_eager", False):
        return
    task_id = getattr(request, "id", None)
    deferred = _deferrals(request)
    engine = task is not None and ttl is not None
    if deferred and task_id is not None and engine:
        # A second delivery of a copy, re-sent earlier: never the policy (its copy may have
        # succeeded, and a newer copy run the key now). Dropped when its copy is done, else
        # re-sent again; its queued key (if any) is the copy's, not this delivery's to free.
        _defer(
            cast("CeleryTask", task),
            request,
            key,
            cast(float, ttl),
            deferred,
            # Its copy may be dead (the key held by a newer one): unless the refusal named its
            # own running copy, a re-send that fails ends it with the publish error.
            ends_copy=refused_by is not None and parse_owner(refused_by).task_id != task_id,
        )
    qkey = queued_key(key, settings.key_prefix)
    owner = _header_owner(request, task_id, qkey)
    if owner is None and task is None:
        return
    known = refused_by is not None or is_inspectable(store)
    holder = refused_by
    if holder is None and is_inspectable(store):
        try:
            run = store.get(key)
        except Exception as exc:
            logger.warning("celery-lease: reading %r failed (%s); %r is kept", key, exc, qkey)
            return  # frees itself within its ttl: never freed while its own body may run
        holder = run.owner if run is not None else None
    if known and task_id is not None:
        if holder is not None and parse_owner(holder).task_id == task_id:
            # Its own run lease (acks_late redelivery of the running copy): the running body
            # keeps the queued key (until_done); it is not this delivery's to free.
            if engine:
                _defer(cast("CeleryTask", task), request, key, cast(float, ttl), 1)
            return
        if holder is None and engine:
            # Free when read: whoever refused this delivery let go in between, and it may have
            # been this very copy (its first delivery, just finished: on_held would fire the
            # failure path of a copy that succeeded). Who it was cannot be told any more, so it
            # is handled as a second delivery: dropped if its copy is done, else re-sent; it
            # runs its body only if its copy is still not done on two free arrivals a ttl
            # apart (a rejected copy whose holder has ended then runs, later). Its queued key
            # goes with it. No copy is known to run: a re-send that fails ends it.
            _defer(cast("CeleryTask", task), request, key, cast(float, ttl), 1, ends_copy=True)
        # Held by another copy; it may have taken the key after this very copy finished (read
        # after the refusal), or this is a late delivery of a finished copy. A delivery of a
        # copy that is done ends here, nothing stored: never the failure path of a copy that
        # ran.
        if engine and _finished(cast("CeleryTask", task), task_id):
            _drop_finished(cast("CeleryTask", task), task_id)
    if owner is not None and policy != "retry":
        _release_quietly(store, qkey, owner, "the copy was rejected")


def _deferrals(request: TaskRequest) -> int:
    """How often this delivery was re-sent to wait for its own copy (0: never): the
    ``lease_deferred`` header, a count."""
    value = getattr(request, DEFERRED, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _finished(task: CeleryTask, task_id: str) -> bool | None:
    """Whether the copy ``task_id`` is done: its result backend holds a ready state (SUCCESS,
    FAILURE, REVOKED).

    ``False`` for any other state, RETRY included (it stays while the retry attempt itself
    runs, so it cannot tell a retried attempt from a dead retry attempt: dropping on it lost
    the work of the latter), and where there is no result to read (no backend,
    ``ignore_result``: a done copy then looks like a dead one, so the body runs again, at
    least once); ``None`` when the backend failed to answer (the caller waits and asks again).
    """
    try:
        state = task.backend.get_state(task_id)
    except NotImplementedError:  # DisabledBackend: no results, ever
        return False
    except Exception as exc:
        logger.warning(
            "celery-lease: reading the state of %s failed (%s); asking later", task_id, exc
        )
        return None
    return state in states.READY_STATES


def _drop_finished(task: CeleryTask, task_id: str) -> None:
    reason = "delivered again after it finished"
    logger.info("celery-lease: %s[%s] %s: body not run, nothing stored", task.name, task_id, reason)
    raise Ignore(reason)


def _defer(
    task: CeleryTask,
    request: TaskRequest,
    key: str,
    ttl: float,
    count: int,
    *,
    unfinished: bool = False,
    ends_copy: bool = False,
) -> None:
    """Re-send this delivery ``countdown=ttl`` later, ``lease_deferred=count``; raise Ignore.
    Dropped instead when its copy is done (not asked again when the caller just read it
    ``unfinished``).

    If the re-send fails: an ``acks_late`` task's message is rejected back to the broker
    (``Reject(requeue=True)``); any other task's was acked when it arrived, so nothing can keep
    it and it ends. With ``ends_copy`` (no copy of this id is known to run: the run key was
    free, or held by another copy) the publish error is stored as the copy's FAILURE (no
    errback; only while neither a ready state nor RETRY is stored: :func:`_fail_unless_stored`):
    its callers see it in ``get()`` instead of waiting for ever. Without it (its own copy holds
    the run key) only logged: that copy carries the work and stores its result.
    """
    task_id = cast(str, request.id)  # every caller checked it
    if not unfinished and _finished(task, task_id):  # in its cooldown, or releasing its key
        _drop_finished(task, task_id)
    headers = {k: v for k, v in (getattr(request, "headers", None) or {}).items() if k != "x-death"}
    headers[DEFERRED] = count
    # As retry() re-sends a request (routing, ids, links, time limits, ``retries`` unchanged),
    # but without ``expires`` (the copy started in time) and around apply_unique: this is the
    # copy itself, whose queued key its running body holds.
    signature = task.signature_from_request(request, countdown=ttl, expires=None, headers=headers)
    try:
        super(_checking_class(), task).apply_async(
            signature.args, signature.kwargs, **signature.options
        )
    except Exception as exc:
        if getattr(request, "acks_late", None) or getattr(task, "acks_late", False):
            logger.warning(
                "celery-lease: re-sending the second delivery of %s[%s] failed (%s); rejected"
                " back to the broker",
                task.name,
                task_id,
                exc,
            )
            raise Reject(exc, requeue=True) from exc
        if ends_copy:
            logger.error(
                "celery-lease: re-sending the second delivery of %s[%s] failed (%s); no copy of"
                " it is known to run: the error is stored as its failure",
                task.name,
                task_id,
                exc,
            )
            _fail_unless_stored(task, task_id, exc)
            raise Ignore("second delivery not re-sent") from exc
        logger.error(
            "celery-lease: re-sending the second delivery of %s[%s] failed (%s); it ends here"
            " (acked on arrival: the copy that still runs carries its work)",
            task.name,
            task_id,
            exc,
        )
        raise Ignore("second delivery not re-sent") from exc
    logger.info(
        "celery-lease: %s[%s] delivered again while its own copy is not done (key %r): re-sent"
        " to come back in %gs, nothing stored",
        task.name,
        task_id,
        key,
        ttl,
    )
    raise Ignore("delivered again while its own copy runs")


def _fail_unless_stored(task: CeleryTask, task_id: str, exc: Exception) -> None:
    """Store ``exc`` as the FAILURE of copy ``task_id`` (no errback) unless its result backend
    holds a ready state (its result) or RETRY (a retry message carries its work), or cannot
    answer. Never raises."""
    try:
        state = task.backend.get_state(task_id)
    except Exception as error:  # no backend (NotImplementedError), or it is down
        logger.debug("celery-lease: reading the state of %s failed (%s)", task_id, error)
        return
    if state not in states.READY_STATES and state != states.RETRY:
        _fail_quietly(task, task_id, exc)


_checking: list[type] = []


def checks_apply_async(cls: type) -> None:
    """Name the task class whose ``apply_async`` calls :func:`apply_unique` (``LockedTask``,
    when :mod:`celery_lease._celery.task` is imported): a delivery re-sent to wait for its own
    copy is published by the ``apply_async`` after it in the class order, past the checks."""
    _checking[:] = [cls]


def _checking_class() -> Any:  # Any: mypy takes super()'s first argument for a class only
    return _checking[0]  # set: a unique copy's task class was made by that module


def _mark_superseded(task: CeleryTask, request: TaskRequest, newer: str | None) -> str:
    """Store the copy of ``request`` REVOKED, ``"superseded by <newer>"``, send its
    ``task-revoked`` event and log it; returns the reason (the caller raises ``Ignore``)."""
    reason = f"superseded by {newer}"
    task.backend.mark_as_revoked(cast(str, request.id), reason, request=request)  # on_start checked
    if task.send_events:
        try:
            task.send_event(
                "task-revoked", terminated=False, signum=None, expired=False, reason=reason
            )
        except Exception:
            logger.warning("celery-lease: could not send task-revoked for %s", request.id)
    logger.info("celery-lease: %s[%s] %s: body not run", task.name, request.id, reason)
    return reason


def _on_revoked(sender: object = None, request: TaskRequest | None = None, **_: object) -> None:
    """``task_revoked`` in the worker: a revoked (or expired) unique copy frees its queued key."""
    task = cast("CeleryTask", sender)  # the Task; ``request``: its Context (headers as attributes)
    options = options_of(type(task))
    if request is None or options is None or options.unique is None:
        return
    header: object = getattr(request, HEADER, None)
    owner = _checked(header, getattr(request, "id", None), None)
    if owner is None:
        return
    qkey = cast(Sequence[str], header)[0]  # _checked: a [key, owner] pair of str
    try:
        prefix = config.get_settings(task.app).key_prefix
        if not qkey.startswith(prefix + NAMESPACE):  # a forged header naming another key
            return
        store = store_for(options.store, task.app)
    except Exception:
        logger.exception("celery-lease: no store to free the queued key of %s", request.id)
        return
    _release_quietly(store, qkey, owner, "the copy was revoked")


task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_lease.unique.revoked")
