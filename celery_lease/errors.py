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

The fencing errors live here too, so every module path result backends store is
``celery_lease.errors``. Each constructor takes exactly the positional arguments kept in
``.args``, so ``pickle`` and Celery's json results (``cls(*args)``) rebuild them.
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
    """The lease on ``key`` could not be acquired: ``reason`` is ``"held"`` (past ``wait``) or
    ``"cancelled"`` (through the ``cancel`` event)."""

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
    """A unique task (``on_duplicate="raise"``) was called while the copy ``task_id`` holds
    ``key``: nothing was published. ``reason`` is ``"queued"``."""

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

    ``reason``: ``"expired"`` (not renewed within its ttl), ``"taken"`` (the store no longer
    records this owner), ``"replaced"`` (a newer ``on_held="replace"`` execution asked it to
    stop), ``"max_hold"``, ``"released"`` (released early, e.g. a task re-sending
    its own id) or ``"forked"`` (checked in a forked child: the lease is its parent's).
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
    """Too few replicas acknowledged an acquire in time (``WAIT``): it was asked again for a
    moment, then released. :func:`lease` retries it within its ``wait``."""

    code = "REPLICA_LAG"


class RestartGraceError(StoreUnavailableError):
    """A free key was refused during a Redis store's ``restart_grace``: the server may have lost
    leases, and their old holders must hear it before anyone gets their keys. :func:`lease`
    retries it within its ``wait``, as a held key.

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

    Raised by :mod:`celery_lease.fencing`; nothing was written.

    Attributes:
        key: the lock key whose token was refused, or ``None`` when unknown.
        token: the refused token.
        current: the fence that refused it (the token of the newer write; always ``> token``),
            or ``None`` when the row was deleted between the refusal and the read of its fence.
        resource: what was written, for the message (``"accounts id=1"``, ``"redis key
            'price'"``), or ``None``.
    """

    code = "STALE_TOKEN"

    def __init__(
        self, key: str | None, token: int, current: int | None, resource: str | None = None
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
