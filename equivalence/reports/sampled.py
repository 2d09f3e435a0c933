"""The sampled audit's reports: `report.md` and `report.html` beside `sampling.json`
(equivalence/sampling/cli.py), with the PIT histogram of each engine's tokens as the chart.

Per engine: the verdict, the p-value and the test that decided it, the power (the smallest total
variation the pooled test and the first token's contexts detect with probability 0.8), the rounding
allowance below float64, the seed checks, and the finding in a sentence; a failed run's one-line reason.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from specaudit.equivalence.reports.charts import BarChart, Series, render_svg, series_color, standalone_svg
from specaudit.equivalence.reports.html import STYLE
from specaudit.equivalence.reports.summary import machine_summary

PASS = "no departure found"


def _finished(sampling: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {spec: report for spec, report in (sampling.get("engines") or {}).items() if not report.get("failed")}


def pit_chart(sampling: dict[str, Any]) -> BarChart:
    """Each finished engine's pooled PIT values, as shares of 20 equal bins: a correct sampler's are flat at
    5% (up to sampling noise); one too sharp piles them at the left, one too flat at the right."""
    histograms = {spec: report["pit_histogram"] for spec, report in _finished(sampling).items()
                  if report.get("pit_histogram")}
    bins = len(next(iter(histograms.values()))) if histograms else 0
    series = tuple(Series(spec, tuple(count / max(1, sum(counts)) for count in counts), series_color(index))
                   for index, (spec, counts) in enumerate(histograms.items()))
    return BarChart(title=f"PIT histogram of the sampled tokens (a correct sampler: {1 / bins:.0%} per bin)"
                    if bins else "PIT histogram of the sampled tokens",
                    x_title="PIT value (0: the target's likeliest tokens)", y_title="share of tokens",
                    categories=tuple(f"{i / bins:.2f}" for i in range(bins)), series=series, percent=True,
                    empty_message="no engine finished", value_labels=False)


def engine_sentence(spec: str, report: dict[str, Any]) -> str:
    """The finding for one engine, in words."""
    if report.get("failed"):
        return f"{spec}: the run failed: {report['error']}"
    samples = f"{report['samples']} samples ({report['tokens']} tokens)"
    if report["verdict"] == "departure":
        return (f"{spec} departs from the target's distribution in {samples}: p = {report['p_value']:.3g} "
                f"({report['worst_test']}); {report.get('finding', '')}")
    seeds = report.get("seeds") or {}
    if report["verdict"] == "seed broken":
        broken = ("the same seed twice gave other tokens" if not seeds.get("same_seed_same_output")
                  else f"requests {seeds.get('rows_differing_alone')} gave other tokens alone than inside the batch")
        return f"{spec}: no departure in {samples}, but the seed's promise is broken: {broken}"
    rounding = report.get("rounding")
    allowed = (f", allowing for {rounding['dtype']} rounding (mean allowance {rounding['allowance_tv_mean']:.2g} TV)"
               if rounding else "")
    return (f"{spec}: no departure found in {samples}; the tests see a departure of TV "
            f"{report['detectable_tv_pooled']:.3f} pooled with probability {report.get('power', 0.8):.0%}{allowed}")


def _rows(sampling: dict[str, Any]) -> list[list[str]]:
    rows = []
    for spec, report in (sampling.get("engines") or {}).items():
        if report.get("failed"):
            rows.append([spec, "run failed", "", report["error"], "", "", "", ""])
            continue
        first = report.get("detectable_tv_first_token")
        rounding = report.get("rounding")
        seeds = report.get("seeds") or {}
        rows.append([spec, report["verdict"], f"{report['p_value']:.3g}", report["worst_test"],
                     f"{report['detectable_tv_pooled']:.3f}" + (f" / {first:.3f}" if first is not None else ""),
                     f"{rounding['allowance_tv_mean']:.2g}" if rounding else "none (float64, CPU)",
                     f"{report['samples']} / {report['tokens']}",
                     ("kept" if seeds.get("same_seed_same_output") and seeds.get("alone_equals_batch") else "broken")
                     if seeds.get("checked") else f"not checked ({seeds.get('why', '')})"])
    return rows


HEADER = ["engine", "verdict", "p-value", "decided by", "detectable TV (pooled / first token)",
          "rounding allowance (mean TV)", "samples / tokens", "seed"]


def verdict_sentence(sampling: dict[str, Any]) -> tuple[bool, str]:
    reports = sampling.get("engines") or {}
    passed = bool(reports) and all(report["verdict"] == PASS for report in reports.values())
    if passed:
        allowed = f" and {sampling['dtype']} rounding" if sampling.get("dtype", "float64") != "float64" else ""
        return True, ("No departure found: no engine's samples depart from the target's distribution by more than "
                      f"its tests see{allowed}")
    failed = [spec for spec, report in reports.items() if report["verdict"] != PASS]
    return False, f"NOT shown to sample the target's distribution: {', '.join(failed)}"


def _setting(sampling: dict[str, Any]) -> list[tuple[str, str]]:
    params = sampling.get("params") or {}
    return [("pair", str(sampling.get("pair"))), ("device", str(sampling.get("device"))),
            ("dtype", str(sampling.get("dtype"))),
            ("teacher forcing", " ".join(str(v) for v in (sampling.get("teacher_forcing") or {}).values())),
            ("sampling", ", ".join(f"{k} {v}" for k, v in params.items())), ("seed", str(sampling.get("seed"))),
            ("batch size", str(sampling.get("batch_size"))), ("timeout", f"{sampling.get('timeout')} s")]


def render_sampled_markdown(sampling: dict[str, Any], chart_file: str | None = None) -> str:
    _, sentence = verdict_sentence(sampling)
    lines = ["# specaudit report: sampled audit", "", f"**{sentence}**", ""]
    lines += ["**Machine:** " + " · ".join(f"{k} {v}" for k, v in machine_summary(sampling)), "",
              "**Setting:** " + " · ".join(f"{k}: {v}" for k, v in _setting(sampling)), "", "## Engines", ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in _rows(sampling)]
    lines += ["", "## Findings", ""]
    lines += [f"- {engine_sentence(spec, report)}" for spec, report in (sampling.get("engines") or {}).items()]
    if chart_file:
        lines += ["", "## PIT histogram", "", f"![PIT histogram]({chart_file})"]
    return "\n".join(lines) + "\n"


def render_sampled_html(sampling: dict[str, Any], chart_svg: str) -> str:
    passed, sentence = verdict_sentence(sampling)

    def pairs(rows: list[tuple[str, str]]) -> str:
        return '<dl class="pairs">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows) + "</dl>"

    cells = ["".join(f"<td>{escape(cell)}</td>" for cell in row) for row in _rows(sampling)]
    table = ("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in HEADER) + "</tr></thead><tbody>"
             + "".join(f"<tr>{row}</tr>" for row in cells) + "</tbody></table>")
    findings = "".join(f"<li>{escape(engine_sentence(spec, report))}</li>"
                       for spec, report in (sampling.get("engines") or {}).items())
    stamp = f"specaudit {sampling.get('specaudit_version')} · created {sampling.get('created')}"
    body = [f'<header><h1>specaudit report: sampled audit</h1><p class="stamp">{escape(stamp)}</p></header>',
            f'<section class="verdict verdict-{"pass" if passed else "fail"}">{escape(sentence)}</section>',
            f'<section class="meta"><div><h2>Machine</h2>{pairs(machine_summary(sampling))}</div>'
            f'<div><h2>Setting</h2>{pairs(_setting(sampling))}</div></section>',
            f"<section><h2>Engines</h2>{table}</section>", f"<section><h2>Findings</h2><ul>{findings}</ul></section>",
            f'<section><h2>Plots</h2><div class="charts"><figure>{chart_svg}</figure></div></section>']
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>specaudit sampled report</title><style>{STYLE}</style></head>"
            f"<body><main>{''.join(body)}</main></body></html>\n")


def write_sampled_reports(sampling: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """`report.md`, `report.html` and `charts/pit.svg` in `out_dir`; the two reports' paths."""
    out_dir = Path(out_dir)
    (out_dir / "charts").mkdir(parents=True, exist_ok=True)
    svg = render_svg(pit_chart(sampling))
    (out_dir / "charts" / "pit.svg").write_text(standalone_svg(svg), encoding="utf-8")
    paths = {"markdown": out_dir / "report.md", "html": out_dir / "report.html"}
    paths["markdown"].write_text(render_sampled_markdown(sampling, "charts/pit.svg"), encoding="utf-8")
    paths["html"].write_text(render_sampled_html(sampling, svg), encoding="utf-8")
    return paths
