"""Statistics of paired, interleaved benchmark blocks: order, pairing, interval, verdict.

Pure functions (no clock, no I/O; randomness only from the ``random.Random`` passed in), shared
by ``bench_task_throughput`` and ``bench_task_overhead``.

The protocol they serve: a run is many short rounds; each round runs one short block of every
contender, in an order shuffled afresh each round (:func:`block_orders`, from a seed the
benchmark prints), so a slow drift of the machine (another process, a CPU's clock, the page
cache) hits all contenders alike and no contender always runs first or last. A contender's
figure in a round is paired with the baseline's block of the same round (:func:`paired_ratios`);
across rounds we report the median of those paired figures and a 95% percentile-bootstrap
interval of that median (:func:`estimate`).

The verdict rule (:func:`verdict`) compares contender A with contender B head to head: in each
round, A's block rate over B's block rate of the same round (both paired with the same drift of
the machine); A is ``"ahead"`` of B when the 95% interval of the median of those ratios lies
wholly above 1, ``"behind"`` when it lies wholly below 1, ``"level"`` otherwise, and ``"too few
rounds"`` under :data:`MIN_ROUNDS` rounds (an interval of one or two values says nothing).
Swapping A and B inverts every ratio, so the verdict does not depend on which is named first.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_ROUNDS = 5  # fewer paired rounds than this: no verdict
RESAMPLES = 2000  # bootstrap resamples per interval
LEVEL = 0.95  # the interval's coverage


def block_orders(names: Sequence[str], rounds: int, rng: random.Random) -> list[list[str]]:
    """The order of the contenders' blocks in each of ``rounds`` rounds: ``names`` shuffled
    afresh by ``rng`` for every round."""
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def paired_ratios(values: Mapping[str, Sequence[float]], base: str) -> dict[str, list[float]]:
    """``{name: [values[name][i] / values[base][i] for each round i]}``: every contender's
    figure over the baseline's in the same round (``base`` maps to ones)."""
    reference = values[base]
    return {
        name: [v / b for v, b in zip(series, reference, strict=True)]
        for name, series in values.items()
    }


def paired_differences(values: Mapping[str, Sequence[float]], base: str) -> dict[str, list[float]]:
    """``{name: [values[name][i] - values[base][i] for each round i]}`` (``base``: zeros)."""
    reference = values[base]
    return {
        name: [v - b for v, b in zip(series, reference, strict=True)]
        for name, series in values.items()
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values``, interpolated linearly between the two
    nearest ranks (position ``q * (n - 1)`` in the sorted values, as numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q}: use 0..1")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


def bootstrap_median_interval(
    values: Sequence[float], rng: random.Random, resamples: int = RESAMPLES, level: float = LEVEL
) -> tuple[float, float]:
    """The percentile-bootstrap interval of the median of ``values``: the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles of the medians of ``resamples`` resamples (each of
    ``len(values)`` values drawn with replacement by ``rng``)."""
    if not values:
        raise ValueError("interval of no values")
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)]
    tail = (1.0 - level) / 2
    return percentile(medians, tail), percentile(medians, 1.0 - tail)


@dataclass(frozen=True)
class Estimate:
    """The median of a contender's paired figures over ``n`` rounds and its interval."""

    median: float
    low: float
    high: float
    n: int

    def text(self, digits: int = 2, suffix: str = "") -> str:
        """``"0.76x [0.72, 0.79]"`` for ``digits=2, suffix="x"``."""
        return f"{self.median:.{digits}f}{suffix} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def estimate(values: Sequence[float], seed: str, resamples: int = RESAMPLES) -> Estimate:
    """Median and 95% bootstrap interval of ``values``; the resamples are drawn by a
    ``random.Random(seed)``, so the same values and seed give the same interval."""
    low, high = bootstrap_median_interval(values, random.Random(seed), resamples)
    return Estimate(statistics.median(values), low, high, len(values))


def verdict(head_to_head: Estimate, min_rounds: int = MIN_ROUNDS) -> str:
    """``"ahead"``, ``"behind"``, ``"level"`` or ``"too few rounds"``: A against B by
    ``head_to_head``, the estimate of A's rate over B's in the same rounds (the rule in the module
    docstring)."""
    if head_to_head.n < min_rounds:
        return "too few rounds"
    if head_to_head.low > 1.0:
        return "ahead"
    if head_to_head.high < 1.0:
        return "behind"
    return "level"
