"""The one exception tree of celery-lease.

::

    LeaseError                        root: catch this to catch anything we raise
    ├── LockNotAcquiredError          the key stayed held past ``wait`` (or the wait was cancelled)
    │   └── AlreadyQueuedError        a unique task's copy holds the key (``on_duplicate="raise"``)
    ├── LockLostError                 a held lease was lost (not renewed in time, taken, max_hold)
    ├── StoreUnavailableError         the store could not be reached or answered with an error
    │   ├── ReplicaLagError           too few replicas confirmed an acquire in time (undone)
    │   └── RestartGraceError         a server that may have lost leases refuses free keys a while
    ├── LeaseConfigError (ValueError) a bad argument or setting, raised at construction time
    ├── StaleTokenError               a fenced write refused: a newer holder already wrote
    └── MissingRowError (LookupError) a fenced update found no row to update

The last two are raised by :mod:`celery_lease.fencing` (which re-exports them); they live here
so that every exception's module path, which result backends store, is ``celery_lease.errors``.

Every constructor takes exactly the positional arguments kept in ``.args`` and no keyword-only
ones, so the exceptions survive ``pickle`` and Celery's json result serializer, which rebuilds
an exception as ``cls(*args)``.
"""

from __future__ import annotations

__all__ = [
    "AlreadyQueuedError",
    "LeaseConfigError",
    "LeaseError",
    "LockLostError",
    "LockNotAcquiredError",
    "MissingRowError",
    "ReplicaLagError",
    "RestartGraceError",
    "StaleTokenError",
    "StoreUnavailableError",
]


class LeaseError(Exception):
    """Root of every exception raised by celery-lease."""

    code: str = "LEASE_ERROR"


class LockNotAcquiredError(LeaseError):
    """The lease on ``key`` could not be acquired.

    ``reason`` is ``"held"`` (another holder kept it past ``wait``) or ``"cancelled"`` (the wait
    was aborted through its ``cancel`` event).
    """

    code = "LOCK_NOT_ACQUIRED"
    http_status = 409
    is_rejection = True

    def __init__(self, key: str, reason: str = "held") -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        if self.reason == "cancelled":
            return f"waiting for the lease on {self.key!r} was cancelled"
        return f"the lease on {self.key!r} is held by another owner"


class AlreadyQueuedError(LockNotAcquiredError):
    """A unique task (``unique=...``, ``on_duplicate="raise"``) was called while the copy
    ``task_id`` holds ``key``: nothing was published. ``reason`` is ``"queued"``."""

    code = "ALREADY_QUEUED"

    def __init__(self, key: str, task_id: str | None = None) -> None:
        LeaseError.__init__(self, key, task_id)
        self.key = key
        self.task_id = task_id
        self.reason = "queued"

    def __str__(self) -> str:
        return f"the unique key {self.key!r} is held by the copy {self.task_id!r}"


class LockLostError(LeaseError):
    """The lease on ``key`` was lost while its holder ran.

    ``reason`` is ``"expired"`` (not renewed within its ttl), ``"taken"`` (the store no longer
    records this owner: it expired there, and someone else may hold it), ``"max_hold"``,
    ``"released"`` (its holder released it early, e.g. a task re-sending its own id) or
    ``"forked"`` (checked in a forked child: the lease is its parent's).
    """

    code = "LOCK_LOST"

    def __init__(self, key: str, reason: str = "lost") -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        return f"the lease on {self.key!r} was lost ({self.reason})"


class StoreUnavailableError(LeaseError):
    """The lock store could not be reached or failed; the driver's error is chained."""

    code = "STORE_UNAVAILABLE"


class ReplicaLagError(StoreUnavailableError):
    """An acquire was refused because too few replicas acknowledged it in time (``WAIT``).

    The store asked again for a moment (a replica that just synced) and then released the
    lease: a failover could have lost it. Asking again later may succeed, so :func:`lease`
    retries it within its ``wait``, and raises it only when the wait runs out.
    """

    code = "REPLICA_LAG"


class RestartGraceError(StoreUnavailableError):
    """A free key was refused: the server may have lost leases (restarted, flushed) and is in
    its restart grace (a Redis store's ``restart_grace``), so that their old holders hear they
    lost them before anyone else gets their keys.

    The message says why, until when and how to turn the grace off for a throwaway server.
    :func:`lease` retries it within its ``wait``, as a held key, and raises it when the wait
    runs out.

    Attributes:
        until: when the grace ends (Unix time in seconds, the server's clock).
    """

    code = "RESTART_GRACE"

    def __init__(self, message: str, until: float) -> None:
        super().__init__(message, until)
        self.until = until

    def __str__(self) -> str:
        return str(self.args[0])


class LeaseConfigError(LeaseError, ValueError):
    """A bad argument or setting; the message names the parameter, the value and what is allowed."""

    code = "LEASE_CONFIG"


class StaleTokenError(LeaseError):
    """A write carrying ``token`` was refused: a newer holder already wrote with ``current``.

    Raised by the fenced writes of :mod:`celery_lease.fencing`. Nothing was written. Like every
    error of celery-lease it survives ``pickle`` and Celery's json result serializer (the
    constructor's arguments are ``.args``).

    Attributes:
        key: the lock key whose token was refused, or ``None`` when the write was given a token
            without a key outside any lease.
        token: the refused token.
        current: the fence that refused it (the token of the newer write; always ``> token``),
            or ``None`` when the row was deleted between the refusal and the read of its fence.
        resource: what was written, for the message (``"accounts id=1"``, ``"redis key
            'price'"``), or ``None``.
    """

    code = "STALE_TOKEN"

    def __init__(
        self,
        key: str | None,
        token: int,
        current: int | None,
        resource: str | None = None,
    ) -> None:
        super().__init__(key, token, current, resource)
        self.key = key
        self.token = token
        self.current = current
        self.resource = resource

    def __str__(self) -> str:
        what = f" to {self.resource}" if self.resource else ""
        lease = f" of the lease on {self.key!r}" if self.key is not None else ""
        newer = (
            "a newer holder" if self.current is None else f"a newer holder (token {self.current})"
        )
        return (
            f"the write{what} with token {self.token}{lease} was refused: {newer} already"
            " wrote, so this holder's lease was lost"
        )


class MissingRowError(LeaseError, LookupError):
    """A fenced update found no row to update (use the upsert helper to create it).

    Attributes:
        resource: the row looked for (``"accounts id=42"``).
    """

    code = "MISSING_ROW"

    def __init__(self, resource: str) -> None:
        super().__init__(resource)
        self.resource = resource

    def __str__(self) -> str:
        return f"a fenced update found no row {self.resource}: nothing was written"
