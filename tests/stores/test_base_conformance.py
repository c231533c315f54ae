"""celery_lease.stores.base.conforms: a store's capabilities are read with ``getattr``, so a
wrapper delegating through ``__getattr__`` offers what the store it wraps offers, on every
Python (``isinstance`` against a runtime-checkable protocol stopped seeing such attributes in
3.12)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import pytest

from celery_lease._core.options import validate_options
from celery_lease.clock import Clock
from celery_lease.stores.base import (
    AsyncLockStore,
    LockStore,
    SupportsBatchRenew,
    SupportsInspection,
    SupportsReleaseNotify,
    conforms,
)
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.sqlite import SQLiteLockStore


class Delegating:
    """The tracing/metrics wrapper pattern: every attribute comes from the wrapped store."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TestDelegatingWrappers:
    def test_a_wrapper_offers_what_its_store_offers(self) -> None:
        wrapper = Delegating(MemoryLockStore())
        assert conforms(wrapper, LockStore)
        assert conforms(wrapper, SupportsInspection)
        assert conforms(wrapper, SupportsReleaseNotify)

    def test_a_wrapper_offers_nothing_its_store_lacks(self, tmp_path: Path) -> None:
        """One wrapper class around different stores: the answer is per wrapped store, not
        remembered for the class."""
        of_memory = Delegating(MemoryLockStore())
        of_sqlite = Delegating(SQLiteLockStore(str(tmp_path / "s.db")))
        of_nothing = Delegating(object())
        assert conforms(of_memory, SupportsReleaseNotify)
        assert not conforms(of_nothing, LockStore)
        assert conforms(of_sqlite, LockStore)
        assert conforms(of_memory, SupportsBatchRenew) == hasattr(MemoryLockStore, "renew_many")
        assert conforms(of_sqlite, SupportsBatchRenew) == hasattr(SQLiteLockStore, "renew_many")
        assert not conforms(of_nothing, SupportsInspection)

    def test_a_wrapped_store_is_accepted_where_a_store_is_asked_for(self) -> None:
        """lease(store=...) validates its options: a delegating wrapper is a LockStore."""
        wrapper = Delegating(MemoryLockStore())
        options = validate_options({"store": wrapper}, where="lease")
        assert options.store is wrapper


class TestMembers:
    def test_a_missing_or_none_method_does_not_conform(self) -> None:
        class NoRelease:
            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                return 1

            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                return True

        class ReleaseIsNone(NoRelease):
            release = None

        assert not conforms(NoRelease(), LockStore)
        assert not conforms(ReleaseIsNone(), LockStore)

    def test_properties_count_as_members(self) -> None:
        """AsyncLockStore's ``sync`` is a property: a class with the coroutines but no ``sync``
        is not an async store; the threaded adapter, which has it, is."""
        from celery_lease.stores.threaded import ThreadedAsyncStore

        class NoSync:
            async def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                return 1

            async def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                return True

            async def release(self, key: str, owner: str) -> None:
                return None

            async def wait_for_release(self, key: str, timeout: float) -> bool:
                return False

            async def aclose(self) -> None:
                return None

        assert not conforms(NoSync(), AsyncLockStore)
        assert conforms(ThreadedAsyncStore(MemoryLockStore()), AsyncLockStore)
        assert not conforms(MemoryLockStore(), AsyncLockStore)

    def test_any_protocol_works_and_a_plain_class_is_refused(self) -> None:
        class Named(Protocol):
            name: str

        class HasName:
            name = "x"

        assert conforms(HasName(), Named)
        assert not conforms(object(), Named)
        assert conforms(Delegating(MemoryLockStore()).clock, Clock)
        with pytest.raises(TypeError, match=r"needs a typing\.Protocol"):
            conforms(object(), MemoryLockStore)
