"""Debounce, the worker's side: a debounced copy claims its own tombstone key before it takes
the run lease (:func:`on_arrival`), and ends REVOKED if a newer call superseded it."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from celery.exceptions import Ignore

from celery_lease._celery.protocols import is_inspectable
from celery_lease._celery.settings import LeaseSettings
from celery_lease._celery.unique import common
from celery_lease._celery.unique.common import logger
from celery_lease._core.owners import parse_owner, queued_owner
from celery_lease._core.unique_options import UniqueOptions
from celery_lease.stores.base import LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest


def on_arrival(
    task: CeleryTask,
    request: TaskRequest,
    store: LockStore,
    key: str,
    settings: LeaseSettings,
    unique: UniqueOptions,
    ttl: float,
    wait: float = 0.0,
) -> Arrival | None:
    """A debounced copy, before it takes the run lease: end here if a newer call superseded it.

    The copy frees its queued lease (owner-checked), then claims its tombstone key for itself
    (a started claim naming its task id) for the run lease's ``ttl`` plus ``wait``
    (``lock_wait``): either a superseding call took it first (the copy ends REVOKED) or no call
    supersedes the copy from now on. The queued lease is freed again once the claim stands: a
    superseding call whose publish failed may have handed it back in between.

    Returns the claim (:class:`Arrival`), which the engine re-asserts once the run lease is
    held (:meth:`Arrival.confirm`) and frees when the execution ends (:meth:`Arrival.leave`);
    ``None`` for a copy without debounce, an eager run, or a message not published through
    ``apply_unique``. A claim of an earlier attempt of this very copy still standing (a second
    delivery while its first runs) stands for this one; one whose acquire failed is freed
    before the error goes on.

    Raises:
        Ignore: the copy was superseded (its REVOKED state is stored).
    """
    if unique.debounce is None or getattr(request, "is_eager", False):
        return None
    task_id = getattr(request, "id", None)
    prefix = settings.key_prefix
    qkey = common.queued_key(key, prefix)
    owner = common.header_owner(request, task_id, qkey)
    if owner is None or task_id is None:
        return None
    store.release(qkey, owner)
    at = int(common.clock.time() * 1000)
    claim = queued_owner(getattr(task, "name", "?"), task_id, at, common.STARTED)
    arrival = Arrival(
        store, common.superseded_key(task_id, prefix), claim, task_id, common.ms(ttl + wait)
    )
    arrival.qkey, arrival.owner = qkey, owner
    arrival.claim_or_end(task, request)
    common.release_quietly(store, qkey, owner, "the copy started")
    return arrival


def leave(arrival: Arrival | None) -> None:
    """:meth:`Arrival.leave` of an arrival, if any."""
    if arrival is not None:
        arrival.leave()


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
            # this message, and the call took it. Not superseded (never by itself): it ends
            # without its body and stores nothing; the call stores its state.
            self._release_queued("its publish failed")
            logger.info(
                "celery-lease: %s[%s] its call's publish failed: body not run",
                getattr(task, "name", "?"),
                self.task_id,
            )
            raise Ignore("its publish failed")
        try:
            reason = _mark_superseded(task, request, newer)
        finally:
            # After the REVOKED state is stored: a superseding call whose publish failed may
            # hand the key back to this copy; a lease under this copy's own owner taken before
            # this release is freed here, one taken after it is freed by that call, which
            # reads the state first.
            self._release_queued("the copy was superseded")
        raise Ignore(reason)

    def _release_queued(self, why: str) -> None:
        if self.qkey is not None and self.owner is not None:
            common.release_quietly(self.store, self.qkey, self.owner, why)

    def _claim(self) -> tuple[bool, str | None]:
        store, task_id = self.store, self.task_id
        for _ in range(common.TRIES):
            token = store.acquire(self.tomb, self.claim, self.hold_ms)
            if token is not None:
                self.taken, self.token = True, token
                return True, None
            self.taken, self.token = False, None
            holder = store.get(self.tomb) if is_inspectable(store) else None
            if holder is None and is_inspectable(store):
                continue  # freed in between (a withdrawing call handed the key back): again
            newer = parse_owner(holder.owner).task_id if holder is not None else None
            return holder is not None and newer == task_id and common.is_started_claim(
                holder.owner
            ), newer
        return False, None

    def confirm(self, task: CeleryTask, request: TaskRequest) -> None:
        """The run lease is held: re-assert the claim before the body starts. A claim that
        lapsed meanwhile (a wait for the run lease, a stall) and was taken by a superseding
        call ends the copy here, REVOKED (``Ignore``; the engine releases the run lease): the
        newer call runs, never both.

        A claim taken afresh here (it had lapsed, or it was an earlier attempt's) may follow a
        superseding call that handed the queued key back to this copy while it had none: that
        key is freed (owner-checked), as at the arrival.

        Raises:
            Ignore: the copy was superseded while it waited for the run lease.
        """
        if self.claim_or_end(task, request):
            self._release_queued("the copy's claim was taken again")

    def leave(self) -> None:
        """The execution ends (its body ran, or it ends without it): free the claim
        (owner-checked: this arrival's own). From here a call may supersede a retry of this
        copy that waits in the queue (the retry then ends REVOKED). Never raises."""
        if self.taken:
            self.taken = False
            common.release_quietly(self.store, self.tomb, self.claim, "the copy's execution ended")


def _mark_superseded(task: CeleryTask, request: TaskRequest, newer: str | None) -> str:
    """Store the copy of ``request`` REVOKED, ``"superseded by <newer>"``, send its
    ``task-revoked`` event and log it; returns the reason (the caller raises ``Ignore``)."""
    reason = f"superseded by {newer}"
    task.backend.mark_as_revoked(cast(str, request.id), reason, request=request)
    if task.send_events:
        try:
            task.send_event(
                "task-revoked", terminated=False, signum=None, expired=False, reason=reason
            )
        except Exception:
            logger.warning("celery-lease: could not send task-revoked for %s", request.id)
    logger.info("celery-lease: %s[%s] %s: body not run", task.name, request.id, reason)
    return reason
