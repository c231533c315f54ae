"""A first try sent before the enter (``LeaseContext.send_first_try``): the enter reads its reply
as the first try's; one never entered with is given up owner-checked."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from celery_lease import LockNotAcquiredError, MemoryLockStore, StoreUnavailableError
from celery_lease._core import lease as lease_module
from celery_lease._core.acquire_plan import SentTry
from celery_lease._core.dispatch import drain
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease.testing import FakeClock

TTL = 30.0


class SendingStore(MemoryLockStore):
    """A memory store that can send an acquire: it takes effect when sent (as on a server),
    its answer is handed over when read; ``events`` records both."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.events: list[tuple[str, str, str]] = []
        self.fail_read: Exception | None = None

    def send_acquire(self, key: str, owner: str, ttl_ms: int) -> Callable[[], int | None]:
        self.events.append(("sent", key, owner))
        token = self.acquire(key, owner, ttl_ms)

        def read() -> int | None:
            self.events.append(("read", key, owner))
            if self.fail_read is not None:
                raise self.fail_read
            return token

        return read

    def release(self, key: str, owner: str) -> None:
        self.events.append(("release", key, owner))
        super().release(key, owner)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> SendingStore:
    return SendingStore(clock)


def _context(store: SendingStore, clock: FakeClock, key: str = "k") -> LeaseContext:
    return LeaseContext(key, store, TTL, 0.0, None, 0.0, None, None, clock)


def _sent(store: SendingStore, clock: FakeClock) -> tuple[LeaseContext, SentTry]:
    """A context on ``"k"`` and its first try, sent."""
    context = _context(store, clock)
    sent = context.send_first_try()
    assert sent is not None
    return context, sent


@contextlib.contextmanager
def entered(context: LeaseContext, sent: SentTry) -> Iterator[Lease]:
    """``with context`` whose enter reads ``sent``."""
    held = context.enter(sent)
    try:
        yield held
    finally:
        context.__exit__(None, None, None)


class TestEnterWithASentTry:
    def test_the_enter_reads_the_sent_reply_and_tries_nothing_more(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """One acquire in all: sent first, its reply read by the enter."""
        context, sent = _sent(store, clock)
        assert store.events == [("sent", "k", sent.owner)]
        with entered(context, sent) as held:
            assert held.owner == sent.owner
            assert store.events == [("sent", "k", sent.owner), ("read", "k", sent.owner)]
            assert store.get("k") is not None
        assert store.get("k") is None

    def test_the_lease_counts_from_the_send(self, store: SendingStore, clock: FakeClock) -> None:
        """Validity and ``held_seconds`` count from the send, not from the enter."""
        context, sent = _sent(store, clock)
        clock.advance(2.0)
        with entered(context, sent) as held:
            assert held.acquired_at == sent.sent_at
            assert held.held_seconds == pytest.approx(2.0)
            clock.advance(TTL - 2.0)  # the ttl from the send has run out, renewal or not
            assert held._key.valid_until <= clock.monotonic()

    def test_a_refused_sent_try_is_refused_as_a_first_try(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """Held by another: the enter raises ``LockNotAcquiredError`` (wait 0); the holder's lease
        is untouched."""
        assert store.acquire("k", "holder", 60_000) is not None
        context, sent = _sent(store, clock)
        with pytest.raises(LockNotAcquiredError):
            context.enter(sent)
        info = store.get("k")
        assert info is not None and info.owner == "holder"

    def test_a_failed_read_raises_and_releases_the_attempt_owner_checked(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """The reply is lost (the acquire may have run): raised as the try's error, and the
        attempt's own lease is released, as for a first try that failed."""
        context, sent = _sent(store, clock)
        store.fail_read = StoreUnavailableError("reply lost")
        with pytest.raises(StoreUnavailableError, match="reply lost"):
            context.enter(sent)
        assert drain(), "the attempt is released on the dispatcher"
        assert ("release", "k", sent.owner) in store.events
        assert store.get("k") is None


class TestGivingUp:
    def test_a_granted_try_not_entered_is_released_by_its_owner(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        context, sent = _sent(store, clock)
        context.abandon_sent(sent)
        assert store.events[-1] == ("release", "k", sent.owner)
        assert store.get("k") is None

    def test_a_refused_try_releases_nothing(self, store: SendingStore, clock: FakeClock) -> None:
        """Giving up a refused try never touches the holder's lease."""
        assert store.acquire("k", "holder", 60_000) is not None
        context, sent = _sent(store, clock)
        context.abandon_sent(sent)
        assert not [e for e in store.events if e[0] == "release"]
        info = store.get("k")
        assert info is not None and info.owner == "holder"

    def test_a_try_already_entered_is_not_given_up(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        context, sent = _sent(store, clock)
        with entered(context, sent):
            context.abandon_sent(sent)
            assert store.get("k") is not None


class TestWhenNothingIsSent:
    def test_a_store_without_send_acquire_sends_nothing(self, clock: FakeClock) -> None:
        plain = MemoryLockStore(clock=clock)
        context = LeaseContext("k", plain, TTL, 0.0, None, 0.0, None, None, clock)
        assert context.send_first_try() is None

    def test_a_limit_sends_nothing(self, store: SendingStore, clock: FakeClock) -> None:
        context = _context(store, clock)
        context.limit = 2
        assert context.send_first_try() is None
        assert store.events == []


class TestASentTryTheEnterDoesNotUse:
    """A try granted too long before the enter, or refused: the enter tries afresh (as if
    nothing had been sent)."""

    def test_a_grant_older_than_a_third_of_the_ttl_is_asked_again_under_its_owner(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """Still held: the same owner's try gets its own token back with a fresh ttl, and the
        lease's validity counts from that try; nothing is released in between."""
        context, sent = _sent(store, clock)
        clock.advance(TTL / 3)  # the renewer's first renewal point: too late to trust the grant
        with entered(context, sent) as held:
            assert held.acquired_at == clock.monotonic()
            assert held.owner == sent.owner
            info = store.get("k")
            assert info is not None and info.owner == held.owner
            assert info.expires_in == TTL
        assert [e[0] for e in store.events] == ["sent", "read", "release"]

    def test_a_late_grant_whose_key_expired_and_is_free_gets_a_new_token(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        context, sent = _sent(store, clock)
        first = store.get("k")
        assert first is not None
        clock.advance(TTL + 1.0)
        assert store.get("k") is None
        with entered(context, sent) as held:
            assert held.token > first.token

    def test_a_late_grant_is_never_refused_by_itself(
        self, store: SendingStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Nothing is released first, so a store error on a release cannot leave the old
        grant refusing the enter's try (on_held would fire with nobody else holding)."""

        def failing_release(key: str, owner: str) -> None:
            raise StoreUnavailableError("release failed")

        context, sent = _sent(store, clock)
        monkeypatch.setattr(store, "release", failing_release)
        clock.advance(TTL / 3)
        held = context.enter(sent)
        assert held.owner == sent.owner
        monkeypatch.undo()
        context.__exit__(None, None, None)
        assert store.get("k") is None

    def test_a_grant_read_before_a_third_of_the_ttl_is_used(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        context, sent = _sent(store, clock)
        clock.advance(TTL / 3 - 0.001)
        with entered(context, sent) as held:
            assert held.acquired_at == sent.sent_at
        assert [e[0] for e in store.events] == ["sent", "read", "release"]

    def test_an_enter_after_the_ttl_never_holds_a_key_another_holds(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """The key expired on the server and another took it: refused, as a first try there."""
        context, sent = _sent(store, clock)
        clock.advance(TTL + 1.0)
        assert store.acquire("k", "other-worker", 60_000) is not None
        with pytest.raises(LockNotAcquiredError):
            context.enter(sent)
        info = store.get("k")
        assert info is not None and info.owner == "other-worker"

    def test_a_refused_try_is_tried_again_at_the_enter(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """The holder ends between the send and the enter (wait 0): the enter's try takes it."""
        assert store.acquire("k", "holder", 60_000) is not None
        context, sent = _sent(store, clock)
        store.release("k", "holder")
        with entered(context, sent) as held:
            info = store.get("k")
            assert info is not None and info.owner == held.owner

    def test_a_failed_try_is_handled_as_a_first_try_that_failed(
        self, store: SendingStore, clock: FakeClock
    ) -> None:
        """With a wait too: raised, not tried again, its attempt released owner-checked (as
        when the enter's own first acquire raises)."""
        context = LeaseContext("k", store, TTL, 5.0, None, 0.0, None, None, clock)
        sent = context.send_first_try()
        assert sent is not None
        store.fail_read = StoreUnavailableError("reply lost")
        with pytest.raises(StoreUnavailableError, match="reply lost"):
            context.enter(sent)
        assert drain(), "the attempt is released on the dispatcher"
        assert [e[0] for e in store.events] == ["sent", "read", "release"]
        assert store.get("k") is None


class TestTheStoreCheck:
    def test_a_store_that_cannot_send_sends_nothing(self, clock: FakeClock) -> None:
        """No ``send_acquire``: ``None`` (the enter tries as usual)."""
        context = LeaseContext(
            "k", MemoryLockStore(clock=clock), TTL, 0.0, None, 0.0, None, None, clock
        )
        assert context.send_first_try() is None

    def test_a_store_the_caller_checked_is_not_asked_again(
        self, store: SendingStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``store_checked``: the caller found ``send_acquire``; the try is sent without asking
        the store's protocol again."""
        asked: list[object] = []
        monkeypatch.setattr(lease_module, "offers", lambda *a: asked.append(a) or True)
        sent = _context(store, clock).send_first_try(True)
        assert sent is not None and asked == []
        _context(store, clock, "k2").send_first_try()
        assert len(asked) == 1
        _context(store, clock).abandon_sent(sent)
