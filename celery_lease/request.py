"""The request attributes of a locked execution, defined on Celery's ``Context`` class.

Importing this module (the task layer does) adds ``lock_key``, ``lock_token``, ``lock_waited``,
``lock_lost`` and ``lease`` to :class:`celery.app.task.Context`. Defined on the class, they are
never treated as custom headers (``retry()`` re-sends those) and always have a value; they are
always overwritten when an execution starts, so a message header of the same name cannot forge
them. ``lock_lost`` is a data descriptor read live from the lease.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

__all__: list[str] = []

Context.lock_key = None
Context.lock_token = None
Context.lock_waited = False
Context.lease = None
Context._lease_run = None
Context._lock_lost_mark = False


def _get_lock_lost(request: Any) -> bool:
    held = request.__dict__.get("lease")
    return bool(request.__dict__.get("_lock_lost_mark")) or (held is not None and held.lost)


def _set_lock_lost(request: Any, value: bool) -> None:
    request.__dict__["_lock_lost_mark"] = bool(value)


# A data descriptor: live from the lease (no lag behind the renewer), and a message header of
# the same name cannot shadow it.
Context.lock_lost = property(_get_lock_lost, _set_lock_lost)
