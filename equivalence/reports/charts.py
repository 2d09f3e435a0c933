"""The report's charts: what each shows is a `BarChart` (data only, testable), drawn by matplotlib.

Every chart here is a bar chart: categories along x, one bar per series in each category (side by
side, or stacked), or small multiples of them (`panels`: one bar chart per panel, e.g. one per pair,
each with its own legend). `render_svg` draws one with matplotlib's Agg backend into an SVG string, text
kept as text (`svg.fonttype: none`) so that a browser renders it crisply and a reader can search it.
Each bar carries the id `bar-<series>-<category>` (`-<panel>` after it in small multiples), so a test
finds the bars that were drawn without looking at pixels. The HTML report embeds the SVGs (small
multiples across the page's width); the markdown report links them as files.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specaudit.equivalence.records import Audit, Run
from specaudit.equivalence.records.serialize import as_audit

STRUCTURAL_COLOR = "#c0392b"
NUMERICAL_COLOR = "#e69f00"
SERIES_COLORS = ("#0072b2", "#56b4e9", "#009e73", "#cc79a7", "#d55e00", "#8c6bb1", "#7f8c8d", "#f0c419")
MAX_POSITION_BINS = 32
FIGURE_SIZE = (6.4, 3.2)  # inches; 100 dpi in the SVG's viewBox
PANEL_SIZE = (3.6, 2.4)  # inches per panel of small multiples (its legend below): three across the report at 100 dpi
LEGEND_LINE = 0.17  # inches per legend entry below a panel
PANEL_COLUMNS = 3
MAX_RUN_SERIES = 4  # observed bars per panel, one per run; past it (or where every run agrees) the runs are pooled


@dataclass(frozen=True)
class Series:
    label: str
    values: tuple[float, ...]  # one per category; NaN: no bar there
    color: str
    # per category (lowest, highest) of what the bar pools, drawn as a whisker; None: no whiskers
    spread: tuple[tuple[float, float], ...] | None = None


@dataclass(frozen=True)
class BarChart:
    title: str
    x_title: str
    y_title: str
    categories: tuple[str, ...]
    series: tuple[Series, ...]
    stacked: bool = False
    percent: bool = False  # values are shares in [0, 1], shown as percentages
    y_max: float | None = None
    empty_message: str = ""  # drawn instead of bars when there is nothing to show
    value_labels: bool = True
    notes: dict[str, Any] = field(default_factory=dict)
    panels: tuple["BarChart", ...] = ()  # small multiples: each panel a chart of its own (its title, its legend)

    @property
    def empty(self) -> bool:
        if self.panels:
            return all(panel.empty for panel in self.panels)
        return not self.categories or not any(
            not math.isnan(v) and v > 0 for s in self.series for v in s.values)


def series_color(index: int) -> str:
    return SERIES_COLORS[index % len(SERIES_COLORS)]


def percent(value: float) -> str:
    return f"{value:.0%}" if value in (0.0, 1.0) or value >= 0.1 else f"{value:.1%}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def render_svg(chart: BarChart) -> str:
    """The chart as one `<svg>` element (no XML prolog), sized by its viewBox to fill its container."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = chart.panels if chart.panels and not chart.empty else ()
    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
                                "axes.spines.right": False, "svg.hashsalt": "specaudit"}):
        if panels:
            columns = min(PANEL_COLUMNS, len(panels))
            rows = math.ceil(len(panels) / columns)
            # each panel's legend below it, one entry a line: the row grows by its longest legend, and the
            # constrained layout keeps axes, labels and legends apart
            legend = LEGEND_LINE * max(len(panel.series) for panel in panels)
            fig, grid = plt.subplots(rows, columns, figsize=(PANEL_SIZE[0] * columns, (PANEL_SIZE[1] + legend) * rows),
                                     dpi=100, squeeze=False, layout="constrained")
        else:
            fig, ax = plt.subplots(figsize=FIGURE_SIZE, dpi=100)
        try:
            if panels:
                fig.suptitle(chart.title, fontsize=11, x=0.01, ha="left")
                axes = [ax for row in grid for ax in row]
                for index, (ax, panel) in enumerate(zip(axes, panels)):
                    _draw_chart(ax, panel, FuncFormatter, title_size=10, suffix=f"-{_slug(panel.title)}")
                    if index % columns:
                        ax.set_ylabel("")
                for ax in axes[len(panels):]:
                    ax.set_visible(False)
            else:
                _draw_chart(ax, chart, FuncFormatter, title_size=11, suffix="")
            with warnings.catch_warnings(record=True) as refused:
                warnings.simplefilter("always")
                if not panels:
                    fig.tight_layout()  # warns, and leaves the layout, where the labels outgrow the figure
            # then the saved figure grows to its labels instead of cutting them
            grown = {"bbox_inches": "tight"} if refused else {}
            buffer = io.StringIO()
            fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None}, **grown)
        finally:
            plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.S)  # RDF licence boilerplate
    label = chart.title.replace('"', "'")
    css = "chart chart-panels" if panels else "chart"  # small multiples take the report's whole width
    return svg.replace("<svg ", f'<svg class="{css}" role="img" aria-label="{label}" ', 1)


def _draw_chart(ax: Any, chart: BarChart, formatter: Any, title_size: int, suffix: str) -> None:
    """One chart (or one panel of small multiples) on `ax`: title, axes, bars (their ids end in `suffix`),
    legend below."""
    ax.set_title(chart.title, fontsize=title_size, loc="left")
    ax.set_xlabel(chart.x_title)
    ax.set_ylabel(chart.y_title)
    if chart.empty:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, chart.empty_message or "nothing to show", transform=ax.transAxes,
                ha="center", va="center", color="#57606a", fontsize=11)
        return
    _draw_bars(ax, chart, suffix)
    if chart.percent:
        ax.yaxis.set_major_formatter(formatter(lambda v, _: f"{v:.0%}"))
    ax.grid(axis="y", color="#eaeef2")
    ax.set_axisbelow(True)
    if len(chart.series) > 1 or chart.stacked:
        if suffix:  # a panel's legend: one entry a line, full text, under the axis title
            ax.legend(frameon=False, fontsize=8, ncols=1, loc="upper left",
                      bbox_to_anchor=(0, -0.3 if _rotated(chart) else -0.24))
        else:
            ax.legend(frameon=False, fontsize=8, ncols=min(4, len(chart.series)),
                      loc="upper left", bbox_to_anchor=(0, -0.28 if _rotated(chart) else -0.18))


def _rotated(chart: BarChart) -> bool:
    return len(chart.categories) * max(len(c) for c in chart.categories) > 60


def _first_bar(series: Series) -> int:
    return next((i for i, v in enumerate(series.values) if not math.isnan(v) and v > 0), -1)


def _draw_bars(ax: Any, chart: BarChart, suffix: str = "") -> None:
    count = len(chart.categories)
    groups = 1 if chart.stacked else max(1, len(chart.series))
    width = 0.8 / groups
    bottoms = [0.0] * count
    top = 0.0
    for index, series in enumerate(chart.series):
        offset = 0.0 if chart.stacked else (index - (groups - 1) / 2) * width
        for position, value in enumerate(series.values):
            if math.isnan(value) or value <= 0:  # nothing to draw; the category keeps its place
                continue
            base = bottoms[position] if chart.stacked else 0.0
            (bar,) = ax.bar(position + offset, value, width * 0.95, bottom=base, color=series.color,
                            label=series.label if position == _first_bar(series) else None)
            bar.set_gid(f"bar-{_slug(series.label)}-{position}{suffix}")
            if series.spread is not None and not chart.stacked:
                low, high = series.spread[position]
                if high > low:  # the pooled runs' lowest and highest
                    ax.errorbar(position + offset, value, yerr=[[value - low], [high - value]], fmt="none",
                                ecolor="#24292f", elinewidth=1, capsize=2)
            if chart.stacked:
                bottoms[position] += value
            top = max(top, base + value)
            if chart.value_labels and not chart.stacked and value > 0:
                text = percent(value) if chart.percent else f"{value:.3g}"
                ax.annotate(text, (position + offset, value), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(count), list(chart.categories), rotation=30 if _rotated(chart) else 0,
                  ha="right" if _rotated(chart) else "center")
    ax.set_ylim(0, chart.y_max if chart.y_max is not None else (top * 1.15 or 1.0))


def standalone_svg(svg: str) -> str:
    """An inline `<svg>` as the content of a file (with the XML namespace a file needs)."""
    if "xmlns=" not in svg.split(">", 1)[0]:
        svg = svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)
    return svg


def write_svg(chart: BarChart, path: Path) -> Path:
    """The chart as a standalone SVG file."""
    path.write_text(standalone_svg(render_svg(chart)), encoding="utf-8")
    return path


# ---- the audit report's three charts ----------------------------------------------------------

def _finished_runs(audit: Audit) -> list[Run]:
    return [run for run in audit.runs if not run.error]


def equivalence_rate_chart(audit: Audit) -> BarChart:
    """Share of prompts whose output matches the reference exactly, per engine (and dtype) and batch size."""
    runs = _finished_runs(audit)
    several_dtypes = len({run.dtype for run in runs}) > 1
    exact: dict[tuple[str, int], list[int]] = {}
    for run in runs:
        engine_key = f"{run.engine} · {run.dtype}" if several_dtypes else str(run.engine)
        totals = exact.setdefault((engine_key, int(run.batch_size or 0)), [0, 0])
        totals[0] += int(run.exact_matches or 0)
        totals[1] += int(run.num_prompts or 0)
    engines = tuple(dict.fromkeys(key[0] for key in exact))
    batch_sizes = sorted({key[1] for key in exact})
    series = []
    for i, size in enumerate(batch_sizes):
        values = []
        for engine in engines:
            matched, total = exact.get((engine, size), (0, 0))
            values.append(matched / total if total else math.nan)
        series.append(Series(f"batch {size}", tuple(values), series_color(i)))
    return BarChart("Equivalence rate by engine and batch size", "engine (all pairs pooled)", "prompts exact",
                    engines, tuple(series), percent=True, y_max=1.08, empty_message="no finished run")


def divergence_position_chart(audit: Audit) -> BarChart:
    """Histogram of the output positions where divergences start, stacked by kind."""
    title = "Where in the output divergences start"
    positions: dict[str, list[int]] = {"structural": [], "numerical": []}
    for run in _finished_runs(audit):
        for divergence in run.divergences:
            if divergence.position is not None and divergence.kind != "reference_mismatch":
                kind = "structural" if divergence.structural else "numerical"
                positions[kind].append(int(divergence.position))
    every = positions["structural"] + positions["numerical"]
    if not every:
        return BarChart(title, "position in the new tokens", "divergences", (), (), empty_message="no divergences")
    span = max(max(every) + 1, int(audit.config.get("max_new_tokens") or 0))
    width = max(1, math.ceil(span / MAX_POSITION_BINS))
    bins = math.ceil(span / width)
    labels = tuple(str(i * width) if width == 1 else f"{i * width}–{i * width + width - 1}" for i in range(bins))
    colors = {"structural": STRUCTURAL_COLOR, "numerical": NUMERICAL_COLOR}
    series = tuple(
        Series(kind, tuple(float(sum(1 for p in positions[kind] if i * width <= p < (i + 1) * width))
                           for i in range(bins)), colors[kind])
        for kind in ("structural", "numerical") if positions[kind])
    return BarChart(title, "position in the new tokens", "divergences", labels, series, stacked=True)


def acceptance_chart(audit: Audit) -> BarChart:
    """Per engine, the share of (step, row) pairs that accepted 0, 1, .., k draft tokens."""
    title = "Accepted draft tokens per step and row"
    histograms: dict[str, list[int]] = {}
    for run in _finished_runs(audit):
        counts = (run.trace or {}).get("accepted_histogram") or []
        if not counts:
            continue
        pooled = histograms.setdefault(str(run.engine), [])
        pooled.extend([0] * (len(counts) - len(pooled)))
        for accepted, hits in enumerate(counts):
            pooled[accepted] += int(hits)
    histograms = {engine: counts for engine, counts in histograms.items() if sum(counts) > 0}
    if not histograms:
        return BarChart(title, "draft tokens accepted", "share of step-rows", (), (),
                        empty_message="no engine exposed a trace")
    longest = max(len(counts) for counts in histograms.values())
    series = tuple(
        Series(engine, tuple((counts[a] if a < len(counts) else 0) / sum(counts) for a in range(longest)),
               series_color(i))
        for i, (engine, counts) in enumerate(histograms.items()))
    return BarChart(title, "draft tokens accepted", "share of step-rows", tuple(str(a) for a in range(longest)),
                    series, percent=True, value_labels=False)


def acceptance_position_chart(audit: Audit | Mapping[str, Any]) -> BarChart:
    """Per draft position, expected against observed acceptance (accepted at k / proposals at k:
    equivalence/acceptance/observed.py), from the runs' acceptance records: small multiples, one panel per
    pair (and dtype, where the audit has several), so that a panel holds the runs of one expectation.

    In a panel: the expectation (one bar per distinct one), then the observed acceptance, one bar per run
    while there are at most MAX_RUN_SERIES and they differ; where every run agrees (equivalent engines at
    every batch size), or past MAX_RUN_SERIES, one bar pooling the panel's runs (accepted / proposals summed),
    its whisker the lowest and highest run. So a panel has at most 1 + MAX_RUN_SERIES observed bars per
    position, whatever the count of runs."""
    title = "Acceptance per draft position: expected against observed"
    records = [(run, run.acceptance) for run in _finished_runs(as_audit(audit))
               if (run.acceptance or {}).get("positions")]
    if not records:
        return BarChart(title, "draft position", "acceptance", (), (),
                        empty_message="no run has both observed and expected acceptance per position")
    several_dtypes = len({run.dtype for run, _ in records}) > 1
    grouped: dict[str, list[tuple[Run, Mapping[str, Any]]]] = {}
    for run, record in records:
        key = f"{run.pair} · {run.dtype}" if several_dtypes else str(run.pair)
        grouped.setdefault(key, []).append((run, record))
    panels = tuple(_acceptance_panel(name, members) for name, members in grouped.items())
    return BarChart(title, "draft position", "acceptance", panels[0].categories, (), percent=True, y_max=1.08,
                    value_labels=False, panels=panels)


def _position_counts(record: Mapping[str, Any], side: str, width: int) -> list[tuple[float, int]]:
    """Per position (accepted, proposals) of one side ("observed" or "expected") of an acceptance record."""
    by_position = {p["position"]: p for p in record["positions"]}
    counts = []
    for k in range(width):
        p = by_position.get(k) or {}
        counts.append((float(p.get(f"{side}_accepted") or 0), int(p.get(f"{side}_proposals") or 0)))
    return counts


def _rates(counts: list[tuple[float, int]]) -> tuple[float, ...]:
    return tuple(accepted / proposals if proposals else math.nan for accepted, proposals in counts)


def _pooled(members: list[list[tuple[float, int]]]) -> tuple[float, ...]:
    """Per position, the members' accepted summed over their proposals summed."""
    return _rates([(sum(m[k][0] for m in members), sum(m[k][1] for m in members)) for k in range(len(members[0]))])


def _acceptance_panel(name: str, members: list[tuple[Run, Mapping[str, Any]]]) -> BarChart:
    width = max(len(record["positions"]) for _, record in members)
    expected = [_position_counts(record, "expected", width) for _, record in members]
    observed = [_position_counts(record, "observed", width) for _, record in members]
    methods = list(dict.fromkeys((record.get("expected") or {}).get("method", "expected") for _, record in members))
    distinct = list(dict.fromkeys(_rates(counts) for counts in observed))
    per_run = 1 < len(distinct) and len(members) <= MAX_RUN_SERIES
    series: list[Series] = []
    expectations = list(dict.fromkeys(_rates(counts) for counts in expected))
    if per_run and len(expectations) > 1:  # the runs' outputs differ, so do their replays: one each
        for (run, _), counts in zip(members, expected):
            series.append(Series(f"expected {_run_name(run)}", _rates(counts), EXPECTED_COLORS[len(series) % 2]))
    else:
        label = f"expected ({', '.join(methods)}" + (f", {len(members)} runs pooled)" if len(expectations) > 1 else ")")
        series.append(Series(label, _pooled(expected) if len(expectations) > 1 else expectations[0], EXPECTED_COLORS[0]))
    if per_run:
        for index, ((run, _), counts) in enumerate(zip(members, observed)):
            series.append(Series(f"observed {_run_name(run)}", _rates(counts), series_color(index)))
    else:
        rates = [_rates(counts) for counts in observed]
        spread = tuple((min(r[k] for r in rates if not math.isnan(r[k])), max(r[k] for r in rates if not math.isnan(r[k])))
                       if any(not math.isnan(r[k]) for r in rates) else (math.nan, math.nan) for k in range(width))
        alike = len(distinct) == 1
        label = (f"observed ({len(members)} run{'s' if len(members) != 1 else ''}"
                 + (", alike)" if alike and len(members) > 1 else ")" if alike else
                    " pooled; whisker: lowest to highest)"))
        series.append(Series(label, _pooled(observed), series_color(0), spread=None if alike else spread))
    return BarChart(name, "draft position", "acceptance", tuple(str(k) for k in range(width)), tuple(series),
                    percent=True, y_max=1.08, value_labels=False)


EXPECTED_COLORS = ("#7f8c8d", "#b8c0c2")
RUN_NAME_WIDTH = 28  # characters of an engine's name in a panel's legend (elided in the middle)


def _run_name(run: Run) -> str:
    """A run within its panel (the pair and dtype are the panel's): engine and batch size."""
    engine = str(run.engine)
    if len(engine) > RUN_NAME_WIDTH:
        engine = engine[: RUN_NAME_WIDTH // 2] + "…" + engine[-(RUN_NAME_WIDTH - RUN_NAME_WIDTH // 2 - 1):]
    return f"{engine} B={run.batch_size}"


def audit_charts(audit: Audit | Mapping[str, Any]) -> dict[str, BarChart]:
    """The report's charts by file stem, in the order the reports show them."""
    audit = as_audit(audit)
    return {"equivalence-rate": equivalence_rate_chart(audit),
            "divergence-positions": divergence_position_chart(audit),
            "acceptance": acceptance_chart(audit),
            "acceptance-positions": acceptance_position_chart(audit)}
