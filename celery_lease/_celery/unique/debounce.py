"""Debounce, the caller's side: a call supersedes the waiting copy (its tombstone written, its
queued lease taken over) and publishes ``debounce`` later; a failed publish hands the key
back. Rules: the package docstring and ``docs/celery.md#debounce``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from celery_lease._celery.unique import common
from celery_lease._celery.unique.call import Call
from celery_lease._celery.unique.common import logger
from celery_lease._core.owners import Holder, is_queued_owner, parse_owner

if TYPE_CHECKING:
    from celery_lease._celery.protocols import AsyncResultLike
    from celery_lease.stores.base import LeaseInfo


def debounced(call: Call) -> AsyncResultLike:
    """Publish ``debounce`` from now, superseding the waiting copy."""
    run = _Debounce(
        replace(
            call, options={k: v for k, v in call.options.items() if k not in ("eta", "countdown")}
        )
    )
    try:
        for _ in range(common.TRIES):
            result = run.attempt()
            if result is not None:
                return result
    except Exception as exc:
        # A caller may hold this call's id: store the FAILURE so its get() does not hang.
        if run.superseding and not run.settled:
            common.fail_quietly(call.task, call.task_id, exc)
        raise
    return run.gave_way(run.started)


@dataclass(frozen=True)
class _Takeover:
    """What handing the key back to the superseded copy ``waiting_id`` undoes."""

    owner: str
    waiting_id: str
    waiting_owner: str
    waiting_ttl_ms: int
    tomb: str
    tomb_owner: str


class _Debounce:
    """One debounced call's attempts and what they learnt on the way."""

    __slots__ = ("call", "cap", "debounce", "settled", "started", "superseding")

    def __init__(self, call: Call) -> None:
        debounce, cap = call.unique.debounce, call.unique.debounce_max
        assert debounce is not None and cap is not None
        self.call, self.debounce, self.cap = call, debounce, cap
        # Once this call wrote a tombstone a racing caller may hold its id: publishing nothing
        # then still leaves a final state under it.
        self.superseding = False
        self.settled = False  # a failed publish (or store error) stored this call's final state
        self.started: str | None = None  # a copy seen started whose queued lease stayed held

    def gave_way(self, existing: str | None) -> AsyncResultLike:
        """A duplicate of ``existing``; stored REVOKED first once this call superseded."""
        if self.superseding:
            common.revoke_quietly(self.call.task, self.call.task_id, existing)
        return self.call.duplicate(existing)

    def attempt(self) -> AsyncResultLike | None:
        """Take the free key, or supersede its waiting copy; ``None``: look again."""
        call = self.call
        store, qkey = call.store, call.qkey
        owner = call.owner()
        if store.acquire(qkey, owner, common.ms(call.queue_ttl + self.debounce)) is not None:
            return self._publish_first(owner)
        info = store.get(qkey)
        if info is None:
            return None
        old = parse_owner(info.owner)
        if not is_queued_owner(info.owner) or old.task_id is None or old.task_id == call.task_id:
            return self.gave_way(old.task_id)
        tomb = common.superseded_key(old.task_id, call.prefix)
        tomb_owner = call.owner()
        if store.acquire(tomb, tomb_owner, self._tomb_ttl_ms()) is None:
            return self._tomb_refused(info, old.task_id, tomb)
        return self._supersede(info, old, old.task_id, tomb, tomb_owner)

    def _tomb_ttl_ms(self) -> int:
        return common.ms(self.call.queue_ttl + self.cap)

    def _publish_first(self, owner: str) -> AsyncResultLike:
        """The key was free: publish (unless a running copy makes this call its duplicate)."""
        call = self.call
        store, qkey = call.store, call.qkey
        if call.unique.unique == "until_done":
            running = _running_copy(call)
            if running is not None:
                store.release(qkey, owner)
                return self.gave_way(running)
        try:
            # Not freed on failure there: below, once no call can supersede this one.
            return call.publish(owner, free=False, countdown=self.debounce)
        except BaseException as exc:
            # Its own tombstone first, so the state stored below never overwrites a REVOKED.
            own = self._take_own_tomb()
            common.release_quietly(store, qkey, owner, "the publish failed")
            if isinstance(exc, Exception):
                self._store_failed_publish(exc, own)
            raise

    def _tomb_refused(self, info: LeaseInfo, old_id: str, tomb: str) -> AsyncResultLike | None:
        """The tombstone (the right to free that copy's lease) is another's."""
        store = self.call.store
        claimed = store.get(tomb)
        writer = parse_owner(claimed.owner).task_id if claimed is not None else None
        if claimed is not None and writer == old_id and common.is_started_claim(claimed.owner):
            # The copy arrived at a worker and frees its queued lease at once, unless its body
            # published a retry that took the key back: then this call is that retry's duplicate
            # if the key is still its own after every try.
            self.started = old_id
        if writer is None or writer == old_id:
            return None  # gone, or the copy claimed it itself (it started): look again
        if store.get(common.superseded_key(writer, self.call.prefix)) is None:
            # A caller racing us supersedes it: we are that caller's duplicate.
            return self.gave_way(writer)
        # The writer no longer waits. If the lease is still the waiting copy's, the writer
        # handed it back (the copy runs: we are its duplicate); else look again.
        again = store.get(self.call.qkey)
        if again is not None and again.owner == info.owner:
            return self.gave_way(old_id)
        return None

    def _supersede(
        self, info: LeaseInfo, old: Holder, old_id: str, tomb: str, tomb_owner: str
    ) -> AsyncResultLike | None:
        """This call holds the waiting copy's tombstone: take its queued lease over, publish."""
        call = self.call
        store, qkey, now = call.store, call.qkey, call.now
        first = old.taken_at if old.taken_at is not None else now
        delay = max(0.0, min(now + self.debounce, first + self.cap) - now)
        owner = call.owner(first)
        self.superseding = True
        takeover = _Takeover(
            owner, old_id, info.owner, common.ms(info.expires_in), tomb, tomb_owner
        )
        try:
            store.release(qkey, info.owner)  # owner-checked: only that waiting copy's lease
            taken = store.acquire(qkey, owner, common.ms(call.queue_ttl + delay))
        except BaseException as exc:
            self._withdraw_failed(takeover, exc)
            raise
        if taken is None:
            # Another call took the key in between: the old copy stays superseded.
            winner = store.get(qkey)
            if winner is None:
                return None
            return self.gave_way(parse_owner(winner.owner).task_id)
        try:
            return call.publish(owner, free=False, countdown=delay)  # _withdraw frees it
        except BaseException as exc:
            self._withdraw_failed(takeover, exc)
            raise

    def _withdraw_failed(self, takeover: _Takeover, exc: BaseException) -> None:
        own = self._withdraw(takeover)
        if isinstance(exc, Exception):
            self._store_failed_publish(exc, own)
            self.settled = True

    def _withdraw(self, takeover: _Takeover) -> tuple[bool, str | None]:
        """Not published: hand the key back to the superseded copy, so exactly one runs. Steps:
        take our own tombstone (refused: a newer call stands in, stop); free our queued lease;
        unless the copy ended, take the key back under its owner (refused: a new call runs);
        copy ended meanwhile: free it again; else remove its tombstone, it runs. Our tombstone
        stays; a store error leaves nothing running rather than two. Returns what
        :meth:`_take_own_tomb` found."""
        own = self._take_own_tomb()
        if not own[0]:
            return own
        call, t = self.call, takeover
        store, qkey = call.store, call.qkey
        try:
            store.release(qkey, t.owner)
            if common.finished(call.task, t.waiting_id):
                return own
            if store.acquire(qkey, t.waiting_owner, t.waiting_ttl_ms) is None:
                return own
            if common.finished(call.task, t.waiting_id):
                store.release(qkey, t.waiting_owner)
                return own
            store.release(t.tomb, t.tomb_owner)
        except Exception as exc:
            logger.warning(
                "celery-lease: handing %r back to the superseded copy failed (%s); it stays"
                " superseded",
                qkey,
                exc,
            )
        return own

    def _take_own_tomb(self) -> tuple[bool, str | None]:
        """Take our own tombstone (our message, if sent, ends bodiless): ``(True, None)`` when
        taken or after a store error, else ``(False, holder)``."""
        call = self.call
        own_tomb = common.superseded_key(call.task_id, call.prefix)
        try:
            for _ in range(common.TRIES):
                if call.store.acquire(own_tomb, call.owner(), self._tomb_ttl_ms()) is not None:
                    return True, None
                holder = call.store.get(own_tomb)
                if holder is not None:
                    return False, holder.owner
        except Exception as exc:
            logger.warning("celery-lease: taking %r failed (%s)", own_tomb, exc)
        return True, None

    def _store_failed_publish(self, exc: Exception, own: tuple[bool, str | None]) -> None:
        """Store a failed call's final state: FAILURE; REVOKED when a newer call holds its
        tombstone; nothing when its own message started."""
        task, task_id = self.call.task, self.call.task_id
        taken, holder = own
        if not taken and holder is not None:
            newer = parse_owner(holder).task_id
            if newer == task_id and common.is_started_claim(holder):
                return
            if newer not in (None, task_id):
                common.revoke_quietly(task, task_id, newer)
                return
        common.fail_quietly(task, task_id, exc)


def _running_copy(call: Call) -> str | None:
    """The task id of another copy holding the run key (running, or in its cooldown)."""
    info = call.store.get(call.key)
    if info is None:
        return None
    holding_task_id = parse_owner(info.owner).task_id
    return holding_task_id if holding_task_id not in (None, call.task_id) else None
