"""A controlled scheduler over ``lease(key, limit=n)`` on the real core, with store faults.

Each actor is a thread running ``with lease("k", limit=...)`` around a body; a
:class:`ControlledStore` in front of a :class:`~celery_lease.MemoryLockStore` on a
:class:`~celery_lease.testing.FakeClock` makes every store call an actor makes a *point*: the
actor stops there and the scheduler picks who goes next, from a seed. A ``wait_for_release`` is
modelled, not slept: the waiting actor can go again once a release of its key was performed or
the clock (the scheduler's other choice while someone waits) has reached its deadline. At a
point, the seed may also make the call fail: ``"lost"`` performs it and then raises
``StoreUnavailableError`` (the reply lost after it took effect), ``"fail"`` raises without
performing it. The core's own threads (the renewer with a ttl far above a run, the dispatcher
that abandons a failed attempt) pass through without stopping.

After each run :func:`check` asserts the invariants: never more bodies inside than ``limit``,
each inside its own slot, held in the store by its own owner id; every token the store granted
for the key larger than every earlier one; each lease's token the one the store granted it; and
once the dispatcher is drained, no slot left held but those whose release failed before it was
performed (they expire within their ttl, as a failed release does)::

    python -m tests.slot_explorer --seeds 500            # many runs
    python -m tests.slot_explorer --seed 17 --verbose    # one run and its timeline
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import threading
from collections.abc import Sequence
from typing import Any

from celery_lease import lease
from celery_lease.errors import LockNotAcquiredError, StoreUnavailableError
from celery_lease.stores.memory import MemoryLockStore
from celery_lease.stores.slots import release_channel, split_slot
from celery_lease.testing import FakeClock, drain

START = 1_000.0
"""The fake clock's reading at the start of a run (seconds)."""

TTL = 600.0
"""Every lease's ttl, seconds: far above the fake time a run moves, so the renewer stays idle."""

REAL_TIMEOUT = 10.0
"""Real seconds the scheduler waits for an actor to reach its next point before it fails."""

KEY = "k"


@dataclasses.dataclass
class Scenario:
    """What one run does: ``actors`` each with its ``wait`` (seconds), the key's ``limit``, and
    the chance that a store call of an actor fails (``fault_rate``)."""

    limit: int
    waits: Sequence[float]
    fault_rate: float = 0.0
    faults_on: tuple[str, ...] = ("acquire_slot", "release")


@dataclasses.dataclass
class _Parked:
    """Where an actor stopped: at a store call (``call``) or in a modelled wait."""

    call: str
    channel: str | None = None  # a wait: the key whose release makes it go
    deadline: float | None = None
    released: bool = False


class Violation(AssertionError):
    """An invariant failed; the message carries the run's timeline."""


class Explorer:
    """One run of a scenario under one seed."""

    def __init__(
        self, scenario: Scenario, seed: int, store_class: type[MemoryLockStore] = MemoryLockStore
    ) -> None:
        self.scenario = scenario
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = FakeClock(START)
        self.inner = store_class(clock=self.clock)
        self.store = ControlledStore(self)
        self.cond = threading.Condition()
        self.names: dict[int, str] = {}  # thread ident -> actor name
        self.parked: dict[str, _Parked] = {}
        self.running: str | None = None
        self.finished: set[str] = set()
        self.timeline: list[str] = []
        self.inside: dict[str, Any] = {}  # actor -> its Lease while its body runs
        self.peak = 0
        self.grants: list[tuple[str, int, int]] = []  # (owner, slot, token) in store order
        self.failed_releases: set[tuple[str, str]] = set()  # (store key, owner) not performed
        self.outcomes: dict[str, str] = {}
        self.errors: list[str] = []

    # The scheduler ------------------------------------------------------------------------------

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._actor, args=(f"a{i}", wait), daemon=True)
            for i, wait in enumerate(self.scenario.waits)
        ]
        for thread in threads:
            thread.start()
        with self.cond:
            while len(self.finished) < len(threads):
                self._wait_quiet(len(threads))
                if len(self.finished) == len(threads):
                    break
                self._choose()
        for thread in threads:
            thread.join(REAL_TIMEOUT)
        drain(REAL_TIMEOUT)
        check(self)

    def _wait_quiet(self, count: int) -> None:
        """Until no actor runs: each is parked at a point or finished."""
        ok = self.cond.wait_for(
            lambda: self.running is None and len(self.parked) + len(self.finished) == count,
            REAL_TIMEOUT,
        )
        if not ok:
            raise Violation(f"an actor never reached its next point\n{self.story()}")

    def _choose(self) -> None:
        now = self.clock.monotonic()
        ready = sorted(
            name
            for name, parked in self.parked.items()
            if parked.channel is None
            or parked.released
            or (parked.deadline is not None and parked.deadline <= now)
        )
        deadlines = [
            p.deadline
            for p in self.parked.values()
            if p.channel is not None and not p.released and p.deadline is not None
        ]
        future = [d for d in deadlines if d > now]
        choices: list[str] = list(ready) + (["clock"] if future else [])
        if not choices:
            raise Violation(f"nobody can go on\n{self.story()}")
        pick = self.rng.choice(choices)
        if pick == "clock":
            step = min(future) - now
            self.clock.advance(step)
            self.timeline.append(f"clock +{step:.3f}s")
            return
        self.running = pick
        del self.parked[pick]
        self.cond.notify_all()

    # Actors -------------------------------------------------------------------------------------

    def _actor(self, name: str, wait: float) -> None:
        with self.cond:
            self.names[threading.get_ident()] = name
        self.park(name, _Parked("start"))
        try:
            with lease(
                KEY,
                store=self.store,
                limit=self.scenario.limit,
                ttl=TTL,
                wait=wait,
                clock=self.clock,
            ) as held:
                self._enter_body(name, held)
                self.park(name, _Parked("body"))
                with self.cond:
                    del self.inside[name]
                    self.timeline.append(f"{name} leaves slot {held.slot}")
            self.outcomes[name] = "ran"
        except LockNotAcquiredError:
            self.outcomes[name] = "refused"
        except StoreUnavailableError:
            self.outcomes[name] = "store failed"
        except BaseException as exc:  # reported by check()
            self.outcomes[name] = f"raised {exc!r}"
            self.errors.append(f"{name} raised {exc!r}")
        finally:
            with self.cond:
                del self.names[threading.get_ident()]  # a later thread may get its ident
                self.finished.add(name)
                self.running = None
                self.timeline.append(f"{name} done: {self.outcomes.get(name)}")
                self.cond.notify_all()

    def _enter_body(self, name: str, held: Any) -> None:
        with self.cond:
            self.inside[name] = held
            self.peak = max(self.peak, len(self.inside))
            self.timeline.append(f"{name} enters slot {held.slot} token {held.token}")
            if len(self.inside) > self.scenario.limit:
                self.errors.append(f"{len(self.inside)} bodies inside, limit {self.scenario.limit}")
            slots = [lease_.slot for lease_ in self.inside.values()]
            if len(set(slots)) != len(slots):
                self.errors.append(f"two bodies share a slot: {slots}")
            info = self.inner.get(held.store_key)
            if info is None or info.owner != held.owner:
                self.errors.append(f"{name}'s slot {held.store_key!r} is held by {info}")
            granted = [t for owner, _, t in self.grants if owner == held.owner]
            if granted[-1:] != [held.token]:
                self.errors.append(f"{name} holds token {held.token}, the store granted {granted}")

    def park(self, name: str, parked: _Parked) -> None:
        """Stop ``name`` at a point until the scheduler picks it."""
        with self.cond:
            self.parked[name] = parked
            if self.running == name:
                self.running = None
            self.timeline.append(f"{name} at {parked.call}")
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.running == name, REAL_TIMEOUT * 3):
                raise Violation(f"{name} was never picked again\n{self.story()}")

    def actor_name(self) -> str | None:
        return self.names.get(threading.get_ident())

    def fault(self, call: str) -> str | None:
        """``"lost"``, ``"fail"`` or ``None`` for this call, from the seed."""
        if call not in self.scenario.faults_on or self.rng.random() >= self.scenario.fault_rate:
            return None
        return self.rng.choice(("lost", "fail"))

    def released(self, store_key: str) -> None:
        """A release of ``store_key`` was performed: its key's modelled waiters may go."""
        channel = release_channel(store_key)
        with self.cond:
            for parked in self.parked.values():
                if parked.channel == channel:
                    parked.released = True

    def story(self) -> str:
        return f"seed {self.seed}, {self.scenario}\n" + "\n".join(self.timeline[-200:])


def _short(owner: str) -> str:
    """The random part of an owner id (``host/pid/<hex>``), for the timeline."""
    return owner.split(";", 1)[0][-6:]


class ControlledStore:
    """The explorer's store: each call an actor makes is a point, and may fail from the seed."""

    def __init__(self, explorer: Explorer) -> None:
        self._x = explorer
        self.clock = explorer.clock

    def _point(self, call: str) -> str | None:
        name = self._x.actor_name()
        if name is None:
            return None
        self._x.park(name, _Parked(call))
        fault = self._x.fault(call)
        if fault is not None:
            self._x.timeline.append(f"{name} {call}: {fault}")
        return fault

    def acquire(self, key: str, owner: str, ttl_ms: int) -> int | None:
        fault = self._point("acquire")
        if fault == "fail":
            raise StoreUnavailableError("acquire failed before it was performed")
        with self._x.cond:
            token = self._x.inner.acquire(key, owner, ttl_ms)
            if token is not None and not any(g[0] == owner for g in self._x.grants):
                self._x.grants.append((owner, 0, token))
            self._x.timeline.append(f"  store: acquire {_short(owner)} -> {token}")
        if fault == "lost":
            raise StoreUnavailableError("the reply of acquire was lost")
        return token

    def acquire_slot(self, key: str, owner: str, ttl_ms: int, limit: int) -> tuple[int, int] | None:
        fault = self._point("acquire_slot")
        if fault == "fail":
            raise StoreUnavailableError("acquire_slot failed before it was performed")
        with self._x.cond:
            got = self._x.inner.acquire_slot(key, owner, ttl_ms, limit)
            if got is not None and not any(g[0] == owner for g in self._x.grants):
                self._x.grants.append((owner, got[0], got[1]))
            self._x.timeline.append(f"  store: acquire_slot {_short(owner)} -> {got}")
        if fault == "lost":
            raise StoreUnavailableError("the reply of acquire_slot was lost")
        return got

    def renew(self, key: str, owner: str, ttl_ms: int) -> bool:
        self._point("renew")
        return self._x.inner.renew(key, owner, ttl_ms)

    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[bool]:
        self._point("renew_many")
        return self._x.inner.renew_many(items)

    def release(self, key: str, owner: str) -> None:
        fault = self._point("release")
        if fault == "fail":
            with self._x.cond:
                if self._x.inner.get(key) is not None:
                    self._x.failed_releases.add((key, owner))
            raise StoreUnavailableError("release failed before it was performed")
        self._x.inner.release(key, owner)
        self._x.timeline.append(f"  store: release {split_slot(key)} {_short(owner)}")
        self._x.released(key)
        if fault == "lost":
            raise StoreUnavailableError("the reply of release was lost")

    def wait_for_release(self, key: str, timeout: float) -> bool:
        name = self._x.actor_name()
        if name is None:
            return self._x.inner.wait_for_release(key, timeout)
        parked = _Parked("wait", channel=key, deadline=self._x.clock.monotonic() + timeout)
        self._x.park(name, parked)
        return parked.released

    def get(self, key: str) -> Any:
        return self._x.inner.get(key)

    def list(self, prefix: str = "") -> Any:
        return self._x.inner.list(prefix)

    def __repr__(self) -> str:
        return f"ControlledStore(seed={self._x.seed})"


def check(explorer: Explorer) -> None:
    """Assert the run's invariants (see the module docstring)."""
    problems = list(explorer.errors)
    tokens = [token for _, _, token in explorer.grants]
    if tokens != sorted(set(tokens)):
        problems.append(f"granted tokens not strictly increasing: {explorer.grants}")
    left = {(info.key, info.owner) for info in explorer.inner.list()}
    unexpected = left - explorer.failed_releases
    if unexpected:
        problems.append(f"slots left held after every actor ended: {sorted(unexpected)}")
    for name, outcome in explorer.outcomes.items():
        if outcome.startswith("raised"):
            problems.append(f"{name}: {outcome}")
    if problems:
        raise Violation("\n".join(problems) + "\n" + explorer.story())
    explorer.clock.advance(TTL)  # a failed release's slot frees itself within its ttl
    still = explorer.inner.list()
    if still:
        raise Violation(f"held past their ttl: {still}\n{explorer.story()}")


SCENARIOS = {
    "three-of-two": Scenario(limit=2, waits=(0.0, 1.0, 1.0)),
    "burst": Scenario(limit=2, waits=(0.0, 0.5, 1.0, 2.0, 2.0)),
    "faults": Scenario(limit=2, waits=(0.5, 1.0, 1.0, 2.0), fault_rate=0.25),
    "one-slot-faults": Scenario(limit=1, waits=(1.0, 1.0, 1.0), fault_rate=0.3),
    "wide": Scenario(limit=3, waits=(0.0, 1.0, 1.0, 1.0, 2.0, 2.0), fault_rate=0.1),
}


def explore(
    name: str, seeds: Sequence[int], store_class: type[MemoryLockStore] = MemoryLockStore
) -> dict[str, int]:
    """Run ``name`` under every seed; the highest peak seen and how many runs saw each outcome."""
    seen: dict[str, int] = {"peak": 0}
    for seed in seeds:
        explorer = Explorer(SCENARIOS[name], seed, store_class)
        explorer.run()
        seen["peak"] = max(seen["peak"], explorer.peak)
        for outcome in explorer.outcomes.values():
            seen[outcome] = seen.get(outcome, 0) + 1
    return seen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("celery_lease").setLevel(logging.ERROR)  # failed releases are expected
    names = args.scenario or sorted(SCENARIOS)
    seeds = [args.seed] if args.seed is not None else list(range(args.seeds))
    for name in names:
        if args.verbose and args.seed is not None:
            explorer = Explorer(SCENARIOS[name], args.seed)
            explorer.run()
            print(explorer.story())
        print(name, explore(name, seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
