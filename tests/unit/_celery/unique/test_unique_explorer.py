"""Unique at enqueue and debounce, explored: every schedule of small scenarios within a
preemption bound, plus fixed random and PCT seeds, over the real code (``tests.unique_explorer``).

A failure prints the run's timeline and the command that replays it exactly. Long mode (a night's
run) and replays: ``python -m tests.unique_explorer --help`` and ``docs/testing.md``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import unique_explorer as ux

pytestmark = pytest.mark.usefixtures("quiet_core_logs")


def _first_violation(outcomes: Iterator[ux.Outcome]) -> tuple[int, ux.Outcome | None]:
    runs = 0
    for outcome in outcomes:
        runs += 1
        if outcome.violations:
            return runs, outcome
    return runs, None


class TestTheScheduler:
    def test_a_seed_gives_the_same_timeline_every_time(self) -> None:
        """Same scenario, same seed: the same interleaving, event for event (ids, steps,
        results)."""
        scenario = ux.SCENARIOS["debounce-until-done"]
        first = ux.run_once(scenario, ux.PCT(11))
        again = ux.run_once(scenario, ux.PCT(11))
        assert [e.line() for e in first.world.timeline] == [e.line() for e in again.world.timeline]
        assert len(first.world.timeline) > 20  # the callers, the clock and a slot all ran

    def test_a_printed_choice_list_replays_the_run(self) -> None:
        """``--choices`` (what a failing dfs or replay run prints) gives the same timeline."""
        scenario = ux.SCENARIOS["redelivery"]
        first = ux.run_once(scenario, ux.RandomWalk(3))
        assert any(first.world.choices)  # not only the first option each time
        replayed = ux.run_once(scenario, ux.Replay(first.world.choices))
        assert [e.line() for e in replayed.world.timeline] == [
            e.line() for e in first.world.timeline
        ]

    def test_one_actor_runs_at_a_time(self) -> None:
        """Between two points only the chosen actor ran: every event of the timeline is the
        chosen actor's, and the steps never go back."""
        outcome = ux.run_once(ux.SCENARIOS["retry"], ux.RandomWalk(5))
        steps = [e.step for e in outcome.world.timeline]
        assert steps == sorted(steps)
        assert outcome.world.max_running == 1

    def test_the_checks_can_fail(self) -> None:
        """A run whose bodies overlapped and whose ids stayed PENDING is reported: I1, I2, I3."""
        world = ux.World(ux.SCENARIOS["redelivery"], ux.RandomWalk(0))
        one = world.body_start("t01", "acct:1", (1, 1), 5, "slot1")
        world.body_start("t02", "acct:1", (1, 2), 4, "slot2")
        world.body_end(one)
        assert [v[:2] for v in world.violations] == ["I1", "I2"]


@pytest.mark.parametrize("name", sorted(ux.SCENARIOS))
def test_every_explored_schedule_keeps_the_invariants(name: str) -> None:
    """Depth-first over every schedule within the scenario's preemption bound, then the CI
    seeds of the random walk and of PCT: no run breaks an invariant (``ux.check``)."""
    scenario = ux.SCENARIOS[name]
    runs, failed = _first_violation(ux.ci_outcomes([scenario]))
    assert failed is None, f"run {runs} of {name} broke an invariant:\n{failed.report()}"
