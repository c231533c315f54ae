"""Public typed aliases of celery-lease's options, for annotations in your code and ours.

::

    from celery_lease.types import Duration, OnHeld, OnLost

    def schedule(policy: OnHeld = "skip", ttl: Duration = "30s") -> None: ...

mypy (``--strict``) then rejects ``on_held="skp"`` where a signature uses :data:`OnHeld`.
"""

from __future__ import annotations

from typing import Literal

from celery_lease.durations import Duration

__all__ = ["Duration", "OnHeld", "OnLost", "Unique"]

OnHeld = Literal["raise", "skip", "retry"]
"""What a run does when the key stays held past ``wait``: raise ``LockNotAcquiredError``
(default), skip the body, or retry the task later."""

OnLost = Literal["mark", "revoke"]
"""What happens when the lease is lost while the body runs: mark it (``request.lock_lost``,
default) or stop the body (revoke)."""

Unique = Literal["running", "queued"]
"""Reserved for issue 9 (uniqueness while running, or from enqueue until the run ends)."""
