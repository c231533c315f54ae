"""A solo worker sends a locked task's acquire when its message arrives (``task_received``) and
reads the reply when :func:`~celery_lease._celery.execution.run_locked` enters the lease: the
round trip overlaps Celery's own work between the two (reserving, accepting, tracing).

Only where nothing can come between: the solo pool (the consumer's thread runs the task inside
the same call), a request Celery hands straight to the pool (no ETA, no rate limit; a revoked
one never reaches ``task_received``), a task whose key is built from the arguments alone
(:attr:`Spec.plain_key`) with no ``limit``, ``unique`` or ``on_held="replace"``, a task class
with no ``before_start`` of the user's and LockedTask's own ``__call__`` (either could end the
request without ``run_locked`` and without a signal; no ``task_prerun``/``task_postrun``
receiver is connected to learn of it: one makes Celery send both for every task), a message not
redelivered (``worker_deduplicate_successful_tasks`` may skip it without a signal), and a store
that can send an acquire (:class:`~celery_lease.stores.base.SupportsSentAcquire`). At most one
try is parked. It is taken by the run of its own request when that run asks for the same key,
store, ttl and wait (the key is built again there and compared; else it is given up), and given
up, owner-checked, when its request is revoked or expires before it runs, fails before its body
(``task_failure``, or Celery's own error around it: ``task_internal_error``),
at the next ``task_received`` and at worker shutdown. Its lease's validity counts from the send;
the enter uses a grant only within a third of the ttl from the send, asks again under the same
owner id after an older grant, and tries afresh after a refusal (:meth:`LeaseContext.enter`).
A request that ends any other way leaves its try held until the next message or the shutdown,
at most for its ttl.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from celery_lease import _forking as forking
from celery_lease._celery import deferral, pool, spec
from celery_lease._celery.protocols import can_send_acquire
from celery_lease._celery.settings import get_settings
from celery_lease._core.acquire_plan import SentTry
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.owners import owner_fields
from celery_lease.stores.base import LockStore
from celery_lease.stores.slots import SLOT_MARK

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_lease._celery.spec import Spec

logger = logging.getLogger("celery_lease.engine")


class SentContext(LeaseContext):
    """A task's lease context whose first try was sent when its message arrived."""

    request_id: object = None  # the id of the request whose message it was sent for
    sent: SentTry | None = None  # the try sent, until the enter reads it or it is given up

    def enter(self, sent: SentTry | None = None) -> Lease:
        """Enter with the try sent at receipt (``sent``: one given instead)."""
        if sent is None:
            sent, self.sent = self.sent, None
        return LeaseContext.enter(self, sent)

    __enter__ = enter

    def give_up(self) -> None:
        """Release, owner-checked, what the sent try took (its reply read first); never raises."""
        sent, self.sent = self.sent, None
        if sent is None:
            return
        try:
            self.abandon_sent(sent)
        except Exception:  # pragma: no cover - abandon_sent logs store errors itself
            logger.exception("celery-lease: giving up the early acquire of %r failed", self.key)


_lock = threading.Lock()
# The parked try, if any (read without the lock by the run's quick check, then taken under it).
parked: SentContext | None = None


def _swap(new: SentContext | None) -> SentContext | None:
    global parked
    with _lock:
        old, parked = parked, new
    return old


def on_task_received(sender: object = None, request: Any = None, **_: object) -> None:
    """``task_received``: give up a leftover try; in a solo worker, send this request's acquire."""
    leftover = _swap(None) if parked is not None else None
    if leftover is not None:
        leftover.give_up()
    if (
        request is None
        or pool.pool_label() != "solo"
        # Not one Celery holds back after task_received (an ETA, a rate limit).
        or request.eta
        or getattr(request.task, "rate_limit", None)
    ):
        return
    task = request.task
    try:
        task_spec = spec.spec_of_task(task)  # a LockedTask whose calls reach run_locked
        context = None if task_spec is None else _sent_context(task, task_spec, request)
    except Exception as exc:  # the run builds its key again and raises what it raises
        logger.debug("celery-lease: no early acquire for %s: %r", request.id, exc)
        return
    if context is not None:
        leftover = _swap(context)
        if leftover is not None:  # pragma: no cover - one consumer thread
            leftover.give_up()


# A task class -> whether it defines no ``before_start`` of the user's.
_no_before_start: dict[type, bool] = {}


def _always_runs_locked(cls: type) -> bool:
    """Whether a started request of ``cls`` (one :data:`spec.spec_of_task` gives a spec for:
    LockedTask's own ``__call__``, none before it that may answer without the lock; a mixin
    after it runs inside the lock) either reaches ``run_locked`` or fails with
    ``task_failure``: no ``before_start`` of the user's (it may raise ``Ignore``, ``Retry`` or
    ``Reject``: no signal)."""
    answer = _no_before_start.get(cls)
    if answer is None:
        answer = _no_before_start[cls] = not deferral.user_defines(cls, "before_start")
    return answer


def _sent_context(task: Any, task_spec: Spec, request: Any) -> SentContext | None:
    """The context ``run_locked`` would build for ``request``, its first try sent; or None."""
    options = task_spec.options
    if (
        not task_spec.plain_key
        or task_spec.limit is not None
        or options.unique is not None
        or options.on_held == "replace"
    ):
        return None
    # Not a message the broker says it delivered before: Celery may skip that one without a
    # signal (worker_deduplicate_successful_tasks).
    delivery_info = getattr(request, "delivery_info", None)
    if not _always_runs_locked(task.__class__) or (
        delivery_info and delivery_info.get("redelivered")
    ):
        return None
    app = task.app
    resolved = task_spec.kept(app)  # what the last run resolved (and its run will), if still so
    if resolved is None:
        # The key only names a store that is none (what the run raises): not built here.
        resolved = task_spec.resolve(app, get_settings(app), str(getattr(task, "name", "")))
    store = resolved.store
    if not _sends(store):  # it cannot send: no key is built
        return None
    key = resolved.settings.key_prefix + task_spec.key_function(request.args, request.kwargs)
    if SLOT_MARK in key:
        return None
    request_id = request.id
    node, name, task_id = owner_fields(getattr(request, "hostname", None), task.name, request_id)
    context = SentContext(  # positional: see LeaseContext.__init__
        key,
        store,
        resolved.ttl,
        resolved.wait,
        options.max_hold,
        options.cooldown,
        None,  # the run's on_lost, set when it takes the context
        None,  # cancel
        resolved.clock,
        None,  # label
        node,
        name,
        task_id,
    )
    context.request_id = request_id
    context.sent = context.send_first_try(True)  # _sends() checked the store
    return context if context.sent is not None else None


# The last store :func:`_sends` was asked about and its answer (one, held strongly).
_last_asked: tuple[object, bool] = (None, False)


def _sends(store: object) -> bool:
    """Whether ``store`` can send an acquire (:func:`can_send_acquire`; the last answer kept)."""
    global _last_asked
    asked, sends = _last_asked
    if asked is not store or store is None:
        sends = can_send_acquire(store)
        _last_asked = (store, sends)
    return sends


def take(
    request: object,
    key: str,
    store: LockStore,
    ttl: float,
    wait: float,
    on_lost: Callable[[Lease], object],
) -> LeaseContext | None:
    """The parked context of ``request`` for ``run_locked``, when it holds the same key,
    store, ttl and wait (else it is given up); None when none is parked for it."""
    mine = parked  # one read: another thread may swap it
    if mine is None or request is None or mine.request_id != getattr(request, "id", None):
        return None  # none, or another execution's: left to its own run
    if _swap(None) is not mine:  # pragma: no cover - one consumer thread
        return None
    if mine.key != key or mine.store is not store or mine.ttl != ttl or mine.wait != wait:
        mine.give_up()
        return None
    mine.on_lost = on_lost
    return mine


def give_up(task_id: object = None) -> None:
    """Give up the parked try (only ``task_id``'s when given)."""
    mine = parked  # one read: another thread may swap it
    if mine is None or (task_id is not None and mine.request_id != task_id):
        return
    if _swap(None) is mine:
        mine.give_up()


def on_task_revoked(request: Any = None, **_: object) -> None:
    """``task_revoked``: a request revoked (or expired) after its acquire was sent frees it."""
    if parked is not None:
        give_up(getattr(request, "id", None) or "")


def on_task_failure(task_id: object = None, **_: object) -> None:
    """``task_failure`` / ``task_internal_error``: a request that failed before its run took its
    try frees it."""
    if parked is not None:
        give_up(task_id or "")


def on_worker_shutdown(**_: object) -> None:
    """``worker_shutdown``: give up a leftover try."""
    give_up()


def _forget_after_fork() -> None:
    global _lock, parked
    _lock, parked = threading.Lock(), None  # the parent's try: the parent's to give up
    global _last_asked
    _last_asked = (None, False)  # its store may be the parent's


forking.on_fork_child(_forget_after_fork, name="early acquire: the parked try")
