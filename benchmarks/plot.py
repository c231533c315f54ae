"""Render the benchmarks' JSON results as SVG bar charts for the docs, without matplotlib.

Each benchmark script writes its measured numbers with ``--json PATH``; this module reads every
``*.json`` in a directory (default ``benchmarks/results/``), recognises each by its
``"benchmark"`` field, and writes one chart per benchmark to ``docs/img/benchmarks-<name>.svg``:

==================  =====================================================================
``benchmark``       chart
==================  =====================================================================
acquire_release     median acquire + release cycles/s per contender, with ``x base`` and
                    ``paired`` ratios
handoff             hand-off latency p50 and p99 per contender (ms, log scale)
renewal_scale       renewal sweep time of 10,000 leases (median, max; synthetic full
                    sweep) against the 100 ms target
task_throughput     median tasks/s per task base, with ratios to the plain task
postgres_handoff    PostgreSQL hand-off latency p50 and p99 per set-up (ms, log scale)
==================  =====================================================================

A benchmark without a result file gets a placeholder chart that says how to produce it, so the
docs always build. ``--nested`` runs of the renewal benchmark are not plotted. The SVG is built
with :mod:`xml.etree.ElementTree`, so labels are escaped and the output is well-formed.

Run: ``python -m benchmarks.plot [--results DIR] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Bar", "Chart", "Row", "load_results", "main", "render_all", "render_svg"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"

SVG_NS = "http://www.w3.org/2000/svg"
FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
PALETTE = ("#3a6ea5", "#e07b39", "#5a9e6f", "#8c6bb1")
CHAR_WIDTH = 6.6  # px per character of 12 px text, a generous estimate for label columns
BOLD_CHAR_WIDTH = 7.6
SMALL_CHAR_WIDTH = 6.2  # 11 px text
BAR_HEIGHT = 16
BAR_GAP = 3
ROW_GAP = 12
PLOT_WIDTH = 400
VALUE_WIDTH = 240  # room right of the plot area for a bar's value text


@dataclass(frozen=True)
class Bar:
    """One bar: its series (colour and legend), its value, and the text printed after it."""

    series: str
    value: float
    text: str


@dataclass(frozen=True)
class Row:
    """A labelled group of bars (one per series); ``ours`` rows are celery-lease's, in bold."""

    label: str
    bars: tuple[Bar, ...]
    ours: bool = False


@dataclass(frozen=True)
class Chart:
    """A horizontal bar chart: rows top to bottom, a linear or log value axis."""

    title: str
    subtitle: str
    versions: str
    axis: str
    rows: tuple[Row, ...]
    log: bool = False
    target: tuple[float, str] | None = None  # a dashed vertical line: value, label


# Rendering -------------------------------------------------------------------------------------


def _linear_ticks(top: float) -> list[float]:
    """0 and round steps (1, 2 or 5 x 10^k) up to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    count = math.ceil(top / step - 1e-9)
    return [i * step for i in range(count + 1)]


def _log_ticks(low: float, high: float) -> list[float]:
    """Powers of ten from below ``low`` to at least ``high``."""
    first = math.floor(math.log10(low))
    if low / 10**first < 2:  # keep the shortest bar visible
        first -= 1
    last = max(math.ceil(math.log10(high)), first + 1)
    return [10.0**k for k in range(first, last + 1)]


def _tick_text(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 1:
        return f"{value:g}"
    return f"{value:.3g}"


def _text(parent: ET.Element, x: float, y: float, text: str, **attrs: str) -> ET.Element:
    element = ET.SubElement(parent, "text", {"x": f"{x:.1f}", "y": f"{y:.1f}", **attrs})
    element.text = text
    return element


def render_svg(chart: Chart) -> str:
    """The chart as a standalone SVG document (a string)."""
    series = list(dict.fromkeys(bar.series for row in chart.rows for bar in row.bars))
    colours = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(series)}
    values = [bar.value for row in chart.rows for bar in row.bars]
    if chart.target is not None:
        values.append(chart.target[0])
    if chart.log:
        ticks = _log_ticks(min(v for v in values if v > 0), max(values))
        low, high = math.log10(ticks[0]), math.log10(ticks[-1])

        def scale(v: float) -> float:
            return (math.log10(max(v, ticks[0])) - low) / (high - low) * PLOT_WIDTH
    else:
        ticks = _linear_ticks(max(values))

        def scale(v: float) -> float:
            return max(v, 0.0) / ticks[-1] * PLOT_WIDTH

    label_width = max(
        round(len(r.label) * (BOLD_CHAR_WIDTH if r.ours else CHAR_WIDTH)) + 16 for r in chart.rows
    )
    left = 12 + max(120, label_width)
    legend_y = 74
    top = legend_y + 10 + (22 if len(series) > 1 else 0)
    heights = [len(r.bars) * (BAR_HEIGHT + BAR_GAP) - BAR_GAP for r in chart.rows]
    plot_bottom = top + sum(heights) + ROW_GAP * (len(chart.rows) - 1)
    longest_note = max(len(chart.subtitle), len(chart.versions))
    width = max(left + PLOT_WIDTH + VALUE_WIDTH, round(24 + longest_note * SMALL_CHAR_WIDTH))
    height = plot_bottom + 48

    svg = ET.Element(
        "svg",
        {
            "xmlns": SVG_NS,
            "width": str(width),
            "height": str(height),
            "viewBox": f"0 0 {width} {height}",
            "role": "img",
            "aria-label": chart.title,
            "font-family": FONT,
            "font-size": "12",
        },
    )
    ET.SubElement(svg, "title").text = chart.title
    ET.SubElement(svg, "rect", {"width": "100%", "height": "100%", "fill": "#ffffff"})
    _text(svg, 12, 22, chart.title, **{"font-size": "15", "font-weight": "bold"})
    _text(svg, 12, 40, chart.subtitle, fill="#555555", **{"font-size": "11"})
    _text(svg, 12, 56, chart.versions, fill="#555555", **{"font-size": "11"})
    if len(series) > 1:
        x = float(left)
        for name in series:
            ET.SubElement(
                svg,
                "rect",
                {
                    "x": f"{x:.1f}",
                    "y": str(legend_y - 10),
                    "width": "12",
                    "height": "12",
                    "fill": colours[name],
                },
            )
            _text(svg, x + 16, legend_y, name)
            x += 16 + len(name) * CHAR_WIDTH + 20

    grid = ET.SubElement(svg, "g", {"stroke": "#dddddd", "stroke-width": "1"})
    for tick in ticks:
        x = left + scale(tick)
        ET.SubElement(
            grid,
            "line",
            {"x1": f"{x:.1f}", "x2": f"{x:.1f}", "y1": str(top - 4), "y2": str(plot_bottom + 4)},
        )
        _text(
            svg, x, plot_bottom + 18, _tick_text(tick), fill="#555555", **{"text-anchor": "middle"}
        )
    _text(
        svg,
        left + PLOT_WIDTH / 2,
        plot_bottom + 36,
        chart.axis + (" (log scale)" if chart.log else ""),
        fill="#333333",
        **{"text-anchor": "middle"},
    )

    y = float(top)
    for row, row_height in zip(chart.rows, heights, strict=True):
        label_attrs = {"text-anchor": "end", "dominant-baseline": "middle"}
        if row.ours:
            label_attrs["font-weight"] = "bold"
        _text(svg, left - 8, y + row_height / 2, row.label, **label_attrs)
        for bar in row.bars:
            length = scale(bar.value)
            ET.SubElement(
                svg,
                "rect",
                {
                    "x": str(left),
                    "y": f"{y:.1f}",
                    "width": f"{max(length, 1.0):.1f}",
                    "height": str(BAR_HEIGHT),
                    "fill": colours[bar.series],
                },
            ).append(_tooltip(f"{row.label}, {bar.series}: {bar.text}"))
            _text(
                svg,
                left + length + 5,
                y + BAR_HEIGHT / 2,
                bar.text,
                **{"dominant-baseline": "middle"},
            )
            y += BAR_HEIGHT + BAR_GAP
        y += ROW_GAP - BAR_GAP

    if chart.target is not None:
        value, label = chart.target
        x = left + scale(value)
        ET.SubElement(
            svg,
            "line",
            {
                "x1": f"{x:.1f}",
                "x2": f"{x:.1f}",
                "y1": str(top - 8),
                "y2": str(plot_bottom + 4),
                "stroke": "#c0392b",
                "stroke-width": "1.5",
                "stroke-dasharray": "5 3",
            },
        )
        _text(svg, x + 4, top - 10, label, fill="#c0392b", **{"font-size": "11"})

    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode", xml_declaration=True) + "\n"


def _tooltip(text: str) -> ET.Element:
    element = ET.Element("title")
    element.text = text
    return element


def render_placeholder(title: str, command: str) -> str:
    """An SVG that says the benchmark has not been run yet, and the command that produces it."""
    width, height = 760, 90
    svg = ET.Element(
        "svg",
        {
            "xmlns": SVG_NS,
            "width": str(width),
            "height": str(height),
            "viewBox": f"0 0 {width} {height}",
            "role": "img",
            "aria-label": f"{title}: not measured yet",
            "font-family": FONT,
            "font-size": "12",
        },
    )
    ET.SubElement(svg, "title").text = f"{title}: not measured yet"
    ET.SubElement(
        svg,
        "rect",
        {
            "x": "1",
            "y": "1",
            "width": str(width - 2),
            "height": str(height - 2),
            "fill": "#fafafa",
            "stroke": "#bbbbbb",
            "stroke-dasharray": "6 4",
        },
    )
    _text(svg, 16, 28, title, **{"font-size": "15", "font-weight": "bold"})
    _text(svg, 16, 50, "Not measured yet. Produce the results, then python -m benchmarks.plot:")
    _text(svg, 16, 70, command, **{"font-family": "ui-monospace, Menlo, Consolas, monospace"})
    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode", xml_declaration=True) + "\n"


# From results to charts ------------------------------------------------------------------------


def _rate(value: float) -> str:
    return f"{value:,.0f}/s"


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value < 100 else f"{value:,.0f} ms"


def _versions(data: Mapping[str, Any]) -> str:
    versions = data.get("versions") or {}
    parts = [f"{name} {version}" for name, version in versions.items()]
    when = data.get("measured_at")
    return (f"measured {when}; " if when else "") + ", ".join(parts)


def _is_ours(name: str) -> bool:
    return any(mark in name for mark in ("lease()", "RedisLockStore", "LockedTask"))


def chart_acquire_release(data: Mapping[str, Any]) -> Chart:
    """Median cycles/s per contender; the text carries both ratios to the baseline."""
    params = data["params"]
    rows = tuple(
        Row(
            c["name"],
            (
                Bar(
                    "median cycles/s",
                    c["median_per_s"],
                    f"{_rate(c['median_per_s'])}  ({c['x_base']:.3f}x base, "
                    f"paired {c['paired']:.3f})",
                ),
            ),
            ours=_is_ours(c["name"]),
        )
        for c in data["contenders"]
    )
    return Chart(
        title="Uncontended acquire + release on Redis (higher is better)",
        subtitle=f"{params['rounds']} rounds x {params['cycles']} cycles, order rotated",
        versions=_versions(data),
        axis="median cycles per second",
        rows=rows,
    )


def chart_handoff(data: Mapping[str, Any]) -> Chart:
    """Hand-off latency p50 and p99 per contender, on a log axis (polling is 50x slower)."""
    params = data["params"]
    rows = tuple(
        Row(
            c["name"],
            (
                Bar("p50", c["p50_ms"], f"p50 {_ms(c['p50_ms'])}"),
                Bar("p99", c["p99_ms"], f"p99 {_ms(c['p99_ms'])}"),
            ),
            ours=_is_ours(c["name"]),
        )
        for c in data["contenders"]
    )
    total = params["rounds"] * params["per_round"]
    return Chart(
        title="Hand-off latency: release -> waiter holds the key (lower is better)",
        subtitle=f"{total} hand-offs per contender in {params['rounds']} rounds",
        versions=_versions(data),
        axis="milliseconds",
        rows=rows,
        log=True,
    )


def chart_renewal_scale(data: Mapping[str, Any]) -> Chart:
    """Sweep times while every lease is held, and one synthetic sweep of all, against 100 ms."""
    ours = data["celery_lease"]
    sweeps = ours["hold_phase_sweeps"]
    renew = sorted(s["renew_many_ms"] for s in sweeps)
    whole = sorted(s["sweep_ms"] for s in sweeps)

    def median(values: Sequence[float]) -> float:
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    rows = [
        Row(
            "renew_many per sweep",
            (
                Bar("median", median(renew), f"median {_ms(median(renew))}"),
                Bar("max", renew[-1], f"max {_ms(renew[-1])}"),
            ),
            ours=True,
        ),
        Row(
            "whole sweep",
            (
                Bar("median", median(whole), f"median {_ms(median(whole))}"),
                Bar("max", whole[-1], f"max {_ms(whole[-1])}"),
            ),
            ours=True,
        ),
        Row(
            f"one renew_many of all {ours['leases']:,}",
            (
                Bar(
                    "synthetic",
                    ours["synthetic_renew_many_ms"],
                    f"{_ms(ours['synthetic_renew_many_ms'])} (synthetic)",
                ),
            ),
            ours=True,
        ),
    ]
    lost = f"{ours['lost_on_lost']} lost"
    prl = data.get("python_redis_lock")
    if prl:
        lost += f"; python-redis-lock: {prl['lost']} of {prl['locks']:,} lost"
    return Chart(
        title=f"Renewal of {ours['leases']:,} held leases, one process (lower is better)",
        subtitle=f"{len(sweeps)} sweeps in {ours['hold_s']} s, ttl {ours['ttl_s']} s; {lost}",
        versions=_versions(data),
        axis="milliseconds",
        rows=tuple(rows),
        target=(100.0, "target 100 ms"),
    )


def _interval(row: Mapping[str, Any]) -> str:
    """``" [0.72, 0.79]"``: a row's 95% interval of its paired ratio, or ``""`` when the
    result has none (results written before the interleaved blocks)."""
    interval = row.get("paired_ratio_interval")
    return f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""


def chart_task_throughput(data: Mapping[str, Any]) -> Chart:
    """Median tasks/s per task base (per scenario); the text carries the ratios to plain.

    Results with ``scenarios`` (pool x broker, written since issue 10) get one row per
    scenario and contender, labelled ``"<contender> (<pool>, <broker>)"``, with ``", results"``
    added for a scenario that stored results (``"results": true``); older results (one solo
    worker on the Redis broker) have only ``contenders``.
    """
    params = data["params"]
    scenarios = data.get("scenarios") or [
        {"pool": "solo", "broker": "redis", "contenders": data["contenders"]}
    ]
    several = len(scenarios) > 1
    rows = tuple(
        Row(
            f"{c['name']} ({s['pool']}, {s['broker']}{', results' if s.get('results') else ''})"
            if several
            else c["name"],
            (
                Bar(
                    "median tasks/s",
                    c["median_per_s"],
                    f"{_rate(c['median_per_s'])}  ({c['ratio']:.2f}x plain, "
                    f"paired {c['paired_ratio']:.2f}x{_interval(c)})",
                ),
            ),
            ours=_is_ours(c["name"]),
        )
        for s in scenarios
        for c in s["contenders"]
    )
    where = "one worker per pool and broker" if several else "one solo worker, Redis broker"
    return Chart(
        title=f"Task throughput, {where} (higher is better)",
        subtitle=f"{params['tasks']} tasks x {params['rounds']} rounds per contender, "
        "distinct keys",
        versions=_versions(data),
        axis="median tasks per second",
        rows=rows,
    )


def chart_postgres_handoff(data: Mapping[str, Any]) -> Chart:
    """PostgreSQL hand-off latency p50 and p99 per set-up (threads, processes)."""
    rows = tuple(
        Row(
            s["name"],
            (
                Bar("p50", s["p50_ms"], f"p50 {_ms(s['p50_ms'])}"),
                Bar("p99", s["p99_ms"], f"p99 {_ms(s['p99_ms'])}"),
            ),
            ours=True,
        )
        for s in data["setups"]
    )
    return Chart(
        title="PostgreSQL hand-off latency: release -> waiter's acquire (lower is better)",
        subtitle=f"{data['params']['handoffs']} hand-offs per set-up",
        versions=_versions(data),
        axis="milliseconds",
        rows=rows,
        log=True,
    )


@dataclass(frozen=True)
class Benchmark:
    """A benchmark the docs show: its chart file, its renderer, and the command that measures it."""

    name: str
    title: str
    command: str
    chart: Callable[[Mapping[str, Any]], Chart]

    @property
    def filename(self) -> str:
        """``benchmarks-<name>.svg``, with dashes."""
        return f"benchmarks-{self.name.replace('_', '-')}.svg"


BENCHMARKS = (
    Benchmark(
        "acquire_release",
        "Uncontended acquire + release",
        "python -m benchmarks.bench_acquire_release --json benchmarks/results/acquire_release.json",
        chart_acquire_release,
    ),
    Benchmark(
        "handoff",
        "Hand-off latency",
        "python -m benchmarks.bench_handoff --json benchmarks/results/handoff.json",
        chart_handoff,
    ),
    Benchmark(
        "renewal_scale",
        "Renewal at scale",
        "python -m benchmarks.bench_renewal_scale --json benchmarks/results/renewal_scale.json",
        chart_renewal_scale,
    ),
    Benchmark(
        "task_throughput",
        "Task throughput",
        "python -m benchmarks.bench_task_throughput --json benchmarks/results/task_throughput.json",
        chart_task_throughput,
    ),
    Benchmark(
        "postgres_handoff",
        "PostgreSQL hand-off latency",
        "python benchmarks/bench_postgres_handoff.py"
        " --json benchmarks/results/postgres_handoff.json",
        chart_postgres_handoff,
    ),
)


def load_results(directory: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The newest result (by ``measured_at``) of each benchmark among ``directory/*.json``.

    Files without a known ``"benchmark"`` field, and ``--nested`` renewal runs, are skipped.
    """
    known = {b.name for b in BENCHMARKS}
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        name = data.get("benchmark") if isinstance(data, dict) else None
        if name not in known or (data.get("params") or {}).get("nested"):
            continue
        previous = found.get(name)
        if previous is None or str(data.get("measured_at", "")) >= str(
            previous[1].get("measured_at", "")
        ):
            found[name] = (path, data)
    return found


def render_all(results: Path, out: Path) -> list[tuple[Path, Path | None]]:
    """Write every benchmark's chart (or its placeholder) to ``out``.

    Returns:
        ``(svg written, result file it came from or None for a placeholder)`` per benchmark.

    Raises:
        ValueError: a result file lacks a field its chart needs (the message names the file).
    """
    out.mkdir(parents=True, exist_ok=True)
    found = load_results(results)
    written: list[tuple[Path, Path | None]] = []
    for benchmark in BENCHMARKS:
        target = out / benchmark.filename
        if benchmark.name in found:
            source, data = found[benchmark.name]
            try:
                svg = render_svg(benchmark.chart(data))
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                raise ValueError(f"{source}: not a {benchmark.name} result ({exc!r})") from exc
            written.append((target, source))
        else:
            svg = render_placeholder(benchmark.title, benchmark.command)
            written.append((target, None))
        target.write_text(svg)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.plot``: render every chart; prints what came from where."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"default: {RESULTS}")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT}")
    args = parser.parse_args(argv)
    try:
        written = render_all(args.results, args.out)
    except ValueError as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 1
    for target, source in written:
        print(f"{target}: " + (f"from {source}" if source else "placeholder (no result file)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
