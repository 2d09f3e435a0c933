"""What the human reports say about an audit: run status, verdict, ordering and wording of evidence.

Shared by the Markdown and HTML reports, so both tell the same story. Every function reads the typed records
(equivalence/records/); a public entry point also takes the JSON object of `audit.json` and reads it once
(`serialize.as_audit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specaudit.equivalence import speculation
from specaudit.equivalence.records import ABSENT, Audit, Divergence, Run, StepBatch, given, thaw
from specaudit.equivalence.records.serialize import as_audit, as_run
from specaudit.equivalence.rulings.plain import REFERENCE_MISMATCH

STATUS_LABELS = {
    "crashed": "CRASHED",
    "structural": "STRUCTURAL",
    "not-equivalent": "NOT EQUIVALENT",
    "reference-mismatch": "REFERENCE MISMATCH",
    "numerical": "numerical flips only",
    "exact": "exact",
    "equivalent": "equivalent",
}
FAILING_STATUSES = ("structural", "not-equivalent")


@dataclass(frozen=True)
class DivergenceEntry:
    run: Run
    divergence: Divergence

    @property
    def kind(self) -> str:
        kind = self.divergence.kind
        return kind if kind in ("structural", REFERENCE_MISMATCH) else "numerical"


def format_number(value: float | int | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        return f"{value:.2e}"
    return f"{value:.4g}"


def format_share(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def divergence_counts(run: Run | Mapping[str, Any]) -> dict[str, int]:
    """Divergences by kind: `structural`, `numerical`, and `reference_mismatch` (rulings/plain.py: the
    reference's request processing is not the server's; not the engine's, not judged)."""
    counts = {"structural": 0, "numerical": 0, REFERENCE_MISMATCH: 0}
    for divergence in as_run(run).divergences:
        kind = divergence.kind
        counts[kind if kind in counts else "numerical"] += 1
    return counts


def run_status(run: Run | Mapping[str, Any]) -> str:
    """One of the keys of STATUS_LABELS."""
    run = as_run(run)
    if run.error:
        return "crashed"
    counts = divergence_counts(run)
    if counts["structural"]:
        return "structural"
    if counts[REFERENCE_MISMATCH]:
        return "reference-mismatch"
    if run.equivalent is False:
        return "not-equivalent"
    if counts["numerical"]:
        return "numerical"
    if run.greedy and run.exact_matches == run.num_prompts:  # a sampled run compares no token exactly
        return "exact"
    return "equivalent"


def run_title(run: Run) -> str:
    return f"{run.engine} · {run.pair} · batch {run.batch_size} · {run.dtype}"


def logit_error_text(run: Run) -> str:
    error, tolerance = run.max_logit_error, run.logit_tolerance
    if error is None or run.error:
        return "—"
    if tolerance is not None and error > tolerance:
        return f"{format_number(error)} > {format_number(tolerance)}"
    return format_number(error)


def _overall(run: Run) -> Mapping[str, Any]:
    """The overall observed and expected rates of the run's acceptance record ({} without one)."""
    return (run.acceptance or {}).get("overall") or {}


def acceptance_rate(run: Run) -> float | None:
    """The run's observed acceptance, accepted tokens / drafted tokens (the one definition:
    equivalence/acceptance/findings.py `DEFINITION`), from its acceptance record, else its counters."""
    observed = _overall(run).get("observed_rate")
    if observed is not None:
        return observed
    return (run.speculation or {}).get("acceptance_rate", (run.trace or {}).get("acceptance_rate"))


def expected_acceptance_rate(run: Run) -> float | None:
    """What the proposer reaches along the run's outputs (equivalence/acceptance/expected.py), or None."""
    return _overall(run).get("expected_rate")


def verdict(audit: Audit | Mapping[str, Any]) -> tuple[str, str]:
    """(status, sentence): status is "fail", "incomplete", "numerical", "pass" or "empty". A run whose
    engine drafted nothing adds "speculation not observed" (a failure with `require_speculation`).
    Sampled runs (reports/sampled.py) add their own verdict; an audit of sampled runs alone has theirs.
    `--require-acceptance` adds the runs it fails, short or never compared, and a run whose every prompt's request
    parameters were refused the fact that it judged nothing (equivalence/gates.py)."""
    audit = as_audit(audit)
    status, sentence = _judged_verdict(audit)
    gated = _acceptance_gate_sentence(audit)
    if gated and status != "empty":
        status, sentence = "fail", f"{sentence} {gated}"
    from specaudit.equivalence.gates import JUDGED, gate_failures

    unjudged = [f.message for f in gate_failures(audit) if f.gate == JUDGED]
    if unjudged and status != "empty":  # a run that judged no prompt proves nothing
        said = "; ".join(unjudged)
        status, sentence = "fail", f"{sentence} {said[0].upper()}{said[1:]}."
    return status, sentence


def _acceptance_gate_sentence(audit: Audit) -> str:
    """What `--require-acceptance R` failed: the runs short of R x expected, and each reason it could not be
    applied with its runs; "" when it failed none."""
    from specaudit.equivalence.gates import ACCEPTANCE, gate_failures

    failures = [f for f in gate_failures(audit) if f.gate == ACCEPTANCE]
    if not failures:
        return ""
    ratio = audit.config.get("require_acceptance")
    short = [label for f in failures if f.applied for label in f.runs]
    parts = [f"acceptance short of {ratio:g} x expected in {len(short)} run(s) ({', '.join(short)})"] if short else []
    parts += [f.message for f in failures if not f.applied]
    return "; ".join(parts) + ": --require-acceptance fails the audit."


def _judged_verdict(audit: Audit) -> tuple[str, str]:
    from specaudit.equivalence.reports.sampled import greedy_view, sampled_runs, sampled_verdict

    if not sampled_runs(audit):
        return _greedy_verdict(audit)
    sampled_status, sampled_sentence = sampled_verdict(audit)
    greedy = greedy_view(audit)
    if not greedy.runs:
        return sampled_status, sampled_sentence
    status, sentence = _greedy_verdict(greedy)
    return ("fail" if sampled_status == "fail" else status), f"{sentence} Sampled runs: {sampled_sentence}."


def _greedy_verdict(audit: Audit) -> tuple[str, str]:
    status, sentence = _equivalence_verdict(audit)
    runs = audit.runs
    required = bool(audit.config.get("require_speculation"))
    note = speculation.audit_note(runs, required)
    if not note:
        return status, sentence
    note = " " + note[0].upper() + note[1:]
    if required and status != "empty":
        return "fail", sentence + note + ": --require-speculation fails the audit."
    return status, sentence + note + ": those runs prove nothing about speculation."


def _equivalence_verdict(audit: Audit) -> tuple[str, str]:
    runs = audit.runs
    if not runs:
        return "empty", "NO RUNS: the audit recorded no runs."
    statuses = [run_status(run) for run in runs]
    failing = [run for run, status in zip(runs, statuses) if status in FAILING_STATUSES]
    crashed = statuses.count("crashed")
    crash_note = f" {crashed} run{'s' if crashed != 1 else ''} crashed." if crashed else ""
    if failing:
        engines = ", ".join(dict.fromkeys(str(run.engine) for run in failing))
        structural = sum(divergence_counts(run)["structural"] for run in failing)
        found = (f"{structural} structural divergence{'s' if structural != 1 else ''}" if structural
                 else "no divergence attributed")
        return "fail", (f"NOT EQUIVALENT: {len(failing)} of {len(runs)} runs diverge from greedy decoding "
                        f"({found}; engines: {engines}).{crash_note}")
    mismatched = sum(divergence_counts(run)[REFERENCE_MISMATCH] for run in runs)
    if mismatched:
        return "incomplete", (f"NOT SHOWN EQUIVALENT: {mismatched} divergence(s) made identically by the plain engine "
                              "to tokens the reference's grammar forbids: the server applies another grammar than the "
                              "reference (its grammar engine or options); give the reference "
                              f"the server's settings.{crash_note}")
    if crashed:
        return "incomplete", (f"INCOMPLETE:{crash_note} The other {len(runs) - crashed} "
                              f"run{'s are' if len(runs) - crashed != 1 else ' is'} equivalent.")
    flips = sum(divergence_counts(run)["numerical"] for run in runs)
    if flips:
        return "numerical", (f"EQUIVALENT up to numerical noise: {len(runs)} runs; {flips} token "
                             f"flip{'s' if flips != 1 else ''} at near-ties of the target, each shown below "
                             f"with its margin and float64 replay.")
    return "pass", f"EQUIVALENT: every token of all {len(runs)} runs matches the reference decoder."


def ordered_divergences(audit: Audit) -> list[DivergenceEntry]:
    """Structural divergences first, then numerical ones; each in run order, then prompt and position."""
    entries = [DivergenceEntry(run, divergence)
               for run in audit.runs if not run.error
               for divergence in run.divergences]
    run_order = {id(run): index for index, run in enumerate(audit.runs)}
    return sorted(entries, key=lambda entry: (entry.kind != "structural", run_order[id(entry.run)],
                                              entry.divergence.prompt_index or 0,
                                              entry.divergence.position or 0))


def machine_summary(audit: Audit) -> list[tuple[str, str]]:
    machine = audit.machine
    device = str(machine.get("device") or "?")
    if machine.get("device_name"):
        device += f" ({machine['device_name']})"
    rows = [("Python", machine.get("python")), ("platform", machine.get("platform")),
            ("processor", machine.get("processor")), ("torch", machine.get("torch")),
            ("transformers", machine.get("transformers")), ("device", device),
            ("CUDA", None if machine.get("cuda") is None else ("yes" if machine["cuda"] else "no"))]
    return [(name, str(value)) for name, value in rows if value not in (None, "")]


def config_summary(audit: Audit) -> list[tuple[str, str]]:
    config = audit.config

    def listed(key: str) -> str | None:
        values = config.get(key)  # a pair may be a mapping (target, draft): shown as the JSON object it is
        return ", ".join(str(thaw(value)) for value in values) if values else None

    prompts = config.get("prompts")
    if prompts is not None and config.get("num_prompts") is not None:
        prompts = f"{prompts} ({config['num_prompts']} prompts)"
    rows = [("engines", listed("engines")), ("pairs", listed("pairs")), ("batch sizes", listed("batch_sizes")),
            ("dtypes", listed("dtypes")), ("prompts", prompts), ("max new tokens", config.get("max_new_tokens")),
            ("draft tokens (k)", config.get("draft_tokens")), ("EOS ids", eos_summary(audit))]
    return [(name, str(value)) for name, value in rows if value not in (None, "")]


def eos_summary(audit: Audit) -> str | None:
    """The EOS ids the audit stopped at: "258, 157", or "the pair's own (258, 157)" with the sets the runs
    resolved, or "none (never stop early)"."""
    config = audit.config
    if "eos_token_id" not in config:
        return None
    eos = config["eos_token_id"]
    if eos is None:
        return "none (never stop early)"
    if eos != "pair":
        return ", ".join(str(i) for i in eos) if isinstance(eos, (list, tuple)) else str(eos)
    sets = list(dict.fromkeys(tuple(run.eos_token_ids) for run in audit.runs
                              if isinstance(run.eos_token_ids, tuple)))
    resolved = "; ".join(", ".join(str(i) for i in ids) or "none" for ids in sets)
    return f"the pair's own ({resolved})" if resolved else "the pair's own"


def rows_count(rows: int) -> str:
    return f"{rows} row" if rows == 1 else f"{rows} rows"


def batch_description(batch: StepBatch | None, prompt_index: int | None) -> str:
    if not batch:
        return "not traced"
    rows, pads = batch.rows, batch.pad_lengths
    described = []
    for position, row in enumerate(rows):
        pad = f" pad {pads[position]}" if position < len(pads) else ""
        marker = " ◀" if row == prompt_index else ""
        described.append(f"prompt {row}{pad}{marker}")
    return f"{batch.kind} step, {rows_count(len(rows))}: " + ", ".join(described)


def replay_description(evidence: Mapping[str, Any]) -> str:
    margin = evidence.get("replay_float64_margin")
    top2 = evidence.get("replay_float64_top2")
    if margin is None and not top2:
        return "not replayed"
    text = f"margin {format_number(margin)}"
    if top2:
        text += "; top-2 " + ", ".join(f"{token} ({logit:.7g})" for token, logit in top2)
    return text


def margin_description(divergence: Divergence) -> str:
    margin = given(divergence.margin)
    noise = divergence.evidence.get("dtype_noise")
    text = format_number(margin)
    if margin is not None and noise is not None:
        relation = "within" if margin <= noise else "above"
        text += f" ({relation} the dtype noise {format_number(noise)})"
    return text


def visible_text(text: str) -> str:
    """`text` on one line with newlines, tabs and other control characters shown as visible symbols."""
    shown = []
    for character in text.replace("\r\n", "\n"):
        code = ord(character)
        if character == "\n":
            shown.append("⏎")
        elif character == "\t":
            shown.append("⇥")
        elif code < 32 or code == 127 or 0x80 <= code < 0xA0:
            shown.append(f"\\x{code:02x}")
        else:
            shown.append(character)
    return "".join(shown)


def split_ids(divergence: Divergence) -> tuple[list[int], list[int], list[int]]:
    context = divergence.context
    if not context:
        return [], [], []
    return list(context.common), list(context.reference), list(context.engine)


TERMINAL_NAME_WIDTH = 40  # engine and pair names longer than this are elided in the middle


def elide_middle(text: str, width: int) -> str:
    """`text` cut to `width` characters by replacing its middle with one ellipsis (both ends stay readable)."""
    if len(text) <= width:
        return text
    kept = width - 1  # one character for the ellipsis
    head, tail = (kept + 1) // 2, kept // 2
    return text[:head] + "…" + (text[len(text) - tail:] if tail else "")


def text_table(header: list[str], rows: list[list[str]], right_aligned: set[int] = frozenset()) -> str:
    """Columns sized to their widest cell, two spaces apart; `right_aligned` holds column indexes."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.rjust(w) if i in right_aligned else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join(line(cells) for cells in [header, *rows])


def summary_table(audit: Audit | Mapping[str, Any]) -> str:
    """The terminal table: one line per run, every column apart however long its names; then, per run whose
    speculation counters say more than the table's drafted/accepted column (nothing drafted, not measured,
    preemptions), one line naming the run and what they showed."""
    from specaudit.equivalence.reports.sampled import greedy_view, summary_lines
    from specaudit.equivalence.reports.served import determinism_line

    audit = as_audit(audit)
    reference = audit.reference or {}
    served = ([f"reference {reference.get('engine')} ({reference.get('asked', '?')}): "
               + determinism_line(reference)[0].lower() + determinism_line(reference)[1:]]
              if reference.get("determinism") else [])
    sampled = served + summary_lines(audit)
    audit = greedy_view(audit)
    if sampled and not audit.runs:
        return "\n".join(sampled)
    rows = []
    for run in audit.runs:
        err = run.max_logit_error
        status = "ERROR" if run.error else ("ok" if run.equivalent else "DIVERGES")
        if run.reference_mismatches and not run.error and run.equivalent:
            status = f"NOT JUDGED: {run.reference_mismatches} reference mismatch(es)"
        if not run.error and speculation.observed(run.speculation) is False:
            status += " (speculation not observed)"
        if run.failures:
            status += f", {len(run.failures)} prompt(s) FAILED"
        rows.append([elide_middle(str(run.engine), TERMINAL_NAME_WIDTH),
                     elide_middle(str(run.pair), TERMINAL_NAME_WIDTH), str(run.batch_size), str(run.dtype),
                     f"{run.exact_matches}/{run.num_prompts}", "%.2e" % err if err is not None else "-",
                     str(run.structural_divergences), str(run.numerical_divergences),
                     speculation.cell(run.speculation), status])
    header = ["engine", "pair", "B", "dtype", "exact", "max logit err", "struct", "numer", "drafted/accepted", "status"]
    lines = [text_table(header, rows, right_aligned={2, 4, 5, 6, 7, 8})]
    for run in audit.runs:
        if not run.error and run.speculation is not ABSENT and speculation.adds_to_cell(run.speculation):
            lines.append(f"{_run_name(run)}: {speculation.verdict(run)}")
    for run, sentence, _ in three_way_runs(audit):
        lines.append(f"{_run_name(run)}: {sentence}")
    return "\n".join(served + lines + sampled[len(served):])


def _run_name(run: Run) -> str:
    """A run on one terminal line: engine, pair, batch size and dtype."""
    return f"{run.engine} {run.pair} B={run.batch_size} {run.dtype}"


def speculation_lines(audit: Audit) -> list[tuple[str, str, str]]:
    """(run title, verdict, source) for every finished run that carries speculation evidence."""
    return [(run_title(run), speculation.verdict(run), (run.speculation or {}).get("source") or "—")
            for run in audit.runs if not run.error and run.speculation is not ABSENT]


THREE_WAY_HEADER = ["prompt", "position", "reference", "speculative", "plain", "plain diverges first at", "kind",
                    "ruled by"]


def three_way_runs(audit: Audit) -> list[tuple[Run, str, list[list[str]]]]:
    """For every finished run audited beside a plain engine: (run, a sentence, the table rows of its
    divergences: the reference's, the speculative run's and the plain run's token at the split)."""
    result = []
    for run in audit.runs:
        plain = run.plain_engine  # an open-ended bag: the plain run's summary (rulings/plain.py)
        if run.error or not plain:
            continue
        if plain.get("error"):
            sentence = plain["error"]
        else:
            sentence = (f"plain engine {plain['engine']}: {plain.get('exact_matches')}/{plain.get('num_prompts')} "
                        f"prompts exact against the reference; the speculative run diverges on "
                        f"{plain.get('speculative_divergences')} prompt(s), {plain.get('same_as_plain')} of them "
                        f"exactly as the plain run does; {plain.get('ruled_numerical_by_plain')} divergence(s) "
                        "ruled numerical by the plain run")
            if plain.get("reference_mismatches"):
                sentence += (f"; {plain['reference_mismatches']} divergence(s) made by the plain run too, to tokens "
                             "the reference's grammar forbids: reference mismatches (the server's grammar is not the "
                             "reference's)")
            if plain.get("speculation") is not None:
                sentence += f"; plain run's counters: {speculation.phrase(plain['speculation'])}"
        rows = [[str(d.prompt_index), str(d.position), format_token(d.reference_token),
                 format_token(d.engine_token), format_token(d.plain_token) if d.plain_token is not ABSENT else "—",
                 format_number(d.plain_first_divergence) if given(d.plain_first_divergence) is not None
                 else ("equal to the reference" if d.plain_token is not ABSENT else "—"),
                 str(d.kind), str(given(d.decided_by) or "—")]
                for d in run.divergences if d.detected_by == "tokens"]
        result.append((run, sentence, rows))
    return result


def format_token(token: Any) -> str:
    return "end" if token is None else str(token)


TIMING_HEADER = ["run", "engine s", "reference s (shared)", "controls s", "plain control s (shared)", "replays s",
                 "re-runs s", "observation s", "diagnosis"]


def timing_rows(audit: Audit) -> list[list[str]]:
    """Where each finished run's time went: the engine's run, the reference (computed once per pair and dtype),
    the rulings' float64 and same-dtype replays, the plain control's run (once per batch composition), and
    the diagnosis's replays, re-runs and hooked re-runs (observation; its total, mode in brackets)."""
    rows = []
    for run in audit.runs:
        timing = run.timing  # an open-ended bag: seconds per stage, and diagnosis_mode
        if run.error or not timing:
            continue

        def seconds(key: str) -> str:
            value = timing.get(key)
            return "—" if value is None else f"{value:.1f}"

        rows.append([run_title(run), seconds("engine"), seconds("reference"), seconds("controls"),
                     seconds("plain_control"), seconds("replays"), seconds("reruns"), seconds("observation"),
                     f"{seconds('diagnosis')} ({timing.get('diagnosis_mode', 'full')})"])
    return rows


def ruling_text(kind: str, divergence: Divergence) -> str:
    """`why structural (decided by float64-replay)`: the ruling's label with what decided it."""
    decided = given(divergence.decided_by) or divergence.evidence.get("decided_by")
    return f"why {kind}" + (f" (decided by {decided})" if decided else "")


def verdict_line(audit: Audit | Mapping[str, Any]) -> str:
    """The terminal's last line, for every composition: whether every audited engine passed, and what the
    engines' speculation counters add."""
    from specaudit.equivalence.run_record import all_passed

    audit = as_audit(audit)
    runs = audit.runs
    failed = [run for run in runs if run.error]
    required = bool(audit.config.get("require_speculation"))
    unseen = speculation.audit_note(runs, required)
    gated = ""
    ratio = audit.config.get("require_acceptance")
    if ratio is not None:
        from specaudit.equivalence.acceptance.findings import unmet
        from specaudit.equivalence.gates import ACCEPTANCE, gate_failures

        short = sum(1 for run in runs if unmet(run))
        if short:
            gated = f"; acceptance short of {ratio} x expected in {short} run(s) (--require-acceptance: exit 1)"
        not_applied = sum(len(f.runs) for f in gate_failures(audit) if f.gate == ACCEPTANCE and not f.applied)
        if not_applied:
            gated += f"; --require-acceptance {ratio:g} not applied to {not_applied} run(s) (exit 1)"
    from specaudit.equivalence.gates import JUDGED, gate_failures

    unjudged = sum(len(f.runs) for f in gate_failures(audit) if f.gate == JUDGED)
    if unjudged and all_passed(audit):  # every prompt's request parameters refused: those runs judged nothing
        return (f"verdict: NOT shown equivalent: nothing judged in {unjudged} run(s), every prompt's request "
                "parameters refused by the engine" + (f"; {unseen}" if unseen else "") + gated)
    if unjudged:
        gated += f"; nothing judged in {unjudged} run(s): every prompt's request parameters refused"
    mismatched = sum(int(given(run.reference_mismatches) or 0) for run in runs)
    if mismatched and all_passed(audit):
        return (f"verdict: NOT shown equivalent: {mismatched} divergence(s) are the reference's, not the engine's "
                "(the plain engine makes them too: the server's grammar is not the reference's)"
                + (f"; {unseen}" if unseen else "") + gated)
    return ("verdict: " + ("every audited engine is equivalent" if runs and all_passed(audit)
                           else "NOT equivalent: see the divergences in the report" if not failed
                           else f"NOT shown equivalent: {len(failed)} run(s) failed (their errors are in audit.json "
                                "and the report)")
            + (f"; {unseen}" + (" (--require-speculation: exit 1)" if required else "") if unseen else "") + gated)
