"""A controlled scheduler over the unique-at-enqueue / debounce protocol, on the real code.

Every actor runs on a thread of its own: callers (each its own "process": its own calls, ids and
wall clock reads), worker slots (each runs a delivery through Celery's real tracer, as a worker's
pool does, for a :class:`~celery_lease.LockedTask` with ``lock_unique`` and, where the scenario
says so, ``lock_debounce``), the broker (inside the callers' and slots' publishes: it can fail a
publish, take a message and then fail, or deliver a message twice) and the clock. The store is a
:class:`~celery_lease.MemoryLockStore` on a :class:`~celery_lease.testing.FakeClock`, behind
:class:`ExploredStore`; the result backend is a Celery ``KeyValueStoreBackend`` over a dict
(:class:`ExploredBackend`: Celery's own code decides what is stored, and refuses to overwrite a
SUCCESS, as the real backends do).

**Only one actor runs at a time.** Each store call, broker publish and backend read or write is a
*point*: the actor stops there and the scheduler picks who goes next among the actors that can
(a slot can when the broker has a message due; a sleeping caller when its time has come; the
clock when a message or a caller waits for a later time: it moves to that time). The choice comes
from a strategy:

- ``random``: a random walk from a seed;
- ``pct``: PCT (random actor priorities, the highest runs; at a few random steps the running
  actor drops to the lowest priority), from a seed;
- ``dfs``: every schedule of a small scenario, depth first, with at most ``bound`` preemptions
  (switching away from an actor that could go on; CHESS's preemption bounding) and at most the
  scenario's number of broker faults.

The same seed (or the same list of choices) gives the same timeline: the ids are numbered in the
order they are made (``t01``, ``t02``...), the clock is fake and moves only when the scheduler
picks it, and the core's background threads run on the real clock with ttls far above the few
milliseconds a run lasts (their first renewal would come after ``lock_ttl``/3 real seconds; the
first renewal of a queued key goes out on the task's thread: :class:`ExploredStore` offers
``renew_deferred``). A clock step of ``lock_ttl``/3 or more (a deferred second delivery's
countdown) is taken only while no slot runs a delivery: the real renewer would renew a running
body's leases meanwhile, the fake clock has nobody to do it.

After each run the invariants of :func:`check` are asserted. A failing run prints its timeline
and how to replay it::

    python -m tests.unique_explorer              # CI mode: every scenario, fixed seeds, dfs
    python -m tests.unique_explorer --scenario debounce-burst --strategy pct --seed 7
    python -m tests.unique_explorer --scenario redelivery --choices 0,0,1,2,0
    python -m tests.unique_explorer --quick                 # a few seconds: seeds only
    python -m tests.unique_explorer --seeds 20000           # long mode (a night's run)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from celery import Celery, chord, group, states
from celery.app.trace import build_tracer
from celery.backends.base import KeyValueStoreBackend
from celery.signals import after_task_publish, before_task_publish

from celery_lease import LockedTask, MemoryLockStore
from celery_lease._celery import settings as lease_settings
from celery_lease._celery.unique import caller as unique_caller
from celery_lease._celery.unique import common as unique_common
from celery_lease._celery.unique import hold as unique_hold
from celery_lease._core.dispatch import get_dispatcher
from celery_lease._core.owners import parse_owner
from celery_lease.stores.base import LeaseInfo
from celery_lease.testing import FakeClock
from tests.explorer_scheduler import REAL_TIMEOUT, BaseActor, Scheduler, Stop, Stuck

START = 1_767_225_600.0
"""The fake clock's reading at the start of every run (2026-01-01T00:00:00Z)."""

RUN_TTL = 60.0
"""The run lease's ttl (``lock_ttl``) of every explored task, seconds."""

MAX_STEPS = 2000
"""Points per run after which the run counts as a livelock."""


# The world of one run -------------------------------------------------------------------------


@dataclasses.dataclass
class Event:
    step: int
    actor: str
    what: str
    result: str = ""

    def line(self) -> str:
        result = f"  -> {self.result}" if self.result else ""
        return f"{self.step:4d}  {self.actor:<8} {self.what}{result}"


@dataclasses.dataclass
class Actor(BaseActor):
    """``kind``: "caller" | "slot" | "background"; ``state`` also "idle" (a dispatcher thread
    whose callback ended) and "killed" (a slot whose process died)."""

    wake_at: float | None = None  # a sleeping caller's time
    error: BaseException | None = None
    current: Message | None = None  # a slot's delivery in progress


@dataclasses.dataclass
class Body:
    task_id: str
    key: str
    args: tuple[Any, ...]
    token: int | None
    slot: str
    started: int
    ended: int | None = None
    retried: bool = False
    killed: bool = False


@dataclasses.dataclass
class Call:
    caller: str
    what: str
    args: tuple[Any, ...]
    ids: list[str] = dataclasses.field(default_factory=list)
    raised: str | None = None
    step: int = 0


@dataclasses.dataclass
class Message:
    seq: int
    task_id: str
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    embed: dict[str, Any]
    eta: float
    redelivered: bool = False
    step: int = 0


class Strategy:
    """Picks one of ``options`` (labels) at a decision of ``kind`` (``"schedule"`` or
    ``"broker"``); ``last`` is the label of the actor that ran last, when it could go on."""

    def pick(self, kind: str, options: Sequence[str], last: str | None) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class RandomWalk(Strategy):
    def __init__(self, seed: int, fault_rate: float = 0.25) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.fault_rate = fault_rate

    def pick(self, kind: str, options: Sequence[str], last: str | None) -> int:
        if kind == "broker":  # options[0] is the plain publish
            if len(options) == 1 or self.rng.random() >= self.fault_rate:
                return 0
            return self.rng.randrange(1, len(options))
        return self.rng.randrange(len(options))

    def describe(self) -> str:
        return f"--strategy random --seed {self.seed}"


class PCT(RandomWalk):
    """Probabilistic concurrency testing: random priorities, ``depth`` priority change points."""

    def __init__(self, seed: int, depth: int = 3, steps: int = 120) -> None:
        super().__init__(seed)
        self.priorities: dict[str, float] = {}
        self.changes = set(self.rng.sample(range(1, steps), depth))
        self.step = 0
        self.low = 0.0

    def pick(self, kind: str, options: Sequence[str], last: str | None) -> int:
        if kind == "broker":
            return super().pick(kind, options, last)
        self.step += 1
        for label in options:
            if label not in self.priorities:
                self.priorities[label] = 1.0 + self.rng.random()
        if self.step in self.changes and last is not None:
            self.low -= 1.0
            self.priorities[last] = self.low
        return max(range(len(options)), key=lambda i: self.priorities[options[i]])

    def describe(self) -> str:
        return f"--strategy pct --seed {self.seed}"


class Replay(Strategy):
    """Follows a list of choices, then takes the first option (the actor that ran last when it
    can go on, the plain publish); records every decision for depth-first enumeration.

    ``bound`` limits preemptions: once spent, an actor that can go on goes on.
    """

    def __init__(self, prefix: Sequence[int], bound: int | None = None) -> None:
        self.prefix = list(prefix)
        self.bound = bound
        self.preemptions = 0
        self.taken: list[tuple[int, int]] = []  # (choice, how many options there were)

    def pick(self, kind: str, options: Sequence[str], last: str | None) -> int:
        n = len(options)
        spent = self.bound is not None and self.preemptions >= self.bound
        if kind == "schedule" and last is not None and spent:
            n = 1  # options[0] is ``last``: no preemption left
        i = len(self.taken)
        choice = self.prefix[i] if i < len(self.prefix) else 0
        if choice >= n:
            raise Stuck(f"replayed choice {choice} at decision {i} has only {n} options")
        if kind == "schedule" and last is not None and choice > 0:
            self.preemptions += 1
        self.taken.append((choice, n))
        return choice

    def describe(self) -> str:
        return "--choices " + ",".join(str(c) for c, _ in self.taken)


class World(Scheduler[Actor]):
    """One run: the actors, the scheduler, the broker, the records the invariants read."""

    def __init__(self, scenario: Scenario, strategy: Strategy) -> None:
        super().__init__()
        self.scenario = scenario
        self.strategy = strategy
        self.clock = FakeClock(START)
        self.last: Actor | None = None
        self.timeline: list[Event] = []
        self.step = 0
        self.ids = itertools.count(1)
        self.seqs = itertools.count(1)
        self.queue: list[Message] = []
        self.published: list[Message] = []
        self.faults_left = scenario.faults
        self.kills_left = scenario.kills
        self.plain_ran: set[str] = set()  # ids of tasks without a lock that ran (chord bodies)
        self.killed_ids: set[str] = set()  # the copies whose delivery died with its slot
        self.bodies: list[Body] = []
        self.active: dict[str, list[Body]] = {}
        self.calls: list[Call] = []
        self.failure_path: list[tuple[str, str]] = []  # (task id, what fired)
        self.traced: list[tuple[str, str, str]] = []  # (task id, slot, state the tracer ended in)
        self.results: dict[str, Any] = {}  # the result backend's keys and values
        self.stopping = False
        self.taken_at: dict[str, int] = {}  # task id -> the step its latest delivery was taken
        self.choices: list[int] = []  # every decision taken: ``--choices`` replays the run
        self.max_running = 0  # the most actors seen running at once (1: the scheduler holds)
        self.store_history: list[tuple[str, tuple[Any, ...], Any, int]] = []  # with its step

    # ids and time ------------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"t{next(self.ids):02d}"

    def now(self) -> float:
        return self.clock.time()

    # the scheduler -----------------------------------------------------------------------------

    def actor(self) -> Actor | None:
        return self.by_thread.get(threading.current_thread())

    def point(self, what: str, *, wake_at: float | None = None) -> Event | None:
        """Stop the calling actor here until the scheduler picks it; then record ``what``.

        A core dispatcher thread (a cooldown or retry keep sent off the task's thread) becomes
        an actor at its first point. Any other thread that is no actor (the main thread
        reading the results) passes through."""
        actor = self.actor()
        if self.out_of_run(actor):  # the run is over: threads in it go on unscheduled, or stop
            return None
        if actor is None:
            if not threading.current_thread().name.startswith("celery-lease-dispatch"):
                self.timeline.append(
                    Event(self.step, threading.current_thread().name, f"{what} (unscheduled)")
                )
                return None
            actor = Actor(
                f"dispatch{len(self.by_thread) - len(self.actors) + 1}", "background", lambda: None
            )
            actor.thread = threading.current_thread()
            with self.cond:
                self.by_thread[threading.current_thread()] = actor
                self.actors.append(actor)
        actor.pending = what
        actor.wake_at = wake_at
        self.park(actor)
        if self.out_of_run(actor):  # the run is over (stuck): let everyone out, unscheduled
            return None
        with self.cond:
            actor.state = "running"
            actor.wake_at = None
            self.max_running = max(self.max_running, sum(a.state == "running" for a in self.actors))
            if self.stopping and actor.kind == "slot" and what == "take":
                raise Stop
        event = Event(self.step, actor.name, what)
        self.timeline.append(event)
        return event

    def _settled(self) -> None:
        deadline = time.monotonic() + REAL_TIMEOUT
        dispatcher = get_dispatcher()
        with self.cond:
            while True:
                running = self.running
                ended = running is not None and running.thread not in dispatcher._busy
                if running is not None and running.kind == "background" and ended:
                    running.state = "idle"  # its callback ended
                    self.running = running = None
                busy_elsewhere = bool(dispatcher._queue) or any(
                    thread not in {a.thread for a in self.actors if a.state == "parked"}
                    for thread in dispatcher._busy
                )
                if (
                    running is None
                    and not busy_elsewhere
                    and not any(
                        a.state in ("new", "running") and a.kind != "background"
                        for a in self.actors
                    )
                ):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = [f"{a.name}:{a.state}:{a.pending}" for a in self.actors]
                    raise Stuck(f"an actor did not reach a point: {busy}")
                self.cond.wait(
                    0.002
                    if busy_elsewhere or (running is not None and running.kind == "background")
                    else min(left, 0.5)
                )

    def _can_go(self, actor: Actor, now: float) -> bool:
        if actor.state != "parked":
            return False
        if actor.pending == "take":
            return any(m.eta <= now for m in self.queue)
        if actor.wake_at is not None:
            return actor.wake_at <= now
        return True

    @staticmethod
    def _busy(actor: Actor) -> bool:
        """A slot in the middle of a delivery (not a killed one: it runs nothing any more)."""
        return (
            actor.kind == "slot"
            and actor.state == "parked"
            and actor.pending not in ("take", "start")
        )

    def _kill(self, actor: Actor) -> None:
        """The slot's process dies where it is parked: it runs nothing more (its thread is let
        out unscheduled after the run, its store calls refused), its body no longer runs, and
        an ``acks_late`` message goes back to the queue (redelivered at once)."""
        actor.state = "killed"
        self.kills_left -= 1
        for running in self.active.values():
            for body in [b for b in running if b.slot == actor.name]:
                running.remove(body)
                body.killed = True
        msg = actor.current
        if msg is not None:
            self.killed_ids.add(msg.task_id)
        acks_late = bool(self.scenario.options.get("acks_late"))
        if msg is not None and acks_late:
            self.queue.append(
                dataclasses.replace(msg, seq=next(self.seqs), eta=self.now(), redelivered=True)
            )
        self.timeline.append(
            Event(
                self.step,
                actor.name,
                f"killed at {actor.pending}",
                f"{msg.task_id if msg else '-'} {'redelivered' if acks_late else 'lost (acked)'}",
            )
        )

    def _clock_target(self, now: float) -> float | None:
        times = [m.eta for m in self.queue if m.eta > now]
        times += [a.wake_at for a in self.actors if a.state == "parked" and a.wake_at is not None]
        future = [t for t in times if t is not None and t > now]
        if not future:
            return None
        target = min(future)
        busy = any(self._busy(a) for a in self.actors)
        if busy and target - now >= RUN_TTL / 3:
            return None  # see the module docstring: only while no delivery runs
        return target

    def run(self) -> None:
        self.start_actors()
        while True:
            self._settled()
            if self.step >= MAX_STEPS:
                raise Stuck(f"no end after {MAX_STEPS} steps")
            now = self.now()
            options = [a for a in self.actors if self._can_go(a, now)]
            labels = [a.name for a in options]
            last = self.last.name if self.last is not None and self.last in options else None
            if last is not None:  # the actor that ran last first: choice 0 goes on with it
                i = labels.index(last)
                options.insert(0, options.pop(i))
                labels.insert(0, labels.pop(i))
            target = self._clock_target(now)
            if target is not None:
                labels.append("clock")
            if not labels:
                break
            if self.kills_left > 0:
                labels += [f"kill {a.name}" for a in self.actors if self._busy(a)]
            self.step += 1
            choice = self.strategy.pick("schedule", labels, last)
            self.choices.append(choice)
            if labels[choice] == "clock":
                assert target is not None
                self.clock.advance(target - now)
                self.timeline.append(
                    Event(self.step, "clock", f"advance to +{self.now() - START:g}s")
                )
                self.last = None
                continue
            if labels[choice].startswith("kill "):
                self._kill(next(a for a in self.actors if f"kill {a.name}" == labels[choice]))
                self.last = None
                continue
            self.last = options[choice]
            self.hand_turn(options[choice])
        self._finish()

    def _finish(self) -> None:
        stuck = [
            a
            for a in self.actors
            if a.state not in ("done", "idle", "killed")
            and not (a.kind == "slot" and a.pending == "take")
        ]
        if stuck:
            raise Stuck(
                "no actor can go on: " + ", ".join(f"{a.name} at {a.pending}" for a in stuck)
            )
        self.stopping = True
        for actor in self.actors:
            if actor.state in ("done", "idle", "killed"):
                continue
            self.hand_turn(actor)
            self._settled()
        for actor in self.actors:
            assert actor.thread is not None
            if actor.kind != "background" and actor.state != "killed":
                actor.thread.join(REAL_TIMEOUT)

    def raised(self, actor: Actor, exc: BaseException) -> None:
        actor.error = exc
        self.violations.append(f"{actor.name} raised {exc!r} (not caught by Celery)")

    def choose(self, kind: str, options: Sequence[str]) -> str:
        choice = self.strategy.pick(kind, options, None)
        self.choices.append(choice)
        return options[choice]

    # the broker --------------------------------------------------------------------------------

    def publish(self, name: str, message: Any) -> None:
        headers = dict(message.headers)
        args, kwargs, embed = message.body
        task_id = headers["id"]
        eta = _wall(headers.get("eta")) or self.now()
        note = _describe_headers(headers)
        event = self.point(
            f"broker.publish {task_id} args={tuple(args)}{note} eta=+{eta - START:g}s"
        )
        outcomes = ["ok"]
        if self.faults_left > 0:
            outcomes += list(self.scenario.broker_faults)
        outcome = self.choose("broker", outcomes) if len(outcomes) > 1 else "ok"
        if outcome != "ok":
            self.faults_left -= 1
        if event is not None:
            event.result = outcome
        if outcome == "fail":
            raise ConnectionError("broker refused the publish (explored fault)")
        copies = 2 if outcome == "twice" else 1
        for copy in range(copies):
            msg = Message(
                next(self.seqs),
                task_id,
                name,
                tuple(args),
                dict(kwargs),
                headers,
                dict(embed or {}),
                eta,
                redelivered=copy > 0,
                step=self.step,
            )
            self.queue.append(msg)
            self.published.append(msg)
        if outcome == "lost-reply":
            raise ConnectionError(
                "broker took the message, then the connection dropped (explored fault)"
            )

    def take(self) -> Message:
        now = self.now()
        due = [m for m in self.queue if m.eta <= now]
        msg = min(due, key=lambda m: (m.eta, m.seq))
        self.queue.remove(msg)
        return msg

    # records -----------------------------------------------------------------------------------

    def body_start(
        self, task_id: str, key: str, args: tuple[Any, ...], token: int | None, slot: str
    ) -> Body:
        body = Body(task_id, key, args, token, slot, self.step)
        running = self.active.setdefault(key, [])
        if running:
            self.violations.append(
                f"I1 two bodies of {key!r} at once: {task_id} starts at step {self.step} while"
                f" {', '.join(b.task_id for b in running)} runs"
            )
        earlier = [b.token for b in self.bodies if b.key == key and b.token is not None]
        if token is None or (earlier and token <= max(earlier)):
            self.violations.append(
                f"I2 body {task_id} of {key!r} runs with fencing token {token}, not above the"
                f" earlier {earlier}"
            )
        running.append(body)
        self.bodies.append(body)
        return body

    def body_end(self, body: Body) -> None:
        if body.killed or body.ended is not None:
            return  # its slot was killed (its thread let out after the run), or ended already
        body.ended = self.step
        self.active[body.key].remove(body)


def _wall(value: object) -> float | None:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.timestamp()
    return None


def _describe_headers(headers: dict[str, Any]) -> str:
    notes = []
    if headers.get("retries"):
        notes.append(f" retries={headers['retries']}")
    if headers.get(unique_common.DEFERRED):
        notes.append(f" deferred={headers[unique_common.DEFERRED]}")
    if headers.get("group"):
        notes.append(" group")
    return "".join(notes)


WORLD: World | None = None
"""The run in progress (the store, the backend and the task bodies record into it)."""


def world() -> World:
    assert WORLD is not None, "no explored run in progress"
    return WORLD


# The store, the backend ----------------------------------------------------------------------


def _who(owner: str | None) -> str:
    if owner is None:
        return "-"
    parsed = parse_owner(owner)
    kind = "queued" if owner.startswith("queued;") else "run"
    return f"{kind}:{parsed.task_id}" if parsed.task_id else owner[:24]


class ExploredStore:
    """A MemoryLockStore (on the run's FakeClock) whose every call is a point of the scheduler.

    Offers what the built-in stores offer to the unique code: ``get`` / ``list`` /
    ``last_token`` / ``force_release`` (SupportsInspection) and ``renew_deferred`` (sent on the
    task's thread, its reply read at once: for the scheduler, one more point)."""

    def __init__(self) -> None:
        self.inner = MemoryLockStore(clock=FakeClock(START))

    def reset(self, clock: FakeClock) -> None:
        self.inner = MemoryLockStore(clock=clock)

    def _call(self, op: str, args: tuple[Any, ...], show: str) -> Any:
        w = WORLD
        event = w.point(f"store.{op} {show}") if w is not None else None
        try:
            result = getattr(self.inner, op)(*args)
        except BaseException as exc:
            if event is not None:
                event.result = f"raised {exc!r}"
            raise
        if w is not None:
            w.store_history.append((op, args, result, w.step))
        if event is not None:
            event.result = _show(result)
        return result

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        return self._call("acquire", (key, owner, ttl_ms), f"{key} {_who(owner)}")  # type: ignore[no-any-return]

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        return self._call("renew", (key, owner, ttl_ms), f"{key} {_who(owner)}")  # type: ignore[no-any-return]

    def renew_deferred(self, key: str, owner: str, ttl_ms: int) -> bool:
        self._call("renew", (key, owner, ttl_ms), f"{key} {_who(owner)} (deferred)")
        return True

    def release(self, key: str, owner: str) -> None:
        self._call("release", (key, owner), f"{key} {_who(owner)}")

    def get(self, key: str) -> LeaseInfo | None:
        return self._call("get", (key,), key)  # type: ignore[no-any-return]

    def list(self, prefix: str = "") -> list[LeaseInfo]:
        return self._call("list", (prefix,), prefix)  # type: ignore[no-any-return]

    def last_token(self, key: str) -> int | None:
        return self._call("last_token", (key,), key)  # type: ignore[no-any-return]

    def force_release(self, key: str) -> LeaseInfo | None:
        return self._call("force_release", (key,), key)  # type: ignore[no-any-return]


def _show(result: object) -> str:
    if isinstance(result, LeaseInfo):
        return f"held by {_who(result.owner)}"
    if result is None:
        return "None"
    return repr(result)


class ExploredBackend(KeyValueStoreBackend):  # type: ignore[misc]
    """Celery's key/value result backend over the run's dict; reads and writes are points."""

    thread_safe = True  # one instance for every actor, as one server is
    implements_incr = True  # chords count their members here (no chord_unlock polling)

    def _data(self) -> dict[str, Any]:
        return world().results

    def get(self, key: Any) -> Any:
        key = _text(key)
        w = world()
        event = w.point(f"backend.get {_short(key)}")
        value = self._data().get(key)
        if event is not None:
            event.result = _state_of(self, value)
        return value

    def mget(self, keys: Any) -> Any:
        return [self.get(k) for k in keys]

    def set(self, key: Any, value: Any) -> None:
        key = _text(key)
        w = world()
        w.point(f"backend.set {_short(key)} {_state_of(self, value)}")
        self._data()[key] = value

    def _set_with_state(self, key: Any, value: Any, state: str) -> None:
        self.set(key, value)

    def delete(self, key: Any) -> None:
        world().point(f"backend.delete {_short(_text(key))}")
        self._data().pop(_text(key), None)

    def incr(self, key: Any) -> int:
        key = _text(key)
        world().point(f"backend.incr {_short(key)}")
        data = self._data()
        data[key] = int(data.get(key) or 0) + 1
        return int(data[key])

    def expire(self, key: Any, value: Any) -> None:
        pass

    def _call_task_errbacks(self, request: Any, exc: BaseException, traceback: Any) -> None:
        world().failure_path.append((str(request.id), "link_error errback"))

    def final_state(self, task_id: str) -> tuple[str, object]:
        value = self._data().get(_text(self.get_key_for_task(task_id)))
        if value is None:
            return states.PENDING, None
        meta = self.decode_result(value)
        return meta["status"], meta.get("result")


def _text(key: Any) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)


def _short(key: str) -> str:
    return key.replace("celery-task-meta-", "meta:")


def _state_of(backend: ExploredBackend, value: Any) -> str:
    if value is None:
        return "None"
    try:
        meta = backend.decode_result(value)
    except Exception:
        return "value"
    if isinstance(meta, dict) and "status" in meta:
        result = meta.get("result")
        if isinstance(result, dict) and "exc_type" in result:
            message = ", ".join(map(str, result.get("exc_message") or ()))
            return f"{meta['status']} {result['exc_type']}({message})"
        return f"{meta['status']} {result!r}"
    return "value"


# Scenarios -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A small world: task options, each caller's actions, how many slots, which faults."""

    name: str
    options: dict[str, Any]
    callers: tuple[tuple[tuple[Any, ...], ...], ...]
    slots: int = 2
    faults: int = 0
    broker_faults: tuple[str, ...] = ("fail", "lost-reply", "twice")
    kills: int = 0
    retry_once: bool = False
    debounced: bool = False
    bound: int = 2
    dfs_limit: int = 500

    def describe(self) -> str:
        return f"--scenario {self.name}"


def _call(*args: Any) -> tuple[Any, ...]:
    return ("call", args)


def _group(*members: tuple[Any, ...]) -> tuple[Any, ...]:
    return ("group", members)


def _chord(*members: tuple[Any, ...]) -> tuple[Any, ...]:
    return ("chord", members)


def _sleep(seconds: float) -> tuple[Any, ...]:
    return ("sleep", seconds)


DEBOUNCE = {"lock_unique": "while_queued", "lock_debounce": 1, "lock_debounce_max": 10}

SCENARIOS = {
    s.name: s
    for s in [
        # Two callers of one key a moment apart, two slots: one body, the newest arguments.
        Scenario(
            "debounce-burst",
            DEBOUNCE,
            ((_call(1, 1),), (_call(1, 2),)),
            debounced=True,
            bound=2,
        ),
        # The same under "until_done", three callers, the third a little later.
        Scenario(
            "debounce-until-done",
            {**DEBOUNCE, "lock_unique": "until_done"},
            ((_call(1, 1),), (_call(1, 2),), (_sleep(0.5), _call(1, 3))),
            debounced=True,
            bound=1,
        ),
        # A debounced burst whose publishes may fail (the hand-back to the waiting copy).
        Scenario(
            "debounce-faults",
            DEBOUNCE,
            ((_call(1, 1),), (_call(1, 2),)),
            faults=1,
            broker_faults=("fail", "lost-reply"),
            bound=1,
        ),
        # until_done, two callers, one message delivered twice (acks_late redelivery).
        Scenario(
            "redelivery",
            {"lock_unique": "until_done", "acks_late": True},
            ((_call(1, 1),), (_call(1, 2),)),
            faults=1,
            broker_faults=("twice",),
            bound=2,
        ),
        # until_done, a body that retries once (countdown 1 s), one broker fault.
        Scenario(
            "retry",
            {"lock_unique": "until_done", "acks_late": True},
            ((_call(1, 1),), (_call(1, 2),)),
            faults=1,
            retry_once=True,
            bound=1,
        ),
        # until_done, acks_late: a slot's process may die anywhere in a delivery (its message
        # is redelivered; its leases expire on the clock).
        Scenario(
            "killed-slot",
            {"lock_unique": "until_done", "acks_late": True},
            ((_call(1, 1),), (_call(1, 2),)),
            kills=1,
            bound=1,
        ),
        # A debounced burst, acks_late, one slot may die.
        Scenario(
            "killed-debounce",
            {**DEBOUNCE, "acks_late": True},
            ((_call(1, 1),), (_call(1, 2),)),
            kills=1,
            bound=1,
        ),
        # Two overlapping chords: (1, 2) then (2, 3) on keys acct:1..3.
        Scenario(
            "chord-duplicates",
            {"lock_unique": "until_done"},
            ((_chord((1, 1), (2, 1)),), (_chord((2, 2), (3, 2)),)),
            bound=1,
            dfs_limit=300,
        ),
        # A group with two members of one key, and a plain call of that key.
        Scenario(
            "group-duplicates",
            {"lock_unique": "until_done"},
            ((_group((4, 1), (4, 2)),), (_call(4, 3),)),
            bound=1,
        ),
    ]
}


# Apps and tasks ------------------------------------------------------------------------------


class _Recorded(LockedTask):  # type: ignore[misc]
    abstract = True

    def on_failure(self, exc: Any, task_id: Any, args: Any, kwargs: Any, einfo: Any) -> None:
        world().failure_path.append((str(task_id), f"on_failure {type(exc).__name__}"))


_apps: dict[str, tuple[Celery, Any, ExploredStore, Any]] = {}


def _app_for(scenario: Scenario) -> tuple[Celery, Any, ExploredStore, Any]:
    if scenario.name in _apps:
        return _apps[scenario.name]
    store = ExploredStore()
    app = Celery(f"explore-{scenario.name}", broker="memory://", set_as_current=False)
    app.conf.update(
        lease_store=store,
        broker_connection_retry_on_startup=False,
        result_backend=f"{__name__}:ExploredBackend",
        task_default_queue="celery",
    )
    retry_once = scenario.retry_once

    @app.task(
        name=f"explore.{scenario.name}",
        base=_Recorded,
        bind=True,
        lock_key="acct:{account}",
        lock_ttl=RUN_TTL,
        lock_queue_ttl="1d",
        shared=False,
        **scenario.options,
    )
    def sync(self: Any, account: int, n: int) -> int:
        w = world()
        request = self.request
        body = w.body_start(
            str(request.id),
            f"acct:{account}",
            (account, n),
            request.lock_token,
            str(request.hostname),
        )
        try:
            w.point(f"body {request.id} args={(account, n)} token={request.lock_token} runs")
            if retry_once and not request.retries:
                body.retried = True
                # The body's work ends here: retry() releases the run lease early (before its
                # publish, by design), so another copy may start while it publishes.
                w.body_end(body)
                raise self.retry(countdown=1)
        finally:
            w.body_end(body)
        return n

    @app.task(name=f"explore-callback.{scenario.name}", shared=False)
    def joined(results: list[int]) -> list[int]:
        """A chord's body (no lock): what its header returned."""
        return results

    app.now = lambda: datetime.fromtimestamp(world().now(), timezone.utc)  # type: ignore[method-assign]
    app.amqp.send_task_message = _send_task_message  # the broker
    task = sync._get_current_object()
    app.finalize()
    tracers = {
        t.name: build_tracer(t.name, t, app=app, eager=False, propagate=False)
        for t in (task, joined._get_current_object())
    }
    _apps[scenario.name] = (app, task, store, tracers)
    return _apps[scenario.name]


def _send_task_message(
    producer: Any,
    name: str,
    message: Any,
    exchange: str | None = None,
    routing_key: str | None = None,
    headers: dict[str, Any] | None = None,
    **options: Any,
) -> None:
    """Celery's ``amqp.send_task_message`` around the explored broker: the custom headers
    merged into the message's, ``before_task_publish`` sent before (celery-lease's early
    release of a task publishing its own id listens there), ``after_task_publish`` after."""
    headers2 = message.headers
    headers2.update(headers or {})
    exchange, routing_key = exchange or "", routing_key or "celery"
    before_task_publish.send(
        sender=name,
        body=message.body,
        exchange=exchange,
        routing_key=routing_key,
        declare=[],
        headers=headers2,
        properties=message.properties,
        retry_policy={},
    )
    world().publish(name, message)
    after_task_publish.send(
        sender=name, body=message.body, headers=headers2, exchange=exchange, routing_key=routing_key
    )


@contextlib.contextmanager
def _deterministic_ids(w: World) -> Iterator[None]:
    """Task and group ids numbered in the order they are made (the timeline's names)."""
    import celery.app.base
    import celery.app.task
    import celery.canvas

    modules = [celery.app.base, celery.canvas, unique_caller]
    saved = [m.uuid for m in modules]  # type: ignore[attr-defined]
    for m in modules:
        m.uuid = w.new_id  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, value in zip(modules, saved, strict=True):
            m.uuid = value  # type: ignore[attr-defined]


# One run -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    scenario: Scenario
    strategy: Strategy
    world: World
    violations: list[str]

    def report(self) -> str:
        lines = [
            f"scenario {self.scenario.name} ({self.strategy.describe()}):"
            f" {len(self.violations)} invariant violation(s)",
            *[f"  ! {v}" for v in self.violations],
            "timeline:",
            *[e.line() for e in self.world.timeline],
            "calls:",
            *[
                f"  {c.caller} {c.what}{c.args} -> "
                + (f"raised {c.raised}" if c.raised else ", ".join(c.ids))
                for c in self.world.calls
            ],
            "final states:",
            *[
                f"  {tid}: {state} {result!r}"
                for tid, (state, result) in _finals(self.world).items()
            ],
            "replay: python -m tests.unique_explorer "
            f"{self.scenario.describe()} {self.strategy.describe()}",
        ]
        return "\n".join(lines)


_lock = threading.Lock()


def run_once(scenario: Scenario, strategy: Strategy) -> Outcome:
    """Run ``scenario`` once under ``strategy``; the invariants checked."""
    global WORLD
    with _lock:
        app, task, store, tracer = _app_for(scenario)
        w = World(scenario, strategy)
        store.reset(w.clock)
        lease_settings.reset(app)
        unique_hold.holding.clear()
        saved_clock = unique_common.clock
        unique_common.clock = w.clock
        WORLD = w
        try:
            with _deterministic_ids(w):
                for i, actions in enumerate(scenario.callers, 1):
                    w.actors.append(
                        Actor(f"caller{i}", "caller", _caller(w, task, f"caller{i}", actions))
                    )
                for i in range(1, scenario.slots + 1):
                    w.actors.append(
                        Actor(f"slot{i}", "slot", _slot(w, app, task, tracer, f"slot{i}"))
                    )
                try:
                    w.run()
                except Stuck as exc:
                    w.violations.append(f"stuck: {exc}")
                    w.abandon()
                    return Outcome(scenario, strategy, w, list(w.violations))
                violations = check(w, app, store)
                w.abandon()  # killed slots' threads end now, their store calls refused
        finally:
            unique_common.clock = saved_clock
            WORLD = None
        return Outcome(scenario, strategy, w, violations)


def _caller(
    w: World, task: Any, name: str, actions: Sequence[tuple[Any, ...]]
) -> Callable[[], None]:
    def run() -> None:
        for kind, value in actions:
            if kind == "sleep":
                w.point(f"sleep {value}s", wake_at=w.now() + value)
                continue
            call = Call(name, kind, tuple(value), step=w.step)
            w.calls.append(call)
            try:
                if kind == "call":
                    result = task.apply_async(value)
                    call.ids = [str(result.id)]
                elif kind == "group":
                    result = group(task.s(*member) for member in value).apply_async()
                    call.ids = [str(r.id) for r in result.results]
                else:  # a chord: the members, then its body's id
                    callback = task.app.tasks[f"explore-callback.{w.scenario.name}"]
                    header = group(task.s(*member) for member in value)
                    result = chord(header)(callback.s())
                    call.ids = [str(r.id) for r in result.parent.results] + [str(result.id)]
            except Exception as exc:
                call.raised = repr(exc)
            w.timeline.append(
                Event(
                    w.step,
                    name,
                    f"call {kind}{tuple(value)} returns",
                    f"raised {call.raised}" if call.raised else ", ".join(call.ids),
                )
            )

    return run


def _slot(w: World, app: Celery, task: Any, tracer: Any, name: str) -> Callable[[], None]:
    def run() -> None:
        while True:
            event = w.point("take")
            msg = w.take()
            actor = w.actor()
            assert actor is not None
            actor.current = msg
            w.taken_at[msg.task_id] = w.step
            if event is not None:
                event.what = (
                    f"take {msg.task_id} args={msg.args}{_describe_headers(msg.headers)}"
                    + (" (redelivered)" if msg.redelivered else "")
                )
            request = {
                **msg.headers,
                "args": list(msg.args),
                "kwargs": msg.kwargs,
                "hostname": name,
                "is_eager": False,
                "delivery_info": {
                    "exchange": "",
                    "routing_key": "celery",
                    "priority": 0,
                    "redelivered": msg.redelivered,
                },
                **msg.embed,
            }
            if msg.name not in tracer:
                tracer[msg.name] = build_tracer(
                    msg.name, app.tasks[msg.name], app=app, eager=False, propagate=False
                )
            result = tracer[msg.name](msg.task_id, list(msg.args), msg.kwargs, request)
            state = (
                getattr(result.info, "state", None) if result.info is not None else states.SUCCESS
            )
            w.traced.append((msg.task_id, name, str(state)))
            if msg.name != task.name and state == states.SUCCESS:
                w.plain_ran.add(msg.task_id)  # a chord's body: no lock, no Body record
            rejected = getattr(result.info, "retval", None) if state == states.REJECTED else None
            if getattr(rejected, "requeue", False):  # Reject(requeue=True): the broker keeps it
                w.queue.append(
                    dataclasses.replace(msg, seq=next(w.seqs), eta=w.now(), redelivered=True)
                )
                state = f"{state} (requeued)"
            w.timeline.append(Event(w.step, name, f"delivery of {msg.task_id} ends", str(state)))
            actor.current = None

    return run


# The invariants ------------------------------------------------------------------------------


def _finals(w: World, only: Sequence[str] | None = None) -> dict[str, tuple[str, object]]:
    app, _task, _store, _tracer = _apps[w.scenario.name]
    backend: ExploredBackend = app.backend
    ids = only or sorted({i for c in w.calls for i in c.ids} | {m.task_id for m in w.published})
    global WORLD
    saved, WORLD = WORLD, w
    try:
        return {i: backend.final_state(i) for i in ids}
    finally:
        WORLD = saved


def check(w: World, app: Celery, store: ExploredStore) -> list[str]:
    """The protocol's invariants over a finished run (I1, I2 are checked as bodies start).

    I1  never two bodies of one key at once;
    I2  a body's fencing token is above every earlier body's of its key;
    I3  every id handed to a caller (a group member's too) ends in a ready state (SUCCESS,
        FAILURE, REVOKED): none PENDING, RETRY or STARTED once nothing is left to run. Two
        outcomes of Celery's own design are let through: PENDING after ``retry()`` failed to
        publish (Celery raises ``Reject(requeue=False)``: the message is dropped), and RETRY
        stored after the retry attempt itself stored SUCCESS (Celery's RETRY write is a read,
        then a write, after the retry message was published);
    I4  a superseded copy (its tombstone taken by another call) ends REVOKED, never FAILURE, and
        fires no failure path (on_failure, link_error errbacks);
    I5  a copy whose body succeeded fires no failure path;
    I6  debounce (no fault injected): a copy superseded before its body began never runs it
        (a caller that stalls across a whole run supersedes nothing: its call comes after the
        run), and once the calls go quiet the newest copy (the last one published that nobody
        superseded) ran its body; except where that copy met the run key held by an earlier
        copy that ran its body (a call made during a run, due before the run released:
        ``on_held`` with ``lock_wait`` decides, as documented for ``"while_queued"``);
    I7  every call's work is done by a body run of its id, or its id ends with a reason (REVOKED
        with one, "superseded by X" leading to a copy that ran or ended with a reason; FAILURE
        with an error), or the call raised; a SUCCESS is never stored for an id whose body
        never ran;
    I8  nothing is left held once nothing runs or waits: no run key, no queued key (the
        tombstones ``superseded:<id>`` expire by themselves, and so do the leases of a killed
        slot's copy, within the run ttl).
    """
    violations = list(w.violations)
    finals = _finals(w)
    succeeded = {b.task_id for b in w.bodies if b.ended is not None and not b.retried}
    succeeded &= {tid for tid, (state, _) in finals.items() if state == states.SUCCESS}
    handed = [(c, i) for c in w.calls for i in c.ids]
    last_delivery = {tid: state for tid, _slot, state in w.traced}
    returned = {b.task_id for b in w.bodies if b.ended is not None and not b.retried}
    for call, tid in handed:
        state, result = finals[tid]
        if state == states.PENDING and last_delivery.get(tid) == states.REJECTED:
            continue  # Celery's retry() whose publish failed: Reject(requeue=False), by design
        if state == states.RETRY and tid in returned:
            continue  # Celery's own race: the retry ran and stored SUCCESS before RETRY landed
        if state not in states.READY_STATES:
            violations.append(
                f"I3 {call.caller}'s call{call.args} was handed {tid}, which ends {state}"
                " with nothing left to run (it never becomes ready)"
            )
    superseded: dict[str, str] = {}
    superseded_at: dict[str, int] = {}  # the step at which another call took its tombstone
    prefix = unique_common.superseded_key("", "")
    for op, args, result, step in w.store_history:
        if op == "acquire" and result is not None and str(args[0]).startswith(prefix):
            old = str(args[0])[len(prefix) :]
            writer = parse_owner(str(args[1])).task_id
            if writer is not None and writer != old:
                superseded.setdefault(old, writer)
                superseded_at.setdefault(old, step)
    fired: dict[str, list[str]] = {}
    for tid, what in w.failure_path:
        fired.setdefault(tid, []).append(what)
    for tid, writer in superseded.items():
        state, result = finals.get(tid, (states.PENDING, None))
        if tid in {b.task_id for b in w.bodies}:
            continue  # handed back after a failed publish: it ran (I1/I6 judge that)
        if state == states.FAILURE or tid in fired:
            violations.append(
                f"I4 {tid}, superseded by {writer}, ends {state} {result!r};"
                f" failure path fired: {fired.get(tid, [])}"
            )
    for tid in sorted(succeeded):
        if tid in fired:
            violations.append(
                f"I5 {tid} succeeded (its body ran and returned, SUCCESS stored) yet its failure"
                f" path fired: {fired[tid]}"
            )
    if (
        w.scenario.debounced
        and w.faults_left == w.scenario.faults
        and w.kills_left == w.scenario.kills
    ):
        for key in sorted({b.key for b in w.bodies} | {"acct:1"}):
            firsts = [
                m
                for m in w.published
                if not m.redelivered
                and not m.headers.get(unique_common.DEFERRED)
                and not m.headers.get("retries")
                and m.args[0] == int(key.split(":")[1])
            ]
            ran = [b for b in w.bodies if b.key == key]
            for body in ran:
                # A tombstone taken after the body started (a caller that stalled across the
                # whole run) supersedes nothing: that call is a new one, after the run.
                if body.task_id in superseded and superseded_at[body.task_id] < body.started:
                    violations.append(
                        f"I6 {body.task_id}{body.args} runs its body although"
                        f" {superseded[body.task_id]} superseded it"
                    )
            firsts = [m for m in firsts if m.task_id not in superseded]
            newest = firsts[-1] if firsts else None
            state, result = finals.get(newest.task_id, ("", None)) if newest else ("", None)
            held_by_a_body = (
                bool(ran) and state == states.FAILURE and "LockNotAcquiredError" in repr(result)
            )  # a call made while a body ran, due before it released: on_held decides (lock_wait)
            if (
                newest is not None
                and newest.task_id not in {b.task_id for b in ran}
                and not held_by_a_body
            ):
                violations.append(
                    f"I6 the debounced burst on {key!r} went quiet without a body of its newest"
                    f" copy {newest.task_id}{newest.args} (bodies run:"
                    f" {', '.join(f'{b.task_id}{b.args}' for b in ran) or 'none'})"
                )
    ran_ids = {b.task_id for b in w.bodies} | w.plain_ran

    def resolved(tid: str, seen: frozenset[str] = frozenset()) -> bool:
        if tid in ran_ids:
            return True
        if tid not in finals:  # named by a "superseded by" reason only
            finals.update(_finals(w, [tid]))
        state, result = finals[tid]
        if state == states.FAILURE:
            return True
        if state == states.REVOKED:
            reason = str(result or "")
            if reason.startswith("superseded by "):
                newer = reason.removeprefix("superseded by ")
                return newer not in seen and newer != "None" and resolved(newer, seen | {tid})
            return bool(reason)
        return False

    for call, tid in handed:
        state, result = finals[tid]
        if state == states.SUCCESS and tid not in ran_ids:
            violations.append(f"I7 {tid} is stored SUCCESS but no body of it ran")
        elif not resolved(tid):
            violations.append(
                f"I7 {call.caller}'s call{call.args} ({tid}) ends {state} {result!r}: neither a"
                " body run nor a reason"
            )
    dead = {b.task_id for b in w.bodies if b.killed} | w.killed_ids
    held = [
        info
        for info in store.inner.list("")
        if not info.key.startswith(prefix)
        # a killed slot's leases free themselves within the run ttl, as documented
        and not (parse_owner(info.owner).task_id in dead and info.expires_in <= RUN_TTL)
    ]
    for info in held:
        violations.append(
            f"I8 {info.key!r} is still held by {_who(info.owner)} once nothing runs or waits"
            f" (expires in {info.expires_in:g}s)"
        )
    return violations


# Drivers -------------------------------------------------------------------------------------


def random_runs(
    scenario: Scenario, seeds: Sequence[int], kind: str = "random"
) -> Iterator[Outcome]:
    for seed in seeds:
        strategy: Strategy = PCT(seed) if kind == "pct" else RandomWalk(seed)
        yield run_once(scenario, strategy)


def dfs_runs(scenario: Scenario, limit: int | None = None) -> Iterator[Outcome]:
    """Every schedule of ``scenario`` within its preemption bound (depth first), at most
    ``limit`` runs (``scenario.dfs_limit`` by default)."""
    prefix: list[int] = []
    limit = scenario.dfs_limit if limit is None else limit
    for _ in range(limit):
        strategy = Replay(prefix, scenario.bound)
        yield run_once(scenario, strategy)
        taken = strategy.taken
        i = len(taken) - 1
        while i >= 0 and taken[i][0] + 1 >= taken[i][1]:
            i -= 1
        if i < 0:
            return
        prefix = [c for c, _ in taken[:i]] + [taken[i][0] + 1]


CI_SEEDS = range(1, 31)
"""The seeds CI runs per scenario and random strategy."""


def ci_outcomes(scenarios: Sequence[Scenario] | None = None) -> Iterator[Outcome]:
    for scenario in scenarios or list(SCENARIOS.values()):
        yield from dfs_runs(scenario)
        yield from random_runs(scenario, CI_SEEDS, "random")
        yield from random_runs(scenario, CI_SEEDS, "pct")


def signature(violation: str) -> str:
    """A violation without its ids and steps: runs that break an invariant the same way group."""
    import re

    return re.sub(r"t\d\d|step \d+|\(\d+, \d+\)|\d+(\.\d+)?", "#", violation)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.unique_explorer", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--strategy", choices=["random", "pct", "dfs"])
    parser.add_argument("--seed", type=int, help="replay one seed (with --strategy random|pct)")
    parser.add_argument("--choices", help="replay one schedule: comma-separated choices")
    parser.add_argument(
        "--seeds", type=int, help="long mode: this many seeds per scenario and strategy"
    )
    parser.add_argument("--quiet", action="store_true", help="one line per distinct violation")
    parser.add_argument(
        "--quick", action="store_true", help="10 random and 10 PCT seeds per scenario, no dfs"
    )
    ns = parser.parse_args(argv)
    logging.getLogger("celery_lease").setLevel(logging.CRITICAL)  # the timelines say it
    scenarios = [SCENARIOS[n] for n in ns.scenario] if ns.scenario else list(SCENARIOS.values())
    outcomes: Iterator[Outcome]
    if ns.choices is not None or ns.seed is not None:
        if len(scenarios) != 1:
            parser.error("a replay needs one --scenario")
        if ns.choices is not None:
            prefix = [int(c) for c in ns.choices.split(",") if c]
            strategy: Strategy = Replay(prefix, None)
        else:
            strategy = PCT(ns.seed) if ns.strategy == "pct" else RandomWalk(ns.seed)
        outcome = run_once(scenarios[0], strategy)
        print(outcome.report())
        return 1 if outcome.violations else 0
    if ns.seeds is not None:
        outcomes = itertools.chain.from_iterable(
            itertools.chain(
                random_runs(s, range(ns.seeds), "random"), random_runs(s, range(ns.seeds), "pct")
            )
            for s in scenarios
        )
    elif ns.quick:
        outcomes = itertools.chain.from_iterable(
            itertools.chain(random_runs(s, range(1, 11)), random_runs(s, range(1, 11), "pct"))
            for s in scenarios
        )
    elif ns.strategy == "dfs":
        outcomes = itertools.chain.from_iterable(dfs_runs(s) for s in scenarios)
    else:
        outcomes = ci_outcomes(scenarios)
    seen: dict[tuple[str, str], Outcome] = {}
    runs = 0
    started = time.monotonic()
    for outcome in outcomes:
        runs += 1
        for v in outcome.violations:
            sig = (outcome.scenario.name, signature(v))
            if sig not in seen:
                seen[sig] = outcome
                if ns.quiet:
                    replay = f"{outcome.scenario.describe()} {outcome.strategy.describe()}"
                    print(f"{outcome.scenario.name}: {v}")
                    print(f"  replay: python -m tests.unique_explorer {replay}")
                else:
                    print(outcome.report(), end="\n\n")
    print(f"{runs} runs in {time.monotonic() - started:.1f}s; {len(seen)} distinct violation(s)")
    return 1 if seen else 0


if __name__ == "__main__":
    sys.exit(main())
