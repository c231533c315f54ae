"""Who keeps a key that turned a locked execution away: a running execution, or one that
succeeded and keeps the key for its ``cooldown``.

Read when a skip is reported (:func:`celery_lease._celery.on_held.apply_policy`), so that the
log line, the REVOKED reason and ``lock_rejected`` say ``cooldown``, until when (wall clock) and
after which execution, rather than only "held by another execution". A cooldown keeps the key
under the owner id of the run that succeeded, so it is told from a running holder in two ways:
its lease lasts longer than a renewal of the task's ttl sets (a running copy renews to at most
its ttl), or the result backend shows the holder's task succeeded (a cooldown shorter than the
ttl). One store ``get``, and one backend read when the first does not tell; never raises.

The backend read runs on a thread of its own, waited for at most :data:`BACKEND_WAIT` seconds,
and at most one runs at a time in a process: a result backend that stopped answering (a read
then lasts its client's socket timeout, 120 s for Redis by default) neither holds the skipping
worker slot nor piles up threads; the skip then says the holder's state is unknown.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend

from celery_lease import _forking as forking
from celery_lease._celery import compat
from celery_lease._core.lease import clock_of
from celery_lease._core.owners import Holder, parse_owner

if TYPE_CHECKING:
    from celery_lease._celery.protocols import CeleryTask

__all__ = ["HeldBy", "iso_utc", "look_up"]

logger = logging.getLogger("celery_lease.engine")

BACKEND_WAIT = 0.5
"""Real seconds a skip waits at most for the result backend's answer about the holder."""

_reading = threading.Lock()  # held while a backend read runs (released by its thread)


def _after_fork_in_child() -> None:
    global _reading
    _reading = threading.Lock()  # a read in flight in the parent has no thread in the child


forking.on_fork_child(_after_fork_in_child, name="held_by: backend read")


@dataclass(frozen=True)
class HeldBy:
    """The holder of a key, as read when an execution was turned away from it."""

    key: str
    holder: Holder
    """The holder's owner id, parsed (node, task, task id...)."""
    until: float
    """When (unix seconds) the key frees itself unless its holder renews it: for a cooldown,
    its end."""
    left: float
    """Seconds from the look-up to ``until``."""
    cooldown: bool
    """Whether the holder is a run that succeeded and keeps the key for its ``cooldown``."""
    state_known: bool = True
    """``False`` when the result backend was asked for the holder's state and did not answer
    within :data:`BACKEND_WAIT` (or an earlier read still hangs): the holder may be running or
    in its cooldown."""

    @property
    def reason(self) -> str:
        """``"cooldown"`` or ``"held"``."""
        return "cooldown" if self.cooldown else "held"

    def describe(self) -> str:
        """What keeps the key, after it: ``in its cooldown until 2026-12-05T22:00:36Z (576.0 s
        left), kept by proj.report[<task id>] on w1@host after it succeeded``, or ``held by
        another execution, proj.report[<task id>] on w1@host``."""
        who = _who(self.holder)
        if not self.cooldown:
            if not self.state_known:
                return (
                    f"held by another execution, {who}"
                    " (its state unknown: the result backend did not answer)"
                )
            return f"held by another execution, {who}"
        return (
            f"in its cooldown until {iso_utc(self.until)} ({self.left:.1f} s left),"
            f" kept by {who} after it succeeded"
        )


def iso_utc(unix_seconds: float) -> str:
    """``2026-12-05T22:00:36Z``: the time in UTC, to the second (rounded down)."""
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


def look_up(store: object, key: str, task: CeleryTask | None, ttl: float) -> HeldBy | None:
    """Who holds ``key`` in ``store`` now, or ``None`` when that cannot be told (a store
    without ``get``, a store error, the key already free). Never raises.

    A holder whose owner id records its ttl but no cooldown is running. Otherwise ``ttl``, the
    turned-away task's lease ttl in seconds, tells: a lease held by the same task for longer
    than that is in its cooldown; else ``task.backend`` is asked for the holder's state
    (``SUCCESS``: in its cooldown).
    """
    try:
        get = getattr(store, "get", None)
        if get is None:
            return None
        info = get(key)
        if info is None:
            return None
        holder = parse_owner(info.owner)
        left = max(0.0, float(info.expires_in))
        until = clock_of(store).time() + left
        if holder.ttl is not None and not holder.cooldown:
            # Its owner id records its ttl and no cooldown (as every owner id of this version
            # does): it keeps the key only while it runs, whatever the backend says of it now
            # (it may have ended between the refusal and this read).
            return HeldBy(key, holder, until, left, False)
        same_task = task is not None and holder.task == getattr(task, "name", None)
        if same_task and left > ttl:  # the store tells: no backend read
            return HeldBy(key, holder, until, left, True)
        succeeded = _succeeded(task, holder.task_id)
        return HeldBy(key, holder, until, left, bool(succeeded), state_known=succeeded is not None)
    except Exception:
        logger.debug("celery-lease: could not read who holds %r", key, exc_info=True)
        return None


def _succeeded(task: CeleryTask | None, task_id: str | None) -> bool | None:
    """Whether the result backend of ``task`` shows ``task_id`` succeeded: ``False`` when it
    stores nothing, is ``rpc://``, or answers with an error; ``None`` when it did not answer
    within :data:`BACKEND_WAIT` seconds or an earlier read still runs."""
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
            # The task's backend as this thread sees it: Celery keeps the app's backend per
            # thread (a connection of its own) unless ``result_backend_thread_safe`` is set.
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
