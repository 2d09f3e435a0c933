"""The plots of `specaudit bench`, as standalone SVG files in the style of `equivalence/reports/charts.py`.

`write_plots(bench, out_dir)` writes `throughput.svg` (tokens/s per engine, grouped by batch size,
with the ceiling: plain decoding's tokens/s times the best speedup, per k), `stages.svg` (each
run's wall time split into draft / verify / realign / other) and `memory.svg` (peak memory per
run), and returns their paths. No plotting library is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from specaudit.equivalence.reports.charts import Column, ColumnGroup, LegendEntry, Segment, column_chart_svg, percent, series_color

STYLE = ("<style>svg.chart{font-family:system-ui,sans-serif;background:#fff}svg.chart text{fill:#444c56;font-size:11px}"
         "svg.chart .legend{font-size:12px}svg.chart .value{font-size:10px;fill:#24292f}"
         "svg.chart .axis-title{font-size:12px;fill:#57606a}svg.chart .grid{stroke:#eaeef2}svg.chart .axis{stroke:#8c959f}"
         "svg.chart .frame{fill:none;stroke:#d0d7de}svg.chart .empty{font-size:14px;fill:#57606a}</style>")
STAGE_COLORS = {"draft": "#56b4e9", "verify": "#0072b2", "realign": "#d55e00", "other": "#bbbbbb"}
CEILING_COLOR = "#7f8c8d"


def _standalone(svg: str) -> str:
    """An inline chart as a file: the namespace, and the report's chart style inside it."""
    svg = svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)
    head, _, rest = svg.partition(">")
    return f"{head}>{STYLE}{rest}\n"


def _runs(bench: dict[str, Any]) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], str]]:
    """The finished runs, and their series label (the engine, with k when the bench has several)."""
    runs = [run for run in bench.get("runs") or [] if "tokens_per_second" in run]
    several_k = len({run["draft_tokens"] for run in runs if run["draft_tokens"] is not None}) > 1

    def label(run: dict[str, Any]) -> str:
        return run["engine"] + (f" k={run['draft_tokens']}" if several_k and run["draft_tokens"] is not None else "")

    return runs, label


def throughput_svg(bench: dict[str, Any]) -> str:
    runs, _label = _runs(bench)
    series = list(dict.fromkeys(_label(run) for run in runs))
    colors = {name: series_color(i) for i, name in enumerate(series)}
    groups = []
    for size in sorted({run["batch_size"] for run in runs}):
        columns = []
        for name in series:
            run = next((r for r in runs if r["batch_size"] == size and _label(r) == name), None)
            if run is None:
                continue
            spread = (run.get("spread") or {}).get("relative_range")
            tooltip = (f"{name}, batch {size}: {run['tokens_per_second']:.2f} tokens/s"
                       + (f" (spread {spread:.0%})" if spread is not None else "")
                       + (f", {run['fraction_of_ceiling']:.0%} of the ceiling" if run.get("fraction_of_ceiling") else ""))
            columns.append(Column((Segment(run["tokens_per_second"], colors[name], tooltip),),
                                  value_label=f"{run['tokens_per_second']:.1f}"))
        ceilings = [r for r in runs if r["batch_size"] == size and r.get("ceiling") and r.get("ratio_to_plain")]
        if ceilings:
            best = ceilings[0]
            plain_tps = best["tokens_per_second"] / best["ratio_to_plain"]
            value = plain_tps * best["ceiling"]
            columns.append(Column((Segment(value, CEILING_COLOR, f"ceiling at batch {size}: {value:.2f} tokens/s "
                                                                 f"({best['ceiling']:.2f}x {best['plain_engine']})"),),
                                  value_label=f"{value:.1f}"))
        groups.append(ColumnGroup(f"batch {size}", tuple(columns)))
    legend = [LegendEntry(name, colors[name]) for name in series] + [LegendEntry("ceiling", CEILING_COLOR)]
    per = "CPU second" if bench.get("clock") == "cpu" else "second"
    return column_chart_svg(groups, title=f"Tokens per {per} by batch size", x_title="batch size",
                            y_title=f"tokens per {per}", legend=legend)


def stages_svg(bench: dict[str, Any]) -> str:
    runs, _label = _runs(bench)
    runs = [run for run in runs if run.get("stage_shares")]
    groups = []
    for run in runs:
        shares = run["stage_shares"]
        segments = tuple(Segment(shares[stage], STAGE_COLORS[stage],
                                 f"{_label(run)}, batch {run['batch_size']}: {stage} {percent(shares[stage])} "
                                 f"({run['stage_seconds'][stage]:.2f} s)") for stage in STAGE_COLORS)
        groups.append(ColumnGroup(f"{_label(run)} B={run['batch_size']}", (Column(segments),)))
    legend = [LegendEntry(stage, color) for stage, color in STAGE_COLORS.items()]
    return column_chart_svg(groups, title="Where the time goes", x_title="engine and batch size",
                            y_title="share of wall time", legend=legend, y_format=percent, y_max=1.0)


def memory_svg(bench: dict[str, Any]) -> str:
    runs, _label = _runs(bench)
    series = list(dict.fromkeys(_label(run) for run in runs))
    colors = {name: series_color(i) for i, name in enumerate(series)}
    groups = []
    for size in sorted({run["batch_size"] for run in runs}):
        columns = []
        for name in series:
            run = next((r for r in runs if r["batch_size"] == size and _label(r) == name), None)
            if run is not None:
                mib = run["peak_memory_bytes"] / 2**20
                columns.append(Column((Segment(mib, colors[name], f"{name}, batch {size}: {mib:.0f} MiB"),),
                                      value_label=f"{mib:.0f}"))
        groups.append(ColumnGroup(f"batch {size}", tuple(columns)))
    legend = [LegendEntry(name, colors[name]) for name in series]
    return column_chart_svg(groups, title="Peak memory above the loaded models", x_title="batch size",
                            y_title="MiB", legend=legend)


def write_plots(bench: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = []
    for name, render in (("throughput.svg", throughput_svg), ("stages.svg", stages_svg), ("memory.svg", memory_svg)):
        path = out_dir / name
        path.write_text(_standalone(render(bench)))
        paths.append(path)
    return paths
