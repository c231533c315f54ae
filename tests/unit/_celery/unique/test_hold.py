"""The queued key an until_done copy keeps while its body runs: free (or kept for the
cooldown) by the time the execution returns, its release sent without waiting where the store
can.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery

from celery_lease import MemoryLockStore
from celery_lease.testing import FakeClock
from tests.unit._celery.test_deferral import only_our_receivers  # noqa: F401 (autouse fixture)
from tests.unit.conftest import Published, SpyStore
from tests.unit.unique_copies import (
    Bodies,
    define_recorded,
    deliver,
    until_done_copy,
)


class TestQueuedKeyFreeBeforeTheResult:
    def test_the_queued_key_is_free_when_the_task_returns(
        self, app: Celery, published: Published, store: SpyStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """until_done: the queued key is free by the time the execution returns (before the
        tracer stores its result), so a delay() made after the result is seen enqueues a new
        copy instead of getting the finished one's id. The dispatcher is held up here to show
        the release does not depend on it."""
        from celery_lease._core import dispatch

        gate = threading.Event()
        submitted: list[str] = []
        real_submit = dispatch.Dispatcher.submit

        def held_up(self: Any, fn: Any, *args: Any) -> Any:
            submitted.append(str(args[-1]) if args else "")

            def later(*a: Any) -> None:
                gate.wait(10)
                fn(*a)

            return real_submit(self, later, *args)

        monkeypatch.setattr(dispatch.Dispatcher, "submit", held_up)
        _, task, _, headers = until_done_copy(app, published, "d.free-at-return")
        try:
            assert deliver(task, headers, deferred=False) == 1
            assert store.get("queued:k:1") is None
            assert store.get("k:1") is None
        finally:
            gate.set()


class DeferringSpy(SpyStore):
    """A SpyStore that also sends renewals and releases "without waiting": it records them in
    ``log`` and applies them only when their replies are read (flush_deferred, or before the
    next call of any kind), as the Redis store's one connection does."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.log: list[str] = []
        self.unread: list[tuple[str, Any]] = []

    def _read_unread(self) -> None:
        unread, self.unread = self.unread, []
        for what, apply in unread:
            apply()
            self.log.append(f"read {what}")

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        self._read_unread()
        return super().acquire(key, owner, ttl_ms)

    def acquire_or_holder(self, key: str, owner: str, ttl_ms: int) -> tuple[int | None, str | None]:
        self._read_unread()  # like the Redis store's: the same connection, replies in order
        return super().acquire_or_holder(key, owner, ttl_ms)

    def release(self, key: str, owner: str) -> None:
        self._read_unread()
        self.log.append(f"release {key}")
        super().release(key, owner)

    def release_deferred(self, key: str, owner: str) -> bool:
        self.log.append(f"send release {key}")
        self.unread.append((f"release {key}", lambda: MemoryLockStore.release(self, key, owner)))
        return True

    def renew_deferred(self, key: str, owner: str, ttl_ms: int) -> bool:
        self.log.append(f"send renew {key}")
        self.unread.append(
            (f"renew {key}", lambda: MemoryLockStore.renew(self, key, owner, ttl_ms))
        )
        return True

    def flush_deferred(self) -> None:
        self._read_unread()


class TestUntilDoneWithoutWaiting:
    """until_done on a store that can send without waiting: the queued key's renewal at start
    and the run lease's release at the end go out unanswered; everything is answered before
    the execution returns unless it publishes nothing (then before the next call or publish)."""

    @pytest.fixture
    def store(self, clock: FakeClock) -> DeferringSpy:
        return DeferringSpy(clock)

    @pytest.fixture(autouse=True)
    def solo(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A solo worker's process, with celery-lease's own receivers only (see
        tests/unit/_celery/test_deferral.py: another module's lock_released recorder, connected
        at import, would rightly make the engine wait)."""
        from celery_lease._celery import pool as pool_module

        monkeypatch.setattr(pool_module, "_pool_label", "solo")

    def test_with_a_stored_result_both_keys_are_free_before_it_is_written(
        self, app: Celery, published: Published, store: DeferringSpy
    ) -> None:
        """The key-value result backend reads both replies just before it writes the result
        (``celery_lease._celery.result_write``)."""
        bodies = Bodies()
        task = define_recorded(app, "d.nowait.stored", bodies, lock_unique="until_done")
        backend = task.backend
        write = backend.set

        def set_recorded(key: Any, value: Any, **options: Any) -> Any:
            store.log.append("write")
            return write(key, value, **options)

        backend.set = set_recorded
        task.delay(1)
        assert deliver(task, published.headers[0], deferred=False) == 1
        backend.store_result(published.headers[0]["id"], 1, "SUCCESS")  # as Celery's tracer
        assert store.get("k:1") is None and store.get("queued:k:1") is None
        assert not store.unread
        log = store.log
        assert log.index("send renew queued:k:1") < log.index("send release k:1")
        # Both sent in order on one connection, then read before the result is written.
        assert log.index("send release k:1") < log.index("send release queued:k:1")
        assert log.index("read release k:1") < log.index("read release queued:k:1")
        assert log.index("read release queued:k:1") < log.index("write")

    def test_publishing_nothing_leaves_both_to_the_next_call(
        self, app: Celery, published: Published, store: DeferringSpy
    ) -> None:
        app.conf.task_ignore_result = True
        bodies = Bodies()
        task = define_recorded(app, "d.nowait.quiet", bodies, lock_unique="until_done")
        task.delay(1)
        assert deliver(task, published.headers[0], deferred=False) == 1
        assert [what for what, _ in store.unread] == [
            "renew queued:k:1",  # sent at the start, nothing read since
            "release k:1",
            "release queued:k:1",
        ]
        # The next publish of this process reads them first: nothing it sends can be seen
        # while the keys are still held.
        again = task.delay(1)
        assert store.get("k:1") is None
        assert again.id != published.headers[0]["id"]  # a new copy: the queued key was free

    def test_a_queued_release_on_another_connection_still_frees_the_run_key_first(
        self, app: Celery, published: Published, store: DeferringSpy
    ) -> None:
        """The queued key's release goes another way (the Redis store's fast connection was
        busy: redis-py's pool, which reads nothing of the fast one): the run lease's release,
        sent without waiting, is still read before the execution returns."""
        bodies = Bodies()
        task = define_recorded(app, "d.nowait.pool", bodies, lock_unique="until_done")
        task.delay(1)

        real_send = store.release_deferred

        def busy_for_the_queued_key(key: str, owner: str) -> bool:
            return False if key.startswith("queued:") else real_send(key, owner)

        def via_pool(key: str, owner: str) -> None:
            store.log.append(f"release {key} (pool)")
            MemoryLockStore.release(store, key, owner)

        store.release_deferred = busy_for_the_queued_key  # type: ignore[method-assign]
        store.release = via_pool  # type: ignore[method-assign]
        assert deliver(task, published.headers[0], deferred=False) == 1
        assert not store.unread
        assert store.get("k:1") is None and store.get("queued:k:1") is None
        # The run lease's release was answered before the queued key's went another way.
        log = store.log
        assert log.index("read release k:1") < log.index("release queued:k:1 (pool)")
