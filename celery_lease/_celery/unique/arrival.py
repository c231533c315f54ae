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
    """A debounced copy, before it takes the run lease: free its queued lease and claim its
    tombstone for the run ``ttl`` plus ``wait``: either a superseding call took it first
    (``Ignore``, REVOKED stored) or nobody supersedes the copy any more. Then free the queued
    lease again (a failed superseding call may have handed it back). Returns the
    :class:`Arrival`, or ``None`` without debounce, when eager, or without ``apply_unique``'s
    header."""
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
    """A debounced copy's claim on its tombstone, from :func:`on_arrival` until :meth:`leave`."""

    __slots__ = ("claim", "hold_ms", "owner", "qkey", "store", "taken", "task_id", "token", "tomb")

    def __init__(self, store: LockStore, tomb: str, claim: str, task_id: str, hold_ms: int):
        self.store, self.tomb, self.claim, self.task_id = store, tomb, claim, task_id
        self.hold_ms = hold_ms
        self.qkey: str | None = None  # the copy's queued lease: key and owner
        self.owner: str | None = None
        self.taken = False  # this arrival's own claim holds the key (not an earlier attempt's)
        self.token: int | None = None  # the claim's token when it was taken

    def claim_or_end(self, task: CeleryTask, request: TaskRequest) -> bool:
        """Take (or renew: same owner, same token) the tombstone; raise ``Ignore`` with REVOKED
        stored if a newer call holds it. Returns whether the claim is fresh (a new token). A
        store error frees what this arrival may hold, then goes on."""
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
            # Its own call's publish raised although the broker took it: the call stores the
            # state, this message ends without its body.
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
            # After REVOKED is stored: a key a failed superseding call hands back to this copy
            # is freed here if taken before, else by that call (it reads the state first).
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
        """The run lease is held: re-assert the claim. One that lapsed and was taken by a
        superseding call ends the copy (``Ignore``; the engine releases the run lease); a
        fresh claim frees a queued key handed back meanwhile."""
        if self.claim_or_end(task, request):
            self._release_queued("the copy's claim was taken again")

    def leave(self) -> None:
        """Free the claim when the execution ends; never raises."""
        if self.taken:
            self.taken = False
            common.release_quietly(self.store, self.tomb, self.claim, "the copy's execution ended")


def _mark_superseded(task: CeleryTask, request: TaskRequest, newer: str | None) -> str:
    """Store REVOKED ``"superseded by <newer>"``, send ``task-revoked``, log; return the reason."""
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
