"""The charts of `specaudit bench` (`equivalence/reports/charts.py` draws them with matplotlib).

`write_plots(bench, out_dir)` writes `throughput.svg` (tokens/s per engine, grouped by batch size,
with the ceiling), `stages.svg` (each run's time split into draft / verify / realign / other) and
`memory.svg` (peak memory per run), and returns their paths.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from specaudit.equivalence.reports.charts import BarChart, Series, series_color, write_svg

STAGE_COLORS = {"draft": "#56b4e9", "verify": "#0072b2", "realign": "#d55e00", "other": "#bbbbbb"}
CEILING_COLOR = "#7f8c8d"


def _runs(bench: dict[str, Any]) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], str]]:
    """The finished runs, and their series label (the engine, with k when the bench has several)."""
    runs = [run for run in bench.get("runs") or [] if "tokens_per_second" in run
            and not (run.get("server") and bench.get("clock") == "cpu")]  # a server's rate is per wall second
    several_k = len({run["draft_tokens"] for run in runs if run["draft_tokens"] is not None}) > 1

    def label(run: dict[str, Any]) -> str:
        return run["engine"] + (f" k={run['draft_tokens']}" if several_k and run["draft_tokens"] is not None else "")

    return runs, label


def _by_batch_size(bench: dict[str, Any], value: Callable[[dict[str, Any]], float]) -> tuple[tuple[str, ...], list[Series]]:
    """Categories `batch N`, one series per engine label, `value(run)` per bar (NaN where no run)."""
    runs, label = _runs(bench)
    names = list(dict.fromkeys(label(run) for run in runs))
    sizes = sorted({run["batch_size"] for run in runs})
    series = []
    for i, name in enumerate(names):
        values = []
        for size in sizes:
            run = next((r for r in runs if r["batch_size"] == size and label(r) == name), None)
            values.append(math.nan if run is None else value(run))
        series.append(Series(name, tuple(values), series_color(i)))
    return tuple(f"batch {size}" for size in sizes), series


def throughput_chart(bench: dict[str, Any]) -> BarChart:
    categories, series = _by_batch_size(bench, lambda run: run["tokens_per_second"])
    runs, _ = _runs(bench)
    ceilings = []
    for size in sorted({run["batch_size"] for run in runs}):
        # the ceiling in tokens/s: plain decoding's tokens/s times the best speedup the acceptance allows
        best = next((r for r in runs if r["batch_size"] == size and r.get("ceiling") and r.get("ratio_to_plain")), None)
        ceilings.append(math.nan if best is None
                        else best["tokens_per_second"] / best["ratio_to_plain"] * best["ceiling"])
    if any(not math.isnan(value) for value in ceilings):
        series.append(Series("ceiling", tuple(ceilings), CEILING_COLOR))
    per = "CPU second" if bench.get("clock") == "cpu" else "second"
    return BarChart(f"Tokens per {per} by batch size", "batch size", f"tokens per {per}", categories, tuple(series),
                    empty_message="no finished run")


def stages_chart(bench: dict[str, Any]) -> BarChart:
    runs, label = _runs(bench)
    runs = [run for run in runs if run.get("stage_shares")]
    series = tuple(Series(stage, tuple(run["stage_shares"][stage] for run in runs), color)
                   for stage, color in STAGE_COLORS.items())
    return BarChart("Where the time goes", "engine and batch size", "share of time",
                    tuple(f"{label(run)} B={run['batch_size']}" for run in runs), series, stacked=True, percent=True,
                    y_max=1.0, empty_message="no finished run")


def memory_chart(bench: dict[str, Any]) -> BarChart:
    categories, series = _by_batch_size(
        bench, lambda run: math.nan if run["peak_memory_bytes"] is None else run["peak_memory_bytes"] / 2**20)
    return BarChart("Peak memory above the loaded models", "batch size", "MiB", categories, tuple(series),
                    empty_message="no finished run")


def write_plots(bench: dict[str, Any], out_dir: Path) -> list[Path]:
    return [write_svg(chart(bench), out_dir / name) for name, chart in
            (("throughput.svg", throughput_chart), ("stages.svg", stages_chart), ("memory.svg", memory_chart))]
