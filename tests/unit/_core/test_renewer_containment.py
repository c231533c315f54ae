"""What one faulty callback or handler on a renewer's path does to the other leases of its store:
an observer or a fenced action raising a ``BaseException``, a logging handler that blocks, an
immediate loss listener that blocks on the renewer thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from celery_lease import Lease, lease
from celery_lease._core.renewer import get_renewer
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore
from tests.unit.core_faults import GatedRenewalStore, Interrupt, poll_until


def _entry_of(held: Lease) -> object:
    assert held._entry is not None
    return held._entry


NOT_EXCEPTIONS = [
    pytest.param(SystemExit("gives up"), id="SystemExit"),
    pytest.param(Interrupt("a gevent.Timeout stand-in"), id="gevent-Timeout-like"),
]


class TestBaseExceptionsOnTheRenewalPath:
    @pytest.mark.parametrize("error", NOT_EXCEPTIONS)
    def test_an_observer_raising_a_base_exception_does_not_swallow_a_loss_of_the_same_sweep(
        self,
        store: SpyStore,
        clock: FakeClock,
        caplog: pytest.LogCaptureFixture,
        error: BaseException,
    ) -> None:
        """a and b renew in one sweep; a's renewal is refused and the observer raises a
        BaseException: a's loss is still notified, the observer's failure logged once, and b
        renewed again."""
        told = threading.Event()

        def exits(key: str, token: int | None, seconds: float, ok: bool | None) -> None:
            raise error

        forget = get_renewer(clock, store).observe_renewals(exits)
        try:
            with lease("b", store=store, ttl=3, clock=clock) as b:
                with lease("a", store=store, ttl=3, clock=clock) as a:
                    a.add_loss_listener(lambda _: told.set(), immediate=True)
                    store.force_release("a")
                    clock.advance(1.0)
                    store.wait_renewals(2)
                    assert told.wait(REAL_TIMEOUT), "a's loss, recorded in that sweep, was told"
                    assert a.lost_reason == "released"
                assert not b.lost
                before = store.batches.copy()
                clock.advance(1.0)  # the renewer goes on renewing b
                store.wait_renewals(3)
                assert len(store.renewals) == 3 and store.batches == before
        finally:
            forget()
        raised = [r for r in caplog.records if "renewal observer" in r.getMessage()]
        assert len(raised) == 1, [r.getMessage() for r in caplog.records]

    @pytest.mark.parametrize("error", NOT_EXCEPTIONS)
    def test_a_fenced_action_raising_a_base_exception_does_not_swallow_a_loss_of_the_same_sweep(
        self, clock: FakeClock, caplog: pytest.LogCaptureFixture, error: BaseException
    ) -> None:
        """b's renewal is in flight with a fenced action that raises a BaseException; a's
        renewal in the same batch is refused: a's loss is still notified, the action's failure
        logged."""
        store = GatedRenewalStore(clock)
        told = threading.Event()
        with (
            lease("a", store=store, ttl=3, clock=clock) as a,
            lease("b", store=store, ttl=3, clock=clock) as b,
        ):
            a.add_loss_listener(lambda _: told.set(), immediate=True)
            store.force_release("a")
            store.gate_key = "b"  # the batch renews a first, then waits inside b's renewal
            clock.advance(1.0)
            assert store.entered.wait(REAL_TIMEOUT)

            def action() -> None:
                raise error

            renewer = get_renewer(clock, store)
            assert renewer.fence(_entry_of(b), action)  # type: ignore[arg-type]
            store.go.set()
            assert told.wait(REAL_TIMEOUT), "a's loss, recorded in that sweep, was told"
            assert a.lost_reason == "released"
            assert not b.lost
        assert any("fenced action" in r.getMessage() for r in caplog.records)


class _BlockingHandler(logging.Handler):
    """A handler that blocks on the first record whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.entered = threading.Event()
        self.go = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage() and not self.entered.is_set():
            self.entered.set()
            self.go.wait(REAL_TIMEOUT)


@pytest.fixture
def blocking_handler() -> Iterator[_BlockingHandler]:
    handler = _BlockingHandler("renewing 'logged' failed")
    log = logging.getLogger("celery_lease.renewer")
    # An in-process Celery worker elsewhere in the session may have configured logging with
    # ``disable_existing_loggers``: this test needs the warning to reach its handler.
    disabled, level = log.disabled, log.level
    log.disabled = False
    log.setLevel(logging.WARNING)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        handler.go.set()
        log.removeHandler(handler)
        log.disabled = disabled
        log.setLevel(level)


class TestABlockingLogHandler:
    def test_the_warning_of_a_failed_renewal_blocks_no_reader_of_the_renewer(
        self, store: SpyStore, clock: FakeClock, blocking_handler: _BlockingHandler
    ) -> None:
        """While a handler blocks in the warning of a failed renewal, the renewer's snapshot
        answers, and another lease of its store is taken and left."""
        store.fail_renewals = 1
        with lease("logged", store=store, ttl=3, clock=clock):
            clock.advance(1.0)
            assert blocking_handler.entered.wait(REAL_TIMEOUT), "the warning was logged"
            answered = threading.Event()
            exited = threading.Event()

            def read_and_exit() -> None:
                get_renewer(clock, store).snapshot()
                answered.set()
                with lease("b", store=store, ttl=30, clock=clock):
                    pass
                exited.set()

            reader = threading.Thread(target=read_and_exit, daemon=True)
            reader.start()
            try:
                assert answered.wait(REAL_TIMEOUT), "snapshot() waited for the logging handler"
                assert exited.wait(REAL_TIMEOUT), "a holder's add() or exit waited for the handler"
            finally:
                blocking_handler.go.set()
                reader.join(REAL_TIMEOUT)


class TestABlockingImmediateListener:
    def test_other_losses_are_recorded_while_an_immediate_listener_blocks_the_renewer(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """a's renewal is refused and a's immediate listener blocks the renewer thread: b (same
        store, renewed in that sweep) is recorded lost by the watchdog when its validity passes,
        without waiting for the listener."""
        unblock = threading.Event()
        entered = threading.Event()
        b_lost = threading.Event()

        def stuck(_: Lease) -> None:
            entered.set()
            unblock.wait(REAL_TIMEOUT)

        try:
            with (
                lease("b", store=store, ttl=3, clock=clock, on_lost=lambda _: b_lost.set()) as b,
                lease("a", store=store, ttl=3, clock=clock) as a,
            ):
                a.add_loss_listener(stuck, immediate=True)
                store.force_release("a")
                clock.advance(1.0)  # b renewed at +1: valid until +1 + 2.968 s
                assert entered.wait(REAL_TIMEOUT)
                poll_until(lambda: clock._deadlines, what="a watchdog waiting for b")
                clock.advance(2.99)
                assert b_lost.wait(REAL_TIMEOUT), (
                    "b's loss must be recorded while a's immediate listener blocks"
                )
                assert b.lost_reason == "expired"
                unblock.set()
        finally:
            unblock.set()
