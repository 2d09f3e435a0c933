"""The "acceptance per draft position" chart stays readable at every count of runs (equivalence/reports/charts.py):
small multiples, one panel per pair, each with at most one expected bar and MAX_RUN_SERIES observed bars per
position (runs that agree, or too many to tell apart, pooled into one bar with the lowest and highest run as its
whisker). Asserted on the chart's structure and on the bars the SVG names, not on pixels."""

from __future__ import annotations

import re
import warnings

from specaudit.equivalence.reports.charts import MAX_RUN_SERIES, acceptance_position_chart, render_svg
from specaudit.equivalence.reports.html import render_html

K = 4
PAIRS = ("tiny-llama", "tiny-gpt2", "tiny-opt")


def _record(observed: list[int], expected: list[int], proposals: int = 100) -> dict:
    return {"positions": [{"position": k, "observed_accepted": a, "observed_proposals": proposals,
                           "expected_accepted": e, "expected_proposals": proposals,
                           "observed_rate": a / proposals, "expected_rate": e / proposals}
                          for k, (a, e) in enumerate(zip(observed, expected))],
            "expected": {"method": "draft-model replay"}, "findings": [], "overall": {}}


def _run(engine: str, pair: str, batch_size: int, observed: list[int], expected: list[int] | None = None,
         dtype: str = "float64") -> dict:
    return {"engine": engine, "pair": pair, "batch_size": batch_size, "dtype": dtype,
            "acceptance": _record(observed, expected or [60, 40, 30, 20])}


def _main_job(observed_of=lambda engine, pair, size: [60, 40, 30, 20]) -> dict:
    """The main job's shape: 2 engines x 3 pairs x 2 batch sizes, 12 runs."""
    return {"runs": [_run(engine, pair, size, observed_of(engine, pair, size))
                     for pair in PAIRS for engine in ("eqspec", "exspec") for size in (4, 16)]}


def test_twelve_runs_make_one_panel_per_pair_with_one_bar_for_runs_that_agree() -> None:
    chart = acceptance_position_chart(_main_job())
    assert [panel.title for panel in chart.panels] == list(PAIRS)
    for panel in chart.panels:
        assert panel.categories == tuple(str(k) for k in range(K))
        assert [series.label for series in panel.series] == ["expected (draft-model replay)", "observed (4 runs, alike)"]
        assert panel.series[1].values == (0.6, 0.4, 0.3, 0.2) and panel.series[1].spread is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svg = render_svg(chart)
    bars = re.findall(r'<g id="(bar-[^"]+)"', svg)
    assert len(bars) == len(set(bars)) == len(PAIRS) * 2 * K  # 2 bars per position per panel, each id its own
    assert all(any(bar.endswith(f"-{pair}") for bar in bars) for pair in PAIRS)
    assert 'class="chart chart-panels"' in svg
    html = render_html({"runs": [{**run, "equivalent": True, "exact_matches": 1, "num_prompts": 1}
                                 for run in _main_job()["runs"]]})
    assert '<figure class="wide"><svg class="chart chart-panels"' in html  # the panels take the page's width


def test_runs_that_differ_have_a_bar_each_and_many_are_pooled_with_whiskers() -> None:
    short = _main_job(lambda engine, pair, size: [30, 10, 5, 1] if (engine, pair, size) == ("exspec", "tiny-opt", 4)
                      else [60, 40, 30, 20])
    panels = {panel.title: panel for panel in acceptance_position_chart(short).panels}
    assert len(panels["tiny-llama"].series) == 2  # its runs agree
    labels = [series.label for series in panels["tiny-opt"].series]
    assert labels == ["expected (draft-model replay)", "observed eqspec B=4", "observed eqspec B=16",
                      "observed exspec B=4", "observed exspec B=16"]
    assert panels["tiny-opt"].series[3].values == (0.3, 0.1, 0.05, 0.01)
    many = {"runs": [_run(f"engine{i}", "tiny-llama", 4, [60 - i, 40, 30, 20]) for i in range(MAX_RUN_SERIES + 5)]}
    (panel,) = acceptance_position_chart(many).panels
    assert len(panel.series) == 2 and "pooled" in panel.series[1].label
    assert panel.series[1].spread[0] == ((60 - MAX_RUN_SERIES - 4) / 100, 0.6)
    svg = render_svg(acceptance_position_chart(many))
    assert len(re.findall(r'<g id="bar-', svg)) == 2 * K


def test_several_dtypes_have_a_panel_each_and_one_pair_still_draws() -> None:
    runs = [_run("eqspec", "tiny-llama", 4, [60, 40, 30, 20], dtype=dtype) for dtype in ("float64", "bfloat16")]
    chart = acceptance_position_chart({"runs": runs})
    assert [panel.title for panel in chart.panels] == ["tiny-llama · float64", "tiny-llama · bfloat16"]
    (one,) = acceptance_position_chart({"runs": runs[:1]}).panels
    assert [series.label for series in one.series] == ["expected (draft-model replay)", "observed (1 run)"]
    assert acceptance_position_chart({"runs": []}).empty and "chart-panels" not in render_svg(
        acceptance_position_chart({"runs": []}))
