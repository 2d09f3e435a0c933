"""Rulings without weights: the reference is a served engine (`--reference ENGINE`), not the target in process.

The audit's process holds no model. The reference is a plain server of the same model (speculation off)
asked one prompt at a time; what it reports beside its greedy tokens (the log-probabilities of its top N
tokens at each position, and, teacher-forced, of any token at a given prefix) is all the evidence there
is. For the first divergent position p of a prompt, the reference's token r and the audited engine's e:

1. `output-match`: the engine's whole output is the reference's output for another prompt (and not its
   own), with at least two of its tokens at or past where it leaves its own (`outputs.other_references_matched`):
   structural, `output_order`.
   `min-tokens` (both sent `min_tokens`): a stop id the reference takes at or past it where the engine goes
   on, or the engine takes inside it: structural, `logits_processor`.
   `stop-string` (both sent stop strings): the reference ends on one and the engine goes on: `stop_string`.
2. `length`: one output ends where the other goes on, without a token to compare: structural,
   `stop_eos` where an EOS is involved, else `stop_length`.
3. `reference-rerun`: the reference itself, asked again at another batch mix, diverges first at p with
   e: the deployment's own nondeterminism makes this divergence, numerical.
4. `reference-margin`: the reference's margin there, log p(r) - log p(e) at the common prefix (from its
   top log-probabilities at p, or teacher-forced: the prefix followed by e sent as a prompt, its
   `prompt_logprobs`), lies within the band measured for this deployment: numerical. Beyond it:
   structural. A margin known only as a bound (e outside the top N, no teacher forcing) is structural
   when the bound is beyond the band, and structural with `margin_bound` set otherwise.

The band (`measure_band`) is the largest of: the reference's own re-run disagreement (twice the
largest difference of a token's log-probability between the two runs on their common prefix, and the
reference's margin at every position where the two runs flip), the audited engine's reported
log-probabilities against the reference's at the same prefix (twice the largest difference, over the
alternatives both report beside the engine's chosen token, on the positions where their tokens agree: the
chosen token's own report is what the `logprob_report` check judges against the band), and a declared floor (`--logit-tolerance`, or `--engine-dtype`'s noise at log-probability 0).

A structural token divergence gets a class only where outputs alone support one: `stop_eos` (an EOS on
one side), `output_order`, `stop_length`; the report checks add `logprob_report`, `finish_reason` and
`usage_report`. Every other structural divergence (position ids, masks, caches, the acceptance rule,
rows crossing) is `unknown` with `needs_weights` true: telling those apart needs the target's logits.

Every ruling is a `records.Divergence` (`served_divergence`, through rulings/record.py `make_divergence`),
with the one context window of every divergence (rulings/record.py `window`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from specaudit.engines.limits import eos_ids
from specaudit.equivalence.compare import matched_prefix
from specaudit.equivalence.records import ABSENT, Divergence
from specaudit.equivalence.rulings.record import make_divergence, named, window
from specaudit.equivalence.rulings.noise import dtype_noise
from specaudit.equivalence.rulings.outputs import departs_at, first_divergence, other_references_matched, token_at
from specaudit.equivalence.rulings.thresholds import REPORT_FLOOR

NEEDS_WEIGHTS = ("needs the weights: outputs alone cannot tell position_ids, attention_mask, kv_cache, "
                 "acceptance_rule or cross_row apart; rerun with --target to name the cause")
Logprobs = "list[dict[int, float]] | None"  # per output token: {token id: log-probability}
TeacherForce = Callable[[list[int], int], "dict[int, float] | None"]  # (prompt + prefix, token) -> top incl. token


@dataclass
class ServedBand:
    """The band a margin must lie within to be numerical, and what it is made of."""

    width: float
    parts: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "parts": dict(self.parts), "notes": list(self.notes)}


def margin_in(top: dict[int, float] | None, reference_token: int, engine_token: int) -> tuple[float | None, bool]:
    """log p(reference token) - log p(engine token) from one top-N dict: (margin, exact). Where the engine
    token is not in it, the margin is at least log p(reference) - the smallest log-probability shown
    (exact False); None where the dict lacks the reference's own token."""
    if not top or reference_token not in top:
        return None, False
    if engine_token in top:
        return float(top[reference_token] - top[engine_token]), True
    return float(top[reference_token] - min(top.values())), False


def _logprob_gap(a: Sequence[dict[int, float] | None] | None, b: Sequence[dict[int, float] | None] | None,
                 upto: int, skip: Sequence[int] | None = None) -> float | None:
    """The largest |log p_a(t) - log p_b(t)| over positions < upto and tokens both report (leaving out
    `skip[position]`, b's own chosen token there, when given)."""
    if not a or not b:
        return None
    gaps = [abs(x[t] - y[t]) for p, (x, y) in enumerate(zip(a[:upto], b[:upto])) if x and y
            for t in x.keys() & y.keys()
            if math.isfinite(x[t]) and math.isfinite(y[t]) and not (skip is not None and p < len(skip) and skip[p] == t)]
    return max(gaps) if gaps else None


def rerun_disagreement(first: list[list[int]], second: list[list[int]], first_lps: list[Any],
                       second_lps: list[Any]) -> dict[str, Any]:
    """How the reference's two runs (two batch mixes) differ: prompts that differ, the margin of the
    first run at each flip, and the largest log-probability difference on their common prefixes."""
    flips, gap = [], 0.0
    for index, (a, b) in enumerate(zip(first, second)):
        at = first_divergence(a, b)
        upto = len(a) if at is None else at
        g = _logprob_gap(first_lps[index] if index < len(first_lps) else None,
                         second_lps[index] if index < len(second_lps) else None, upto + (1 if at is not None else 0))
        gap = max(gap, g or 0.0)
        if at is None:
            continue
        flip: dict[str, Any] = {"prompt_index": index, "position": at, "first_token": token_at(a, at),
                                "second_token": token_at(b, at), "margin": None}
        lps = first_lps[index] if index < len(first_lps) else None
        if lps and at < len(lps) and flip["first_token"] is not None and flip["second_token"] is not None:
            flip["margin"], flip["margin_exact"] = margin_in(lps[at], flip["first_token"], flip["second_token"])
        flips.append(flip)
    margins = [f["margin"] for f in flips if f["margin"] is not None and f.get("margin_exact")]
    return {"prompts": len(first), "identical": len(first) - len(flips), "flips": flips,
            "largest_flip_margin": max(margins) if margins else None, "largest_logprob_difference": gap}


def measure_band(rerun: dict[str, Any], engine_gap: float | None, *, logit_tolerance: float | None = None,
                 engine_dtype: str | None = None, engine_gap_note: str | None = None) -> ServedBand:
    """The band of one audited run (module docstring)."""
    parts: dict[str, float | None] = {
        "reference_rerun_logprobs": 2 * rerun["largest_logprob_difference"],
        "reference_rerun_flips": rerun["largest_flip_margin"],
        "engine_vs_reference_logprobs": None if engine_gap is None else 2 * engine_gap,
        "declared": logit_tolerance if logit_tolerance is not None
        else dtype_noise(engine_dtype, 1.0) if engine_dtype else None,
    }
    notes = [engine_gap_note] if engine_gap_note else []
    if engine_gap is None and not engine_gap_note:
        notes.append("the audited engine reports no log-probabilities to compare with the reference's")
    width = max([v for v in parts.values() if v is not None] or [0.0])
    return ServedBand(width, parts, notes)


def engine_logprob_gap(reference: list[list[int]], outputs: list[list[int]], reference_lps: list[Any],
                       engine_lps: list[Any]) -> float | None:
    """The largest difference of a token's log-probability, audited engine against reference, at the
    same prefix (the positions before each prompt's first divergence, and that position itself), over the
    alternatives the engine reports beside its chosen token: its report of the chosen token is what the
    `logprob_report` check judges against this band, so it does not widen it."""
    gaps = []
    for index, (r, o) in enumerate(zip(reference, outputs)):
        at = first_divergence(r, o)
        upto = len(r) if at is None else at + 1
        g = _logprob_gap(reference_lps[index] if index < len(reference_lps) else None,
                         engine_lps[index] if index < len(engine_lps) else None, upto, skip=o)
        if g is not None:
            gaps.append(g)
    return max(gaps) if gaps else None


def rule(index: int, prompt: list[int], reference: list[int], output: list[int], *, eos_token_id: Any,
         reference_lps: Any, band: ServedBand, all_references: list[list[int]] | None = None,
         second_reference: list[int] | None = None, teacher_force: TeacherForce | None = None,
         params: Any = None, reference_report: dict[str, Any] | None = None) -> Divergence | None:
    """The divergence of prompt `index` (None when the output equals the reference's). `params`: the
    request parameters both were sent (their stop ids stop a row; `min_tokens` names `logits_processor`)."""
    position = first_divergence(reference, output)
    if position is None:
        return None
    ends = set(eos_ids(eos_token_id)) | set(params.stop_token_ids if params is not None else ())
    min_tokens = params.min_tokens if params is not None else 0
    r, e = token_at(reference, position), token_at(output, position)

    def ruled(kind: str, cls: str | None, decided_by: str, reason: str, margin: float | None = None,
              exact: bool | None = None, bound: float | None = None, needs_weights: bool = False) -> Divergence:
        evidence: dict[str, Any] = {"reason": reason, "margin_exact": exact}
        if bound is not None:
            evidence["margin_bound"] = bound
        evidence["band"] = band.width
        return served_divergence(index, position, r, e, kind, decided_by, evidence, prompt, reference, output,
                                 cls=cls, margin=margin, needs_weights=needs_weights)

    # 1. another prompt's output
    if all_references is not None:
        others = other_references_matched(index, all_references, output)
        if others:
            return ruled("structural", "output_order", "output-match",
                         f"the output is the reference's output for prompt {others[0]}, not this prompt's")
    # 1b. min_tokens: a stop id the reference takes at or past min_tokens, or the engine takes before it
    if min_tokens and ((r in ends and e not in ends and position >= min_tokens)
                       or (e in ends and position < min_tokens)):
        who = (f"the reference stops with {r} at new token {position}, past min_tokens {min_tokens}, where the engine "
               f"goes on with {e}" if r in ends else
               f"the engine stops with {e} at new token {position}, inside min_tokens {min_tokens}")
        return ruled("structural", "logits_processor", "min-tokens",
                     f"{who}: min_tokens applied past its end or not at all (both were sent the same request)")
    # 2. one side ends
    stopped_on = (reference_report or {}).get("stop_reason")
    if r is None and isinstance(stopped_on, str) and params is not None and stopped_on in params.stop:
        return ruled("structural", "stop_string", "stop-string", (
            f"the reference stops at stop string {stopped_on!r} after {len(reference)} token(s); the engine, sent the "
            f"same stop strings, returns {len(output) - len(reference)} token(s) after it"))
    if r is None or e is None:
        ended, other = ("reference", e) if r is None else ("engine", r)
        stop_eos = (reference and reference[-1] in ends) or (output and output[-1] in ends)
        return ruled("structural", "stop_eos" if stop_eos else "stop_length", "length", (
            f"the {ended} output ends at position {position} where the other goes on with token {other}: a stop "
            "decision, not a near-tie"))
    # 3. the reference's own re-run makes the same divergence
    if second_reference is not None and departs_at(reference, second_reference, position, e):
        return ruled("numerical", None, "reference-rerun", (
            f"the reference, asked again at another batch mix, also makes token {e} at position {position}: the "
            "deployment's own nondeterminism"))
    # 4. the reference's margin at the common prefix
    top = reference_lps[position] if reference_lps and position < len(reference_lps) else None
    margin, exact = margin_in(top, r, e)
    how = "the reference's top log-probabilities there"
    if not exact and teacher_force is not None:
        forced = teacher_force(list(prompt) + list(reference[:position]), e)
        merged = {**(forced or {}), **(top or {})}
        if forced and e in forced:
            merged[e] = forced[e]
            if r not in merged:
                merged[r] = forced.get(r, merged.get(r))
            m2, exact2 = margin_in(merged, r, e)
            if m2 is not None and exact2:
                margin, exact, how = m2, True, "teacher-forced: the prefix and the engine's token sent as a prompt"
    if margin is not None and exact and margin <= band.width:
        return ruled("numerical", None, "reference-margin", (
            f"the reference's margin log p({r}) - log p({e}) = {margin:.3g} ({how}) lies within the band "
            f"{band.width:.3g} measured for this deployment"), margin, exact)
    bound = None
    if margin is None:
        reason = ("the reference reports no log-probabilities at this position: no margin, so no precision "
                  "control explains the divergence")
    elif exact:
        reason = (f"the reference's margin log p({r}) - log p({e}) = {margin:.3g} ({how}) lies beyond the band "
                  f"{band.width:.3g} measured for this deployment")
    else:
        bound = margin
        reason = (f"token {e} is outside the reference's top {len(top or {})} there: its margin is at least {margin:.3g}"
                  + (f", beyond the band {band.width:.3g}" if margin > band.width else
                     f" (within the band {band.width:.3g} only as a bound; teacher forcing gave nothing)"))
    if e in ends or r in ends:
        return ruled("structural", "stop_eos", "reference-margin", reason, margin, exact, bound)
    return ruled("structural", "unknown", "reference-margin", reason, margin, exact, bound, needs_weights=True)


def served_divergence(index: int, position: int | None, reference_token: int | None, engine_token: int | None,
                      kind: str, decided_by: str, evidence: Mapping[str, Any], prompt: Sequence[int],
                      reference: Sequence[int], output: Sequence[int], *, cls: str | None = None,
                      margin: float | None = None, needs_weights: bool = False,
                      detected_by: str = "tokens") -> Divergence:
    """A served ruling (`rule`, `report_findings`, a failed request) as a divergence (rulings/record.py
    `make_divergence`): no step traced, the context window around `position` (none for a finding about the
    whole output), and for a structural one the class the ruling named (`named_by` its `decided_by`; `unknown`
    with what would name it where outputs alone cannot, `needs_weights`)."""
    reason = evidence.get("reason")
    return make_divergence(
        prompt_index=index, position=position, reference_token=reference_token, engine_token=engine_token,
        margin=margin, kind=kind, decided_by=decided_by, detected_by=detected_by, evidence=evidence, step=None,
        context=ABSENT if position is None else window(reference[:position], reference, output, position)[0],
        diagnosis=ABSENT if kind != "structural" else named(
            cls or "unknown", f"{reason}; {NEEDS_WEIGHTS}" if needs_weights else reason, decided_by,
            needs_weights=needs_weights))


def request_failed(index: int, reason: str, prompt: Sequence[int], reference: Sequence[int],
                   output: Sequence[int]) -> Divergence:
    """A request the engine answered with an error: structural, its class unknown (no tokens compared)."""
    return served_divergence(index, 0, None, None, "structural",
                             "request-failed", {"reason": reason}, prompt, reference, output)


def report_findings(index: int, prompt: list[int], reference: list[int], output: list[int], report: dict[str, Any],
                    reference_lps: Any, band: ServedBand, eos_token_id: Any,
                    reference_finish: str | None = None) -> list[Divergence]:
    """What the engine says beside its tokens, against the reference server's answer for the same
    prompt: usage counts, finish_reason where the tokens agree, reported log-probabilities of the chosen
    tokens against the reference's at the same prefix (beyond twice the band, at least `REPORT_FLOOR`)."""
    findings: list[Divergence] = []
    ends = set(eos_ids(eos_token_id))

    def finding(cls: str, decided_by: str, reason: str, position: int | None = None, **evidence: Any) -> None:
        findings.append(served_divergence(index, position, token_at(reference, position), token_at(output, position),
                                          "structural", decided_by, {**evidence, "reason": reason}, prompt, reference,
                                          output, cls=cls, detected_by=cls.split("_")[0]))

    usage = report.get("usage") or {}
    returned = report.get("returned_tokens", len(output))
    counts = {"prompt_tokens": {len(prompt)}, "completion_tokens": {len(output), returned}}
    if output and output[-1] in ends:
        counts["completion_tokens"].add(len(output) - 1)
    wrong = {k: v for k, v in usage.items() if k in counts and v not in counts[k]}
    if wrong:
        finding("usage_report", "usage-count", "usage says " + ", ".join(f"{k} {v}" for k, v in wrong.items())
                + f" for a {len(prompt)}-token prompt and {len(output)} returned token(s)", usage=usage)
    finish = report.get("finish_reason")
    if output == reference and finish is not None and reference_finish is not None and finish != reference_finish:
        finding("finish_reason", "finish-compare", f"the tokens equal the reference's, which says finish_reason "
                f"{reference_finish!r}; the engine says {finish!r}", len(output) - 1 if output else None)
    chosen = report.get("chosen_logprobs")
    if chosen and reference_lps:
        agree = matched_prefix(reference, output)
        off = []
        for p in range(min(agree, len(chosen), len(reference_lps))):
            expected = (reference_lps[p] or {}).get(output[p])
            if chosen[p] is None or expected is None:
                continue
            tolerance = max(2 * band.width, REPORT_FLOOR * max(1.0, abs(expected)))
            if abs(chosen[p] - expected) > tolerance:
                off.append((p, chosen[p], expected, tolerance))
        if off:
            compared = min(agree, len(chosen), len(reference_lps))
            zero = all(v == 0.0 for v in chosen[:compared] if v is not None)
            p, got, expected, tolerance = off[0]
            finding("logprob_report", "logprob-compare",
                    ("every reported log-probability is 0.0 (p = 1)" if zero else f"{len(off)} of {compared} "
                     "positions off") + f": at position {p} the engine reports {got:.6g} for token {output[p]}, the "
                    f"reference server {expected:.6g} at the same prefix (tolerance {tolerance:.3g})", p,
                    positions_off=[q for q, *_ in off], all_zero=zero)
    return findings
