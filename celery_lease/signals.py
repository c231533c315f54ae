"""Celery signals sent by locked tasks, from the process (and thread) that runs the task.

Each is a :class:`celery.utils.dispatch.Signal` sent with the task object as ``sender``, as
Celery's own task signals are. Connect receivers at import time of a module the worker imports,
so that prefork children inherit them::

    from celery_lease.signals import lock_lost

    @lock_lost.connect
    def page_someone(sender, key, token, reason, **kwargs):
        ...

- ``lock_acquired(key, token, waited, wait_seconds)``: the lease was taken; ``waited`` is True when
  another holder had it first, ``wait_seconds`` is how long acquiring took (seconds).
- ``lock_rejected(key, reason, until, holder_task_id)``: the key stayed held past ``wait``; the
  body did not run. For ``on_held="skip"`` the holder is read: ``reason`` is ``"cooldown"`` (a
  run that succeeded keeps the key for its ``cooldown``) or ``"held"``, ``until`` when the key
  frees itself unless renewed (unix seconds), ``holder_task_id`` the holder's task id; each is
  ``None`` when it could not be read, and for the other policies. ``"held"`` also when the
  result backend did not tell in time whether the holder succeeded.
- ``lock_lost(key, token, reason)``: the lease was lost while the body ran; ``reason`` is
  ``"expired"``, ``"taken"``, ``"released"`` (an operator's force-release) or ``"max_hold"``.
  Sent from the lease dispatcher's thread, never
  the renewer's: a receiver that blocks delays no renewal and no ``on_lost="revoke"`` interrupt
  (only other loss listeners queued behind it). It can arrive after the body ended.
- ``lock_released(key, token, held_seconds)``: the lease was released (or kept for ``cooldown``)
  after the body, or released early because the running task published a message with its own
  id (``retry()``; sent once, at that moment, from the publishing thread); ``held_seconds`` is
  how long it was held. Not sent for a lease that was lost (``lock_lost`` was sent instead:
  there was nothing of ours left to release). An early release sends no ``lock_lost``.
  The worker's main process also sends it, with ``reason="holder_died"``, ``pid`` and
  ``exitcode`` (``sender`` the task, ``held_seconds`` counted from the owner's taken-at),
  when it released the leases of a pool child that died while holding them (SIGKILL, OOM,
  hard time limit).
- ``lock_duplicate(key, task_id, existing_task_id)``: a unique task (``unique=...``) was called
  while the copy ``existing_task_id`` held ``key``; nothing was published for ``task_id`` (the id
  the call would have had). Sent in the caller's process, from the calling thread.

Every signal also carries ``task_id``, the id of the execution (``None`` for a direct call), so
a receiver can tell executions apart: ``lock_lost`` comes from another thread, where
``sender.request`` is not that execution's request.

A receiver that raises is logged and never breaks the task.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.utils.dispatch import Signal

__all__ = [
    "lock_acquired",
    "lock_duplicate",
    "lock_lost",
    "lock_rejected",
    "lock_released",
    "send",
]

logger = logging.getLogger("celery_lease.signals")

lock_acquired = Signal(
    name="lock_acquired", providing_args={"key", "token", "waited", "wait_seconds", "task_id"}
)
lock_rejected = Signal(
    name="lock_rejected",
    providing_args={"key", "task_id", "reason", "until", "holder_task_id"},
)
lock_lost = Signal(name="lock_lost", providing_args={"key", "token", "reason", "task_id"})
lock_released = Signal(
    name="lock_released",
    providing_args={"key", "token", "held_seconds", "task_id", "reason", "pid", "exitcode"},
)

lock_duplicate = Signal(
    name="lock_duplicate", providing_args={"key", "task_id", "existing_task_id"}
)


def send(signal: Signal, sender: object, **named: Any) -> None:
    """Send ``signal`` if anyone listens; a receiver's error is logged, never raised."""
    if not signal.receivers:
        return
    try:
        signal.send(sender=sender, **named)
    except Exception:  # Signal.send is robust in Celery 5; stay safe if that ever changes
        logger.exception("celery-lease: a receiver of %s raised", signal.name)
