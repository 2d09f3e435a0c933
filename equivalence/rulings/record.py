"""One divergence record: where it arises, what the engine and the reference chose, and its ruling.

Every divergence of a run, whichever producer finds it, is built by `make_divergence` as a
`records.Divergence` (frozen): the in-process and black-box token rulings (`divergence`), the findings
that name their own class (`finding`: request parameters, constraints, report checks), the served
rulings (rulings/served.py), the draft check (draft_fidelity.py). A later stage changes one with
`dataclasses.replace`; the run serializes them once (records/serialize.py).

Beside the ruling (`Ruler.rule`, ruler.py) a record keeps the engine step that emitted the token,
the row's accepted counts at every step up to it, the batch at that step (rows, pad lengths, group or
fallback), the reference's top-2 margin at the position, and the tokens around it (`window`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specaudit.engines.trace import Trace
from specaudit.equivalence.compare import top2
from specaudit.equivalence.records import ABSENT, Absent, Context, ContextText, Diagnosis, Divergence, StepBatch
from specaudit.equivalence.rulings.thresholds import LOGIT_TOLERANCE
from specaudit.equivalence.rulings.band import NoiseBand, band_evidence
from specaudit.equivalence.rulings.ruler import Ruler

# the context window of every divergence, every mode alike: the last CONTEXT_TOKENS tokens of the output before
# it (the common prefix), then CONTEXT_TOKENS tokens of each side's continuation
CONTEXT_TOKENS = 16


@dataclass(frozen=True)
class StepContext:
    """The engine step that emitted a token, the row's accepted counts up to it, and that step's batch (each
    None: not traced)."""

    step: int | None = None
    accepted_history: tuple[int, ...] | None = None
    batch: StepBatch | None = None


def step_context(trace: Trace | None, prompt_index: int, position: int) -> StepContext:
    """Step, accepted history and batch composition for the engine token at `position`."""
    if trace is None or prompt_index >= len(trace.emitted_at):
        return StepContext()
    emitted_at = trace.emitted_at[prompt_index]
    if not emitted_at:
        return StepContext()
    step = emitted_at[min(position, len(emitted_at) - 1)]
    record = trace.steps[step]
    return StepContext(step, tuple(trace.accepted_history(prompt_index, up_to_step=step)),
                       StepBatch(kind=record.kind, rows=tuple(record.rows), pad_lengths=tuple(record.pad_lengths)))


def window(common: Sequence[int], reference: Sequence[int], engine: Sequence[int], position: int,
           tokenizer: Any | None = None) -> tuple[Context, ContextText | None]:
    """The tokens around a divergence at `position` (`CONTEXT_TOKENS` each side): `common` is the output before
    it, `reference` and `engine` each side's whole output; with a tokenizer, their text too."""
    start = max(0, position - CONTEXT_TOKENS)
    ids = Context(common=tuple(common[start:position]),
                  reference=tuple(reference[position:position + CONTEXT_TOKENS]),
                  engine=tuple(engine[position:position + CONTEXT_TOKENS]))
    text = None
    if tokenizer is not None:
        try:
            text = ContextText(common=tokenizer.decode(list(ids.common)),
                               reference=tokenizer.decode(list(ids.reference)),
                               engine=tokenizer.decode(list(ids.engine)))
        except Exception:  # a tokenizer that cannot decode some ids: ids alone still tell the story
            text = None
    return ids, text


def reference_margin_at(reference_logits: torch.Tensor | None, position: int) -> tuple[float | None, float | None]:
    """Top-2 margin and top logit of the reference at `position` (on the common prefix)."""
    if reference_logits is None or position >= reference_logits.shape[0]:
        return None, None
    pairs, margin = top2(reference_logits[position])
    return margin, pairs[0][1]


def make_divergence(*, prompt_index: int, position: int | None, reference_token: int | None,
                    engine_token: int | None, kind: str, detected_by: str, evidence: Mapping[str, Any],
                    decided_by: str | None | Absent = ABSENT, margin: float | None | Absent = ABSENT,
                    logit_error: float | None | Absent = ABSENT, context: Context | None | Absent = ABSENT,
                    text: ContextText | None | Absent = ABSENT, emitted: StepContext | None = None,
                    step: int | None | Absent = ABSENT, diagnosis: Diagnosis | Absent = ABSENT) -> Divergence:
    """The one constructor of a divergence: what every producer knows (where, the two tokens, the ruling and
    what decided it), and what some add (the margin, the logit error, the context, the step that emitted it,
    a class named by the ruling itself). `emitted`: the step, accepted history and batch of a traced run;
    `step` alone otherwise (a served run: None, not traced). An optional field left out is not
    written to `audit.json` (`records.ABSENT`)."""
    return Divergence(prompt_index=prompt_index, position=position, reference_token=reference_token,
                      engine_token=engine_token, margin=margin, kind=kind, decided_by=decided_by,
                      detected_by=detected_by, logit_error=logit_error, evidence=evidence, context=context, text=text,
                      step=emitted.step if emitted is not None else step,
                      accepted_history=emitted.accepted_history if emitted is not None else ABSENT,
                      batch=emitted.batch if emitted is not None else ABSENT, diagnosis=diagnosis)


def named(cls: str, evidence: str | None, named_by: str | None, *, needs_weights: bool | Absent = ABSENT) -> Diagnosis:
    """The diagnosis of a divergence whose ruling names its class itself (nothing else tried)."""
    return Diagnosis(cls=cls, evidence=evidence, named_by=named_by, tried=(), needs_weights=needs_weights)


def finding(index: int, position: int | None, cls: str, decided_by: str, reason: str, evidence: Mapping[str, Any],
            reference_token: int | None = None, engine_token: int | None = None,
            detected_by: str = "tokens") -> Divergence:
    """A structural divergence a check names itself (request parameters, constraints, a report check): its
    reason first in the evidence, its class named by the check that decided it."""
    return make_divergence(prompt_index=index, position=position, reference_token=reference_token,
                           engine_token=engine_token, kind="structural", decided_by=decided_by,
                           detected_by=detected_by, evidence={"reason": reason, **evidence},
                           diagnosis=named(cls, reason, decided_by))


@dataclass(frozen=True)
class PromptOutputs:
    """One prompt's side of a ruling: the prompt, the output judged against (the reference's, or a correct
    decoder's continued past a numerical flip), the engine's, the logits that chose the judged-against output
    ([n, V], for the margin), the engine's trace and the tokenizer (for the context's text)."""

    index: int
    prompt: list[int]
    reference_out: list[int]
    engine_out: list[int]
    reference_logits: torch.Tensor | None
    trace: Trace | None
    tokenizer: Any


def divergence(outputs: PromptOutputs, position: int, ruler: Ruler, *, detected_by: str = "tokens",
               logit_error_value: float | None = None, logit_error_so_far: float | None = None,
               band: NoiseBand | None = None, engine_entry: dict[int, float] | None = None,
               same_dtype: torch.Tensor | None = None) -> Divergence:
    """The divergence record of `outputs` at `position`, ruled by `ruler` (every dtype, in-process and
    black-box). `detected_by` "logits": tokens agree but logits differ beyond the dtype's tolerance, always a
    bug. `band`: a black-box engine's noise band, whose evidence (and `engine_entry`, its log-probabilities at
    the position) goes beside the ruling; `same_dtype`: the audit dtype's logits on the common prefix."""
    reference_out, engine_out, dtype = outputs.reference_out, outputs.engine_out, ruler.dtype
    reference_token = reference_out[position] if position < len(reference_out) else None
    engine_token = engine_out[position] if position < len(engine_out) else None
    margin, _ = reference_margin_at(outputs.reference_logits, position)
    if detected_by == "logits":
        kind, evidence = "structural", {"decided_by": "logits", "reason": (
            f"tokens agree but logits differ by {logit_error_value:.3g} "
            f"(> {LOGIT_TOLERANCE.get(dtype, float('nan')):.0e} in {dtype})")}
    else:
        kind, evidence = ruler.rule(outputs.prompt, reference_out, engine_out, position, same_dtype)
        if band is not None:  # a black-box engine: its band and what its log-probabilities said, beside the ruling
            evidence.update(band_evidence(band, evidence, engine_token, reference_token, engine_entry))
    if logit_error_so_far is not None:
        evidence["logit_error_so_far"] = logit_error_so_far
    ids, text = window(engine_out[:position], reference_out, engine_out, position, outputs.tokenizer)
    return make_divergence(
        prompt_index=outputs.index, position=position, reference_token=reference_token, engine_token=engine_token,
        margin=margin, kind=kind, decided_by=evidence.get("decided_by"), detected_by=detected_by,
        logit_error=logit_error_value, evidence=evidence, context=ids, text=text,
        emitted=step_context(outputs.trace, outputs.index, position))
