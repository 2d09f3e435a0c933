"""Expected acceptance under sampling: per draft position, the sum over verify steps of
alpha = sum_x min(p(x), q(x)), teacher-forced along the sampled outputs, with its variance.

At a verify step the draft proposes x_j from its processed distribution q_j and the target accepts it with
probability min(1, p_j(x_j) / q_j(x_j)) (engines/sampling/rules.py), where p_j is the target's processed
distribution at the same prefix. Given everything before position j of the step, the acceptance there is a
Bernoulli with probability alpha_j = sum_x q_j(x) min(1, p_j(x) / q_j(x)) = sum_x min(p_j(x), q_j(x)).
Position j is reached only when drafts 0..j-1 were accepted, and then those drafts are the output's next
tokens: the prefix at position j of a step that began after `start` emitted tokens is prompt + output[:start
+ j], which the sampled audit teacher-forces anyway (equivalence/sampling/audit.py: p with the request's whole
processing on the sample's own history, q with its temperature and cuts on the draft's raw logits, as the
engines' drafters draw). So, per position j, over the steps observed to reach it:

- expected accepted E_j = sum alpha_j, variance V_j = sum alpha_j (1 - alpha_j) (predictable: each alpha
  is known before its Bernoulli is drawn);
- observed accepted X_j = the steps whose draft j was accepted.

X_j - E_j is a martingale with that variance; equivalence/acceptance/findings.py tests it per position
(Holm). A reached position whose prefix the output does not show (drafts accepted past the row's stop: an
EOS among them, or the budget) is left out of both sides; whether it is left out is settled before its own
draw, so leaving it out biases neither. The verify steps come from the engine's trace (each row's
`start`, drafted and accepted counts per step), accumulated over every `generate` call of the draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specaudit.engines.trace import Trace
from specaudit.equivalence.acceptance.expected import ExpectedAcceptance
from specaudit.equivalence.acceptance.findings import SAMPLED, compare
from specaudit.equivalence.acceptance.observed import ObservedAcceptance

BELOW_FLOAT64 = ("the engine runs the pair in {dtype}: its p and q carry that rounding, so the float64 overlap "
                 "is an estimate, and no excess over it is called impossible")


@dataclass(frozen=True)
class VerifyStep:
    """One row's verify step in a sampled draw."""

    sample: int  # the request's index in the draw
    start: int  # tokens the request had emitted before the step (its prefill's token included)
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted (the acceptance rule's, before the row's stop)
    emitted: int  # tokens the step emitted (accepted + recovered or bonus, cut at the row's stop)


def verify_steps(trace: Trace | None, first: int = 0) -> list[VerifyStep]:
    """The verify steps of one `generate` call's trace, its prompt i being request `first + i` of the draw;
    [] where the engine kept no trace."""
    if trace is None:
        return []
    emitted = [0] * trace.num_prompts
    steps = []
    for step in trace.steps:
        drafted = step.drafted_counts if step.drafted_counts is not None else [trace.draft_tokens] * len(step.rows)
        for row, d, a, e in zip(step.rows, drafted, step.accepted_counts, step.emitted_counts):
            if step.kind != "prefill":
                steps.append(VerifyStep(first + row, emitted[row], d, a, e))
            emitted[row] += e
    return steps


def observed_of(steps: Sequence[VerifyStep], source: str) -> ObservedAcceptance | None:
    """The draw's counters from its verify steps (observed.py's definition); None when nothing was drafted."""
    width = max((s.drafted for s in steps), default=0)
    if not width:
        return None
    accepted_at, drafts_at = [0] * width, [0] * width
    for s in steps:
        for j in range(s.drafted):
            drafts_at[j] += 1
        for j in range(min(s.accepted, s.drafted)):
            accepted_at[j] += 1
    return ObservedAcceptance(source=source, verify_steps=len(steps), drafted_tokens=sum(drafts_at),
                              accepted_tokens=sum(accepted_at), accepted_per_position=tuple(accepted_at),
                              drafts_per_position=tuple(drafts_at), emitted_tokens=sum(s.emitted for s in steps))


def overlaps(target_probs: Sequence[torch.Tensor], draft_probs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per sample [n]: alpha before each sampled token, sum_x min(p(x), q(x)) of the processed target and
    draft distributions [n, V] (float64, on the target's vocabulary)."""
    return [torch.minimum(p, q).sum(-1) for p, q in zip(target_probs, draft_probs)]


def expectation(steps: Sequence[VerifyStep], outputs: Sequence[Sequence[int]], alphas: Sequence[torch.Tensor], *,
                exact: bool, note: str = "") -> tuple[ExpectedAcceptance, ObservedAcceptance]:
    """(the expectation, the observed counts over the same verify positions) from the draw's verify steps, its
    outputs and each sample's alphas [n] (module docstring). Positions the outputs do not show are left out
    of both, and the note says how many."""
    width = max((s.drafted for s in steps), default=0)
    expected, variance = [0.0] * width, [0.0] * width
    accepted_at, drafts_at = [0] * width, [0] * width
    left_out = 0
    for s in steps:
        shown = len(outputs[s.sample])
        alpha = alphas[s.sample].tolist()  # [n]
        for j in range(s.drafted):
            reached = j <= s.accepted
            if reached and s.start + j >= shown:  # its prefix holds drafts the row never emitted
                left_out += 1
                continue
            drafts_at[j] += 1
            if reached:
                a = alpha[s.start + j]
                expected[j] += a
                variance[j] += a * (1 - a)
                accepted_at[j] += int(s.accepted > j)
    notes = [note] if note else []
    if left_out:
        notes.append(f"{left_out} reached draft position(s) past a row's stop (drafts it never emitted) left out of "
                     "both sides")
    described = "; ".join(notes)
    observed = ObservedAcceptance(
        source="the verify positions the sampled outputs show (the engine's trace)", verify_steps=len(steps),
        drafted_tokens=sum(drafts_at), accepted_tokens=sum(accepted_at), accepted_per_position=tuple(accepted_at),
        drafts_per_position=tuple(drafts_at), emitted_tokens=None)
    return (ExpectedAcceptance(method=SAMPLED, exact=exact, k=width, verify_steps=len(steps),
                               accepted_per_position=tuple(expected), drafts_per_position=tuple(drafts_at),
                               note=described, variance_per_position=tuple(variance)), observed)


def sampled_record(steps: Sequence[VerifyStep] | None, outputs: Sequence[Sequence[int]] | None,
                   alphas: Sequence[torch.Tensor] | None, *, observed: ObservedAcceptance | None, exact: bool,
                   note: str = "", required: float | None = None, baseline: ExpectedAcceptance | None = None,
                   unavailable: str | None = None) -> dict[str, Any]:
    """A sampled run's `acceptance` record (findings.py `AcceptanceRecord`, as JSON): the engine's `observed`
    counters against a `baseline` where one is given, else against the overlap expectation where the verify
    steps and alphas are known, else the observed counters alone with `unavailable`, the reason."""
    if baseline is not None:
        return compare(observed, baseline, required=required).to_json()
    if steps and outputs is not None and alphas is not None:
        expected, counted = expectation(steps, outputs, alphas, exact=exact, note=note)
        return compare(observed, expected, required=required, compared=counted).to_json()
    return compare(observed, None, required=required,
                   unavailable=unavailable or "no verify steps were seen").to_json()
