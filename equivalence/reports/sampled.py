"""The sampled runs of an audit (`mode: "sampled"` in `audit.json`, equivalence/sampling/cli.py): their
section of `report.md` and `report.html`, their charts and their lines in the terminal summary.

Per engine: the verdict, the p-value and the test that decided it, the power (the smallest total
variation the pooled test and the first token's contexts detect with probability 0.8), the rounding
allowance below float64, the seed checks, and the finding in a sentence; a failed run's one-line reason.
Two charts: the PIT histogram of each engine's tokens (flat under a correct sampler), and the departure
per output position (the TV of each position's PIT bins beyond what sampling noise gives).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from html import escape
from typing import Any

from specaudit.equivalence.records import SAMPLED, Audit, Run, given, thaw
from specaudit.equivalence.records.serialize import as_audit
from specaudit.equivalence.reports.charts import BarChart, Series, acceptance_position_chart, series_color

PASS = "no departure found"

# Below, a sampled run's report (`run_report`: its `sampled` bag, sampling/audit.py's tests' report) is an
# open-ended mapping, read by its keys.


def is_sampled(run: Run) -> bool:
    return run.mode == SAMPLED


def sampled_runs(audit: Audit) -> list[Run]:
    return [run for run in audit.runs if is_sampled(run)]


def greedy_view(audit: Audit) -> Audit:
    """The audit with its greedy runs alone: what the greedy report's sections read."""
    return replace(audit, runs=tuple(run for run in audit.runs if not is_sampled(run)))


def run_report(run: Run) -> Mapping[str, Any]:
    """A sampled run's report: the tests' mapping (`sampled`) of a finished run; for a failed one its verdict
    ("run failed"), one-line `error`, traceback and seconds."""
    if run.failed or run.error:
        return {"verdict": "run failed", "failed": True, "error": run.error,
                "traceback": given(run.traceback), "seconds": run.seconds}
    return run.sampled


def sampled_reports(audit: Audit | Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each sampled run's report (`run_report`) by engine (`engine B=.. dtype` when an engine ran twice).
    `audit`: an `Audit`, or the JSON object of `audit.json` (read once, `serialize.as_audit`)."""
    runs = sampled_runs(as_audit(audit))
    engines = [run.engine for run in runs]
    return {(str(run.engine) if engines.count(run.engine) == 1
             else f"{run.engine} B={run.batch_size} {run.dtype}"): run_report(run) for run in runs}


def _finished(audit: Audit) -> dict[str, Mapping[str, Any]]:
    return {spec: report for spec, report in sampled_reports(audit).items() if not report.get("failed")}


def pit_chart(audit: Audit) -> BarChart:
    """Each finished engine's pooled PIT values, as shares of 20 equal bins: a correct sampler's are flat at
    5% (up to sampling noise); one too sharp piles them at the left, one too flat at the right."""
    histograms = {spec: report["pit_histogram"] for spec, report in _finished(audit).items()
                  if report.get("pit_histogram")}
    bins = len(next(iter(histograms.values()))) if histograms else 0
    series = tuple(Series(spec, tuple(count / max(1, sum(counts)) for count in counts), series_color(index))
                   for index, (spec, counts) in enumerate(histograms.items()))
    return BarChart(title=f"PIT histogram of the sampled tokens (a correct sampler: {1 / bins:.0%} per bin)"
                    if bins else "PIT histogram of the sampled tokens",
                    x_title="PIT value (0: the target's likeliest tokens)", y_title="share of tokens",
                    categories=tuple(f"{i / bins:.2f}" for i in range(bins)), series=series, percent=True,
                    empty_message="no engine finished", value_labels=False)


POSITION_SCOPE = "output position "  # the scope of the per-position tests (equivalence/sampling/audit.py)


def departure_by_position(report: Mapping[str, Any]) -> dict[int, float]:
    """Output position -> the TV of its PIT bins beyond sampling noise (`tv_excess` of its chi-square test);
    positions with too few tokens for a test are absent."""
    return {int(test["scope"][len(POSITION_SCOPE):]): float(test.get("tv_excess") or 0.0)
            for test in report.get("tests") or []
            if test.get("scope", "").startswith(POSITION_SCOPE) and test.get("test") == "chi_square_pit"}


def position_chart(audit: Audit) -> BarChart:
    """Per output position and engine, how far its tokens' PIT values depart from uniform beyond noise: a
    fault of the k-th token of a step, or of a bonus token, shows at the positions it reaches first."""
    per_engine = {spec: departure_by_position(report) for spec, report in _finished(audit).items()}
    positions = sorted({position for departures in per_engine.values() for position in departures})
    series = tuple(Series(spec, tuple(departures.get(position, float("nan")) for position in positions),
                          series_color(index)) for index, (spec, departures) in enumerate(per_engine.items()))
    return BarChart(title="Departure per output position (TV of the PIT bins beyond sampling noise)",
                    x_title="output position", y_title="excess TV", categories=tuple(map(str, positions)),
                    series=series, empty_message="no departure beyond sampling noise at any position",
                    value_labels=False)


def acceptance_chart(audit: Audit) -> BarChart:
    """Per draft position, the sampled runs' expected acceptance (sum min(p, q) along the samples) against
    observed: the greedy runs' chart (charts.py) drawn over the sampled runs, under a title of its own."""
    chart = acceptance_position_chart(replace(audit, runs=tuple(sampled_runs(audit))))
    return replace(chart, title="Acceptance per draft position under sampling: expected against observed")


def sampled_charts(audit: Audit) -> dict[str, BarChart]:
    """The sampled section's charts by file stem; none without sampled runs (the acceptance chart where a
    sampled run has an acceptance comparison)."""
    runs = sampled_runs(audit)
    if not runs:
        return {}
    charts = {"sampled-pit": pit_chart(audit), "sampled-positions": position_chart(audit)}
    if any((run.acceptance or {}).get("positions") for run in runs):
        charts["sampled-acceptance-positions"] = acceptance_chart(audit)
    return charts


def engine_sentence(spec: str, report: Mapping[str, Any]) -> str:
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


def summary_line(spec: str, report: Mapping[str, Any]) -> str:
    """The terminal's line for one sampled run."""
    if report.get("failed"):
        return f"{spec}: run failed: {report['error']}"
    first = report["detectable_tv_first_token"]
    effect = report["effect_tv"]
    return (f"{spec}: {report['verdict']}, p = {report['p_value']:.3g} ({report['worst_test']}), "
            f"effect TV {effect if effect is None else round(effect, 3)}; {report['samples']} samples, "
            f"{report['tokens']} tokens; smallest detectable TV {report['detectable_tv_pooled']:.3f} pooled"
            + (f", {first:.3f} at the first token" if first is not None else "")
            + (f"; {report['finding']}" if report.get("finding") else "")
            + _speculation_summary(report.get("speculation"))
            + (f"; {report['power_note']}" if report.get("power_note") else ""))


def _speculation_summary(speculation: Mapping[str, Any] | None) -> str:
    if not speculation:
        return ""
    if speculation.get("drafted_tokens") is None:
        return "; no speculation counters"
    rate = speculation.get("acceptance_rate")
    return (f"; speculation: {speculation.get('accepted_tokens')} of {speculation.get('drafted_tokens')} drafted "
            f"tokens accepted" + (f" ({rate:.2f})" if rate is not None else ""))


def summary_lines(audit: Audit) -> list[str]:
    return [summary_line(spec, report) for spec, report in sampled_reports(audit).items()]


def _rows(audit: Audit) -> list[list[str]]:
    rows = []
    for spec, report in sampled_reports(audit).items():
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


def sampled_verdict(audit: Audit) -> tuple[str, str]:
    """(status, sentence) of the sampled runs: status "pass", "fail" or "empty"."""
    reports = sampled_reports(audit)
    if not reports:
        return "empty", "NO RUNS: the audit recorded no runs."
    if all(report["verdict"] == PASS for report in reports.values()):
        dtypes = {run.dtype for run in sampled_runs(audit)} - {"float64"}
        allowed = f" and {', '.join(sorted(map(str, dtypes)))} rounding" if dtypes else ""
        return "pass", ("No departure found: no engine's samples depart from the target's distribution by more "
                        f"than its tests see{allowed}")
    failed = [spec for spec, report in reports.items() if report["verdict"] != PASS]
    return "fail", f"NOT shown to sample the target's distribution: {', '.join(failed)}"


def sampled_setting(audit: Audit) -> list[tuple[str, str]]:
    config = audit.config
    params = thaw(config.get("sampling") or {})  # plain values: a list shows as the JSON list it is
    forcing = thaw(config.get("teacher_forcing") or {})
    asked = {k: v for k, v in thaw(config.get("request_params") or {}).items() if k not in ("top_k", "temperature", "top_p")}
    rows = [("samples per engine", config.get("samples")), ("sampling", ", ".join(f"{k} {v}" for k, v in params.items())),
            # the command line's request parameters (a prompts file's per-line ones are in each run's `request_params`)
            ("request parameters", ", ".join(f"{k} {v}" for k, v in asked.items())),
            ("seed", config.get("seed")), ("alpha (family-wise)", config.get("alpha")),
            ("teacher forcing", " ".join(str(v) for v in forcing.values())),
            ("timeout", None if config.get("timeout") is None else f"{config['timeout']} s")]
    return [(name, str(value)) for name, value in rows if value not in (None, "")]


def _markdown_cell(cell: str) -> str:
    return cell.replace("|", "\\|")


def sampled_markdown(audit: Audit, chart_files: dict[str, str] | None = None) -> list[str]:
    """The sampled section of report.md; `chart_files`: chart title -> path relative to the report."""
    if not sampled_runs(audit):
        return []
    _, sentence = sampled_verdict(audit)
    lines = ["## Sampled runs", "", f"**{sentence}**", "",
             "**Setting:** " + " · ".join(f"{k}: {v}" for k, v in sampled_setting(audit)), ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in _rows(audit)]
    lines += ["", "### Findings", ""]
    lines += [f"- {engine_sentence(spec, report)}" for spec, report in sampled_reports(audit).items()]
    for title, path in (chart_files or {}).items():
        lines += ["", f"![{title}]({path})"]
    return lines + [""]


def sampled_html(audit: Audit, chart_svgs: list[str]) -> str:
    """The sampled section of report.html, its charts' SVGs embedded."""
    if not sampled_runs(audit):
        return ""
    status, sentence = sampled_verdict(audit)
    setting = '<dl class="pairs">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                                             for k, v in sampled_setting(audit)) + "</dl>"
    cells = ["".join(f"<td>{escape(cell)}</td>" for cell in row) for row in _rows(audit)]
    table = ("<table><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in HEADER) + "</tr></thead><tbody>"
             + "".join(f"<tr>{row}</tr>" for row in cells) + "</tbody></table>")
    findings = "".join(f"<li>{escape(engine_sentence(spec, report))}</li>"
                       for spec, report in sampled_reports(audit).items())
    figures = "".join(f"<figure>{svg}</figure>" for svg in chart_svgs)
    return (f'<section class="sampled"><h2>Sampled runs</h2>'
            f'<p class="verdict verdict-{"pass" if status == "pass" else "fail"}">{escape(sentence)}</p>'
            f"{setting}{table}<h3>Findings</h3><ul>{findings}</ul>"
            f'<div class="charts">{figures}</div></section>')
