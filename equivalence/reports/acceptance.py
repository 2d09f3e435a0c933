"""The reports' acceptance section: per run, observed against expected acceptance per draft position.

Read from each run's `acceptance` record (equivalence/acceptance/findings.py): the definition once, then
per run a headline (overall observed, expected, their ratio and interval, the findings) and a table with
one row per draft position, and the payoff (`--payoff`) where it was measured. The markdown and HTML reports
render the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from specaudit.equivalence.acceptance.findings import DEFINITION, headline
from specaudit.equivalence.acceptance.payoff import headline as payoff_headline
from specaudit.equivalence.records import Audit
from specaudit.equivalence.records.serialize import as_audit
from specaudit.equivalence.reports.summary import run_title

EXPECTED = ("what the proposer reaches along the run's outputs (a replay; sampled: the sum of min(p, q) over the "
            "verify steps that reached the position, with its variance), or an earlier audit's counts (a baseline). "
            "The outputs' verdict does not depend on it")
POSITION_HEADER = ["position", "observed", "expected", "ratio", "interval", "p short (Holm)"]


def _share(accepted: float, proposals: int) -> str:
    """A count (or, sampled, a sum of acceptance probabilities, to one decimal) over the proposals."""
    count = str(int(accepted)) if float(accepted).is_integer() else f"{accepted:.1f}"
    return f"{count}/{proposals} ({accepted / proposals:.1%})" if proposals else "—"


def _number(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def acceptance_runs(audit: Audit | Mapping[str, Any]) -> list[tuple[str, str, list[list[str]], list[str]]]:
    """For every finished run with an acceptance record: (title, headline, position rows, findings' texts).
    The record is an open-ended bag (findings.py `Comparison.to_json`), read by its keys."""
    found = []
    for run in as_audit(audit).runs:
        record = run.acceptance
        if run.error or not record:
            continue
        rows = [[str(p["position"]), _share(p["observed_accepted"], p["observed_proposals"]),
                 _share(p["expected_accepted"], p["expected_proposals"]), _number(p.get("ratio")),
                 f"[{_number(p.get('ratio_low'))}, {_number(p.get('ratio_high'))}]",
                 _number(p.get("p_short_holm"), 4)] for p in record.get("positions") or []]
        texts = [finding["text"] for finding in record.get("findings") or []]
        expected = record.get("expected") or {}
        if record.get("implied"):
            texts.append(f"proposer: {record['implied']}")
        if expected.get("note"):
            texts.append(f"expectation: {expected['note']}")
        if record.get("payoff"):
            texts.append(payoff_headline(record["payoff"]))
        found.append((run_title(run), headline(record), rows, texts))
    return found


def markdown_lines(audit: Audit | Mapping[str, Any]) -> list[str]:
    runs = acceptance_runs(audit)
    if not runs:
        return []
    lines = ["## Acceptance per draft position", "", f"Definition: {DEFINITION}. Expected: {EXPECTED}.", ""]
    for title, text, rows, texts in runs:
        lines += [f"**{title}**: {text}", ""]
        if rows:
            lines += ["| " + " | ".join(POSITION_HEADER) + " |", "|" + "|".join("---" for _ in POSITION_HEADER) + "|"]
            lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
        lines += [f"- {t}" for t in texts] + ([""] if texts else [])
    return lines


def html_section(audit: Audit | Mapping[str, Any]) -> str:
    runs = acceptance_runs(audit)
    if not runs:
        return ""
    parts = [f"<h2>Acceptance per draft position</h2><p>Definition: {escape(DEFINITION)}. Expected: "
             f"{escape(EXPECTED)}.</p>"]
    head = "".join(f"<th>{escape(name)}</th>" for name in POSITION_HEADER)
    for title, text, rows, texts in runs:
        parts.append(f"<h3>{escape(title)}</h3><p>{escape(text)}</p>")
        if rows:
            body = "".join("<tr>" + "".join(f'<td class="number">{escape(v)}</td>' for v in row) + "</tr>"
                           for row in rows)
            parts.append(f'<div class="table-wrap"><table class="runs"><thead><tr>{head}</tr></thead>'
                         f"<tbody>{body}</tbody></table></div>")
        if texts:
            parts.append("<ul>" + "".join(f"<li>{escape(t)}</li>" for t in texts) + "</ul>")
    return "".join(parts)
