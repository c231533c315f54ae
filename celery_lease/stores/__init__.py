"""Lock stores: the protocol and its implementations (each in its own module, loaded on use)."""

from celery_lease.stores.base import (
    LeaseInfo,
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
    store_from_url,
)
from celery_lease.stores.memory import MemoryLockStore

__all__ = [
    "LeaseInfo",
    "LockStore",
    "MemoryLockStore",
    "SupportsBatchRenew",
    "SupportsInspection",
    "SupportsReleaseNotify",
    "store_from_url",
]
