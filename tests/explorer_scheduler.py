"""The scheduler core the Celery explorers (``tests.sent_acquire_explorer``,
``tests.unique_explorer``) share: every actor runs on a thread of its own, and only one runs at a
time.

An actor parks at a point (:meth:`Scheduler.park`) until the scheduler hands it the turn
(:meth:`Scheduler.hand_turn`); the explorer decides which parked actor goes next, when its clock
moves and what the invariants read. What differs between the explorers stays in them: what a
point records, when an actor may go, how a run settles and ends, and how an actor's exception is
recorded (:meth:`Scheduler.raised`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from celery_lease.testing import drain

REAL_TIMEOUT = 10.0
"""Seconds of real time an actor may take to reach its next point before the run is stuck."""


class Stuck(Exception):
    """The chosen actor did not reach a point in time (it blocks on something the scheduler does
    not control, such as a lock a parked actor holds), or the run did not end."""


class Stop(BaseException):
    """Raised in a parked actor when the run is over or abandoned (never caught by the code
    under test)."""


@dataclasses.dataclass
class BaseActor:
    """One thread the scheduler runs; an explorer's actor adds what its points wait for."""

    name: str
    kind: str  # "background" for a thread of the code under test; the rest: the explorer's
    run: Callable[[], None] = lambda: None
    thread: threading.Thread | None = None
    state: str = "new"  # new | parked | running | done, and the explorer's own
    pending: str = "start"  # the point it is parked at
    go: threading.Event = dataclasses.field(default_factory=threading.Event)


ActorT = TypeVar("ActorT", bound=BaseActor)


class Scheduler(Generic[ActorT]):
    """The actors of one run, their threads, and the turn one of them holds."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.actors: list[ActorT] = []
        self.by_thread: dict[threading.Thread, ActorT] = {}
        self.running: ActorT | None = None
        self.abandoned = False
        self.violations: list[str] = []

    def point(self, what: str) -> object:
        """Park the calling actor at ``what`` until the scheduler picks it (the explorer's)."""
        raise NotImplementedError

    def start_actors(self) -> None:
        """One daemon thread per actor, known by :attr:`by_thread` before it starts."""
        for actor in self.actors:
            thread = threading.Thread(target=self._main, args=(actor,), daemon=True)
            actor.thread = thread
            with self.cond:
                self.by_thread[thread] = actor
            thread.start()

    def out_of_run(self, actor: ActorT | None) -> bool:
        """True when the run is abandoned: the calling thread goes on unscheduled. Raises
        :class:`Stop` in an actor that is not a background thread instead."""
        if not self.abandoned:
            return False
        if actor is not None and actor.kind != "background":
            raise Stop
        return True

    def park(self, actor: ActorT) -> None:
        """Park ``actor`` (its :attr:`~BaseActor.pending` and what it waits for already set),
        let the scheduler go on, and return once the scheduler handed it the turn (or let it
        out: check :meth:`out_of_run` after)."""
        with self.cond:
            actor.state = "parked"
            if self.running is actor:
                self.running = None
            self.cond.notify_all()
        actor.go.wait()
        actor.go.clear()

    def hand_turn(self, actor: ActorT) -> None:
        """Let the parked ``actor`` go on: it runs until its next point."""
        with self.cond:
            self.running = actor
            actor.state = "running"
        actor.go.set()

    def ran(self, actor: ActorT) -> None:
        """Called on the actor's thread when its run returned. Nothing by default."""

    def raised(self, actor: ActorT, exc: BaseException) -> None:
        """Called on the actor's thread when its run raised (:class:`Stop` aside): a violation
        by default."""
        self.violations.append(f"{actor.name} raised {exc!r}")

    def _main(self, actor: ActorT) -> None:
        try:
            self.point("start")
            actor.run()
            self.ran(actor)
        except Stop:
            pass
        except BaseException as exc:
            self.raised(actor, exc)
        finally:
            with self.cond:
                actor.state = "done"
                if self.running is actor:
                    self.running = None
                self.cond.notify_all()

    def let_out(self) -> None:
        """What :meth:`abandon` does after the actors' threads ended and before the dispatcher
        drains. Nothing by default."""

    def abandon(self) -> None:
        """Let every parked actor out, unscheduled; returns once the actors that are no
        background thread ended and the dispatcher drained, so that no later run meets them."""
        self.abandoned = True
        for actor in list(self.actors):
            actor.go.set()
        for actor in list(self.actors):
            if actor.kind != "background" and actor.thread is not None:
                actor.thread.join(REAL_TIMEOUT)
        self.let_out()
        drain(REAL_TIMEOUT)
