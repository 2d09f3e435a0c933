"""The served reference's section of both reports (`specaudit audit --reference ENGINE`): how the reference was
asked, its determinism (the two runs' agreement), and each run's noise band with what it is made of."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from specaudit.equivalence.records import ABSENT, Audit, Run

# The reference's record (`Audit.reference`: how it was asked, its runs, its determinism) and a run's noise band
# are open-ended mappings, read by their keys.


def _number(value: Any) -> str:
    return "?" if value is None else format(value, ".3g")


def determinism_line(reference: Mapping[str, Any]) -> str:
    """The reference's own agreement with itself, in one sentence."""
    det = reference.get("determinism") or {}
    flips = det.get("flips") or []
    return (f"Determinism: the two runs agree on {det.get('identical')} of {det.get('prompts')} prompts; largest "
            f"log-probability difference on their common prefixes {_number(det.get('largest_logprob_difference'))}"
            + ("; flips: " + ", ".join(f"prompt {f['prompt_index']} at {f['position']} (margin {_number(f.get('margin'))})"
                                      for f in flips) if flips else "") + ".")


def band_line(run: Run) -> str:
    band = run.noise_band or {}
    parts = ", ".join(f"{name} {value:.3g}" for name, value in (band.get("parts") or {}).items() if value is not None)
    return (f"band {_number(band.get('width'))} ({parts or 'nothing measured'})"
            + "".join(f"; {note}" for note in band.get("notes") or []))


def _served_runs(audit: Audit) -> list[Run]:
    return [run for run in audit.runs if run.dtype == "served" and run.noise_band is not ABSENT]


def served_markdown(audit: Audit) -> list[str]:
    """`report.md`'s section; nothing for an audit without a served reference."""
    reference = audit.reference
    if not reference:
        return []
    lines = ["## The served reference", "", f"`{reference.get('engine')}`, asked {reference.get('asked', '?')}; no "
             "weights in the audit's process.", ""]
    if reference.get("error"):
        return lines + [f"**failed**: {reference['error']}", ""]
    runs = reference.get("runs") or []
    if runs:
        lines += ["| run | in flight | order | seconds | s per request |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {r['in_flight']} | {r['order']} | {r['seconds']:.2f} | {r['seconds_per_request']:.3f} |"
                  for n, r in enumerate(runs, 1)] + [""]
    if reference.get("determinism"):
        lines += [determinism_line(reference), ""]
    for run in _served_runs(audit):
        lines.append(f"- {run.engine}, {run.batch_size} in flight: {band_line(run)}")
    return lines + [""]


def served_html(audit: Audit) -> str:
    """`report.html`'s section; "" for an audit without a served reference."""
    reference = audit.reference
    if not reference:
        return ""
    parts = [f"<h2>The served reference</h2><p><code>{escape(str(reference.get('engine')))}</code>, asked "
             f"{escape(str(reference.get('asked', '?')))}; no weights in the audit's process.</p>"]
    if reference.get("error"):
        parts.append(f"<p class=\"failed\"><strong>failed</strong>: {escape(reference['error'])}</p>")
        return "<section>" + "".join(parts) + "</section>"
    runs = reference.get("runs") or []
    if runs:
        rows = "".join(f"<tr><td>{n}</td><td>{r['in_flight']}</td><td>{escape(r['order'])}</td>"
                       f"<td>{r['seconds']:.2f}</td><td>{r['seconds_per_request']:.3f}</td></tr>"
                       for n, r in enumerate(runs, 1))
        parts.append("<table><thead><tr><th>run</th><th>in flight</th><th>order</th><th>seconds</th>"
                     f"<th>s per request</th></tr></thead><tbody>{rows}</tbody></table>")
    if reference.get("determinism"):
        parts.append(f"<p>{escape(determinism_line(reference))}</p>")
    bands = "".join(f"<li>{escape(str(run.engine))}, {run.batch_size} in flight: {escape(band_line(run))}</li>"
                    for run in _served_runs(audit))
    if bands:
        parts.append(f"<ul>{bands}</ul>")
    return "<section>" + "".join(parts) + "</section>"
