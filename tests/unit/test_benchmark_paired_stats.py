"""``benchmarks/paired_stats.py``: block order, pairing, bootstrap interval and verdict rule."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from benchmarks import paired_stats
from benchmarks.paired_stats import Estimate


class ScriptedRandom(random.Random):
    """A ``random.Random`` whose ``choices`` returns the scripted resamples in turn."""

    def __new__(cls, resamples: list[list[float]]) -> ScriptedRandom:
        # Python 3.10's random.Random.__new__ seeds from the constructor's argument (a list:
        # unhashable); the seed is irrelevant here.
        return super().__new__(cls)

    def __init__(self, resamples: list[list[float]]) -> None:
        super().__init__(0)
        self.resamples = list(resamples)

    def choices(self, population: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.resamples.pop(0)


class TestBlockOrders:
    def test_every_round_runs_each_contender_once(self) -> None:
        names = ["plain", "LockedTask", "QueueOnce", "Singleton"]
        orders = paired_stats.block_orders(names, 40, random.Random(7))
        assert len(orders) == 40
        assert all(sorted(order) == sorted(names) for order in orders)

    def test_the_same_seed_gives_the_same_orders(self) -> None:
        names = ["a", "b", "c"]
        first = paired_stats.block_orders(names, 10, random.Random(3))
        assert first == paired_stats.block_orders(names, 10, random.Random(3))

    def test_each_contender_runs_first_in_some_round(self) -> None:
        names = ["plain", "LockedTask", "QueueOnce", "Singleton"]
        orders = paired_stats.block_orders(names, 40, random.Random(11))
        assert {order[0] for order in orders} == set(names)

    def test_the_names_passed_in_are_left_in_their_order(self) -> None:
        names = ["a", "b", "c"]
        paired_stats.block_orders(names, 5, random.Random(1))
        assert names == ["a", "b", "c"]


class TestPairing:
    def test_ratios_divide_by_the_baseline_of_the_same_round(self) -> None:
        rates = {"plain": [100.0, 200.0, 400.0], "X": [50.0, 150.0, 400.0]}
        assert paired_stats.paired_ratios(rates, "plain") == {
            "plain": [1.0, 1.0, 1.0],
            "X": [0.5, 0.75, 1.0],
        }

    def test_differences_subtract_the_baseline_of_the_same_round(self) -> None:
        us = {"plain": [50.0, 60.0], "LockedTask": [120.0, 100.0]}
        assert paired_stats.paired_differences(us, "plain") == {
            "plain": [0.0, 0.0],
            "LockedTask": [70.0, 40.0],
        }

    def test_rounds_missing_on_one_side_are_an_error(self) -> None:
        with pytest.raises(ValueError):
            paired_stats.paired_ratios({"plain": [1.0, 2.0], "X": [1.0]}, "plain")


class TestPercentile:
    @pytest.mark.parametrize(
        ("q", "expected"), [(0.0, 1.0), (0.25, 1.75), (0.5, 2.5), (0.75, 3.25), (1.0, 4.0)]
    )
    def test_interpolates_between_the_nearest_ranks(self, q: float, expected: float) -> None:
        assert paired_stats.percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)

    def test_one_value_is_every_quantile(self) -> None:
        assert paired_stats.percentile([7.0], 0.025) == 7.0

    @pytest.mark.parametrize(("values", "q"), [([], 0.5), ([1.0], 1.5)])
    def test_no_values_or_q_outside_0_1_is_an_error(self, values: list[float], q: float) -> None:
        with pytest.raises(ValueError):
            paired_stats.percentile(values, q)


class TestBootstrap:
    def test_the_interval_is_taken_from_the_resamples_medians(self) -> None:
        # Medians of the five resamples: 1, 2, 2, 3, 5; the 25% and 75% quantiles of those
        # (positions 1 and 3 of 0..4) are 2 and 3.
        rng = ScriptedRandom([[1, 1, 2], [2, 2, 9], [1, 2, 3], [3, 3, 1], [5, 5, 5]])
        interval = paired_stats.bootstrap_median_interval(
            [1.0, 2.0, 3.0], rng, resamples=5, level=0.5
        )
        assert interval == (2.0, 3.0)

    def test_equal_values_give_an_interval_of_no_width(self) -> None:
        interval = paired_stats.bootstrap_median_interval([0.8] * 9, random.Random(1))
        assert interval == (0.8, 0.8)

    def test_two_values_span_both_ends(self) -> None:
        # A resample of [1, 3] has median 1, 2 or 3 with chances 1/4, 1/2, 1/4: the 2.5% and
        # 97.5% quantiles of 2000 such medians are 1 and 3.
        interval = paired_stats.bootstrap_median_interval([1.0, 3.0], random.Random(5))
        assert interval == (1.0, 3.0)

    def test_the_same_seed_gives_the_same_estimate(self) -> None:
        values = [0.71, 0.78, 0.74, 0.69, 0.80, 0.77, 0.73]
        first = paired_stats.estimate(values, "redis-solo:LockedTask")
        assert first == paired_stats.estimate(values, "redis-solo:LockedTask")
        assert first.median == 0.74
        assert first.n == 7
        assert 0.69 <= first.low <= first.median <= first.high <= 0.80


class TestVerdict:
    @pytest.mark.parametrize(
        ("head_to_head", "expected"),
        [
            (Estimate(1.08, 1.02, 1.12, 20), "ahead"),
            (Estimate(0.92, 0.88, 0.98, 20), "behind"),
            (Estimate(1.05, 0.97, 1.10, 20), "level"),
            (Estimate(0.95, 0.90, 1.01, 20), "level"),
            # an interval that touches 1 does not exclude it
            (Estimate(1.05, 1.00, 1.10, 20), "level"),
            (Estimate(0.95, 0.90, 1.00, 20), "level"),
        ],
    )
    def test_the_head_to_head_interval_must_exclude_one(
        self, head_to_head: Estimate, expected: str
    ) -> None:
        assert paired_stats.verdict(head_to_head) == expected

    def test_fewer_rounds_than_the_minimum_give_no_verdict(self) -> None:
        few = Estimate(1.5, 1.4, 1.6, 4)
        assert paired_stats.verdict(few) == "too few rounds"
        assert paired_stats.verdict(few, min_rounds=4) == "ahead"


def test_estimate_text_shows_median_and_interval() -> None:
    assert Estimate(0.7612, 0.7204, 0.7951, 30).text(suffix="x") == "0.76x [0.72, 0.80]"
