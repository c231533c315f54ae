"""The per-task hot path: what it must not do, and that its shortcuts give the same answers.

A LockedTask's own Python per task is kept small (traced in-process by
``benchmarks/bench_task_overhead.py``). Each shortcut here is checked against the slow path it
stands for, and the costs it avoids are checked as behaviour (no protocol check for a free key,
no finished lease kept alive by the renewer), never as timings.
"""

from __future__ import annotations

import gc
import inspect
import re
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_lease import MemoryLockStore, lease
from celery_lease._core.keys import _bind, _binder, _canonical_argument, _field, _simple_field
from celery_lease._core.owners import make_owner
from celery_lease._core.renewer import COMPACT_AFTER, get_renewer
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore


def _a(x, y): ...  # type: ignore[no-untyped-def]
def _b(x, y=2, *, z=3): ...  # type: ignore[no-untyped-def]
def _c(x, *, z): ...  # type: ignore[no-untyped-def]
def _d(x, /, y, *args, **kwargs): ...  # type: ignore[no-untyped-def]
def _e(): ...  # type: ignore[no-untyped-def]
def _f(x=None, y=None): ...  # type: ignore[no-untyped-def]


SIGNATURES = [inspect.signature(f) for f in (_a, _b, _c, _d, _e, _f)]
NAMES = ["x", "y", "z", "args", "kwargs", "w"]


def _slow(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return list(_bind(signature, args, kwargs).arguments.items())
    except TypeError:
        return TypeError


def _fast(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return list(_binder(signature)(args, kwargs).items())
    except TypeError:
        return TypeError


class TestBinder:
    @settings(max_examples=400, deadline=None)
    @given(
        index=st.integers(0, len(SIGNATURES) - 1),
        args=st.lists(st.integers(), max_size=4).map(tuple),
        kwargs=st.dictionaries(st.sampled_from(NAMES), st.integers(), max_size=4),
    )
    def test_the_fast_binder_gives_what_signature_bind_gives(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Same arguments in the same order (defaults applied), or TypeError where bind raises."""
        signature = SIGNATURES[index]
        assert _fast(signature, args, kwargs) == _slow(signature, args, kwargs)

    def test_a_call_that_does_not_fit_raises_binds_own_error(self) -> None:
        """A missing argument raises Signature.bind's TypeError, naming the parameter."""
        with pytest.raises(TypeError, match="'y'"):
            _binder(SIGNATURES[0])((1,), {})


class _CountingStore:
    """A store without ``wait_for_release`` (as SQLite) that counts lookups of that name."""

    def __init__(self) -> None:
        self.inner = MemoryLockStore()
        self.lookups = 0

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self.inner.acquire(key, owner, ttl_ms)

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self.inner.renew(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self.inner.release(key, owner)

    def __getattr__(self, name: str) -> Any:
        if name == "wait_for_release":
            self.lookups += 1
        raise AttributeError(name)


class TestAcquireCost:
    def test_a_free_key_never_looks_for_release_notification(self) -> None:
        """Acquiring a free key does not check the store for ``wait_for_release`` (a protocol
        check of every member, tens of us, each time for a store without it, e.g. SQLite)."""
        store = _CountingStore()
        for n in range(3):
            with lease(f"k{n}", store=store):
                pass
        assert store.lookups == 0

    def test_a_held_key_is_polled_until_it_is_released(self) -> None:
        """A waiter on a held key (store without notification) gets it after the release."""
        store = _CountingStore()
        tokens: list[int] = []
        with lease("k", store=store) as first:

            def wait() -> None:
                with lease("k", store=store, wait=REAL_TIMEOUT) as second:
                    tokens.append(second.token)

            waiter = threading.Thread(target=wait)
            waiter.start()
            for _ in range(2000):  # until the waiter found the key held and looked it up
                if store.lookups:
                    break
                threading.Event().wait(0.005)
        waiter.join(REAL_TIMEOUT)
        assert tokens and tokens[0] > first.token
        assert store.lookups >= 1


class TestOwnerIds:
    def test_owner_ids_are_unique_and_readable(self) -> None:
        """``host/pid/16 hex digits`` (then the holder fields), never the same twice."""
        ids = [make_owner() for _ in range(20000)]
        assert len(set(ids)) == len(ids)
        assert all(re.match(r"[^/;]+/\d+/[0-9a-f]{16}(;|$)", i) for i in ids)


class TestRenewerHeaps:
    def test_finished_leases_do_not_pile_up_in_the_renewer(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Leases taken and released one after another leave at most ~COMPACT_AFTER items in
        the renewer's heaps (each held a finished lease alive for up to a ttl before)."""
        with lease("kept", store=store, ttl=3, clock=clock):
            for n in range(4 * COMPACT_AFTER):
                with lease(f"k{n}", store=store, ttl=3, clock=clock):
                    pass
            renewer = get_renewer(clock, store)
            assert len(renewer._heap) <= COMPACT_AFTER + 2
            assert len(renewer._deadlines) <= COMPACT_AFTER + 2

    def test_a_held_lease_is_still_renewed_after_the_heaps_were_rebuilt(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """Compaction keeps the items of held leases: the one held throughout is renewed."""
        with lease("kept", store=store, ttl=3, clock=clock) as held:
            for n in range(2 * COMPACT_AFTER):
                with lease(f"k{n}", store=store, ttl=3, clock=clock):
                    pass
            clock.advance(1.0)
            store.wait_renewals(1)
            assert [key for key, _ in store.renewals] == ["kept"]
            assert not held.lost


class TestNoCyclicGarbage:
    def test_ended_leases_are_freed_without_the_cyclic_collector(self) -> None:
        """Leases entered and left one after another (past a compaction of the renewer's
        heaps) leave nothing for the cyclic garbage collector: no frame pointing at itself, no
        lease held in a cycle with its renewer entry (each would make collections more frequent
        and longer, a cost every task pays)."""
        store = MemoryLockStore()
        with lease("warm", store=store):
            pass
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for n in range(COMPACT_AFTER + 50):
                with lease(f"k{n}", store=store):
                    pass
            with lease("nested", store=store), lease("nested", store=store):
                pass
            gc.collect()
            ours = [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("cel")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert ours == []


class TestLossEvent:
    def test_wait_lost_after_the_loss_returns_at_once(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The loss event, made on the first wait, starts set when the loss came before."""
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            store.acquire("k", "another-owner", 60_000)  # taken, not just freed
            clock.advance(1.0)
            store.wait_renewals(1)
            assert held._lost_event is None  # nobody waited: no event was made
            assert held.wait_lost(timeout=None)
            assert held.lost_reason == "taken"


class TestSimpleFields:
    @settings(max_examples=500, deadline=None)
    @given(
        value=st.one_of(
            st.integers(),
            st.integers(-(10**20), 10**20),
            st.booleans(),
            st.text(max_size=210),
            st.text(alphabet="abcXYZ019._-", max_size=210),
            st.from_regex(r"[0-9]+(\.[0-9]*)?", fullmatch=True),
        )
    )
    def test_a_simple_field_is_what_the_full_encoding_gives(self, value: object) -> None:
        """The shortcut for ints and plain strs gives the full encoding's text, or declines."""
        simple = _simple_field(value)
        if simple is not None:
            assert simple == _field(_canonical_argument(value, "v", "t"))
