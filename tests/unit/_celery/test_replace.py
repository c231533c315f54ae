"""``on_held="replace"``: the take-over loop, forced through its dangerous orders on a
MemoryLockStore and a FakeClock, and its end in a task (a call a newer one overtook ends as a
skip does, reason ``"replaced"``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TaskRevokedError

from celery_lease import (
    LeaseConfigError,
    LockedTask,
    LockLostError,
    LockNotAcquiredError,
    MemoryLockStore,
    lease,
    locked,
)
from celery_lease import signals as lease_signals
from celery_lease._celery.replace import Superseded, take_over
from celery_lease._core.lease import Lease, LeaseContext
from celery_lease._core.options import REPLACE_WAIT_MARGIN, replace_wait, validate_options
from celery_lease._core.owners import make_owner, parse_owner, set_node
from celery_lease.errors import ReplicaLagError
from celery_lease.stores.base import LeaseInfo
from celery_lease.stores.slots import MAX_LIMIT, marked
from celery_lease.testing import FakeClock
from tests.unit.conftest import REAL_TIMEOUT, SpyStore

TTL = 30.0
WAIT = TTL + REPLACE_WAIT_MARGIN
TIMEOUT = 20.0  # real seconds a result is waited for (worker tests)
POLL = 0.01  # real seconds between polls of a result or an event (worker tests)


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
    (unless ``runs_on``: a body under ``on_lost="mark"``) the lease reads lost, then the context
    is left."""

    def __init__(
        self, store: Any, clock: FakeClock, task_id: str, *, runs_on: bool = False
    ) -> None:
        self.runs_on = runs_on
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
            if not self.runs_on:
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


def _advance_until(
    clock: FakeClock, event: threading.Event, step: float = 1.0, within: float = 2 * WAIT
) -> None:
    """Move ``clock`` by ``step`` until ``event`` is set, ``within`` seconds of it at most: a
    waiter that began its pause just after a release was signalled wakes at its next poll (at
    most POLL_MAX)."""
    for _ in range(int(within / step) + 2):
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

        def swap_after_the_next_read() -> None:
            forcing.after_get = swap

        forcing.after_first_mark = swap_after_the_next_read
        with pytest.raises(Superseded):
            take_over(_context(forcing, clock, "new"), WAIT, option="on_held")
        assert forcing.guarded_marks == [("old", False)]
        info = forcing.get("job")
        assert info is not None and info.owner == "plain"
        forcing.release("job", "plain")

    def test_a_holder_with_this_calls_task_id_is_never_asked(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """The broker redelivers the running task's message (same task id): the copy does not
        ask the running original to stop; it is refused as ``on_held="raise"`` refuses."""
        original = make_owner(task="t", task_id="same-id")
        assert forcing.acquire("job", original, 60_000) is not None
        with pytest.raises(LockNotAcquiredError) as caught:
            take_over(_context(forcing, clock, "same-id"), WAIT, option="on_held")
        assert type(caught.value) is LockNotAcquiredError and caught.value.reason == "held"
        info = forcing.get("job")
        assert info is not None and info.owner == original
        forcing.release("job", original)

    def test_past_the_wait_it_raises_lock_not_acquired(
        self, forcing: _Forcing, clock: FakeClock
    ) -> None:
        """A holder that keeps the key (here: renewed behind the mark's back by a raw owner)
        past the wait (at least the ttl and the margin from its ask, its owner id recording no
        ttl of its own): ``LockNotAcquiredError`` ("held"), as on_held="raise" gives."""
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

    def _both_asked(
        self, forcing: _Forcing, clock: FakeClock, *, runs_on: bool = False
    ) -> tuple[_Replacer, _Replacer]:
        """B then C asked a holder to stop (and try with their tickets, held at their gates);
        the holder read ``"replaced"`` and left."""
        for name in ("B", "C"):
            forcing.gates[name] = threading.Event()
            forcing.at_gate[name] = threading.Event()
        with lease("job", store=forcing, ttl=TTL, clock=clock) as holder:
            b = _Replacer(forcing, clock, "B", runs_on=runs_on)
            assert forcing.at_gate["B"].wait(REAL_TIMEOUT)  # B drew its ticket, tries with it
            c = _Replacer(forcing, clock, "C")
            assert forcing.at_gate["C"].wait(REAL_TIMEOUT)
            lost = _lost_event(holder)
            clock.advance(TTL / 3)  # the holder's renewal is refused: "replaced"
            assert lost.wait(REAL_TIMEOUT) and holder.lost_reason == "replaced"
        return b, c

    def test_c_first_b_gives_up(self, forcing: _Forcing, clock: FakeClock) -> None:
        """C takes the freed key first: B, refused by a newer stamp, gives up."""
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

    @pytest.mark.parametrize("runs_on", [True, False], ids=["mark", "revoke"])
    def test_the_older_replacer_wins_the_freed_key_and_the_newest_still_ends_holding(
        self, forcing: _Forcing, clock: FakeClock, runs_on: bool
    ) -> None:
        """B takes the freed key first and, under ``on_lost="mark"``, runs on after C asks it to
        stop: its lease, no longer renewed, ends one ttl after its last renewal, later than
        C's first deadline. Asking B extended C's wait to B's ttl and the margin: C ends
        holding. Under ``"revoke"`` B leaves at its next renewal and C holds sooner."""
        b, c = self._both_asked(forcing, clock, runs_on=runs_on)
        forcing.gates["B"].set()  # B's try lands first
        _advance_until(clock, b.holding)
        b_held = b.held
        assert b_held is not None
        forcing.gates["C"].set()
        _advance_until(clock, c.holding, within=3 * WAIT)
        assert b_held.lost_reason == "replaced"
        assert c.error is None and c.held is not None and c.held.token > b_held.token
        b.leave.set()
        c.leave.set()
        b.join()
        c.join()
        assert b.error is None and c.error is None


class TestStoreErrors:
    """A store error inside the loop is asked again until the wait runs out, then raised."""

    @pytest.mark.parametrize("failing", ["acquire", "get", "mark_replaced"])
    def test_a_transient_error_is_asked_again_and_the_replacer_takes_over(
        self, clock: FakeClock, failing: str
    ) -> None:
        store = _Failing(clock, failing, times=1)
        with lease("job", store=store, ttl=TTL, clock=clock) as old:
            replacer = _Replacer(store, clock, "new")
            lost = _lost_event(old)
            _advance_until(clock, lost)
            assert old.lost_reason == "replaced"
        _advance_until(clock, replacer.holding)
        assert store.raised == 1
        replacer.leave.set()
        replacer.join()
        assert replacer.error is None

    def test_an_error_lasting_past_the_wait_is_raised(self, clock: FakeClock) -> None:
        """Never a silent success: the last error once the deadline passed."""
        store = _Failing(clock, "get", times=10**6)
        assert store.acquire("job", "old", 600_000) is not None
        replacer = _Replacer(store, clock, "new")
        _advance_until(clock, replacer.done)
        replacer.join()
        assert type(replacer.error) is ReplicaLagError
        assert store.raised > 1
        store.release("job", "old")


class _Failing(_Forcing):
    """Raises ``ReplicaLagError`` from ``method`` (``acquire``: the tries carrying a ticket)
    ``times`` times, then answers."""

    def __init__(self, clock: FakeClock, method: str, times: int) -> None:
        super().__init__(clock)
        self.method, self.left, self.raised = method, times, 0

    def _fail(self, method: str) -> None:
        if method == self.method and self.left > 0:
            self.left -= 1
            self.raised += 1
            raise ReplicaLagError("injected")

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        if parse_owner(owner).replace_ticket is not None:
            self._fail("acquire")
        return super().acquire(key, owner, ttl_ms)

    def get(self, key: str) -> LeaseInfo | None:
        self._fail("get")
        return super().get(key)

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        self._fail("mark_replaced")
        return super().mark_replaced(key, ticket, holder)


class TestWait:
    def test_the_default_wait_is_the_ttl_plus_the_margin(self) -> None:
        options = validate_options({"on_held": "replace"}, where="t")
        assert replace_wait(options, TTL) == TTL + REPLACE_WAIT_MARGIN

    def test_an_explicit_wait_is_kept(self) -> None:
        options = validate_options({"on_held": "replace", "wait": 40}, where="t")
        assert replace_wait(options, TTL) == 40.0

    def test_a_wait_shorter_than_the_ttl_is_refused_at_definition(self) -> None:
        """The holder may renew until its ttl ends: a shorter wait would ask it to stop and
        then give up, leaving nobody to run."""
        with pytest.raises(
            LeaseConfigError, match=r"lock_wait of t=5\.0 .*shorter than.*ttl.*30\.0.*unset"
        ):
            validate_options(
                {"on_held": "replace", "wait": 5, "ttl": 30}, where="t", prefix="lock_"
            )

    def test_a_wait_shorter_than_the_apps_ttl_is_refused_at_the_call(
        self, app: Celery, store: SpyStore
    ) -> None:
        """The ttl known only from the app's setting: the call raises, nothing is asked."""
        app.conf.lease_default_ttl = 30

        @app.task(base=LockedTask, lock_on_held="replace", lock_wait=5, lock_key="k", shared=False)
        def body() -> str:
            return "ran"

        assert store.acquire("k", "old", 60_000) is not None
        with pytest.raises(LeaseConfigError, match=r"lock_wait of task .*=5\.0 .*ttl"):
            body()
        info = store.get("k")
        assert info is not None and info.owner == "old"
        store.release("k", "old")


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

    def test_a_cooldown_is_refused(self) -> None:
        """A holder in its cooldown runs nothing and cannot be asked to stop."""
        with pytest.raises(LeaseConfigError, match=r"on_held of t='replace'.*cooldown=5\.0"):
            validate_options({"on_held": "replace", "cooldown": 5}, where="t")

    def test_a_limit_of_one_is_refused(self) -> None:
        """limit=1 holds the key's slots, not the key itself that replace asks to stop."""
        with pytest.raises(LeaseConfigError, match=r"on_held of t='replace'.*limit=1"):
            validate_options({"on_held": "replace", "limit": 1}, where="t")

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


class _SwapsOnTheFirstAsk(MemoryLockStore):
    """Once ``armed``, the first ask (the ticket drawn) is followed by the holder ``"old"``
    leaving and a newer call taking the key: the asker is overtaken."""

    newer = make_owner(task="newer", task_id="n-1")

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def mark_replaced(
        self, key: str, ticket: int | None = None, holder: str | None = None
    ) -> tuple[int, str | None, bool]:
        answer = super().mark_replaced(key, ticket, holder)
        if ticket is None and self.armed:
            self.armed = False
            self.release(key, "old")
            assert self.acquire(key, self.newer, 60_000) is not None
        return answer


@pytest.fixture(scope="module")
def worker() -> Iterator[SimpleNamespace]:
    """A threads-pool worker on a real-time memory store, with the tasks below."""
    store = _SwapsOnTheFirstAsk()
    app = Celery("replace", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.lease_store = store
    app.conf.broker_transport_options = {"polling_interval": POLL}
    starts: list[tuple[str, int]] = []
    started = {label: threading.Event() for label in ("first", "mark-first")}
    leave = threading.Event()

    @app.task(
        bind=True, base=LockedTask, lock_key="auto", lock_ttl=0.6, lock_on_held="replace",
        lock_on_lost="revoke", autoretry_for=(Exception,), max_retries=2,
        default_retry_delay=0, retry_backoff=False, retry_jitter=False, shared=False,
    )  # fmt: skip
    def revoking(self: Any, label: str) -> str:
        starts.append((label, int(self.request.retries)))
        started.get(label, threading.Event()).set()
        while label == "first" and not leave.wait(POLL):  # polls: the interrupt lands here
            pass
        return label

    @app.task(
        bind=True, base=LockedTask, lock_key="auto-mark", lock_ttl=0.6, lock_on_held="replace",
        lock_on_lost="mark", autoretry_for=(Exception,), max_retries=2,
        default_retry_delay=0, retry_backoff=False, retry_jitter=False, shared=False,
    )  # fmt: skip
    def marking(self: Any, label: str) -> str:
        starts.append((label, int(self.request.retries)))
        started.get(label, threading.Event()).set()
        if label == "mark-first":
            assert self.request.lease is not None
            assert self.request.lease.wait_lost(TIMEOUT)
            raise ValueError("failed after the ask")
        return label

    @locked(key="busy", on_held="replace")
    def helper() -> str:
        return "ran"

    @app.task(shared=False)
    def calls_helper() -> list[str | None]:
        return [helper()]

    root_level = logging.getLogger().level  # the worker's logging setup changes it
    try:
        with start_worker(
            app, pool="threads", concurrency=3, perform_ping_check=False, shutdown_timeout=TIMEOUT
        ):
            yield SimpleNamespace(
                app=app, store=store, revoking=revoking, marking=marking,
                calls_helper=calls_helper, starts=starts, started=started, leave=leave,
            )  # fmt: skip
    finally:
        leave.set()
        app.close()
        set_node(None)  # the worker named this process's owner ids after its node
        logging.getLogger().setLevel(root_level)


class TestOnAWorker:
    def test_a_replaced_revoking_execution_ends_revoked_and_is_not_retried(
        self, worker: SimpleNamespace
    ) -> None:
        """``on_lost="revoke"`` with ``autoretry_for=(Exception,)``: the first body, stopped
        because a newer call asked for its key, ends REVOKED (reason: replaced), never retried
        (a retry would take the key back from the newer call); the newer call succeeds."""
        first = worker.revoking.delay("first")
        assert worker.started["first"].wait(TIMEOUT)
        second = worker.revoking.delay("second")
        assert second.get(timeout=TIMEOUT, interval=POLL) == "second"
        with pytest.raises(TaskRevokedError, match="replaced"):
            first.get(timeout=TIMEOUT, interval=POLL)
        assert first.state == "REVOKED"
        assert [s for s in worker.starts if s[0] == "first"] == [("first", 0)]

    def test_a_replaced_execution_that_fails_is_not_retried(self, worker: SimpleNamespace) -> None:
        """``on_lost="mark"``: the first body runs on after the ask and fails; its retry would
        replace the newer call, so it ends with ``LockLostError("replaced")`` instead."""
        first = worker.marking.delay("mark-first")
        assert worker.started["mark-first"].wait(TIMEOUT)
        second = worker.marking.delay("mark-second")
        assert second.get(timeout=TIMEOUT, interval=POLL) == "mark-second"
        with pytest.raises(LockLostError) as caught:
            first.get(timeout=TIMEOUT, interval=POLL)
        assert caught.value.reason == "replaced"
        assert [s for s in worker.starts if s[0] == "mark-first"] == [("mark-first", 0)]

    def test_an_overtaken_replace_helper_returns_none_to_the_body(
        self, worker: SimpleNamespace
    ) -> None:
        """A ``@locked(on_held="replace")`` helper a newer call overtook, called from a running
        body: it returns None there as a skipped helper does; the task goes on and succeeds."""
        store = worker.store
        assert store.acquire("busy", "old", 60_000) is not None
        store.armed = True
        result = worker.calls_helper.delay()
        assert result.get(timeout=TIMEOUT, interval=POLL) == [None]
        assert result.state == "SUCCESS"
        store.release("busy", store.newer)
