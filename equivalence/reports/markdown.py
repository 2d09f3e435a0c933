"""Human reports of an audit: `report.md` for terminals and pull requests, `report.html` for a browser.

Both are drawn from the typed records of `audit.json` (equivalence/records/); optional fields may be missing
(`ABSENT`). `write_reports` and the renderers also take the JSON object and read it once (`serialize.as_audit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specaudit.equivalence.records import Audit, Run, given
from specaudit.equivalence.records.serialize import as_audit

from specaudit.equivalence.reports.charts import audit_charts, render_svg, standalone_svg
from specaudit.equivalence.reports.diagnosis import adversarial_case, adversarial_note, class_lines, failure_lines
from specaudit.equivalence.reports.html import render_html
from specaudit.equivalence.reports.sampled import greedy_view, sampled_charts, sampled_markdown, sampled_runs
from specaudit.equivalence.reports.served import served_markdown
from specaudit.equivalence.reports.summary import (
    STATUS_LABELS,
    DivergenceEntry,
    acceptance_rate,
    expected_acceptance_rate,
    batch_description,
    config_summary,
    divergence_counts,
    format_number,
    format_share,
    logit_error_text,
    machine_summary,
    margin_description,
    ordered_divergences,
    replay_description,
    ruling_text,
    run_status,
    run_title,
    speculation_lines,
    split_ids,
    three_way_runs,
    THREE_WAY_HEADER,
    TIMING_HEADER,
    timing_rows,
    visible_text,
    verdict,
)
from specaudit.equivalence import speculation
from specaudit.equivalence.reports import acceptance as acceptance_report

MARKDOWN_DIVERGENCE_LIMIT = 20
ERROR_TAIL_LINES = 20


def _code_cell(content: str) -> str:
    content = visible_text(content).replace("|", "\\|")
    fence = "`"
    while fence in content:
        fence += "`"
    padding = " " if content.startswith("`") or content.endswith("`") or not content.strip() else ""
    return f"{fence}{padding}{content}{padding}{fence}"


def _ids_text(ids: list[int], mark_first: bool = False) -> str:
    words = [str(token) for token in ids]
    if mark_first and words:
        words[0] = f"[{words[0]}]"
    return " ".join(words)


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |" for row in rows]
    return lines


def _markdown_runs(runs: tuple[Run, ...]) -> list[str]:
    rows = []
    for run in runs:
        counts = divergence_counts(run)
        exact = f"{run.exact_matches}/{run.num_prompts}" if not run.error else "—"
        rows.append([str(run.engine), str(run.pair), str(run.batch_size),
                     str(run.dtype), exact, logit_error_text(run), format_share(acceptance_rate(run)),
                     format_share(expected_acceptance_rate(run)), speculation.cell(run.speculation),
                     str(counts["structural"]), str(counts["numerical"]), STATUS_LABELS[run_status(run)]])
    header = ["engine", "pair", "batch", "dtype", "exact", "max logit error", "acceptance", "expected",
              "drafted/accepted", "structural", "numerical", "status"]
    return _markdown_table(header, rows)


def _markdown_divergence(number: int, entry: DivergenceEntry) -> list[str]:
    divergence, evidence = entry.divergence, entry.divergence.evidence  # evidence: an open-ended bag
    history = given(divergence.accepted_history)
    lines = [f"### {number}. {entry.kind.upper()} · {run_title(entry.run)} · prompt "
             f"{divergence.prompt_index}, position {divergence.position}, "
             f"step {format_number(given(divergence.step))}", ""]
    bullets = [
        f"tokens: reference `{divergence.reference_token}`, engine `{divergence.engine_token}` "
        f"(detected by {divergence.detected_by})",
        f"target top-2 margin on the common prefix: {margin_description(divergence)}",
        f"float64 replay of the target: {replay_description(evidence)}",
    ]
    found = divergence.diagnosis
    if found:
        needs = " (needs the weights)" if found.needs_weights else ""
        bullets.insert(0, f"**diagnosis: {found.cls}{needs}**: {found.evidence}")
        if found.tried:
            bullets.insert(1, "tried: " + "; ".join(str(t) for t in found.tried))
    case = adversarial_case(entry.run, divergence.prompt_index)
    if case is not None:
        bullets.insert(0, f"adversarial prompt `{case.get('case')}` ({case.get('length')} tokens): {case.get('why')}")
    if evidence.get("reason"):
        bullets.append(f"{ruling_text(entry.kind, divergence)}: {evidence['reason']}")
    if evidence.get("plain_engine"):
        bullets.append(f"plain engine: {evidence['plain_engine']}")
    if (entry.run.noise_band or {}).get("how"):  # a black-box engine (recording, server)
        bullets.append(f"noise band: {entry.run.noise_band['how']}")
    if given(divergence.logit_error) is not None:
        bullets.append(f"logit error at this position: {format_number(divergence.logit_error)}")
    bullets.append("accepted draft tokens per step: "
                   + (", ".join(str(count) for count in history) if history else "not traced"))
    bullets.append(f"batch at that step: {batch_description(given(divergence.batch), divergence.prompt_index)}")
    lines += [f"- {bullet}" for bullet in bullets] + [""]
    common, reference, engine = split_ids(divergence)
    rows = []
    text = divergence.text
    if text:
        rows.append(["text", _code_cell("…" + str(text.common)), _code_cell(str(text.reference)),
                     _code_cell(str(text.engine))])
    rows.append(["ids", _code_cell("… " + _ids_text(common)), _code_cell(_ids_text(reference, True)),
                 _code_cell(_ids_text(engine, True))])
    lines += _markdown_table(["", "before the split", "reference continues", "engine continues"], rows)
    return lines + [""]


def _float64_switches(runs: tuple[Run, ...]) -> list[str]:
    """One line per pair and model that `engines/models/float64.py` switched to compute in float64."""
    lines, seen = [], set()
    for run in runs:
        for role, notes in ((run.pair_info or {}).get("float64_switches") or {}).items():
            key = (run.pair, role)
            if key not in seen:
                seen.add(key)
                lines.append(f"- {run.pair} {role}: " + "; ".join(notes))
    return lines


def render_markdown(audit: Audit | Mapping[str, Any], divergence_limit: int = MARKDOWN_DIVERGENCE_LIMIT,
                    chart_files: dict[str, str] | None = None) -> str:
    """The report; `chart_files` (title -> path relative to the report) are linked as images. Sampled runs
    have a section of their own (reports/sampled.py); every other section reads the greedy runs."""
    audit = as_audit(audit)
    _, sentence = verdict(audit)
    sampled_titles = {chart.title for chart in sampled_charts(audit).values()}
    sampled_section = sampled_markdown(audit, {title: path for title, path in (chart_files or {}).items()
                                               if title in sampled_titles})
    chart_files = {title: path for title, path in (chart_files or {}).items() if title not in sampled_titles}
    whole, audit = audit, greedy_view(audit)  # the acceptance section reads sampled runs too
    runs = audit.runs
    lines = ["# specaudit report", "", f"**{sentence}**", ""]
    diagnosed = class_lines(audit)
    if diagnosed:
        lines += ["## Diagnosis", "", "One line per class of structural divergence: how many and their share, what "
                  "named it, the first example and what showed it, and the fix.", ""]
        lines += _markdown_table(["class", "count", "share", "named by", "first example", "evidence", "fix"],
                                 [[f"**{line.cls}**", str(line.count), f"{line.share:.0%}", line.named_by,
                                   line.example, line.evidence, line.fix] for line in diagnosed])
        lines.append("")
    stamp = [f"specaudit {audit.specaudit_version}" if audit.specaudit_version else "",
             f"created {audit.created}" if audit.created else ""]
    if any(stamp):
        lines += [" · ".join(part for part in stamp if part), ""]
    machine, config = machine_summary(audit), config_summary(audit)
    if machine:
        lines += ["**Machine:** " + " · ".join(f"{name} {value}" for name, value in machine), ""]
    if config:
        lines += ["**Config:** " + " · ".join(f"{name}: {value}" for name, value in config), ""]
    note = adversarial_note(audit)
    if note:
        lines += ["**Adversarial prompts:** " + note, ""]
    lines += served_markdown(audit)
    if runs:
        lines += ["## Runs", ""] + _markdown_runs(runs) + [""]
    lines += sampled_section
    if chart_files:
        lines += ["## Charts", ""] + [f"![{title}]({path})" for title, path in chart_files.items()] + [""]
    evidence = speculation_lines(audit)
    if evidence:
        lines += ["## Speculation", "", "What each engine's own counters show it drafted during the run (a server's "
                  "metrics read before and after the run; a built-in engine's trace).", ""]
        lines += _markdown_table(["run", "verdict", "source"], [[title, text, source] for title, text, source in evidence])
        lines.append("")
    lines += acceptance_report.markdown_lines(whole)
    three_way = three_way_runs(audit)
    if three_way:
        lines += ["## Three-way rulings", "", "Each divergence of the speculative run beside the plain run of the same "
                  "engine (no speculation): one the plain run makes identically (same position, same token) is the "
                  "engine's precision, ruled numerical.", ""]
        for run, sentence, rows in three_way:
            lines += [f"**{run_title(run)}**: {sentence}", ""]
            if rows:
                lines += _markdown_table(THREE_WAY_HEADER, rows) + [""]
    timing = timing_rows(audit)
    if timing:
        lines += ["## Where the time went", "", "Seconds per run: the engine's own run; the reference (once per pair "
                  "and dtype); the rulings' controls (float64 and same-dtype replays); the plain control's run (once "
                  "per batch composition, below float64); the diagnosis's logit replays, its re-runs of the engine, "
                  "its hooked re-runs that observe what the engine fed the target, and its total.", ""]
        lines += _markdown_table(TIMING_HEADER, timing) + [""]
    switches = _float64_switches(runs)
    if switches:
        lines += ["## How the models ran in float64", ""] + switches + [""]
    crashed = [run for run in runs if run.error]
    if crashed:
        lines += ["## Crashed runs", ""]
        for run in crashed:
            error_lines = str(run.error).rstrip().splitlines()
            shown = [visible_text(line) for line in error_lines[-ERROR_TAIL_LINES:]]
            fence = "````" if "```" in str(run.error) else "```"
            lines += [f"**{run_title(run)}**" + (f" (last {len(shown)} of {len(error_lines)} lines)"
                                                 if len(shown) < len(error_lines) else ""), "", fence]
            lines += shown + [fence, ""]
    failures = failure_lines(audit)
    if failures:
        lines += ["## Prompts that made the engine fail", "",
                  "Each run that failed was bisected over its prompts; these prompts make the engine fail on their "
                  "own, and every other prompt was judged as usual.", ""]
        for failure in failures:
            lines += [f"**{failure.run}: prompt {failure.prompt_index}**: {visible_text(failure.reason)}"
                      + (f" ({failure.case})" if failure.case else ""), "", "```"]
            lines += [visible_text(line) for line in failure.traceback_tail.splitlines()] + ["```", ""]
    entries = ordered_divergences(audit)
    if entries:
        lines += ["## Divergences", "",
                  "Numerical: a precision control explains it (below float64: the float64 replay puts both tokens "
                  "within the band measured on the run, a same-dtype replay nearly ties them, or a plain batched run "
                  "makes the same flip). Structural: anything else, a bug in the batching. Each says what decided it.",
                  ""]
        for number, entry in enumerate(entries[:divergence_limit], start=1):
            lines += _markdown_divergence(number, entry)
        left_out = len(entries) - divergence_limit
        if left_out > 0:
            lines += [f"{left_out} more divergence{'s' if left_out != 1 else ''} left out; "
                      "audit.json lists all of them.", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_reports(audit: Audit | Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write `report.md`, `report.html` and the charts (`charts/*.svg`, linked from report.md, embedded in
    report.html) into `out_dir`; returns the two reports' paths keyed "markdown" and "html". `audit`: an
    `Audit`, or the JSON object of `audit.json` (read once, `serialize.as_audit`)."""
    audit = as_audit(audit)
    out_dir = Path(out_dir)
    (out_dir / "charts").mkdir(parents=True, exist_ok=True)
    greedy = greedy_view(audit)
    charts = {**(audit_charts(greedy) if greedy.runs or not sampled_runs(audit) else {}), **sampled_charts(audit)}
    svgs = {stem: render_svg(chart) for stem, chart in charts.items()}
    for stem, svg in svgs.items():
        (out_dir / "charts" / f"{stem}.svg").write_text(standalone_svg(svg), encoding="utf-8")
    chart_files = {chart.title: f"charts/{stem}.svg" for stem, chart in charts.items()}
    paths = {"markdown": out_dir / "report.md", "html": out_dir / "report.html"}
    paths["markdown"].write_text(render_markdown(audit, chart_files=chart_files), encoding="utf-8")
    paths["html"].write_text(render_html(audit, charts=svgs), encoding="utf-8")
    return paths
