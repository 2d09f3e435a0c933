"""`report.html`: one self-contained page (inline CSS and SVG, no scripts, no external resources)."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from specaudit.equivalence.records import Audit, Run, StepBatch, given
from specaudit.equivalence.records.serialize import as_audit

from specaudit.equivalence.reports.charts import audit_charts, render_svg
from specaudit.equivalence.reports.diagnosis import adversarial_case, adversarial_note, class_lines, failure_lines
from specaudit.equivalence.reports.sampled import greedy_view, sampled_charts, sampled_html, sampled_runs
from specaudit.equivalence.reports.served import served_html
from specaudit.equivalence.reports.summary import (
    STATUS_LABELS,
    DivergenceEntry,
    acceptance_rate,
    expected_acceptance_rate,
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
    rows_count,
    speculation_lines,
    split_ids,
    three_way_runs,
    TIMING_HEADER,
    timing_rows,
    THREE_WAY_HEADER,
    visible_text,
    verdict,
)
from specaudit.equivalence import speculation
from specaudit.equivalence.reports import acceptance as acceptance_report

HTML_DIVERGENCE_LIMIT = 200

STYLE = """
:root { --ink: #1f2328; --muted: #656d76; --line: #d8dee4; --panel: #f6f8fa; --structural: #c0392b;
        --numerical: #b7791f; --pass: #1a7f37; --crash: #6e40c9; }
* { box-sizing: border-box; }
body { margin: 0; background: #fff; color: var(--ink); line-height: 1.45;
       font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 28px 32px 64px; }
h1 { font-size: 26px; margin: 0 0 2px; } h2 { font-size: 19px; margin: 36px 0 12px; border-bottom: 1px solid var(--line);
     padding-bottom: 6px; } h3 { font-size: 15px; margin: 0; }
.stamp, .note { color: var(--muted); font-size: 13px; margin: 0; }
code, pre, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, "Liberation Mono", monospace; font-size: 13px; }
.verdict { margin: 18px 0; padding: 14px 18px; border-radius: 8px; font-weight: 600; font-size: 16px; border: 1px solid; }
.verdict-fail { background: #ffebe9; border-color: #ffcecb; color: #82071e; }
.verdict-incomplete { background: #fbefff; border-color: #ecd8ff; color: #512a97; }
.verdict-numerical { background: #fff8c5; border-color: #eed888; color: #6c4400; }
.verdict-pass { background: #dafbe1; border-color: #aceebb; color: #116329; }
.verdict-empty { background: var(--panel); border-color: var(--line); color: var(--muted); }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
.card .number { font-size: 24px; font-weight: 650; } .card .what { color: var(--muted); font-size: 13px; }
.card.structural .number { color: var(--structural); } .card.numerical .number { color: var(--numerical); }
.card.crashed .number { color: var(--crash); }
.meta { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 0 32px; }
dl.pairs { display: grid; grid-template-columns: max-content 1fr; gap: 4px 16px; margin: 0; font-size: 14px; }
dl.pairs dt { color: var(--muted); } dl.pairs dd { margin: 0; overflow-wrap: anywhere; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(500px, 1fr)); gap: 16px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 8px; padding: 12px 12px 6px; }
figure.wide { grid-column: 1 / -1; }
svg.chart { width: 100%; height: auto; display: block; font-family: inherit; }
.table-wrap { overflow-x: auto; }
table.runs { border-collapse: collapse; width: 100%; font-size: 13.5px; }
table.runs th, table.runs td { padding: 6px 10px; border-bottom: 1px solid var(--line); text-align: left; white-space: nowrap; }
table.runs th { background: var(--panel); font-weight: 600; } table.runs td.number { text-align: right; font-variant-numeric: tabular-nums; }
table.runs tr:hover td { background: #fafbfc; }
table.diagnosis { border-collapse: collapse; width: 100%; font-size: 13.5px; }
table.diagnosis th, table.diagnosis td { padding: 6px 10px; border-bottom: 1px solid var(--line); text-align: left;
                                         vertical-align: top; }
table.diagnosis th { background: var(--panel); font-weight: 600; } table.diagnosis td.number { text-align: right; }
.pill { display: inline-block; padding: 1px 9px; border-radius: 999px; font-size: 12px; font-weight: 600; border: 1px solid; }
.pill.exact, .pill.equivalent { color: var(--pass); border-color: #aceebb; background: #dafbe1; }
.pill.numerical { color: #6c4400; border-color: #eed888; background: #fff8c5; }
.pill.structural, .pill.not-equivalent { color: #82071e; border-color: #ffcecb; background: #ffebe9; }
.pill.crashed { color: #512a97; border-color: #ecd8ff; background: #fbefff; }
.crash { border: 1px solid #ecd8ff; border-radius: 8px; margin: 10px 0; }
.crash summary { cursor: pointer; padding: 8px 14px; font-weight: 600; background: #fbefff; border-radius: 8px; }
.crash pre { margin: 0; padding: 12px 14px; overflow-x: auto; white-space: pre-wrap; }
article.divergence { border: 1px solid var(--line); border-left: 5px solid var(--numerical); border-radius: 8px;
                     padding: 14px 18px; margin: 14px 0; }
article.divergence.structural { border-left-color: var(--structural); }
article.divergence > header { display: flex; flex-wrap: wrap; align-items: baseline; gap: 6px 12px; margin-bottom: 12px; }
.where { color: var(--muted); font-size: 13.5px; }
.split { display: grid; grid-template-columns: max-content minmax(0, 1fr) minmax(0, 1fr); margin: 8px 0 12px;
         border: 1px solid var(--line); border-radius: 6px; overflow: hidden; }
.split > div { padding: 6px 10px; white-space: pre-wrap; overflow-wrap: anywhere; }
.split .side { font-size: 12px; font-weight: 600; color: var(--muted); background: var(--panel); }
.split .common { text-align: right; color: var(--muted); border-right: 2px dashed #8c959f; background: #fcfcfd; }
.split .row-reference { border-bottom: 1px solid var(--line); }
.split .next.reference { background: #eefbf1; } .split .next.engine { background: #fff1f0; }
.split .head { font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted);
               background: var(--panel); border-bottom: 1px solid var(--line); padding: 4px 10px; }
.split .head.common-head { text-align: right; }
.token { display: inline-block; padding: 0 4px; margin: 1px 2px; border-radius: 4px; background: #eaeef2; }
.token.first { background: #24292f; color: #fff; }
.chips .chip { display: inline-block; min-width: 22px; text-align: center; padding: 0 6px; margin: 1px 2px;
               border-radius: 4px; background: #eaeef2; font-size: 12.5px; }
.chips .chip.here { background: #24292f; color: #fff; }
"""


def _cell(value: object, css_class: str = "") -> str:
    attribute = f' class="{css_class}"' if css_class else ""
    return f"<td{attribute}>{escape(str(value))}</td>"


def _visible(text: str) -> str:
    return escape(visible_text(text))


def _pairs(rows: list[tuple[str, str]]) -> str:
    return '<dl class="pairs">' + "".join(f"<dt>{escape(k)}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"


def _cards(audit: Audit) -> str:
    runs = audit.runs
    finished = [run for run in runs if not run.error]
    exact = sum(int(run.exact_matches or 0) for run in finished)
    prompts = sum(int(run.num_prompts or 0) for run in finished)
    structural = sum(divergence_counts(run)["structural"] for run in finished)
    numerical = sum(divergence_counts(run)["numerical"] for run in finished)
    crashed = len(runs) - len(finished)
    cards = [("", str(len(runs)), "runs"), ("", f"{exact}/{prompts}", "prompts exact"),
             ("structural" if structural else "", str(structural), "structural divergences"),
             ("numerical" if numerical else "", str(numerical), "numerical flips"),
             ("crashed" if crashed else "", str(crashed), "crashed runs")]
    return '<section class="cards">' + "".join(
        f'<div class="card {css}"><div class="number">{escape(number)}</div><div class="what">{escape(what)}</div></div>'
        for css, number, what in cards) + "</section>"


def _runs_table(runs: tuple[Run, ...]) -> str:
    header = ["engine", "pair", "batch", "dtype", "exact", "max logit error", "acceptance", "expected", "drafted/accepted",
              "structural", "numerical", "steps", "seconds", "status"]
    rows = []
    for index, run in enumerate(runs):
        counts, status, trace = divergence_counts(run), run_status(run), run.trace or {}  # trace: a summary bag
        exact = "—" if run.error else f"{run.exact_matches}/{run.num_prompts}"
        kinds = ", ".join(f"{kind} {n}" for kind, n in (trace.get("step_kinds") or {}).items())
        steps = f'<td class="number" title="{escape(kinds)}">{escape(format_number(trace.get("steps")))}</td>'
        target = f"crash-{index}" if status == "crashed" else ""
        label = escape(STATUS_LABELS[status])
        pill = f'<a href="#{target}" class="pill {status}">{label}</a>' if target else f'<span class="pill {status}">{label}</span>'
        rows.append("<tr>" + _cell(run.engine) + _cell(run.pair)
                    + _cell(run.batch_size, "number") + _cell(run.dtype)
                    + _cell(exact, "number") + _cell(logit_error_text(run), "number")
                    + _cell(format_share(acceptance_rate(run)), "number")
                    + _cell(format_share(expected_acceptance_rate(run)), "number")
                    + _cell(speculation.cell(run.speculation), "number") + _cell(counts["structural"], "number")
                    + _cell(counts["numerical"], "number") + steps + _cell(format_number(run.seconds), "number")
                    + f"<td>{pill}</td></tr>")
    head = "".join(f"<th>{escape(name)}</th>" for name in header)
    return f'<div class="table-wrap"><table class="runs"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def _crashes(runs: tuple[Run, ...]) -> str:
    parts = [f'<details class="crash" id="crash-{index}" open><summary>{escape(run_title(run))}</summary>'
             f"<pre>{escape(str(run.error).rstrip())}</pre></details>"
             for index, run in enumerate(runs) if run.error]
    return ("<h2>Crashed runs</h2>" + "".join(parts)) if parts else ""


def _failures(audit: Audit) -> str:
    parts = [f'<details class="crash" open><summary>{escape(f.run)}: prompt {escape(str(f.prompt_index))}: '
             f"{escape(f.reason)}{escape(' (' + f.case + ')') if f.case else ''}</summary>"
             f"<pre>{escape(f.traceback_tail)}</pre></details>" for f in failure_lines(audit)]
    return ("<h2>Prompts that made the engine fail</h2>" + "".join(parts)) if parts else ""


def _token_spans(ids: list[int], mark_first: bool) -> str:
    return "".join(f'<span class="token{" first" if mark_first and i == 0 else ""}">{escape(str(token))}</span>'
                   for i, token in enumerate(ids))


def _split_grid(common: str, reference: str, engine: str, css_class: str) -> str:
    return (f'<div class="split {css_class}"><div class="head"></div><div class="head common-head">before the split</div>'
            '<div class="head">after the split</div>'
            f'<div class="side row-reference">reference</div><div class="common row-reference">{common}</div>'
            f'<div class="next reference row-reference">{reference}</div>'
            f'<div class="side">engine</div><div class="common">{common}</div><div class="next engine">{engine}</div></div>')


def _chips(values: list[int], here: int | None = None) -> str:
    return '<span class="chips">' + "".join(
        f'<span class="chip{" here" if i == here else ""}">{escape(str(v))}</span>' for i, v in enumerate(values)) + "</span>"


def _batch_html(batch: StepBatch | None, prompt_index: int | None) -> str:
    if not batch:
        return "not traced"
    rows, pads = batch.rows, batch.pad_lengths
    labels = [f"prompt {row}" + (f" · pad {pads[i]}" if i < len(pads) else "") for i, row in enumerate(rows)]
    here = rows.index(prompt_index) if prompt_index in rows else None
    chips = '<span class="chips">' + "".join(
        f'<span class="chip{" here" if i == here else ""}">{escape(label)}</span>' for i, label in enumerate(labels)) + "</span>"
    return f"{escape(str(batch.kind))} step, {rows_count(len(rows))}: {chips}"


def _divergence_article(number: int, entry: DivergenceEntry) -> str:
    divergence, evidence = entry.divergence, entry.divergence.evidence  # evidence: an open-ended bag
    common, reference, engine = split_ids(divergence)
    grids = []
    text = divergence.text
    if text:
        grids.append(_split_grid("…" + _visible(str(text.common)), _visible(str(text.reference)),
                                 _visible(str(text.engine)), "text"))
    grids.append(_split_grid("…" + _token_spans(common, False), _token_spans(reference, True),
                             _token_spans(engine, True), "mono ids"))
    history = given(divergence.accepted_history)
    rows = [("tokens", f"reference <code>{escape(str(divergence.reference_token))}</code>, engine "
                       f"<code>{escape(str(divergence.engine_token))}</code> "
                       f"(detected by {escape(str(divergence.detected_by))})"),
            ("target top-2 margin", escape(margin_description(divergence))),
            ("float64 replay", escape(replay_description(evidence)))]
    found = divergence.diagnosis
    if found:
        rows.insert(0, ("diagnosis", f"<strong>{escape(str(found.cls))}{' (needs the weights)' if found.needs_weights else ''}</strong>: "
                                     f"{escape(str(found.evidence))}"))
        if found.tried:
            rows.insert(1, ("tried", escape("; ".join(str(t) for t in found.tried))))
    case = adversarial_case(entry.run, divergence.prompt_index)
    if case is not None:
        rows.insert(0, ("adversarial prompt", f"<code>{escape(str(case.get('case')))}</code> "
                                              f"({escape(str(case.get('length')))} tokens): {escape(str(case.get('why')))}"))
    if evidence.get("reason"):
        rows.append((ruling_text(entry.kind, divergence), escape(str(evidence["reason"]))))
    if (entry.run.noise_band or {}).get("how"):  # a black-box engine (recording, server)
        rows.append(("noise band", escape(str(entry.run.noise_band["how"]))))
    if given(divergence.logit_error) is not None:
        rows.append(("logit error", escape(format_number(divergence.logit_error))))
    rows.append(("accepted per step", _chips(history, len(history) - 1) if history else "not traced"))
    rows.append(("batch at that step", _batch_html(given(divergence.batch), divergence.prompt_index)))
    where = (f"prompt {divergence.prompt_index} · position {divergence.position} · "
             f"step {format_number(given(divergence.step))}")
    return (f'<article class="divergence {entry.kind}" id="divergence-{number}"><header>'
            f'<span class="pill {entry.kind}">{entry.kind}</span><h3>{number}. {escape(run_title(entry.run))}</h3>'
            f'<span class="where">{escape(where)}</span></header>{"".join(grids)}{_pairs(rows)}</article>')


def _divergences(audit: Audit, limit: int) -> str:
    entries = ordered_divergences(audit)
    if not entries:
        return ""
    parts = ["<h2>Divergences</h2>",
             '<p class="note">Numerical: the target\'s top-2 margin at the split is within the dtype\'s noise and a '
             "float64 replay confirms the near-tie. Structural: anything else, a bug in the batching. "
             "Each row shows the same common prefix, then where the reference and the engine go next.</p>"]
    parts += [_divergence_article(number, entry) for number, entry in enumerate(entries[:limit], start=1)]
    if len(entries) > limit:
        parts.append(f'<p class="note">{len(entries) - limit} more divergences left out; audit.json lists all of them.</p>')
    return "".join(parts)


def _diagnosis_section(audit: Audit) -> str:
    lines = class_lines(audit)
    note = adversarial_note(audit)
    parts = []
    if lines:
        head = "".join(f"<th>{name}</th>" for name in ("class", "count", "share", "named by", "first example",
                                                        "evidence", "fix"))
        rows = "".join(f'<tr><td><strong>{escape(line.cls)}</strong></td><td class="number">{line.count}</td>'
                       f'<td class="number">{line.share:.0%}</td><td>{escape(line.named_by)}</td>'
                       f"<td>{escape(line.example)}</td><td>{escape(line.evidence)}</td><td>{escape(line.fix)}</td></tr>"
                       for line in lines)
        parts.append('<h2>Diagnosis</h2><p class="note">One line per class of structural divergence: how many, the '
                     "first example and what showed it, and the fix.</p>"
                     f'<div class="table-wrap"><table class="diagnosis"><thead><tr>{head}</tr></thead>'
                     f"<tbody>{rows}</tbody></table></div>")
    if note:
        parts.append(f'<p class="note">Adversarial prompts: {escape(note)}</p>')
    return f'<section class="diagnosis">{"".join(parts)}</section>' if parts else ""


def _speculation_section(audit: Audit) -> str:
    lines = speculation_lines(audit)
    if not lines:
        return ""
    rows = "".join(f"<tr>{_cell(title)}{_cell(text)}{_cell(source)}</tr>" for title, text, source in lines)
    return ("<h2>Speculation</h2><p>What each engine's own counters show it drafted during the run (a server's "
            "metrics read before and after the run; a built-in engine's trace).</p>"
            '<div class="table-wrap"><table class="runs"><thead><tr><th>run</th><th>verdict</th><th>source</th>'
            f"</tr></thead><tbody>{rows}</tbody></table></div>")


def _three_way_section(audit: Audit) -> str:
    parts = []
    for run, sentence, rows in three_way_runs(audit):
        parts.append(f"<h3>{escape(run_title(run))}</h3><p>{escape(sentence)}</p>")
        if rows:
            head = "".join(f"<th>{escape(name)}</th>" for name in THREE_WAY_HEADER)
            body = "".join("<tr>" + "".join(_cell(value) for value in row) + "</tr>" for row in rows)
            parts.append(f'<div class="table-wrap"><table class="runs"><thead><tr>{head}</tr></thead>'
                         f"<tbody>{body}</tbody></table></div>")
    if not parts:
        return ""
    return ("<h2>Three-way rulings</h2><p>Each divergence of the speculative run beside the plain run of the same "
            "engine (no speculation): one the plain run makes identically (same position, same token) is the "
            "engine's precision, ruled numerical.</p>" + "".join(parts))


def _timing_section(audit: Audit) -> str:
    rows = timing_rows(audit)
    if not rows:
        return ""
    head = "".join(f"<th>{escape(name)}</th>" for name in TIMING_HEADER)
    body = "".join("<tr>" + "".join(_cell(value) for value in row) + "</tr>" for row in rows)
    return ("<h2>Where the time went</h2><p>Seconds per run: the engine, the reference (once per pair and dtype), the "
            "rulings' controls, the plain control (once per batch composition), the diagnosis's replays, "
            "re-runs and hooked re-runs (observation), and its total.</p>"
            f'<div class="table-wrap"><table class="runs"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            "</table></div>")


def _figure(svg: str) -> str:
    # the chart's own title is its caption; small multiples (charts.py `panels`) take the whole row
    wide = ' class="wide"' if 'class="chart chart-panels"' in svg.split(">", 1)[0] else ""
    return f"<figure{wide}>{svg}</figure>"


def render_html(audit: Audit | Mapping[str, Any], divergence_limit: int = HTML_DIVERGENCE_LIMIT,
                charts: dict[str, str] | None = None) -> str:
    """The page; `charts` are the SVGs of `audit_charts` (and `sampled_charts`) by stem when the caller has
    drawn them already. Sampled runs have a section of their own; every other section reads the greedy runs."""
    audit = as_audit(audit)
    status, sentence = verdict(audit)
    greedy, sampled_stems = greedy_view(audit), sampled_charts(audit)
    if charts is None:
        drawn = {**(audit_charts(greedy) if greedy.runs or not sampled_runs(audit) else {}), **sampled_stems}
        charts = {stem: render_svg(chart) for stem, chart in drawn.items()}
    sampled_section = sampled_html(audit, [svg for stem, svg in charts.items() if stem in sampled_stems])
    charts = {stem: svg for stem, svg in charts.items() if stem not in sampled_stems}
    whole, audit = audit, greedy  # the acceptance section reads sampled runs too
    runs = audit.runs
    stamp = " · ".join(part for part in (
        f"specaudit {audit.specaudit_version}" if audit.specaudit_version else "",
        f"created {audit.created}" if audit.created else "") if part)
    machine = [(name, escape(value)) for name, value in machine_summary(audit)]
    config = [(name, escape(value)) for name, value in config_summary(audit)]
    figures = "".join(_figure(svg) for svg in charts.values())
    body = [
        f'<header><h1>specaudit report</h1><p class="stamp">{escape(stamp)}</p></header>',
        f'<section class="verdict verdict-{status}">{escape(sentence)}</section>',
        _diagnosis_section(audit),
        _cards(audit),
        '<section class="meta">'
        + (f"<div><h2>Machine</h2>{_pairs(machine)}</div>" if machine else "")
        + (f"<div><h2>Configuration</h2>{_pairs(config)}</div>" if config else "") + "</section>",
        f'<section><h2>Plots</h2><div class="charts">{figures}</div></section>' if figures else "",
        served_html(audit),
        f"<section><h2>Runs</h2>{_runs_table(runs)}</section>" if runs else "",
        sampled_section,
        f"<section>{_speculation_section(audit)}</section>",
        f"<section>{acceptance_report.html_section(whole)}</section>",
        f"<section>{_three_way_section(audit)}</section>",
        f"<section>{_timing_section(audit)}</section>",
        f"<section>{_crashes(runs)}{_failures(audit)}</section>",
        f"<section>{_divergences(audit, divergence_limit)}</section>",
    ]
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>specaudit report: {escape(sentence.split(':')[0])}</title><style>{STYLE}</style></head>"
            f"<body><main>{''.join(body)}</main></body></html>\n")
