"""Public typed aliases of celery-lease's options, for annotations (mypy rejects ``"skp"``)."""

from __future__ import annotations

from typing import Literal

from celery_lease.durations import Duration

__all__ = ["Duration", "OnDuplicate", "OnHeld", "OnLost", "Unique"]

OnHeld = Literal["raise", "skip", "retry", "replace"]
"""What a run does when the key stays held past ``wait``: raise ``LockNotAcquiredError``
(default), skip the body, or retry the task later; ``"replace"`` asks the holder to stop at
once and takes the key when it is free (a task option only)."""

OnLost = Literal["mark", "revoke"]
"""What happens when the lease is lost while the body runs: mark it (``request.lock_lost``,
default) or stop the body (revoke)."""

Unique = Literal["while_queued", "until_done"]
"""Unique at enqueue (``lock_unique``, ``locked(unique=)``): a call is a duplicate, and nothing is
published for it, while a copy waits in the queue (``"while_queued"``), or while a copy waits,
runs, or is in its cooldown (``"until_done"``). ``None`` (the default): every call is published."""

OnDuplicate = Literal["existing", "raise"]
"""What a duplicate call of a unique task gets: the ``AsyncResult`` of the copy holding the key
(``"existing"``, default) or ``AlreadyQueuedError`` (``"raise"``)."""
