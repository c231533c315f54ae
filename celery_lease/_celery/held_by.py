"""Who keeps a key that turned a locked execution away: a running execution, or one in its
``cooldown`` (its lease outlasts a renewal of the ttl, or a SUCCESS is stored). The backend read
runs on its own thread, at most :data:`BACKEND_WAIT` s, one at a time per process, so a hung
backend neither holds the worker slot nor piles up threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, cast

from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend

from celery_lease import _forking as forking
from celery_lease._celery import compat
from celery_lease._core.lease import clock_of
from celery_lease._core.owners import Holder, parse_owner
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import SLOT_MARK, split_slot

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask

logger = logging.getLogger("celery_lease.engine")

BACKEND_WAIT = 0.5  # Real seconds a skip waits at most for the backend's answer about the holder.
_reading = threading.Lock()  # held while a backend read runs (released by its thread)


def _after_fork_in_child() -> None:
    global _reading
    _reading = threading.Lock()  # a read in flight in the parent has no thread in the child


forking.on_fork_child(_after_fork_in_child, name="held_by: backend read")


@dataclass(frozen=True)
class HeldBy:
    """The holder of a key when an execution was turned away: ``until`` (unix s) it frees itself
    unless renewed, ``left`` seconds; ``state_known`` False when the backend did not answer."""

    key: str
    holder: Holder
    until: float
    left: float
    cooldown: bool
    state_known: bool = True

    @property
    def reason(self) -> str:
        return "cooldown" if self.cooldown else "held"

    def describe(self) -> str:
        """``in its cooldown until 2026-12-05T22:00:36Z (576.0 s left), kept by proj.report[<id>]
        on w1@host after it succeeded``, or ``held by another execution, proj.report[<id>] on
        w1@host``."""
        who = _who(self.holder)
        if self.cooldown:
            return (
                f"in its cooldown until {iso_utc(self.until)} ({self.left:.1f} s left),"
                f" kept by {who} after it succeeded"
            )
        unknown = (
            "" if self.state_known else " (its state unknown: the result backend did not answer)"
        )
        return f"held by another execution, {who}{unknown}"


def iso_utc(unix_seconds: float) -> str:
    """``2026-12-05T22:00:36Z``: UTC, to the second (rounded down)."""
    moment = datetime.fromtimestamp(int(unix_seconds), tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _who(holder: Holder) -> str:
    if holder.task is not None or holder.task_id is not None:
        name = f"{holder.task or '?'}[{holder.task_id or '?'}]"
    elif holder.label is not None:
        name = repr(holder.label)
    else:
        name = holder.raw
    return name if holder.node is None else f"{name} on {holder.node}"


def look_up(
    store: object, key: str, task: CeleryTask | None, ttl: float, *, limited: bool = False
) -> HeldBy | None:
    """Who holds ``key`` in ``store`` now, or ``None`` when that cannot be told; never raises. A
    lease of the same task held longer than ``ttl`` (s), or a SUCCESS in the backend, is a
    cooldown. ``limited`` (a task with a ``limit``): the key is kept by its slots' holders, read
    with ``store.list`` (inspection stores only); the one whose slot frees soonest is named."""
    try:
        info = _soonest_slot(store, key) if limited else _the_key(store, key)
        if info is None:
            return None
        holder = parse_owner(info.owner)
        left = max(0.0, float(info.expires_in))
        until = clock_of(store).time() + left
        if holder.ttl is not None and not holder.cooldown:
            # Running, whatever the backend says now (it may have ended since the refusal).
            return HeldBy(key, holder, until, left, False)
        same_task = task is not None and holder.task == getattr(task, "name", None)
        if same_task and left > ttl:  # the store tells: no backend read
            return HeldBy(key, holder, until, left, True)
        succeeded = _succeeded(task, holder.task_id)
        return HeldBy(key, holder, until, left, bool(succeeded), state_known=succeeded is not None)
    except Exception:
        logger.debug("celery-lease: could not read who holds %r", key, exc_info=True)
        return None


def _the_key(store: object, key: str) -> LeaseInfo | None:
    get = getattr(store, "get", None)
    return None if get is None else cast("LeaseInfo | None", get(key))


def _soonest_slot(store: object, key: str) -> LeaseInfo | None:
    """The live slot of ``key`` that frees soonest (the key itself and other keys left out)."""
    list_ = getattr(store, "list", None)
    if list_ is None:
        return None
    listed = cast("list[LeaseInfo]", list_(prefix=key + SLOT_MARK))
    slots = [info for info in listed if _slot_of(key, info.key) is not None]
    return min(slots, key=lambda info: info.expires_in, default=None)


def _slot_of(key: str, store_key: str) -> int | None:
    """The slot of ``key`` that ``store_key`` is, else ``None``."""
    base, slot = split_slot(store_key)
    return slot if base == key else None


def _succeeded(task: CeleryTask | None, task_id: str | None) -> bool | None:
    """Whether the backend shows ``task_id`` succeeded (``False``: no results or an error;
    ``None``: no answer within :data:`BACKEND_WAIT`, or an earlier read still runs)."""
    if task is None or task_id is None:
        return False
    backend = getattr(task, "backend", None)
    if isinstance(backend, (DisabledBackend, RPCBackend)):
        return False  # no results stored; rpc:// results live on the caller's queue
    if compat.task_meta_reader(backend) is None:
        return False
    reading = _reading
    if not reading.acquire(blocking=False):
        return None  # an earlier read still hangs: do not pile up another
    answer: list[Mapping[str, object]] = []

    def read() -> None:
        try:
            # Celery keeps the backend per thread unless ``result_backend_thread_safe``.
            shared = getattr(backend, "thread_safe", False) is True
            get = compat.task_meta_reader(backend if shared else getattr(task, "backend", None))
            if get is not None:
                answer.append(get(task_id))
        except Exception:  # an unreachable backend tells nothing
            logger.debug("celery-lease: could not read the state of %s", task_id, exc_info=True)
        finally:
            reading.release()

    reader = threading.Thread(target=read, name="celery-lease-held-by", daemon=True)
    try:
        reader.start()
    except BaseException:
        reading.release()
        raise
    reader.join(BACKEND_WAIT)
    if reader.is_alive():
        return None
    return bool(answer) and answer[0].get("status") == "SUCCESS"
