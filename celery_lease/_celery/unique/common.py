"""What every side of unique shares: header names, keys, the clock, the checked header owner,
backend reads and quiet writes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery import states

from celery_lease._celery.settings import LeaseSettings, pick
from celery_lease._core.owners import is_queued_owner, parse_owner
from celery_lease._core.unique_options import BUILTIN_QUEUE_TTL, SUPERSEDED_NAMESPACE, UniqueOptions
from celery_lease.clock import SYSTEM_CLOCK, Clock
from celery_lease.stores.base import LockStore

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask, TaskRequest

logger = logging.getLogger("celery_lease.unique")

# Message header of a unique copy: ``[queued key, owner id]`` of its queued lease.
HEADER = "lease_queued"
# Message header (a count) of a second delivery re-sent to wait for its own running copy.
DEFERRED = "lease_deferred"
NAMESPACE = "queued:"  # Inserted after ``lease_key_prefix`` to name a task key's queued lease.
STARTED = "started"  # The label of a debounced copy's claim on its own tombstone.
TRIES = 8  # Attempts when the key flips between free and held under our feet.
# Unique's wall clock (eta, debounce window); tests swap in a FakeClock.
clock: Clock = SYSTEM_CLOCK


def queued_key(key: str, prefix: str) -> str:
    """The queued lease's key for ``key`` (which starts with ``prefix``)."""
    return prefix + NAMESPACE + key[len(prefix) :]


def superseded_key(task_id: str, prefix: str) -> str:
    return f"{prefix}{SUPERSEDED_NAMESPACE}{task_id}"


def ms(seconds: float) -> int:
    """Whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))


def queue_ttl(unique: UniqueOptions, settings: LeaseSettings) -> float:
    return pick(unique.queue_ttl, settings.default_queue_ttl, BUILTIN_QUEUE_TTL)


def is_started_claim(owner: str) -> bool:
    """Whether ``owner`` is a copy's claim on its own tombstone (not a superseding call's)."""
    return is_queued_owner(owner) and parse_owner(owner).label == STARTED


def header_owner(request: TaskRequest | None, task_id: str | None, qkey: str | None) -> str | None:
    """The header's queued owner if it names this task id (and ``qkey``); else ``None``."""
    header: object = getattr(request, HEADER, None)
    if not isinstance(header, (list, tuple)) or len(header) != 2 or task_id is None:
        return None
    hkey, owner = header
    if not isinstance(hkey, str) or not isinstance(owner, str) or not is_queued_owner(owner):
        return None
    if qkey is not None and hkey != qkey:
        return None
    return owner if parse_owner(owner).task_id == task_id else None


def finished(task: CeleryTask, task_id: str) -> bool | None:
    """Whether copy ``task_id`` is done (a ready state; ``False`` without results, since the
    body runs again); ``None`` when the backend failed (ask later)."""
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


def release_quietly(store: LockStore, key: str, owner: str, why: str) -> None:
    """``store.release`` (owner-checked); a store error is logged, never raised."""
    try:
        store.release(key, owner)
    except Exception as exc:
        logger.warning(
            "celery-lease: releasing %r (%s) failed (%s); it frees itself within its ttl",
            key,
            why,
            exc,
        )


def fail_quietly(task: CeleryTask, task_id: str, exc: Exception) -> None:
    """Store ``exc`` as the FAILURE of copy ``task_id`` (no errback); never raises."""
    try:
        task.backend.mark_as_failure(task_id, exc, call_errbacks=False)
    except Exception as error:  # no result backend, or it is down too: the caller has exc
        logger.debug("celery-lease: could not store the failed publish of %s: %s", task_id, error)


def revoke_quietly(task: CeleryTask, task_id: str, newer: str | None) -> None:
    """Store copy ``task_id`` REVOKED ``"superseded by <newer>"``, so a caller handed its id
    does not wait forever; errors logged."""
    reason = f"superseded by {newer}"
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
