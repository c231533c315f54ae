"""The pytest plugin of ``celery_lease.testing``, as a user's test suite meets it.

``use_lease_store`` is exercised the way a project uses it: a test module with one module-level
app, run by pytest itself (``pytester``, in a subprocess so that the inner run's imports and
celery-lease's process-wide caches stay its own).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import LockedTask, LockNotAcquiredError, MemoryLockStore, lease
from celery_lease._celery import settings as config
from celery_lease._celery.store_resolution import store_for
from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.signals import lock_lost
from celery_lease.testing import FakeClock, close_lease_stores, override_lease_store
from tests.unit.conftest import REAL_TIMEOUT

pytest_plugins = ["pytester"]


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``call`` on a daemon thread; its result or exception lands in the returned dict."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = call()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


class TestOverrideLeaseStore:
    def test_nested_overrides_each_put_back_the_store_they_replaced(self) -> None:
        """Inside the blocks the app's tasks get the innermost store; each exit brings back the
        one before, and the last the app's own setting."""
        app = Celery("proj", broker="memory://", set_as_current=False)
        app.conf.lease_store = "memory://"
        outer, inner = MemoryLockStore(), MemoryLockStore()
        with override_lease_store(app, outer):
            assert config.get_store(app) is outer
            with override_lease_store(app, inner):
                assert config.get_store(app) is inner
            assert config.get_store(app) is outer
        assert app.conf.lease_store == "memory://"
        assert config.get_store(app) not in (outer, inner)


class TestUseLeaseStore:
    def test_each_test_of_a_module_level_app_gets_a_fresh_store(
        self, pytester: pytest.Pytester
    ) -> None:
        """Two tests in a row point one module-level app at their own store, and the app's own
        ``lease_store`` is back (and read again) after them."""
        pytester.makepyfile(
            """
            import pytest
            from celery import Celery

            from celery_lease import LockedTask, LockNotAcquiredError
            from celery_lease._celery import settings as config

            app = Celery("proj", broker="memory://", set_as_current=False)
            app.conf.task_always_eager = True
            app.conf.lease_store = "memory://"

            @app.task(base=LockedTask, lock_key="report")
            def report():
                return report.request.lock_token

            stores = []

            def test_first_holds_the_key_in_its_store(use_lease_store):
                store = use_lease_store(app)
                stores.append(store)
                store.acquire("report", "another-worker", 60_000)
                with pytest.raises(LockNotAcquiredError):
                    report.delay().get()

            def test_second_sees_its_own_fresh_store(use_lease_store, lease_store):
                store = use_lease_store(app)
                assert store is lease_store and store is not stores[0]
                token = report.delay().get()  # the first test's holder is not in this store
                assert store.last_token("report") == token
                stores.append(store)

            def test_the_apps_setting_is_back_afterwards():
                assert app.conf.lease_store == "memory://"
                assert config.get_store(app) not in stores
            """
        )
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=3)

    def test_a_namespaced_setting_is_overridden_and_restored(
        self, pytester: pytest.Pytester
    ) -> None:
        """A Django-style ``CELERY_LEASE_STORE`` (namespace ``"CELERY"``), set in the settings
        object and in ``app.conf``, yields to the test's store and is restored as it was."""
        pytester.makepyfile(
            """
            from celery import Celery

            from celery_lease import LockedTask
            from celery_lease._celery import settings as config
            from celery_lease._celery.setting_typos import misspelled_settings

            class Settings:
                CELERY_BROKER_URL = "memory://"
                CELERY_TASK_ALWAYS_EAGER = True
                CELERY_LEASE_STORE = "memory://"

            app = Celery("proj", set_as_current=False)
            app.config_from_object(Settings, namespace="CELERY")
            other = Celery("other", broker="memory://", set_as_current=False)
            other.conf.update(lease_store="memory://")

            @app.task(base=LockedTask, lock_key="report")
            def report():
                return report.request.lock_token

            def test_tasks_use_the_test_store(use_lease_store):
                store = use_lease_store(app)
                assert use_lease_store(other) is store
                token = report.delay().get()
                assert store.last_token("report") == token
                assert config.get_store(other) is store

            def test_both_settings_are_back_as_they_were():
                assert "CELERY_LEASE_STORE" not in app.conf.changes
                assert app.conf.get("lease_store") == "memory://"
                assert dict(other.conf.changes)["lease_store"] == "memory://"
                assert misspelled_settings(app.conf, config.SETTINGS) == []
            """
        )
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=2)


class TestWaitingOnThePluginStore:
    """A wait on the plugin's store is measured on the clock the store sleeps on: ``lease_clock``
    (a deadline read from the system clock while ``wait_for_release`` sleeps on the fake clock,
    which nobody moves, is never reached); a ``clock=`` given to ``lease()`` wins.
    """

    def test_a_clock_given_to_lease_is_the_one_waited_on(
        self, lease_store: MemoryLockStore
    ) -> None:
        """``lease(..., clock=SYSTEM_CLOCK, wait=0.2)`` on the fake-clock store gives up after
        0.2 real seconds: it neither reads nor sleeps on the store's clock."""
        lease_store.acquire("report", "another-worker", 60_000)

        def enter() -> None:
            with lease("report", store=lease_store, wait=0.2, clock=SYSTEM_CLOCK):
                pass

        thread, out = _in_thread(enter)
        try:
            thread.join(REAL_TIMEOUT)
            assert not thread.is_alive(), "the waiter still waits after its wait ran out"
            assert isinstance(out.get("error"), LockNotAcquiredError), out
        finally:
            lease_store.force_release("report")

    def test_a_waiting_lease_gives_up_once_the_store_clock_passes_its_wait(
        self, lease_store: MemoryLockStore, lease_clock: FakeClock
    ) -> None:
        """``lease(key, wait="5s")`` on a held key raises LockNotAcquiredError when the test
        advances ``lease_clock`` by 5 s, without any real waiting."""
        lease_store.acquire("report", "another-worker", 60_000)

        def enter() -> None:
            with lease("report", store=lease_store, wait="5s"):
                pass

        thread, out = _in_thread(enter)
        try:
            lease_clock.wait_for_sleepers(1, timeout=REAL_TIMEOUT)
            lease_clock.advance(5)
            thread.join(REAL_TIMEOUT)
            assert not thread.is_alive(), "the waiter still waits after its wait ran out"
            assert isinstance(out.get("error"), LockNotAcquiredError), out
        finally:
            lease_store.force_release("report")  # frees the waiter, should it be stuck

    def test_a_task_with_lock_wait_gives_up_once_the_store_clock_passes_it(
        self, lease_store: MemoryLockStore, lease_clock: FakeClock
    ) -> None:
        """An eager task with ``lock_wait="5s"`` on the plugin's store fails with
        LockNotAcquiredError once ``lease_clock`` passes its wait."""
        app = Celery("waits", broker="memory://", set_as_current=False)
        app.conf.task_always_eager = True
        app.conf.lease_store = lease_store

        @app.task(base=LockedTask, lock_key="report", lock_wait="5s")
        def report() -> int:
            token = report.request.lock_token
            assert isinstance(token, int)
            return token

        lease_store.acquire("report", "another-worker", 60_000)
        thread, out = _in_thread(lambda: report.delay().get())
        try:
            lease_clock.wait_for_sleepers(1, timeout=REAL_TIMEOUT)
            lease_clock.advance(5)
            thread.join(REAL_TIMEOUT)
            assert not thread.is_alive(), "the task still waits after its lock_wait ran out"
            assert isinstance(out.get("error"), LockNotAcquiredError), out
        finally:
            lease_store.force_release("report")


class TestFakeClock:
    """``FakeClock.advance`` moves forward by a finite step only."""

    @pytest.mark.parametrize("step", [math.nan, math.inf, -1.0])
    def test_fake_clock_refuses_a_step_that_is_not_a_finite_forward_one(self, step: float) -> None:
        """NaN would make every deadline comparison false; inf breaks tokens; back is refused."""
        clock = FakeClock(5.0)
        with pytest.raises(ValueError, match="seconds="):
            clock.advance(step)
        assert clock.monotonic() == 5.0


class TestATaskOnThePluginClock:
    """Under the fixtures a task's lease runs on ``lease_clock``, the clock of the store it is
    taken in: its renewer sleeps on it, so a test loses the task's lease by moving that clock."""

    def test_a_running_tasks_renewer_sleeps_on_lease_clock(
        self,
        use_lease_store: Callable[[Celery], MemoryLockStore],
        lease_clock: FakeClock,
    ) -> None:
        """While an eager task's body runs, its renewer waits on ``lease_clock``; once the key
        is force-released, moving the clock by a third of the ttl makes the renewer find the
        loss, and the body sees ``request.lock_lost``."""
        app = Celery("renewals", broker="memory://", set_as_current=False)
        app.conf.task_always_eager = True
        store = use_lease_store(app)
        started, go = threading.Event(), threading.Event()

        @app.task(base=LockedTask, lock_key="report", lock_ttl="30s")
        def renewed_report() -> bool:
            started.set()
            assert go.wait(REAL_TIMEOUT)
            return bool(renewed_report.request.lock_lost)

        lost = threading.Event()

        def heard(sender: object, **kwargs: Any) -> None:
            lost.set()

        lock_lost.connect(heard, sender=renewed_report, weak=False)
        thread, out = _in_thread(lambda: renewed_report.apply().get())
        try:
            assert started.wait(REAL_TIMEOUT)
            lease_clock.wait_for_sleepers(1, timeout=REAL_TIMEOUT)
            assert store.force_release("report") is not None
            lease_clock.advance(10)  # the renewer's turn: it finds the key released
            assert lost.wait(REAL_TIMEOUT), "no lock_lost: the renewer did not wake"
        finally:
            lock_lost.disconnect(heard, sender=renewed_report)
            go.set()
            thread.join(REAL_TIMEOUT)
        assert not thread.is_alive()
        assert out == {"result": True}


class TestAutojump:
    """``FakeClock(autojump_threshold=...)`` moves itself to the next deadline once every
    thread of the clock waits on it and it has been quiet that long (real seconds), as trio's
    ``MockClock`` does once every task is blocked."""

    def test_a_wait_from_the_tests_own_thread_returns(self) -> None:
        """``lease(wait="5s")`` on a held key, called from the test's own thread, gives up
        after 5 s of the clock that nobody advances by hand."""
        clock = FakeClock(1000.0, autojump_threshold=0.001)
        store = MemoryLockStore(clock=clock)
        store.acquire("report", "another-worker", 60_000)
        with (
            pytest.raises(LockNotAcquiredError),
            lease("report", store=store, wait="5s", clock=clock),
        ):
            pass
        assert clock.monotonic() == 1005.0

    def test_a_holders_renewals_happen_in_turn_while_the_test_thread_waits(self) -> None:
        """A holder's renewer wakes every second of a 3 s ttl; a waiter on the test's own thread
        waits 7 s, more than two ttls. The clock stops at each deadline on the way, so every
        renewal happens in turn: the holder never loses the key, and the waiter gives up."""
        clock = FakeClock(0.0, autojump_threshold=0.05)
        store = MemoryLockStore(clock=clock)
        holding, done = threading.Event(), threading.Event()

        def hold() -> bool:
            with lease("report", store=store, ttl="3s", clock=clock) as held:
                holding.set()
                assert done.wait(REAL_TIMEOUT)
                return held.lost

        holder, out = _in_thread(hold)
        try:
            assert holding.wait(REAL_TIMEOUT)
            clock.wait_for_sleepers(1, timeout=REAL_TIMEOUT)  # the renewer sleeps on the clock
            with (
                pytest.raises(LockNotAcquiredError),
                lease("report", store=store, wait="7s", clock=clock),
            ):
                pass
            assert clock.monotonic() >= 7.0
        finally:
            done.set()
            holder.join(REAL_TIMEOUT)
        assert out == {"result": False}  # renewed all along, never lost

    def test_the_clock_does_not_jump_while_a_renewer_is_busy_with_its_store(self) -> None:
        """A renewal round trip takes many thresholds of real time (a Redis or SQLite store,
        or a renewer thread the machine descheduled), while the test's own thread is the only
        one sleeping on the clock. The renewer has waited on the clock, so it counts as busy
        from the moment its wait returns until its next wait begins: the clock stays still
        during each renewal, and the lease is never lost on the way."""
        threshold = 0.002
        clock = FakeClock(1000.0, autojump_threshold=threshold)
        moved: list[tuple[float, float]] = []

        def round_trip() -> None:
            before = clock.monotonic()
            threading.Event().wait(25 * threshold)  # real work, off the clock
            after = clock.monotonic()
            if after != before:
                moved.append((before, after))

        class SlowRenewals(MemoryLockStore):
            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                round_trip()
                return super().renew(key, owner, ttl_ms)

            def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
                round_trip()
                return super().renew_many(items)

        store = SlowRenewals(clock=clock)
        lost: list[str] = []
        with lease("report", store=store, ttl="9s", clock=clock, on_lost=lost.append) as held:
            clock.wait(threading.Event(), 30.0)  # the test's own thread: renewals every 3 s
            assert clock.monotonic() == 1030.0
            assert not held.lost, f"lost at {clock.monotonic()} while renewing: {moved}"
        assert moved == []
        assert lost == []

    def test_a_thread_that_waited_on_the_clock_holds_it_still_until_it_waits_again(
        self,
    ) -> None:
        """A thread whose wait on the clock returned is busy until its next wait or its end:
        no jump while it works, and a thread that ended no longer counts."""
        clock = FakeClock(0.0, autojump_threshold=0.001)
        working, finish = threading.Event(), threading.Event()

        def work() -> None:
            clock.wait(threading.Event(), 1.0)  # a participant from here on
            working.set()
            assert finish.wait(REAL_TIMEOUT)  # busy, off the clock

        worker, _ = _in_thread(work)
        assert working.wait(REAL_TIMEOUT)
        sleeper, slept = _in_thread(lambda: clock.wait(threading.Event(), 5.0))
        clock.wait_for_sleepers(1, timeout=REAL_TIMEOUT)
        # While the worker is busy the sleeper's deadline is not jumped to, however long the
        # sleeper has slept; the worker ending (it never waits again) lets the clock move.
        assert not threading.Event().wait(50 * 0.001) and clock.monotonic() == 1.0
        finish.set()
        worker.join(REAL_TIMEOUT)
        sleeper.join(REAL_TIMEOUT)
        assert not sleeper.is_alive() and slept == {"result": False}
        assert clock.monotonic() == 6.0

    @pytest.mark.parametrize("threshold", [math.nan, -0.1])
    def test_a_threshold_that_is_no_duration_is_refused(self, threshold: float) -> None:
        """The parameter, the value and what is allowed are named."""
        with pytest.raises(ValueError, match=r"autojump_threshold=.*>= 0"):
            FakeClock(autojump_threshold=threshold)

    def test_off_by_default(self) -> None:
        """Without a threshold the clock never moves by itself (``math.inf``, trio's default)."""
        assert FakeClock().autojump_threshold == math.inf


class TestCloseLeaseStores:
    """``close_lease_stores(app)``: the stores celery-lease built for the app in this process
    (its lease store, the stores of its tasks' ``lock_store`` URLs) are closed and forgotten, so
    that nothing of ours stays connected to a database a test runner is about to drop."""

    def test_the_built_store_is_closed_and_the_next_use_builds_another(
        self, tmp_path: Path
    ) -> None:
        app = Celery("closing", broker="memory://", set_as_current=False)
        app.conf.lease_store = f"sqlite:///{tmp_path / 'app.db'}"
        try:
            built = config.get_store(app)
            by_url = store_for(f"sqlite:///{tmp_path / 'task.db'}", app)
            closed: list[object] = []
            for store in (built, by_url):
                original = store.close  # type: ignore[attr-defined]

                def close(store: object = store, original: Any = original) -> None:
                    closed.append(store)
                    original()

                store.close = close  # type: ignore[attr-defined]
            close_lease_stores(app)
            assert closed == [built, by_url]
            assert config.get_store(app) is not built
        finally:
            config.reset(app)

    def test_a_store_instance_given_in_the_settings_is_left_open(self) -> None:
        """A ``LockStore`` set as ``lease_store`` is the caller's: forgotten, not closed."""
        given = MemoryLockStore()
        given.close = lambda: pytest.fail("the caller's store was closed")  # type: ignore[attr-defined]
        app = Celery("given", broker="memory://", set_as_current=False)
        app.conf.lease_store = given
        try:
            assert config.get_store(app) is given
            close_lease_stores(app)
            assert config.get_store(app) is given
        finally:
            config.reset(app)
