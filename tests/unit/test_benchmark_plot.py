"""``benchmarks/plot.py``: SVG charts rendered from small synthetic benchmark results."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from benchmarks import plot

SVG = "{http://www.w3.org/2000/svg}"
VERSIONS = {"python": "3.11.7", "redis-py": "8.1.0", "python-redis-lock": "4.0.1"}
WHEN = "2026-12-02T10:00:00+00:00"


def acquire_release(when: str = WHEN) -> dict[str, Any]:
    """A synthetic ``bench_acquire_release --json`` result."""
    rows = [
        ("baseline SET NX PX + Lua CAD", 3903.2, 1.0, 1.0),
        ("RedisLockStore acquire+release", 3058.4, 0.783, 0.937),
        ("lease() on RedisLockStore", 1340.0, 0.343, 0.304),
        ("redis-py Lock", 3477.0, 0.891, 0.86),
        ("python-redis-lock <&>", 2405.0, 0.616, 0.626),
    ]
    return {
        "benchmark": "acquire_release",
        "measured_at": when,
        "versions": VERSIONS,
        "params": {"rounds": 15, "cycles": 2000},
        "baseline": rows[0][0],
        "contenders": [
            {
                "name": name,
                "median_per_s": rate,
                "min_per_s": rate / 2,
                "max_per_s": rate * 2,
                "x_base": x_base,
                "paired": paired,
                "round_trips": 2.0,
                "per_round_per_s": [rate],
            }
            for name, rate, x_base, paired in rows
        ],
    }


def handoff() -> dict[str, Any]:
    """A synthetic ``bench_handoff --json`` result."""
    rows = [
        ("lease() on RedisLockStore", 1.194, 6.785),
        ("redis-py Lock (polls 0.1 s)", 52.83, 94.111),
        ("python-redis-lock (BLPOP)", 1.105, 6.98),
    ]
    return {
        "benchmark": "handoff",
        "measured_at": WHEN,
        "versions": VERSIONS,
        "params": {"rounds": 10, "per_round": 25},
        "contenders": [
            {
                "name": name,
                "n": 250,
                "p50_ms": p50,
                "p90_ms": p50 * 2,
                "p99_ms": p99,
                "max_ms": p99 * 2,
                "mean_ms": p50,
                "release_ms": 0.9,
            }
            for name, p50, p99 in rows
        ],
        "lease_waited": {"true": 250, "of": 250},
    }


def renewal_scale(nested: bool = False) -> dict[str, Any]:
    """A synthetic ``bench_renewal_scale --json`` result with three hold-phase sweeps."""
    sweeps = [(40.0, 50.0), (50.3, 62.7), (350.4, 363.7)]
    return {
        "benchmark": "renewal_scale",
        "measured_at": WHEN,
        "versions": VERSIONS,
        "params": {"leases": 10_000, "prl_locks": 1000, "nested": nested},
        "celery_lease": {
            "leases": 10_000,
            "nested": nested,
            "ttl_s": 3,
            "hold_s": 9,
            "hold_phase_sweeps": [
                {"leases": 2000, "renew_many_ms": r, "sweep_ms": s, "round_trips": 1}
                for r, s in sweeps
            ],
            "synthetic_renew_many_ms": 228.6,
            "lost_on_lost": 0,
            "table": {},
        },
        "python_redis_lock": {"locks": 1000, "lost": 5, "table": {}},
    }


def task_throughput() -> dict[str, Any]:
    """A synthetic ``bench_task_throughput --json`` result."""
    rows = [("plain", 812.0, 1.0), ("LockedTask", 520.0, 0.64), ("QueueOnce", 600.0, 0.74)]
    return {
        "benchmark": "task_throughput",
        "measured_at": WHEN,
        "versions": {"python": "3.11.7", "celery": "5.7.0"},
        "params": {"tasks": 300, "rounds": 5},
        "baseline": "plain",
        "contenders": [
            {
                "name": name,
                "median_per_s": rate,
                "ratio": ratio,
                "paired_ratio": ratio,
                "per_round_per_s": [rate],
            }
            for name, rate, ratio in rows
        ],
    }


def write(directory: Path, name: str, data: dict[str, Any]) -> Path:
    """Write one result file into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(data))
    return path


def texts(svg: Path) -> list[str]:
    """Every ``<text>`` of a well-formed SVG file (``ET.parse`` raises on malformed XML)."""
    root = ET.parse(svg).getroot()
    assert root.tag == f"{SVG}svg"
    return [element.text or "" for element in root.iter(f"{SVG}text")]


def bar_widths(svg: Path) -> dict[str, float]:
    """The width of each bar, by the bar's tooltip (``row, series: text``)."""
    root = ET.parse(svg).getroot()
    widths = {}
    for rect in root.iter(f"{SVG}rect"):
        tip = rect.find(f"{SVG}title")
        if tip is not None and tip.text:
            widths[tip.text] = float(rect.attrib["width"])
    return widths


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    """The charts rendered from four synthetic results (no PostgreSQL one) into tmp_path/out."""
    results = tmp_path / "results"
    write(results, "acquire_release.json", acquire_release())
    write(results, "handoff.json", handoff())
    write(results, "renewal_scale.json", renewal_scale())
    write(results, "task_throughput.json", task_throughput())
    assert plot.main(["--results", str(results), "--out", str(tmp_path / "out")]) == 0
    return tmp_path / "out"


class TestCharts:
    def test_acquire_release_chart_carries_every_contender_with_its_rate_and_ratios(
        self, rendered: Path
    ) -> None:
        """Each contender's label, median cycles/s and both ratios appear in the chart's text."""
        words = texts(rendered / "benchmarks-acquire-release.svg")
        for row in acquire_release()["contenders"]:
            assert row["name"] in words
            assert any(
                w.startswith(f"{row['median_per_s']:,.0f}/s")
                and f"{row['x_base']:.3f}x base" in w
                and f"paired {row['paired']:.3f}" in w
                for w in words
            ), (row["name"], words)

    def test_a_faster_contender_gets_a_longer_bar(self, rendered: Path) -> None:
        """The bar of the baseline (3,903/s) is longer than lease()'s (1,340/s)."""
        widths = {
            tip.split(",")[0]: w
            for tip, w in bar_widths(rendered / "benchmarks-acquire-release.svg").items()
        }
        assert widths["baseline SET NX PX + Lua CAD"] > widths["lease() on RedisLockStore"] > 0

    def test_handoff_chart_carries_p50_and_p99_of_every_contender(self, rendered: Path) -> None:
        """Each contender's label and its p50 and p99 in ms appear; the axis is logarithmic."""
        words = texts(rendered / "benchmarks-handoff.svg")
        for row in handoff()["contenders"]:
            assert row["name"] in words
            assert f"p50 {row['p50_ms']:.3g} ms" in words
            assert f"p99 {row['p99_ms']:.3g} ms" in words
        assert "milliseconds (log scale)" in words

    def test_renewal_chart_shows_median_and_max_sweep_and_the_target(self, rendered: Path) -> None:
        """The median and max sweep times, the synthetic sweep and the 100 ms target appear."""
        words = texts(rendered / "benchmarks-renewal-scale.svg")
        assert "median 62.7 ms" in words
        assert "max 364 ms" in words
        assert "median 50.3 ms" in words
        assert "229 ms (synthetic)" in words
        assert "target 100 ms" in words

    def test_task_throughput_chart_carries_every_contender_and_ratio(self, rendered: Path) -> None:
        """Each task base's label, tasks/s and ratio to the plain task appear."""
        words = texts(rendered / "benchmarks-task-throughput.svg")
        for row in task_throughput()["contenders"]:
            assert row["name"] in words
            assert any(
                w.startswith(f"{row['median_per_s']:,.0f}/s") and f"{row['ratio']:.2f}x plain" in w
                for w in words
            ), (row["name"], words)

    def test_a_benchmark_without_results_gets_a_placeholder_with_its_command(
        self, rendered: Path
    ) -> None:
        """No PostgreSQL result: its chart says so and gives the command that produces it."""
        words = texts(rendered / "benchmarks-postgres-handoff.svg")
        assert any(w.startswith("Not measured yet") for w in words)
        assert any("bench_postgres_handoff.py --json" in w for w in words)


class TestResults:
    def test_the_newest_result_of_a_benchmark_is_plotted(self, tmp_path: Path) -> None:
        """Of two acquire_release files, the one with the later measured_at is used."""
        write(tmp_path, "a.json", acquire_release("2026-12-03T00:00:00+00:00"))
        write(tmp_path, "b.json", acquire_release("2026-12-01T00:00:00+00:00"))
        found = plot.load_results(tmp_path)
        assert found["acquire_release"][0] == tmp_path / "a.json"

    def test_nested_renewal_runs_are_not_plotted(self, tmp_path: Path) -> None:
        """A --nested renewal result is skipped, so the renewal chart is a placeholder."""
        write(tmp_path, "nested.json", renewal_scale(nested=True))
        assert "renewal_scale" not in plot.load_results(tmp_path)

    def test_a_result_missing_a_field_is_reported_with_its_file(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A handoff file without contenders makes main() fail with the file's name on stderr."""
        broken = {k: v for k, v in handoff().items() if k != "contenders"}
        path = write(tmp_path / "results", "handoff.json", broken)
        with pytest.raises(ValueError, match=r"handoff\.json"):
            plot.render_all(tmp_path / "results", tmp_path / "out")
        assert plot.main(["--results", str(path.parent), "--out", str(tmp_path / "out")]) == 1
        assert str(path) in capsys.readouterr().err


class TestTaskThroughputScenarios:
    def test_every_scenario_and_contender_gets_a_labelled_row(self, tmp_path: Path) -> None:
        """A result with ``scenarios`` (pool x broker) plots each contender of each scenario."""
        data = task_throughput()
        data["scenarios"] = [
            {
                "name": "solo, Redis",
                "pool": "solo",
                "broker": "redis",
                "contenders": data["contenders"],
            },
            {
                "name": "prefork, embedded",
                "pool": "prefork",
                "broker": "embedded",
                "contenders": [
                    dict(c, median_per_s=c["median_per_s"] / 2) for c in data["contenders"]
                ],
            },
        ]
        results = tmp_path / "results"
        write(results, "task_throughput.json", data)
        assert plot.main(["--results", str(results), "--out", str(tmp_path / "out")]) == 0
        words = texts(tmp_path / "out" / "benchmarks-task-throughput.svg")
        for row in data["contenders"]:
            assert f"{row['name']} (solo, redis)" in words
            assert f"{row['name']} (prefork, embedded)" in words
            assert any(w.startswith(f"{row['median_per_s'] / 2:,.0f}/s") for w in words), words

    def test_scenarios_with_and_without_results_get_distinct_labels(self, tmp_path: Path) -> None:
        """A scenario that stores results (``"results": true``) is labelled apart from the same
        pool and broker with results ignored, so neither row hides the other."""
        data = task_throughput()
        data["scenarios"] = [
            {
                "name": f"solo, Redis, results {mode}",
                "pool": "solo",
                "broker": "redis",
                "results": stored,
                "contenders": [
                    dict(c, median_per_s=c["median_per_s"] / (3 if stored else 1))
                    for c in data["contenders"]
                ],
            }
            for mode, stored in (("ignored", False), ("stored", True))
        ]
        results = tmp_path / "results"
        write(results, "task_throughput.json", data)
        assert plot.main(["--results", str(results), "--out", str(tmp_path / "out")]) == 0
        words = texts(tmp_path / "out" / "benchmarks-task-throughput.svg")
        for row in data["contenders"]:
            assert f"{row['name']} (solo, redis)" in words
            assert f"{row['name']} (solo, redis, results)" in words

    def test_a_paired_ratio_interval_is_shown_next_to_the_ratio(self, tmp_path: Path) -> None:
        """Rows with ``paired_ratio_interval`` (interleaved blocks) show it after the paired
        ratio; rows without one (older results) show the ratio alone."""
        data = task_throughput()
        data["contenders"][1]["paired_ratio_interval"] = [0.6, 0.71]
        results = tmp_path / "results"
        write(results, "task_throughput.json", data)
        assert plot.main(["--results", str(results), "--out", str(tmp_path / "out")]) == 0
        words = texts(tmp_path / "out" / "benchmarks-task-throughput.svg")
        assert any(w.endswith("paired 0.64x [0.60, 0.71])") for w in words), words
        assert any(w.endswith("paired 0.74x)") for w in words), words
