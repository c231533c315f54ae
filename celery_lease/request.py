"""The request attributes of a locked execution, defined on Celery's ``Context`` class.

Importing this module (the task layer does) adds ``lock_key``, ``lock_token``, ``lock_waited``,
``lock_lost`` and ``lease`` to :class:`celery.app.task.Context`. Defined on the class, they are
never treated as custom headers (``retry()`` re-sends those) and always have a value; they are
always overwritten when an execution starts, so a message header of the same name cannot forge
them.

``lock_lost`` is a read-only data descriptor: it reads the lease's own loss record
(:attr:`celery_lease.Lease.lost`), so it can never lag behind the renewer, and a message header
named ``lock_lost`` (which Celery stores in the request's ``__dict__``) cannot shadow it. There
is no second copy of the loss state on the request.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

__all__: list[str] = []

Context.lock_key = None
Context.lock_token = None
Context.lock_waited = False
Context.lease = None
Context._lease_run = None  # True on a request a locked execution has claimed


def _get_lock_lost(request: Any) -> bool:
    """Whether the lease of this request's execution is lost (False before it is acquired)."""
    held = request.__dict__.get("lease")
    return held is not None and bool(held.lost)


Context.lock_lost = property(
    _get_lock_lost, doc="True once this execution's lease is lost (read from the lease)."
)
