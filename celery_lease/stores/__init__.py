"""Lock stores: the protocol and its implementations (each in its own module, loaded on use)."""

from celery_lease.stores.base import (
    AsyncLockStore,
    LeaseInfo,
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
)
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.registry import async_store_from_url, store_from_url

__all__ = [
    "AsyncLockStore",
    "LeaseInfo",
    "LockStore",
    "MemoryLockStore",
    "SupportsBatchRenew",
    "SupportsInspection",
    "SupportsReleaseNotify",
    "async_store_from_url",
    "store_from_url",
]
