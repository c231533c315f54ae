"""Celery signals sent by locked tasks, from the process (and thread) that runs the task.

Each is a :class:`celery.utils.dispatch.Signal` sent with the task as ``sender`` and the
execution's ``task_id``; ``lock_acquired``, ``lock_lost`` and ``lock_released`` name the ``key``
and the ``slot`` held (0 for a task without ``limit``). A receiver that raises is logged and
never breaks the task. Arguments and moments: docs/operations.md ("Signals for telemetry").
"""

from __future__ import annotations

import logging
from typing import Any

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_duplicate", "lock_lost", "lock_rejected", "lock_released", "send"]

logger = logging.getLogger("celery_lease.signals")

lock_acquired = Signal(
    name="lock_acquired",
    providing_args={"key", "token", "waited", "wait_seconds", "task_id", "slot"},
)
lock_rejected = Signal(
    name="lock_rejected", providing_args={"key", "task_id", "reason", "until", "holder_task_id"}
)
lock_lost = Signal(name="lock_lost", providing_args={"key", "token", "reason", "task_id", "slot"})
lock_released = Signal(
    name="lock_released",
    providing_args={"key", "token", "held_seconds", "task_id", "reason", "pid", "exitcode", "slot"},
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
