"""Helpers for unit tests of our own logic: a spy store over MemoryLockStore, on a FakeClock, and
a Celery app on it (in-memory broker and backend) with a spy on the messages it publishes."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish

from celery_lease import MemoryLockStore, StoreUnavailableError, lease
from celery_lease._celery.unique import common as unique_common
from celery_lease._core.renewer import IDLE_EXIT, Entry, Renewer, renewers, shutdown
from celery_lease.testing import FakeClock

REAL_TIMEOUT = 10.0
"""Real seconds a test waits for a background thread before it fails."""


class SpyStore(MemoryLockStore):
    """A MemoryLockStore that records renewals and can be told to fail them."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.renewals: list[tuple[str, float]] = []
        self.batches: list[int] = []
        self.fail_renewals = 0  # how many renewals to fail with StoreUnavailableError
        self.fail_forever = False
        self.renewed = threading.Condition()

    def _note(self, key: str) -> None:
        with self.renewed:
            self.renewals.append((key, self.clock.monotonic()))
            self.renewed.notify_all()

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        if self.fail_forever or self.fail_renewals > 0:
            self.fail_renewals -= 1
            self._note(key)
            raise StoreUnavailableError("injected renewal failure")
        result = super().renew(key, owner, ttl_ms)
        self._note(key)
        return result

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.batches.append(len(items))
        return [self.renew(*item) for item in items]

    def wait_renewals(self, count: int) -> None:
        """Block (real time) until at least ``count`` renewals were attempted."""
        with self.renewed:
            if not self.renewed.wait_for(lambda: len(self.renewals) >= count, REAL_TIMEOUT):
                raise AssertionError(f"{len(self.renewals)} renewals seen, expected {count}")
        # Only renewers and their watchdogs wait on the clock in these tests (one pair per
        # store): once all of them wait again, this store's renewer has handled the results
        # (and scheduled what comes next).
        threads = sum(
            (renewer.thread is not None) + (renewer.watchdog is not None)
            for renewer in renewers(self.clock)
        )
        self.clock.wait_for_sleepers(threads, timeout=REAL_TIMEOUT)


def renewer_thread_after_one_lease(
    renewer: Renewer, store: SpyStore, clock: FakeClock, key: str = "k"
) -> threading.Thread:
    """Take and leave a lease on ``key`` so that ``renewer`` runs; its thread, now idle."""
    with lease(key, store=store, ttl=3, clock=clock):
        thread = renewer.thread
    assert thread is not None
    return thread


def let_idle_exit(thread: threading.Thread, clock: FakeClock) -> None:
    """Move ``clock`` by the renewer's idle exit and join its (idle) ``thread``."""
    clock.advance(IDLE_EXIT)
    thread.join(REAL_TIMEOUT)


def held_entry(store: SpyStore, clock: FakeClock, key: str = "late") -> Entry:
    """A renewer entry for a lease on ``key`` held in ``store`` by "me" (ttl 3 s), not added."""
    store.acquire(key, "me", 3000)
    return Entry(
        store=store,
        key=key,
        owner="me",
        ttl=3,
        sent_at=clock.monotonic(),
        max_hold_at=None,
        on_lost=lambda reason: None,
    )


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    """A fake clock; at teardown the threads that waited on it are stopped.

    A renewer (and its watchdog) on a fake clock that nobody moves any more polls the clock's
    condition every few milliseconds for ever: left running, each test's pair would add to the
    load that the real-time waits of every later test run under.
    """
    clock = FakeClock(1000.0)
    yield clock
    left = sorted({key for renewer in renewers(clock) for key in renewer.held_keys()})
    assert not left, f"the test left leases held on its clock: {left}"
    # A lease another test left held (reported there) keeps every thread: stop none then.
    if not any(renewer.held_keys() for renewer in renewers()):
        shutdown()


@pytest.fixture
def store(clock: FakeClock) -> SpyStore:
    return SpyStore(clock)


class Published:
    """Counts the messages published per task name (after_task_publish)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.headers: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, sender: Any = None, headers: Any = None, **_: Any) -> None:
        with self._lock:
            self.ids.append(headers["id"])
            self.headers.append(headers)


@pytest.fixture
def published() -> Iterator[Published]:
    spy = Published()
    after_task_publish.connect(spy, weak=False)
    yield spy
    after_task_publish.disconnect(spy)


@pytest.fixture
def app(store: SpyStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """A Celery app on ``store`` (memory broker and result backend); unique's clock is ``clock``."""
    monkeypatch.setattr(unique_common, "clock", clock)
    app = Celery("unique-unit", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(lease_store=store, broker_connection_retry_on_startup=False)
    yield app
    app.close()
