"""celery-lease: singleton Celery tasks on renewed leases with fencing tokens.

The core (leases, renewal, stores protocol, errors) is imported eagerly and needs only the
standard library. Names whose layer needs Celery or an optional driver are loaded on first use
(PEP 562), so ``import celery_lease`` works without the ``redis`` or ``postgres`` extras and fails
only when such a name is used, with a message that says which extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from celery_lease._celery.app_lease import lease
from celery_lease._core.lease import Lease, LeaseContext, current_lease, get_lock_token
from celery_lease._core.renewer import shutdown
from celery_lease.clock import Clock, SystemClock
from celery_lease.durations import Duration, to_seconds
from celery_lease.errors import (
    AlreadyQueuedError,
    LeaseConfigError,
    LeaseError,
    LockLostError,
    LockNotAcquiredError,
    ReplicaLagError,
    RestartGraceError,
    StoreUnavailableError,
)
from celery_lease.stores import async_store_from_url, registry, store_from_url
from celery_lease.stores.base import (
    AsyncLockStore,
    LeaseInfo,
    LockStore,
    SupportsAcquireOrHolder,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
)
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.threaded import ThreadedAsyncStore

if TYPE_CHECKING:
    from celery_lease._celery.task import LockedTask, locked
    from celery_lease.stores.postgres import PostgresLockStore
    from celery_lease.stores.postgres_async import AsyncPostgresLockStore
    from celery_lease.stores.redis import RedisLockStore
    from celery_lease.stores.redis_async import AsyncRedisLockStore
    from celery_lease.stores.sqlite import SQLiteLockStore

__all__ = [
    "AlreadyQueuedError",
    "AsyncLockStore",
    "AsyncPostgresLockStore",
    "AsyncRedisLockStore",
    "Clock",
    "Duration",
    "Lease",
    "LeaseConfigError",
    "LeaseContext",
    "LeaseError",
    "LeaseInfo",
    "LockLostError",
    "LockNotAcquiredError",
    "LockStore",
    "LockedTask",
    "MemoryLockStore",
    "PostgresLockStore",
    "RedisLockStore",
    "ReplicaLagError",
    "RestartGraceError",
    "SQLiteLockStore",
    "StoreUnavailableError",
    "SupportsAcquireOrHolder",
    "SupportsBatchRenew",
    "SupportsInspection",
    "SupportsReleaseNotify",
    "SystemClock",
    "ThreadedAsyncStore",
    "async_store_from_url",
    "current_lease",
    "get_lock_token",
    "lease",
    "locked",
    "shutdown",
    "store_from_url",
    "to_seconds",
]

# name -> (module, extra that provides its driver, or None); the stores' from the store table
_LAZY: dict[str, tuple[str, str | None]] = {
    **registry.lazy_names(),
    "LockedTask": ("celery_lease._celery.task", None),
    "locked": ("celery_lease._celery.task", None),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, extra = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'celery_lease' has no attribute {name!r}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if extra is None:
            raise
        raise ImportError(
            f"celery_lease.{name} needs the {extra!r} extra: pip install 'celery-lease[{extra}]'"
            f" ({exc})"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
