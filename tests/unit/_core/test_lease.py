"""lease(): acquire, wait, hold, lose, release; on a FakeClock, never sleeping."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest

from celery_lease import (
    Lease,
    LeaseConfigError,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    ReplicaLagError,
    RestartGraceError,
    SQLiteLockStore,
    StoreUnavailableError,
    current_lease,
    get_lock_token,
    lease,
)
from celery_lease._core.dispatch import drain
from celery_lease._core.lease import LeaseContext, clock_of
from celery_lease._core.renewer import Entry, Renewer, renewers
from celery_lease.clock import SYSTEM_CLOCK
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore
from tests.unit.core_faults import REAL, Interrupt


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a thread; its result or exception lands in the returned dict."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


class TestAcquireAndRelease:
    def test_holds_then_releases(self, store: SpyStore, clock: FakeClock) -> None:
        """Inside the block the key is held under the lease's owner; after it, the key is free."""
        with lease("k", store=store, clock=clock) as held:
            assert isinstance(held, Lease)
            info = store.get("k")
            assert info is not None and info.owner == held.owner and info.token == held.token
            assert not held.lost and not held.waited
        assert store.get("k") is None

    def test_second_holder_is_rejected_at_once(self, store: SpyStore, clock: FakeClock) -> None:
        """With wait=0 a held key raises LockNotAcquiredError naming the key."""
        store.acquire("k", "someone-else", 30_000)
        with pytest.raises(LockNotAcquiredError) as info, lease("k", store=store, clock=clock):
            pass
        assert info.value.key == "k" and info.value.reason == "held"

    def test_tokens_increase_across_acquisitions(self, store: SpyStore, clock: FakeClock) -> None:
        """Each acquisition of a key gets a larger token than the previous one."""
        tokens = []
        for _ in range(5):
            with lease("k", store=store, clock=clock) as held:
                tokens.append(held.token)
        assert tokens == sorted(tokens) and len(set(tokens)) == 5

    def test_owner_ids_are_fresh(self, store: SpyStore, clock: FakeClock) -> None:
        """Every acquisition uses a new random owner id."""
        owners = set()
        for _ in range(3):
            with lease("k", store=store, clock=clock) as held:
                owners.add(held.owner)
        assert len(owners) == 3

    def test_body_error_propagates_and_releases(self, store: SpyStore, clock: FakeClock) -> None:
        """A body that raises still releases the key, and its error leaves the block unchanged."""
        with pytest.raises(KeyError), lease("k", store=store, clock=clock):
            raise KeyError("boom")
        assert store.get("k") is None

    def test_failed_release_is_ignored(self, store: SpyStore, clock: FakeClock) -> None:
        """A release that fails is logged, not raised: the lease expires anyway."""

        def broken(key: str, owner: str) -> None:
            raise RuntimeError("store down")

        store.release = broken  # type: ignore[method-assign]
        with lease("k", store=store, clock=clock):
            pass

    def test_decorator_form(self, store: SpyStore, clock: FakeClock) -> None:
        """lease() decorates a function: each call holds the key and sees its own token."""
        seen: list[int | None] = []

        @lease("k", store=store, clock=clock)
        def work(x: int) -> int:
            seen.append(get_lock_token())
            return x * 2

        assert work(2) == 4 and work(3) == 6
        assert seen[0] is not None and seen[1] is not None and seen[1] > seen[0]
        assert store.get("k") is None


class TestAmbientToken:
    def test_get_lock_token_inside_and_outside(self, store: SpyStore, clock: FakeClock) -> None:
        """get_lock_token() is the innermost lease's token inside, None outside."""
        assert get_lock_token() is None and current_lease() is None
        with lease("a", store=store, clock=clock) as a:
            assert get_lock_token() == a.token
            with lease("b", store=store, clock=clock) as b:
                assert get_lock_token() == b.token and current_lease() is b
            assert get_lock_token() == a.token
        assert get_lock_token() is None

    def test_token_is_per_thread(self, store: SpyStore, clock: FakeClock) -> None:
        """Another thread does not see this thread's lease."""
        with lease("a", store=store, clock=clock):
            thread, out = run_in_thread(get_lock_token)
            thread.join(REAL_TIMEOUT)
        assert out == {"result": None}

    def test_reentrant_on_same_key_and_store(self, store: SpyStore, clock: FakeClock) -> None:
        """A nested lease on the same key and store reuses the held lease and keeps it held."""
        with lease("k", store=store, clock=clock) as outer:
            with lease("k", store=store, clock=clock) as inner:
                assert inner is outer
            assert store.get("k") is not None, "the inner exit must not release the outer lease"
        assert store.get("k") is None

    def test_same_key_other_store_is_not_reentrant(self, clock: FakeClock) -> None:
        """Re-entrancy needs the same store: a different store is a different lock."""
        one, two = MemoryLockStore(clock=clock), MemoryLockStore(clock=clock)
        with lease("k", store=one, clock=clock) as a, lease("k", store=two, clock=clock) as b:
            assert a is not b


class TestWaiting:
    def test_waiter_wakes_on_release(self, store: SpyStore, clock: FakeClock) -> None:
        """A waiter acquires as soon as the holder releases, and knows it waited."""
        store.acquire("k", "holder", 30_000)

        def waiter() -> tuple[int, bool]:
            with lease("k", store=store, wait=60, clock=clock) as held:
                return held.token, held.waited

        thread, out = run_in_thread(waiter)
        clock.wait_for_sleepers(1)
        store.release("k", "holder")
        thread.join(REAL_TIMEOUT)
        assert "result" in out, out
        assert out["result"][1] is True

    def test_waiter_notices_expiry_without_release(self, store: SpyStore, clock: FakeClock) -> None:
        """A holder that dies (never releases) is replaced once its lease expires."""
        first = store.acquire("k", "dead-holder", 2_000)
        assert first is not None

        def waiter() -> int:
            with lease("k", store=store, wait=60, clock=clock) as held:
                return held.token

        thread, out = run_in_thread(waiter)
        clock.wait_for_sleepers(1)
        clock.advance(2.5)
        thread.join(REAL_TIMEOUT)
        assert out.get("result", 0) > first

    def test_wait_runs_out(self, store: SpyStore, clock: FakeClock) -> None:
        """When the key stays held past wait, LockNotAcquiredError is raised."""
        store.acquire("k", "holder", 600_000)
        thread, out = run_in_thread(
            lambda: lease("k", store=store, wait=5, clock=clock).__enter__()
        )
        for _ in range(40):
            if not thread.is_alive():
                break
            clock.wait_for_sleepers(1)
            clock.advance(0.5)
        thread.join(REAL_TIMEOUT)
        assert isinstance(out.get("error"), LockNotAcquiredError)
        assert out["error"].reason == "held"

    def test_polls_back_off_to_one_second(self, clock: FakeClock) -> None:
        """Without release notification, polls start at 50 ms and double up to 1 s."""

        class Polled:
            def __init__(self) -> None:
                self.inner = MemoryLockStore(clock=clock)
                self.tries: list[float] = []

            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                self.tries.append(clock.monotonic())
                return self.inner.acquire(key, owner, ttl_ms)

            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                return self.inner.renew(key, owner, ttl_ms)

            def release(self, key: str, owner: str) -> None:
                self.inner.release(key, owner)

        polled = Polled()
        polled.inner.acquire("k", "holder", 600_000)
        thread, out = run_in_thread(
            lambda: lease("k", store=polled, wait=4, clock=clock).__enter__()
        )
        waits = 0
        while thread.is_alive():
            try:
                clock.wait_for_waits(waits + 1, timeout=0.2)
            except TimeoutError:
                continue
            waits = clock.waits
            clock.advance_to_next_deadline()
        thread.join(REAL_TIMEOUT)
        gaps = [round(b - a, 3) for a, b in zip(polled.tries, polled.tries[1:], strict=False)]
        assert gaps[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
        assert isinstance(out.get("error"), LockNotAcquiredError)

    @pytest.mark.parametrize(
        "refusal",
        [
            lambda text: ReplicaLagError(text),
            lambda text: RestartGraceError(text, 1_800_000_000.0),
        ],
        ids=["replica-lag", "restart-grace"],
    )
    @pytest.mark.parametrize("lags", [2, 1000])
    def test_an_acquire_the_replicas_did_not_confirm_is_retried_within_the_wait(
        self, clock: FakeClock, lags: int, refusal: Callable[[str], StoreUnavailableError]
    ) -> None:
        """A ReplicaLagError (the store released the unconfirmed lease) or a RestartGraceError
        (a server in its restart grace refused the free key) is asked again within wait like a
        held key; when the wait runs out, that error is raised, not "held"."""

        class Lagging:
            def __init__(self) -> None:
                self.inner = MemoryLockStore(clock=clock)
                self.asks = 0

            def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
                self.asks += 1
                if self.asks <= lags:
                    raise refusal(f"acquire {key!r} refused for now (ask {self.asks})")
                return self.inner.acquire(key, owner, ttl_ms)

            def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
                return self.inner.renew(key, owner, ttl_ms)

            def release(self, key: str, owner: str) -> None:
                self.inner.release(key, owner)

        lagging = Lagging()
        context = lease("k", store=lagging, wait=4, clock=clock)
        thread, out = run_in_thread(context.__enter__)
        waits = 0
        while thread.is_alive():
            try:
                clock.wait_for_waits(waits + 1, timeout=0.2)
            except TimeoutError:
                continue
            waits = clock.waits
            clock.advance_to_next_deadline()
        thread.join(REAL_TIMEOUT)
        if lags == 2:
            held = out.get("result")
            assert isinstance(held, Lease) and lagging.asks == 3, out
            context.__exit__(None, None, None)
        else:
            assert type(out.get("error")) is type(refusal("")), out
            assert 3 < lagging.asks < lags

    def test_cancel_aborts_the_wait(self, store: SpyStore, clock: FakeClock) -> None:
        """Setting cancel stops a waiter with an error that says it was cancelled."""
        store.acquire("k", "holder", 600_000)
        cancel = threading.Event()
        thread, out = run_in_thread(
            lambda: lease("k", store=store, wait=600, cancel=cancel, clock=clock).__enter__()
        )
        clock.wait_for_sleepers(1)
        cancel.set()
        clock.advance(1.0)
        thread.join(REAL_TIMEOUT)
        err = out.get("error")
        assert isinstance(err, LockNotAcquiredError) and err.reason == "cancelled"
        assert "cancelled" in str(err)


class TestLoss:
    def test_loss_on_renew_refused(self, store: SpyStore, clock: FakeClock) -> None:
        """When renew() returns False the lease is lost as 'taken' and on_lost runs once."""
        calls: list[Lease] = []
        with lease("k", store=store, ttl=3, clock=clock, on_lost=calls.append) as held:
            store.force_release("k")
            store.acquire("k", "another-owner", 60_000)  # taken, not just freed
            clock.advance(1.0)
            assert held.wait_lost(timeout=REAL_TIMEOUT) or held.lost
            assert held.lost_reason == "taken"
            with pytest.raises(LockLostError):
                held.check()
            clock.advance(1.0)
        assert drain(), "on_lost runs on the dispatcher: wait for it"
        assert calls == [held]

    def test_body_error_after_loss_is_lock_lost(self, store: SpyStore, clock: FakeClock) -> None:
        """If the body raises after the loss, LockLostError leaves the block, chained."""
        with (
            pytest.raises(LockLostError) as info,
            lease("k", store=store, ttl=3, clock=clock) as held,
        ):
            store.force_release("k")
            clock.advance(1.0)
            held._loss_event().wait(REAL_TIMEOUT)
            raise ValueError("write failed")
        assert isinstance(info.value.__cause__, ValueError)
        assert info.value.key == "k"

    def test_success_after_loss_stands(self, store: SpyStore, clock: FakeClock) -> None:
        """A body that ignores the loss and succeeds returns normally."""
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            clock.advance(1.0)
            held._loss_event().wait(REAL_TIMEOUT)
        assert held.lost

    def test_never_releases_someone_elses_lease(self, store: SpyStore, clock: FakeClock) -> None:
        """After a loss and a takeover, leaving the block does not free the new holder's key."""
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            newcomer = store.acquire("k", "newcomer", 30_000)
            clock.advance(1.0)
            held._loss_event().wait(REAL_TIMEOUT)
        info = store.get("k")
        assert info is not None and info.owner == "newcomer" and info.token == newcomer

    def test_lost_by_local_expiry_without_renewer(self, store: SpyStore, clock: FakeClock) -> None:
        """Past its local validity a lease reads as lost even before the renewer reports it."""
        store.fail_forever = True
        with lease("k", store=store, ttl=3, clock=clock) as held:
            clock.advance(3.0)
            assert held.lost
            with pytest.raises(LockLostError, match="expired"):
                held.check()


class TestCooldown:
    def test_key_stays_taken_after_success(self, store: SpyStore, clock: FakeClock) -> None:
        """With a cooldown, a successful body leaves the key taken for that long."""
        with lease("nightly", store=store, ttl=3, cooldown="1h", clock=clock):
            pass
        assert store.get("nightly") is not None
        with pytest.raises(LockNotAcquiredError), lease("nightly", store=store, clock=clock):
            pass
        clock.advance(3601)
        with lease("nightly", store=store, clock=clock):
            pass

    def test_failure_releases_despite_cooldown(self, store: SpyStore, clock: FakeClock) -> None:
        """A body that fails releases at once, so the work can be retried."""
        with pytest.raises(RuntimeError), lease("n", store=store, cooldown=3600, clock=clock):
            raise RuntimeError
        assert store.get("n") is None


class TestValidation:
    @pytest.mark.parametrize(
        ("kwargs", "pattern"),
        [
            ({"ttl": 0}, r"ttl=0 must be > 0"),
            ({"ttl": "soon"}, r"ttl='soon' is not a duration"),
            ({"ttl": 0.0001}, r"ttl=0.0001 must be more than 2.02 ms"),
            ({"wait": -1}, r"wait=-1 must be >= 0"),
            ({"max_hold": 0}, r"max_hold=0 must be > 0"),
            ({"cooldown": "-5s"}, r"cooldown='-5s' is not a duration"),
            ({"on_lost": 3}, r"on_lost=3 must be a callable"),
            ({"cancel": "yes"}, r"cancel='yes' must be a threading.Event"),
            ({"clock": object()}, r"clock=.* must provide monotonic"),
        ],
    )
    def test_bad_arguments_fail_at_call_time(
        self, store: SpyStore, kwargs: dict[str, Any], pattern: str
    ) -> None:
        """lease(...) validates every argument before acquiring anything."""
        with pytest.raises(LeaseConfigError, match=pattern):
            lease("k", store=store, **kwargs)
        assert store.get("k") is None

    @pytest.mark.parametrize("key", ["", None, 42])
    def test_bad_key(self, store: SpyStore, key: Any) -> None:
        """The key must be a non-empty string."""
        with pytest.raises(LeaseConfigError, match="key="):
            lease(key, store=store)

    def test_store_url_string_is_refused_with_a_hint(self) -> None:
        """A URL where a store is expected says to build the store once."""
        with pytest.raises(LeaseConfigError, match="store_from_url"):
            lease("k", store="redis://localhost")  # type: ignore[arg-type]


def wait_until(predicate: Callable[[], object], timeout: float = REAL_TIMEOUT) -> None:
    """Poll ``predicate`` (real time) until it is true; AssertionError after ``timeout``."""
    limit = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > limit:
            raise AssertionError(f"timed out waiting for {predicate}")
        time.sleep(0.001)


class TestLossListeners:
    def test_listener_sees_the_loss_recorded(self, store: SpyStore, clock: FakeClock) -> None:
        """A listener runs once, with the lease already reading lost and its reason."""
        seen: list[tuple[bool, str | None]] = []
        with lease("k", store=store, ttl=3, clock=clock) as held:
            held.add_loss_listener(lambda h: seen.append((h.lost, h.lost_reason)))
            store.force_release("k")
            store.acquire("k", "another-owner", 60_000)  # taken, not just freed
            clock.advance(1.0)
            wait_until(lambda: seen)
        assert seen == [(True, "taken")]

    def test_immediate_listener_runs_on_the_thread_that_decided(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """An immediate listener runs on the renewer thread when the renewer records the loss."""
        names: list[str] = []
        with lease("k", store=store, ttl=3, clock=clock) as held:
            held.add_loss_listener(
                lambda h: names.append(threading.current_thread().name), immediate=True
            )
            store.force_release("k")
            clock.advance(1.0)
            wait_until(lambda: names)
            assert held.lost
        assert names == ["celery-lease-renewer"]

    def test_listener_added_after_the_loss_runs_at_once(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """On a lost lease, an immediate listener is called now, another one dispatched now."""
        now: list[str] = []
        later: list[str] = []
        with lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            clock.advance(1.0)
            assert held.wait_lost(REAL_TIMEOUT)
            held.add_loss_listener(
                lambda h: now.append(threading.current_thread().name), immediate=True
            )
            assert now == [threading.current_thread().name]
            held.add_loss_listener(lambda h: later.append(threading.current_thread().name))
            wait_until(lambda: later)
        assert later[0] != threading.current_thread().name

    def test_a_listener_that_raises_is_logged(
        self, store: SpyStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A failing listener is logged; the other listeners still run."""
        ran: list[bool] = []

        def explode(_: Lease) -> None:
            raise RuntimeError("listener bug")

        with lease("k", store=store, ttl=3, clock=clock) as held:
            held.add_loss_listener(explode, immediate=True)
            held.add_loss_listener(explode)
            held.add_loss_listener(lambda h: ran.append(True))
            store.force_release("k")
            clock.advance(1.0)
            wait_until(lambda: ran)
            wait_until(lambda: sum("raised" in r.getMessage() for r in caplog.records) >= 2)

    def test_a_listener_must_be_callable(self, store: SpyStore, clock: FakeClock) -> None:
        """A non-callable listener is refused, naming the value."""
        with (
            lease("k", store=store, clock=clock) as held,
            pytest.raises(LeaseConfigError, match="fn=3 must be a callable"),
        ):
            held.add_loss_listener(3)  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
class TestFork:
    """A forked child never uses, renews or releases the leases of its parent."""

    @staticmethod
    def _child(report: Callable[[], dict[str, Any]], ready: int, out: int) -> None:
        """In the child: wait for the parent's go, write ``report()`` as JSON, never return."""
        status = 1
        try:
            os.read(ready, 1)
            os.write(out, json.dumps(report()).encode())
            status = 0
        except BaseException as exc:  # pragma: no cover - reported to the parent
            os.write(out, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(status)

    @staticmethod
    def _collect(pid: int, out: int) -> dict[str, Any]:
        _, status = os.waitpid(pid, 0)
        chunks = []
        while chunk := os.read(out, 65536):
            chunks.append(chunk)
        os.close(out)
        report: dict[str, Any] = json.loads(b"".join(chunks) or b"{}")
        assert os.waitstatus_to_exitcode(status) == 0, report
        return report

    def test_child_ignores_the_parents_frames(self, tmp_path: Path) -> None:
        """After fork the parent releases, O takes k: the child does not re-enter the old lease."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        ready_r, ready_w = os.pipe()
        out_r, out_w = os.pipe()
        context = lease("k", store=store, ttl=30)
        parent = context.__enter__()

        def report() -> dict[str, Any]:
            seen: dict[str, Any] = {
                "current": current_lease() is None,
                "token": get_lock_token(),
                "parent_lost": parent.lost,
            }
            try:
                with lease("k", store=store, ttl=30, wait=0) as mine:
                    seen["enter"] = f"re-entered (same: {mine is parent}, lost: {mine.lost})"
            except LockNotAcquiredError:
                seen["enter"] = "held by another owner"
            with lease("child-key", store=store, ttl=30) as own:
                seen["own"] = current_lease() is own and get_lock_token() == own.token
            return seen

        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            self._child(report, ready_r, out_w)
        os.close(out_w)
        context.__exit__(None, None, None)
        assert store.acquire("k", "another-owner", 60_000) is not None
        os.write(ready_w, b"x")
        seen = self._collect(pid, out_r)
        assert seen == {
            "current": True,
            "token": None,
            "parent_lost": True,
            "enter": "held by another owner",
            "own": True,
        }

    def test_child_exiting_the_parents_block_releases_nothing(self, tmp_path: Path) -> None:
        """A child that unwinds the parent's ``with`` leaves the parent's lease held and renewed."""
        store = SQLiteLockStore(tmp_path / "leases.db")
        ready_r, ready_w = os.pipe()
        out_r, out_w = os.pipe()
        context = lease("k", store=store, ttl=30)
        parent = context.__enter__()
        try:

            def report() -> dict[str, Any]:
                context.__exit__(None, None, None)
                info = store.get("k")
                return {"held_by_parent": info is not None and info.owner == parent.owner}

            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                self._child(report, ready_r, out_w)
            os.close(out_w)
            os.write(ready_w, b"x")
            seen = self._collect(pid, out_r)
            assert seen == {"held_by_parent": True}
            info = store.get("k")
            assert info is not None and info.owner == parent.owner, "the child released it"
            assert current_lease() is parent and not parent.lost
        finally:
            context.__exit__(None, None, None)
        assert store.get("k") is None


# An asynchronous exception inside lease()'s own bookkeeping ---------------------------------


_lease_module = sys.modules["celery_lease._core.lease"]


class AsyncLockLostStandIn(LockLostError):
    """Stands for the Celery layer's ``AsyncLockLost``: a ``LockLostError``, so an ``Exception``."""

    def __init__(self) -> None:
        super().__init__("outer", "revoked")


class OnceRaisingRelease(MemoryLockStore):
    """A MemoryLockStore whose next ``release`` raises ``error`` before its effect."""

    def __init__(self, clock: FakeClock, error: type[BaseException]) -> None:
        super().__init__(clock=clock)
        self.error = error
        self.armed = False
        self.releases = 0

    def release(self, key: str, owner: str) -> None:
        self.releases += 1
        if self.armed:
            self.armed = False
            raise self.error()
        super().release(key, owner)


def renewed_keys(clock: FakeClock) -> list[str]:
    """The keys the renewers of ``clock`` (of every store) still renew."""
    return sorted(key for renewer in renewers(clock) for key in renewer.held_keys())


def interrupt_once(monkeypatch: pytest.MonkeyPatch, target: object, name: str, where: str) -> None:
    """Make the next call of ``target.name`` raise ``Interrupt(where)``; it is itself again
    from then on."""
    original = getattr(target, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(target, name, original)
        raise Interrupt(where)

    monkeypatch.setattr(target, name, interrupted)


class TestInterruptInsideTheCore:
    """An asynchronous exception lands in ``lease()``'s own bookkeeping on the body's thread."""

    def test_after_the_acquire_nothing_stays_held_or_renewed(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised between the acquire and the frame push: the lease is ended, not leaked."""
        store = MemoryLockStore(clock=clock)
        interrupt_once(monkeypatch, _lease_module, "Frame", "delivered in __enter__")
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock):
            pytest.fail("the body must not run")  # pragma: no cover
        assert renewed_keys(clock) == [], "the lease is renewed for ever"
        assert store.get("k") is None, "the key stays taken"
        assert _lease_module.current_lease() is None

    def test_while_renewal_starts_the_key_is_freed_before_the_interrupt_propagates(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised inside the renewer's ``add``: the key is released on the body's thread
        before the interrupt leaves ``with`` (a Ctrl-C that ends the process leaves nothing
        to a daemon thread), once, and is never renewed."""
        released_on: list[threading.Thread] = []

        class RecordingStore(MemoryLockStore):
            def release(self, key: str, owner: str) -> None:
                released_on.append(threading.current_thread())
                super().release(key, owner)

        store = RecordingStore(clock=clock)
        interrupt_once(monkeypatch, Renewer, "add", "delivered in Renewer.add")
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock):
            pytest.fail("the body must not run")  # pragma: no cover
        assert released_on == [threading.current_thread()], "not released before the raise"
        assert store.get("k") is None, "the key stays taken"
        assert drain()
        assert released_on == [threading.current_thread()], "released twice"
        assert renewed_keys(clock) == [], "the lease is renewed for ever"

    def test_between_the_granted_try_and_its_lease_the_key_is_freed_once(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised after the store granted the key, before its lease is built: the attempt is
        released (owner-checked, once), not left taken for its ttl."""
        store = OnceRaisingRelease(clock, Interrupt)
        interrupt_once(monkeypatch, LeaseContext, "_hold", "delivered before the lease is built")
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock):
            pytest.fail("the body must not run")  # pragma: no cover
        assert drain()
        assert store.get("k") is None, "the key stays taken"
        assert store.releases == 1
        assert renewed_keys(clock) == []

    def test_inside_the_end_record_the_lease_still_ends(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised inside Renewer.remove (under its lock): not renewed, released, not re-entered."""
        store = MemoryLockStore(clock=clock)
        overdue = Entry.overdue
        armed = threading.Event()

        def interrupted(entry: Entry, now: float) -> str | None:
            if armed.is_set() and threading.current_thread() is threading.main_thread():
                armed.clear()
                raise Interrupt("delivered in Renewer.remove")
            return overdue(entry, now)

        monkeypatch.setattr(Entry, "overdue", interrupted)
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock):
            armed.set()
        assert renewed_keys(clock) == [], "the lease is renewed for ever"
        assert store.get("k") is None, "the key stays taken"
        assert _lease_module.current_lease() is None

    @pytest.mark.parametrize("error", [Interrupt, AsyncLockLostStandIn])
    def test_inside_the_release_call_it_propagates_and_the_key_is_freed(
        self, clock: FakeClock, error: type[BaseException]
    ) -> None:
        """Raised inside the store's release: it is not logged away as a store error (the body
        must stop), and the exit sends the release again (owner-checked)."""
        store = OnceRaisingRelease(clock, error)
        with pytest.raises(error), lease("k", store=store, ttl=3, clock=clock):
            store.armed = True
        assert renewed_keys(clock) == []
        assert store.get("k") is None, "the key stays taken for a ttl"
        assert store.releases == 2

    def test_inside_an_early_release_it_propagates_and_the_key_is_freed(
        self, clock: FakeClock
    ) -> None:
        """The same inside release_early: raised, and the key freed anyway."""
        store = OnceRaisingRelease(clock, AsyncLockLostStandIn)
        context = lease("k", store=store, ttl=3, clock=clock)
        with context:
            store.armed = True
            with pytest.raises(AsyncLockLostStandIn):
                context.release_early()
            assert store.get("k") is None, "the key stays taken for a ttl"
        assert renewed_keys(clock) == []

    def test_a_finished_lease_left_on_the_stack_is_never_re_entered(
        self, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Raised before the frame is popped: a later lease() on the key acquires afresh."""
        store = MemoryLockStore(clock=clock)
        pop = _lease_module.pop_frame

        def interrupted(held: Lease) -> None:
            monkeypatch.setattr(_lease_module, "pop_frame", pop)
            raise Interrupt("delivered before the pop")

        monkeypatch.setattr(_lease_module, "pop_frame", interrupted)
        with pytest.raises(Interrupt), lease("k", store=store, ttl=3, clock=clock) as first:
            pass
        assert store.acquire("k", "intruder", 60_000) is not None, "the first lease was ended"
        with (
            pytest.raises(LockNotAcquiredError),
            lease("k", store=store, ttl=3, clock=clock, wait=0) as second,
        ):
            pytest.fail(f"re-entered {second!r} (same: {second is first}) while O holds k")
        assert _lease_module.current_lease() is None

    def test_a_finished_frame_is_not_re_entered_even_if_still_on_the_stack(
        self, clock: FakeClock
    ) -> None:
        """Defence in depth: a closed lease found on the stack is skipped by re-entry."""
        store = MemoryLockStore(clock=clock)
        context = lease("k", store=store, ttl=3, clock=clock)
        token = _lease_module.current_frame.set(None)
        try:
            stale = context.__enter__()
            context.__exit__(None, None, None)
            _lease_module.current_frame.set(_lease_module.Frame(stale, None))  # left behind
            assert store.acquire("k", "intruder", 60_000) is not None
            with pytest.raises(LockNotAcquiredError), lease("k", store=store, clock=clock):
                pytest.fail("re-entered a finished lease")  # pragma: no cover
        finally:
            _lease_module.current_frame.reset(token)


class TestBaseExceptionThroughTheExit:
    @pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit, Interrupt])
    def test_a_base_exception_after_a_loss_is_not_turned_into_lock_lost(
        self, clock: FakeClock, error: type[BaseException]
    ) -> None:
        """Ctrl-C (or SystemExit, GeneratorExit) in a body whose lease was lost stays what it
        is: a LockLostError (an Exception) would let ``except Exception`` swallow it."""
        store = MemoryLockStore(clock=clock)
        with pytest.raises(error), lease("k", store=store, ttl=3, clock=clock) as held:
            store.force_release("k")
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            raise error()


class TestTtlAboveTheDriftMargin:
    """A ttl must leave the lease some local validity once the drift margin is taken off."""

    @pytest.mark.parametrize("ttl", [0.001, "2ms", 0.002])
    def test_a_ttl_that_leaves_no_validity_is_refused(self, ttl: object) -> None:
        """A ttl within the drift margin would be lost the moment it is acquired: refused."""
        with pytest.raises(LeaseConfigError, match=r"ttl=.* must be more than 2\.\d+ ms"):
            lease("k", store=MemoryLockStore(), ttl=ttl)

    def test_the_shortest_ttl_accepted_is_held_when_acquired(self, clock: FakeClock) -> None:
        """Just above the margin, a lease is held (not lost) right after the acquire."""
        store = MemoryLockStore(clock=clock)
        with lease("k", store=store, ttl="3ms", clock=clock) as held:
            assert not held.lost


class TestReleaseEarlyReason:
    def test_a_custom_reason_does_not_turn_the_body_error_into_lock_lost(
        self, clock: FakeClock
    ) -> None:
        """After release_early("handed-over") the exit raises nothing of its own, as documented."""
        store = MemoryLockStore(clock=clock)
        context = lease("k", store=store, ttl=3, clock=clock)
        with pytest.raises(KeyError), context as held:
            assert context.release_early("handed-over") is True
            assert held.lost_reason == "handed-over"
            raise KeyError("the body fails on its own")

    def test_a_loss_before_the_early_release_still_chains_the_body_error(
        self, clock: FakeClock
    ) -> None:
        """Lost ("taken") first: release_early records nothing; a body error is LockLostError."""
        store = MemoryLockStore(clock=clock)
        context = lease("k", store=store, ttl=3, clock=clock)
        with pytest.raises(LockLostError, match="taken"), context as held:
            store.force_release("k")
            store.acquire("k", "another-owner", 60_000)  # taken, not just freed
            clock.advance(1.0)
            assert held.wait_lost(REAL)
            assert context.release_early("handed-over") is False
            raise KeyError("the body fails on its own")


class TestImmediateListenerOnTheBodyThread:
    def test_a_listener_run_by_a_lost_read_may_use_the_lease_again(self, clock: FakeClock) -> None:
        """The body's own read records the loss; its immediate listener (same thread) reads
        lost, check()s, adds a listener and releases early: no deadlock, one notification."""
        store = MemoryLockStore(clock=clock)
        seen: list[object] = []
        context = lease("k", store=store, ttl=3, clock=clock)

        def listener(held: Lease) -> None:
            seen.append(threading.current_thread() is threading.main_thread())
            seen.append((held.lost, held.lost_reason))
            with pytest.raises(LockLostError):
                held.check()
            held.add_loss_listener(lambda h: seen.append("nested"), immediate=True)
            seen.append(context.release_early())

        with context as held:
            held.add_loss_listener(listener, immediate=True)
            assert held._entry is not None
            # Validity runs out with R asleep until its due time and W idle (no store call):
            # this read is the first to see it, and records the loss on the body's thread.
            held._entry.valid_until = clock.monotonic()
            assert held.lost
            assert len(seen) == 4, "the listener ran inside the read"
        assert seen == [True, (True, "expired"), "nested", False]
        assert store.get("k") is None


class TestReentry:
    def test_a_reentered_lease_is_the_outer_one_and_its_exit_releases_nothing(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with lease("k", store=store, ttl=3, clock=clock) as outer:
            with lease("k", store=store, ttl=3, clock=clock) as inner:
                assert inner is outer
            info = store.get("k")
            assert info is not None and info.owner == outer.owner
        assert store.get("k") is None

    def test_reentry_after_the_outer_lease_was_lost_acquires_anew(self) -> None:
        clock = FakeClock(1000.0)
        store = MemoryLockStore(clock=clock)
        with lease("k", store=store, ttl=3, clock=clock) as outer:
            store.force_release("k")
            clock.advance(1.0)
            assert outer.wait_lost(REAL_TIMEOUT)
            with lease("k", store=store, ttl=3, clock=clock) as inner:
                assert inner is not outer and inner.owner != outer.owner
                assert inner.token > outer.token


class _Anything:
    """Answers every attribute, as a ``__getattr__`` proxy that forwards blindly does."""

    def __getattr__(self, name: str) -> Any:
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Anything()


class _RaisingClockStore(MemoryLockStore):
    """A store whose ``clock`` property fails with something other than AttributeError."""

    @property
    def clock(self) -> Any:
        raise RuntimeError("the clock is not configured")


class _OwnClock:
    """A user's clock: a class of its own that defines what a clock does."""

    def __init__(self) -> None:
        self.inner = FakeClock(50.0)

    def monotonic(self) -> float:
        return self.inner.monotonic()

    def time(self) -> float:
        return self.inner.time()

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        return self.inner.wait(event, timeout)


class TestClockOf:
    """A task's lease runs on its store's clock only when that is a real clock; anything else
    (a proxy answering every attribute, a Mock, a ``clock`` that raises) gives the system
    clock, and never an error on the task's path."""

    @pytest.mark.parametrize(
        "store",
        [
            pytest.param(_Anything(), id="getattr-proxy"),
            pytest.param(Mock(), id="mock"),
            pytest.param(Mock(spec=MemoryLockStore), id="mock-with-spec"),
            pytest.param(_RaisingClockStore(), id="raising-property"),
        ],
    )
    def test_a_store_without_a_real_clock_gives_the_system_clock(self, store: object) -> None:
        assert clock_of(store) is SYSTEM_CLOCK

    def test_a_mock_clock_that_claims_a_clock_class_is_refused(self) -> None:
        """``Mock(spec=FakeClock)`` passes ``isinstance(..., FakeClock)``: its class is what
        counts."""

        class WithMockClock(MemoryLockStore):
            @property
            def clock(self) -> Any:
                return Mock(spec=FakeClock)

        assert clock_of(WithMockClock()) is SYSTEM_CLOCK

    def test_a_stores_own_clock_is_used(self) -> None:
        clock = FakeClock(1000.0)
        assert clock_of(MemoryLockStore(clock=clock)) is clock
        assert clock_of(MemoryLockStore()) is SYSTEM_CLOCK

    def test_a_clock_class_of_the_users_own_is_used(self) -> None:
        own = _OwnClock()
        assert clock_of(MemoryLockStore(clock=own)) is own

    def test_a_delegating_wrapper_gives_its_inner_stores_clock(self) -> None:
        """The tests' wrapper pattern (``__getattr__`` to the inner store) forwards a real
        clock: that clock is used."""

        class Wrapper:
            def __init__(self, inner: object) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        clock = FakeClock(1000.0)
        assert clock_of(Wrapper(MemoryLockStore(clock=clock))) is clock
