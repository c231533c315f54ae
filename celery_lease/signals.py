"""Celery signals sent by locked tasks, from the process (and thread) that runs the task.

Each is a :class:`celery.utils.dispatch.Signal` sent with the task as ``sender`` and the
execution's ``task_id``; connect receivers at import of a module the worker imports, so prefork
children inherit them. A receiver that raises is logged and never breaks the task. Arguments and
moments: docs/operations.md ("Signals for telemetry").

- ``lock_acquired(key, token, waited, wait_seconds)``: the lease was taken.
- ``lock_rejected(key, reason, until, holder_task_id)``: the key stayed held past ``wait``.
- ``lock_lost(key, token, reason)``: lost while the body ran; sent from the dispatcher thread,
  never the renewer's, so a blocking receiver delays no renewal; may arrive after the body.
- ``lock_released(key, token, held_seconds)``: released (or kept for ``cooldown``); from the
  worker's main process with ``reason="holder_died"``, ``pid``, ``exitcode`` for a dead child.
- ``lock_duplicate(key, task_id, existing_task_id)``: a unique task's call published nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_duplicate", "lock_lost", "lock_rejected", "lock_released", "send"]

logger = logging.getLogger("celery_lease.signals")

lock_acquired = Signal(
    name="lock_acquired", providing_args={"key", "token", "waited", "wait_seconds", "task_id"}
)
lock_rejected = Signal(
    name="lock_rejected", providing_args={"key", "task_id", "reason", "until", "holder_task_id"}
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
