"""``on_held="replace"``: the take-over loop, forced through its dangerous orders on a
MemoryLockStore and a FakeClock, and its end in a task (a call a newer one overtook ends as a
skip does, reason ``"replaced"``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError, LockedTask, LockNotAcquiredError, lease
from celery_lease import signals as lease_signals
from celery_lease._celery.replace import Superseded, take_over
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.options import REPLACE_WAIT_MARGIN, replace_wait, validate_options
from celery_lease._core.owners import make_owner, parse_owner
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import MAX_LIMIT, marked
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore

TTL = 30.0
WAIT = TTL + REPLACE_WAIT_MARGIN


class _Forcing(SpyStore):
    """A SpyStore that runs a test's step at chosen points, and holds the tries that carry a
    ticket (``rt``) of a gated task id until its gate opens."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.before_first_mark: Callable[[], None] | None = None
        self.after_first_mark: Callable[[], None] | None = None
        self.after_get: Callable[[], None] | None = None
        self.gates: dict[str, threading.Event] = {}
        self.at_gate: dict[str, threading.Event] = {}
        self.guarded_marks: list[tuple[str | None, bool]] = []  # (holder=, asked)
        self.ticket_seen: dict[str, int] = {}
        self._step_lock = threading.Lock()

    def tickets_of(self, task_id: str) -> int:
        """The ticket the tries of ``task_id`` carry (read from the last one that waited)."""
        return self.ticket_seen[task_id]

    def _once(self, name: str) -> None:
        with self._step_lock:
            step = getattr(self, name)
            setattr(self, name, None)
        if step is not None:
            step()

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        found = parse_owner(owner)
        gate = self.gates.get(found.task_id or "")
        if found.replace_ticket is not None and gate is not None:
            self.ticket_seen[found.task_id or ""] = found.replace_ticket
            self.at_gate[found.task_id or ""].set()
            assert gate.wait(REAL_TIMEOUT)
        return super().acquire(key, owner, ttl_ms)

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        if ticket is None:
            self._once("before_first_mark")
        answer = super().mark_replaced(key, ticket, holder)
        if ticket is None:
            self._once("after_first_mark")
        else:
            self.guarded_marks.append((holder, answer[2]))
        return answer

    def get(self, key: str) -> LeaseInfo | None:
        info = super().get(key)
        self._once("after_get")
        return info


@pytest.fixture
def forcing(clock: FakeClock) -> _Forcing:
    return _Forcing(clock)


def _context(store: Any, clock: FakeClock, task_id: str, key: str = "job") -> LeaseContext:
    """What an ``on_held="replace"`` execution enters: ``wait=0``, each try its own."""
    return LeaseContext(
        key, store, TTL, 0.0, None, 0.0, None, None, clock, task="t", task_id=task_id
    )


class _Replacer:
    """``take_over`` on a thread; once it holds, the lease stays held until ``leave`` is set or
    the lease reads lost, then the context is left."""

    def __init__(self, store: Any, clock: FakeClock, task_id: str) -> None:
        self.context = _context(store, clock, task_id)
        self.held: Lease | None = None
        self.error: BaseException | None = None
        self.holding = threading.Event()
        self.leave = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"replacer {task_id}")
        self.thread.start()

    def _run(self) -> None:
        try:
            context, held = take_over(self.context, WAIT, option="on_held")
            self.held = held
            self.holding.set()
            held.add_loss_listener(lambda _held: self.leave.set(), immediate=True)
            self.leave.wait(REAL_TIMEOUT)  # set by the test, or by the loss
            context.__exit__(None, None, None)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def join(self) -> None:
        self.thread.join(REAL_TIMEOUT)
        assert not self.thread.is_alive()


def _advance_until(clock: FakeClock, event: threading.Event, step: float = 1.0) -> None:
    """Move ``clock`` by ``step`` until ``event`` is set: a waiter that began its pause just
    after a release was signalled wakes at its next poll (at most POLL_MAX)."""
    for _ in range(int(WAIT / step) + 2):
        if event.wait(0.05):
            return
        clock.advance(step)
    assert event.wait(REAL_TIMEOUT)


class TestTakeOver:
    def test_a_free_key_is_taken_at_once_without_a_ticket(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """Granted at the first try: no holder is asked, the owner id carries no ``rt``."""
        context, held = take_over(_context(forcing, clock, "a"), WAIT, option="on_held")
        try:
            assert parse_owner(held.owner).replace_ticket is None
            assert forcing.guarded_marks == []
        finally:
            context.__exit__(None, None, None)

    def test_the_holder_reads_replaced_and_the_replacer_takes_over_with_a_higher_token(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """The holder's next renewal is refused (``"replaced"``); once it leaves, the replacer
        holds with an owner id carrying its ticket, ticket and token above the holder's."""
        marked_ = threading.Event()
        forcing.after_first_mark = marked_.set
        with lease("job", store=forcing, ttl=TTL, clock=clock) as old:
            replacer = _Replacer(forcing, clock, "new")
            assert marked_.wait(REAL_TIMEOUT)
            clock.advance(TTL / 3)
            assert old.wait_lost(REAL_TIMEOUT)
            assert old.lost_reason == "replaced"
            assert not replacer.holding.is_set()
        _advance_until(clock, replacer.holding)
        held = replacer.held
        assert held is not None
        ticket = parse_owner(held.owner).replace_ticket
        assert ticket is not None
        assert old.token < ticket < held.token
        assert held.waited and held.wait_seconds >= TTL / 3
        replacer.leave.set()
        replacer.join()
        assert replacer.error is None

    def test_the_holder_released_before_the_mark_leaves_nothing_to_mark(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """The holder leaves between the refusal and the mark: the mark finds the key free
        (nobody marked) and the next try takes it."""
        old = forcing.acquire("job", "old", 60_000)
        assert old is not None
        forcing.before_first_mark = lambda: forcing.release("job", "old")
        context, held = take_over(_context(forcing, clock, "new"), WAIT, option="on_held")
        try:
            assert held.token > old
            assert parse_owner(held.owner).replace_ticket is not None
            assert forcing.guarded_marks == []
        finally:
            context.__exit__(None, None, None)

    def test_a_plain_holder_that_took_the_key_before_the_mark_is_replaced(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """The holder leaves and a plain (``on_held="raise"``) holder takes the key before the
        mark: its token (its stamp) is below the ticket, so it is marked, and the replacer takes
        over once it leaves."""
        assert forcing.acquire("job", "old", 60_000) is not None
        plain: list[int | None] = []

        def swap() -> None:
            forcing.release("job", "old")
            plain.append(forcing.acquire("job", "plain", 60_000))

        forcing.before_first_mark = swap
        first_try = forcing.at_gate["new"] = threading.Event()
        forcing.gates["new"] = gate = threading.Event()
        replacer = _Replacer(forcing, clock, "new")
        assert first_try.wait(REAL_TIMEOUT)  # asked already: its tries carry the ticket
        taken = plain[0]
        assert taken is not None
        info = forcing.get("job")
        assert info is not None and info.owner == marked("plain")
        ticket = forcing.tickets_of("new")
        assert taken < ticket
        gate.set()
        forcing.release("job", "plain")  # the marked holder's exit
        _advance_until(clock, replacer.holding)
        assert replacer.held is not None and replacer.held.token > ticket
        replacer.leave.set()
        replacer.join()
        assert replacer.error is None

    def test_a_plain_holder_that_took_the_key_after_the_ticket_wins(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """A plain holder taking the key after the ticket was drawn is a newer call (its token
        is above the ticket): the replacer gives up (``Superseded``), the plain holder is left
        unmarked."""
        assert forcing.acquire("job", "old", 60_000) is not None

        def swap() -> None:
            forcing.release("job", "old")
            assert forcing.acquire("job", "plain", 60_000) is not None

        forcing.after_first_mark = swap
        with pytest.raises(Superseded) as caught:
            take_over(_context(forcing, clock, "new"), WAIT, option="on_held")
        assert caught.value.reason == "replaced"
        info = forcing.get("job")
        assert info is not None and info.owner == "plain"
        forcing.release("job", "plain")

    def test_the_holder_guard_never_marks_a_holder_that_came_after_the_read(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """Between the read of the holder and its mark, the holder leaves and another takes the
        key: the mark (``holder=`` the one read) leaves the newcomer unmarked."""
        assert forcing.acquire("job", "old", 60_000) is not None

        def swap() -> None:
            forcing.release("job", "old")
            assert forcing.acquire("job", "plain", 60_000) is not None

        forcing.after_get = swap
        with pytest.raises(Superseded):
            take_over(_context(forcing, clock, "new"), WAIT, option="on_held")
        assert forcing.guarded_marks == [("old", False)]
        info = forcing.get("job")
        assert info is not None and info.owner == "plain"
        forcing.release("job", "plain")

    def test_past_the_wait_it_raises_lock_not_acquired(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """A holder that keeps the key (here: renewed behind the mark's back by a raw owner)
        past the wait: ``LockNotAcquiredError`` ("held"), as on_held="raise" gives."""
        assert forcing.acquire("job", "stubborn", 600_000) is not None
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                take_over(_context(forcing, clock, "new"), 3.0, option="on_held")
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=run)
        thread.start()
        _advance_until(clock, done)
        thread.join(REAL_TIMEOUT)
        assert len(errors) == 1 and type(errors[0]) is LockNotAcquiredError
        assert errors[0].reason == "held"  # type: ignore[attr-defined]
        forcing.release("job", "stubborn")


def _lost_event(held: Lease) -> threading.Event:
    event = threading.Event()
    held.add_loss_listener(lambda _h: event.set(), immediate=True)
    return event


class TestNewestWins:
    """Two replacers B (older ticket) then C: C ends holding, whichever tries first once the
    holder leaves."""

    def _both_asked(self, forcing: _Forcing, clock: FakeClock) -> tuple[_Replacer, _Replacer]:
        for name in ("B", "C"):
            forcing.gates[name] = threading.Event()
            forcing.at_gate[name] = threading.Event()
        b = _Replacer(forcing, clock, "B")
        assert forcing.at_gate["B"].wait(REAL_TIMEOUT)  # B drew its ticket and tries with it
        c = _Replacer(forcing, clock, "C")
        assert forcing.at_gate["C"].wait(REAL_TIMEOUT)
        return b, c

    def test_c_first_b_gives_up(self, forcing: _Forcing, clock: FakeClock) -> None:
        """C takes the freed key first: B, refused by a newer stamp, gives up."""
        with lease("job", store=forcing, ttl=TTL, clock=clock):
            b, c = self._both_asked(forcing, clock)
        forcing.gates["C"].set()
        assert c.holding.wait(REAL_TIMEOUT)
        forcing.gates["B"].set()
        b.join()
        assert isinstance(b.error, Superseded)
        assert b.error.holder.task_id == "C"
        assert not c.done.is_set()
        c.leave.set()
        c.join()
        assert c.error is None

    def test_b_first_is_replaced_by_c(self, forcing: _Forcing, clock: FakeClock) -> None:
        """B takes the freed key first: C (newer ticket) marks B, B reads ``"replaced"``,
        and C ends holding with a token above B's."""
        with lease("job", store=forcing, ttl=TTL, clock=clock):
            b, c = self._both_asked(forcing, clock)
        forcing.gates["B"].set()
        assert b.holding.wait(REAL_TIMEOUT)
        b_held = b.held
        assert b_held is not None
        b_lost = _lost_event(b_held)
        forcing.gates["C"].set()
        _advance_until(clock, b_lost)
        assert b_held.lost_reason == "replaced"
        _advance_until(clock, c.holding)
        b.join()
        assert b.error is None
        assert c.held is not None and c.held.token > b_held.token
        c_ticket = parse_owner(c.held.owner).replace_ticket
        b_ticket = parse_owner(b_held.owner).replace_ticket
        assert b_ticket is not None and c_ticket is not None and b_ticket < c_ticket
        c.leave.set()
        c.join()
        assert c.error is None


class TestWait:
    def test_the_default_wait_is_the_ttl_plus_the_margin(self) -> None:
        options = validate_options({"on_held": "replace"}, where="t")
        assert replace_wait(options, TTL) == TTL + REPLACE_WAIT_MARGIN

    def test_an_explicit_wait_is_kept(self) -> None:
        options = validate_options({"on_held": "replace", "wait": 7}, where="t")
        assert replace_wait(options, TTL) == 7.0


class _NoReplace:
    """A store without ``mark_replaced``."""

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return 1

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return True

    def release(self, key: str, owner: str) -> None:
        return None


class TestValidation:
    @pytest.mark.parametrize("limit", [2, MAX_LIMIT, lambda account: 1])
    def test_a_limit_above_one_or_callable_is_refused(self, limit: object) -> None:
        with pytest.raises(LeaseConfigError, match=r"lock_on_held of t='replace'.*limit="):
            validate_options({"on_held": "replace", "limit": limit}, where="t", prefix="lock_")

    def test_a_limit_of_one_is_allowed(self) -> None:
        assert validate_options({"on_held": "replace", "limit": 1}, where="t").on_held == "replace"

    def test_unique_is_refused(self) -> None:
        with pytest.raises(LeaseConfigError, match=r"on_held of t='replace'.*unique="):
            validate_options({"on_held": "replace", "unique": "until_done"}, where="t")

    def test_a_store_without_replace_is_refused_at_definition(self) -> None:
        with pytest.raises(LeaseConfigError, match=r"on_held of t='replace' needs a store"):
            validate_options({"on_held": "replace", "store": _NoReplace()}, where="t")

    def test_the_apps_store_without_replace_is_refused_at_the_call(
        self, app: Celery, clock: FakeClock
    ) -> None:
        app.conf.lease_store = _NoReplace()

        @app.task(base=LockedTask, lock_on_held="replace", lock_key="k", shared=False)
        def body() -> str:
            return "ran"

        with pytest.raises(LeaseConfigError, match=r"lock_on_held of task .*'replace'"):
            body()


@pytest.fixture
def rejected() -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **named: Any) -> None:
        sent.append(named)

    lease_signals.lock_rejected.connect(receiver, weak=False)
    yield sent
    lease_signals.lock_rejected.disconnect(receiver)


class TestInATask:
    def test_a_called_task_takes_over_from_the_holder(
        self, app: Celery, store: SpyStore, clock: FakeClock
    ) -> None:
        """A task called while another lease holds its key: the holder reads ``"replaced"``,
        the body runs once the holder left, with a token above the holder's."""
        tokens: list[int | None] = []

        @app.task(
            base=LockedTask,
            bind=True,
            lock_on_held="replace",
            lock_key="k",
            lock_ttl=TTL,
            shared=False,
        )
        def body(self: Any) -> str:
            tokens.append(self.request.lock_token)
            return "ran"

        results: list[object] = []
        with lease("k", store=store, ttl=TTL, clock=clock) as old:
            thread = threading.Thread(target=lambda: results.append(body()))
            thread.start()
            lost = _lost_event(old)
            _advance_until(clock, lost)
            assert old.lost_reason == "replaced"
            assert tokens == []
        thread.join(REAL_TIMEOUT)
        assert results == ["ran"]
        assert len(tokens) == 1 and tokens[0] is not None and tokens[0] > old.token

    def test_an_overtaken_call_ends_as_a_skip_with_reason_replaced(
        self, app: Celery, store: SpyStore, clock: FakeClock, rejected: list[dict[str, Any]]
    ) -> None:
        """A newer call's lease (its token above this call's ticket) holds the key: this call
        returns None without running and ``lock_rejected`` says ``"replaced"``."""
        ran: list[str] = []

        @app.task(base=LockedTask, lock_on_held="replace", lock_key="k", lock_ttl=TTL, shared=False)
        def body() -> str:
            ran.append("ran")
            return "ran"

        assert store.acquire("k", "old", 60_000) is not None
        newer = make_owner(task="newer", task_id="n-1")
        original = store.mark_replaced

        def mark_then_swap(key: str, ticket: int | None = None, holder: str | None = None) -> Any:
            answer = original(key, ticket, holder)
            if ticket is None:  # the first mark drew the ticket: a newer call takes the key
                store.release(key, "old")
                assert store.acquire(key, newer, 60_000) is not None
            return answer

        store.mark_replaced = mark_then_swap  # type: ignore[method-assign]
        assert body() is None
        store.release("k", newer)
        assert ran == []
        assert [(r["reason"], r["holder_task_id"]) for r in rejected] == [("replaced", "n-1")]

    def test_the_marked_lease_owner_is_stored_marked_while_the_body_runs(
        self, store: SpyStore, clock: FakeClock
    ) -> None:
        """The mark is the owner id with REPLACED_MARK: ``get`` shows it until the exit."""
        with lease("k", store=store, ttl=TTL, clock=clock) as held:
            store.mark_replaced("k")
            info = store.get("k")
            assert info is not None and info.owner == marked(held.owner)
