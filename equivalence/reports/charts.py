"""Inline SVG charts for the HTML report, drawn from an audit dict with no plotting library.

Every chart is a column chart: groups of columns along x, each column a stack of segments. Each
segment is one `<rect class="bar">` with a `<title>` tooltip, so a browser shows values on hover
and a test can measure the bars that were laid out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from html import escape
from typing import Any

STRUCTURAL_COLOR = "#c0392b"
NUMERICAL_COLOR = "#e69f00"
SERIES_COLORS = ("#0072b2", "#56b4e9", "#009e73", "#cc79a7", "#d55e00", "#8c6bb1", "#7f8c8d", "#f0c419")

CHART_WIDTH = 640
CHART_HEIGHT = 300
PLOT_LEFT = 58
PLOT_RIGHT = 16
PLOT_TOP = 50
PLOT_BOTTOM = 56
TICK_CHARACTER_WIDTH = 6.2
ROTATED_LABEL_CHARACTERS = 26
MAX_POSITION_BINS = 32


@dataclass(frozen=True)
class Segment:
    value: float
    color: str
    tooltip: str


@dataclass(frozen=True)
class Column:
    segments: tuple[Segment, ...]
    value_label: str = ""


@dataclass(frozen=True)
class ColumnGroup:
    label: str
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class LegendEntry:
    label: str
    color: str


def series_color(index: int) -> str:
    return SERIES_COLORS[index % len(SERIES_COLORS)]


def percent(value: float) -> str:
    return f"{value * 100:.0f}%" if value in (0.0, 1.0) or value * 100 >= 10 else f"{value * 100:.1f}%"


def count(value: float) -> str:
    return f"{value:g}"


def nice_axis_top(largest: float) -> tuple[float, float]:
    """A round axis maximum at or above `largest`, and the tick step that divides it."""
    if largest <= 0:
        return 1.0, 0.25
    rough_step = largest / 4
    magnitude = 10 ** math.floor(math.log10(rough_step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= rough_step)
    if step >= 1 and largest >= 1:
        step = max(1.0, round(step))
    return math.ceil(largest / step - 1e-9) * step, step


def _text(x: float, y: float, content: str, css_class: str, anchor: str = "middle", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" class="{css_class}"{extra}>'
            f"{escape(content)}</text>")


def _svg_open(title: str, height: float = CHART_HEIGHT) -> str:
    return (f'<svg class="chart" viewBox="0 0 {CHART_WIDTH} {height:.0f}" width="{CHART_WIDTH}" '
            f'height="{height:.0f}" role="img" aria-label="{escape(title)}">'
            f"<title>{escape(title)}</title>")


def empty_chart_svg(title: str, message: str) -> str:
    return (_svg_open(title)
            + f'<rect x="0.5" y="0.5" width="{CHART_WIDTH - 1}" height="{CHART_HEIGHT - 1}" class="frame"/>'
            + _text(CHART_WIDTH / 2, CHART_HEIGHT / 2, message, "empty")
            + "</svg>")


def _legend_svg(legend: Iterable[LegendEntry]) -> str:
    parts = []
    x = float(PLOT_LEFT)
    for entry in legend:
        parts.append(f'<rect x="{x:.1f}" y="12" width="12" height="12" rx="2" fill="{entry.color}" class="swatch"/>')
        parts.append(_text(x + 17, 22.5, entry.label, "legend", anchor="start"))
        x += 30 + 7.2 * len(entry.label)
    return "".join(parts)


def column_chart_svg(groups: list[ColumnGroup], *, title: str, x_title: str, y_title: str,
                     legend: list[LegendEntry], y_format: Callable[[float], str] = count,
                     y_max: float | None = None) -> str:
    """A grouped (and, where columns have several segments, stacked) column chart as inline SVG."""
    if not groups or not any(group.columns for group in groups):
        return empty_chart_svg(title, "no data")
    largest = max((sum(s.value for s in column.segments) for group in groups for column in group.columns), default=0.0)
    top, step = (y_max, y_max / 4) if y_max is not None else nice_axis_top(largest)
    plot_width = CHART_WIDTH - PLOT_LEFT - PLOT_RIGHT
    plot_height = CHART_HEIGHT - PLOT_TOP - PLOT_BOTTOM
    base_y = PLOT_TOP + plot_height
    group_width = plot_width / len(groups)
    label_every = max(1, math.ceil(len(groups) / 16))
    labels = [group.label for group in groups]
    rotate_labels = max(len(label) for label in labels) * TICK_CHARACTER_WIDTH > group_width * label_every - 6
    if rotate_labels:
        labels = [label if len(label) <= ROTATED_LABEL_CHARACTERS else label[:ROTATED_LABEL_CHARACTERS - 1] + "…"
                  for label in labels]
    label_drop = max(len(label) for label in labels) * TICK_CHARACTER_WIDTH * 0.5 if rotate_labels else 0.0
    height = CHART_HEIGHT + label_drop

    def y_of(value: float) -> float:
        return base_y - plot_height * min(value, top) / top

    parts = [_svg_open(title, height), _legend_svg(legend)]
    ticks = int(round(top / step))
    for tick in range(ticks + 1):
        value = tick * step
        y = y_of(value)
        parts.append(f'<line x1="{PLOT_LEFT}" x2="{CHART_WIDTH - PLOT_RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(_text(PLOT_LEFT - 6, y + 4, y_format(value), "tick", anchor="end"))

    for group_index, group in enumerate(groups):
        group_x = PLOT_LEFT + group_index * group_width
        inner = group_width * (0.8 if len(group.columns) > 1 else 0.7)
        column_width = inner / max(1, len(group.columns))
        first_x = group_x + (group_width - inner) / 2
        for column_index, column in enumerate(group.columns):
            x = first_x + column_index * column_width
            bar_width = max(1.0, column_width - (2 if column_width > 6 else 0.5))
            stacked = 0.0
            for segment in column.segments:
                if segment.value <= 0:
                    continue
                y_top, y_bottom = y_of(stacked + segment.value), y_of(stacked)
                parts.append(f'<rect class="bar" x="{x:.2f}" y="{y_top:.2f}" width="{bar_width:.2f}" '
                             f'height="{max(0.0, y_bottom - y_top):.2f}" fill="{segment.color}">'
                             f"<title>{escape(segment.tooltip)}</title></rect>")
                stacked += segment.value
            if column.value_label and column_width >= 14:
                parts.append(_text(x + bar_width / 2, y_of(stacked) - 4, column.value_label, "value"))
        if group_index % label_every == 0 and rotate_labels:
            x, y = group_x + group_width / 2, base_y + 12
            parts.append(_text(x, y, labels[group_index], "tick", anchor="end",
                               extra=f' transform="rotate(-30 {x:.1f} {y:.1f})"'))
        elif group_index % label_every == 0:
            parts.append(_text(group_x + group_width / 2, base_y + 16, labels[group_index], "tick"))
    parts.append(f'<line x1="{PLOT_LEFT}" x2="{CHART_WIDTH - PLOT_RIGHT}" y1="{base_y}" y2="{base_y}" class="axis"/>')
    parts.append(_text(PLOT_LEFT + plot_width / 2, height - 10, x_title, "axis-title"))
    parts.append(_text(14, PLOT_TOP + plot_height / 2, y_title, "axis-title",
                       extra=f' transform="rotate(-90 14 {PLOT_TOP + plot_height / 2:.1f})"'))
    parts.append("</svg>")
    return "".join(parts)


def _finished_runs(audit: dict[str, Any]) -> list[dict[str, Any]]:
    return [run for run in audit.get("runs") or [] if not run.get("error")]


def equivalence_rate_svg(audit: dict[str, Any]) -> str:
    """Share of prompts whose output matches the reference exactly, per engine (and dtype) and batch size."""
    title = "Equivalence rate by engine and batch size"
    runs = _finished_runs(audit)
    several_dtypes = len({run.get("dtype") for run in runs}) > 1
    exact: dict[tuple[str, int], list[int]] = {}
    for run in runs:
        engine_key = f"{run.get('engine', '?')} · {run.get('dtype')}" if several_dtypes else str(run.get("engine", "?"))
        totals = exact.setdefault((engine_key, int(run.get("batch_size") or 0)), [0, 0])
        totals[0] += int(run.get("exact_matches") or 0)
        totals[1] += int(run.get("num_prompts") or 0)
    engines = list(dict.fromkeys(key[0] for key in exact))
    batch_sizes = sorted({key[1] for key in exact})
    colors = {size: series_color(i) for i, size in enumerate(batch_sizes)}
    groups = []
    for engine in engines:
        columns = []
        for size in batch_sizes:
            matched, total = exact.get((engine, size), (0, 0))
            if total == 0:
                continue
            rate = matched / total
            tooltip = f"{engine}, batch {size}: {matched}/{total} prompts exact ({percent(rate)})"
            columns.append(Column((Segment(rate, colors[size], tooltip),), value_label=percent(rate)))
        groups.append(ColumnGroup(engine, tuple(columns)))
    legend = [LegendEntry(f"batch {size}", colors[size]) for size in batch_sizes]
    return column_chart_svg(groups, title=title, x_title="engine (all pairs pooled)", y_title="prompts exact",
                            legend=legend, y_format=percent, y_max=1.0)


def divergence_position_svg(audit: dict[str, Any]) -> str:
    """Histogram of the output positions where divergences start, stacked by kind."""
    title = "Where in the output divergences start"
    positions: dict[str, list[int]] = {"structural": [], "numerical": []}
    for run in _finished_runs(audit):
        for divergence in run.get("divergences") or []:
            if divergence.get("position") is not None:
                kind = "structural" if divergence.get("kind") == "structural" else "numerical"
                positions[kind].append(int(divergence["position"]))
    every = positions["structural"] + positions["numerical"]
    if not every:
        return empty_chart_svg(title, "no divergences")
    span = max(max(every) + 1, int((audit.get("config") or {}).get("max_new_tokens") or 0))
    width = max(1, math.ceil(span / MAX_POSITION_BINS))
    bins = math.ceil(span / width)
    colors = {"structural": STRUCTURAL_COLOR, "numerical": NUMERICAL_COLOR}
    groups = []
    for index in range(bins):
        low, high = index * width, index * width + width - 1
        label = str(low) if width == 1 else f"{low}–{high}"
        segments = []
        for kind in ("structural", "numerical"):
            hits = sum(1 for position in positions[kind] if low <= position <= high)
            segments.append(Segment(float(hits), colors[kind], f"positions {label}: {hits} {kind}"))
        groups.append(ColumnGroup(label, (Column(tuple(segments)),)))
    legend = [LegendEntry(kind, colors[kind]) for kind in ("structural", "numerical") if positions[kind]]
    return column_chart_svg(groups, title=title, x_title="position in the new tokens", y_title="divergences",
                            legend=legend)


def acceptance_svg(audit: dict[str, Any]) -> str:
    """Per engine, the share of (step, row) pairs that accepted 0, 1, .., k draft tokens."""
    title = "Accepted draft tokens per step and row"
    histograms: dict[str, list[int]] = {}
    for run in _finished_runs(audit):
        counts = (run.get("trace") or {}).get("accepted_histogram") or []
        if not counts:
            continue
        pooled = histograms.setdefault(str(run.get("engine", "?")), [])
        pooled.extend([0] * (len(counts) - len(pooled)))
        for accepted, hits in enumerate(counts):
            pooled[accepted] += int(hits)
    histograms = {engine: counts for engine, counts in histograms.items() if sum(counts) > 0}
    if not histograms:
        return empty_chart_svg(title, "no engine exposed a trace")
    colors = {engine: series_color(i) for i, engine in enumerate(histograms)}
    longest = max(len(counts) for counts in histograms.values())
    groups = []
    for accepted in range(longest):
        columns = []
        for engine, counts in histograms.items():
            share = (counts[accepted] if accepted < len(counts) else 0) / sum(counts)
            tooltip = f"{engine}: {percent(share)} of step-rows accepted {accepted}"
            columns.append(Column((Segment(share, colors[engine], tooltip),)))
        groups.append(ColumnGroup(str(accepted), tuple(columns)))
    legend = [LegendEntry(engine, color) for engine, color in colors.items()]
    return column_chart_svg(groups, title=title, x_title="draft tokens accepted", y_title="share of step-rows",
                            legend=legend, y_format=percent)
