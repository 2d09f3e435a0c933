"""One divergence record: where it arises, what the engine and the reference chose, and its ruling.

Beside the ruling (`Ruler.rule`, ruler.py) a record keeps the engine step that emitted the token,
the row's accepted counts at every step up to it, the batch at that step (rows, pad lengths, group or
fallback), the reference's top-2 margin at the position, and the tokens around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from specaudit.engines.trace import Trace
from specaudit.equivalence.compare import top2
from specaudit.equivalence.rulings.thresholds import LOGIT_TOLERANCE
from specaudit.equivalence.rulings.band import NoiseBand, band_evidence
from specaudit.equivalence.rulings.ruler import Ruler

CONTEXT_TOKENS = 16


def step_context(trace: Trace | None, prompt_index: int, position: int) -> dict[str, Any]:
    """Step, accepted history and batch composition for the engine token at `position`."""
    if trace is None or prompt_index >= len(trace.emitted_at):
        return {"step": None, "accepted_history": None, "batch": None}
    emitted_at = trace.emitted_at[prompt_index]
    if not emitted_at:
        return {"step": None, "accepted_history": None, "batch": None}
    step = emitted_at[min(position, len(emitted_at) - 1)]
    record = trace.steps[step]
    return {
        "step": step,
        "accepted_history": trace.accepted_history(prompt_index, up_to_step=step),
        "batch": {"kind": record.kind, "rows": record.rows, "pad_lengths": record.pad_lengths},
    }


def context(common: list[int], reference: list[int], engine: list[int], position: int, tokenizer: Any | None) -> tuple[dict, dict | None]:
    start = max(0, position - CONTEXT_TOKENS)
    ids = {
        "common": list(common[start:position]),
        "reference": list(reference[position : position + CONTEXT_TOKENS]),
        "engine": list(engine[position : position + CONTEXT_TOKENS]),
    }
    text = None
    if tokenizer is not None:
        try:
            text = {key: tokenizer.decode(value) for key, value in ids.items()}
        except Exception:  # a tokenizer that cannot decode some ids: ids alone still tell the story
            text = None
    return ids, text


def reference_margin_at(reference_logits: torch.Tensor | None, position: int) -> tuple[float | None, float | None]:
    """Top-2 margin and top logit of the reference at `position` (on the common prefix)."""
    if reference_logits is None or position >= reference_logits.shape[0]:
        return None, None
    pairs, margin = top2(reference_logits[position])
    return margin, pairs[0][1]


class Diagnosis(TypedDict, total=False):
    """A structural divergence's cause (equivalence/diagnosis/): its class, what showed it, the check that named
    it, every check tried; a served ruling says whether naming it needs the weights."""

    cls: str  # (the JSON key is "class")
    evidence: str
    named_by: str | None
    tried: list[str]
    needs_weights: bool  # served rulings: outputs alone cannot name it
    decided_by: str | None
    mechanism: str | None
    shared: Any


class Divergence(TypedDict, total=False):
    """One divergence of `audit.json`, every mode alike (greedy, black-box, served; docs/reports.md#auditjson)."""

    prompt_index: int
    position: int | None  # the new token's index in the output
    step: int | None  # the engine step that emitted it (None: not traced)
    reference_token: int | None  # None: the reference ends there
    engine_token: int | None  # None: the engine ends there
    margin: float | None  # the reference's top-2 margin on the common prefix
    kind: str  # "structural" or "numerical"
    decided_by: str | None  # the ruling's control
    detected_by: str  # "tokens", "logits", "draft", or a report check's
    logit_error: float | None
    evidence: dict[str, Any]
    context: dict[str, list[int]]  # the common prefix's end, then each side's continuation
    text: dict[str, str] | None
    accepted_history: list[int] | None
    batch: dict[str, Any] | None
    # past a numerical flip: the flip it was judged past, and the output of a correct decoder on the engine's own
    # prefix it was judged against (the reference's output otherwise)
    continued_after: int
    continued_reference: list[int]
    diagnosis: dict[str, Any]  # a `Diagnosis` ("class" for `cls`)


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
    ids, text = context(engine_out[:position], reference_out, engine_out, position, outputs.tokenizer)
    record: Divergence = {
        "prompt_index": outputs.index, "position": position, "reference_token": reference_token,
        "engine_token": engine_token, "margin": margin, "kind": kind, "decided_by": evidence.get("decided_by"),
        "detected_by": detected_by, "logit_error": logit_error_value, "evidence": evidence, "context": ids,
        "text": text,
    }
    record.update(step_context(outputs.trace, outputs.index, position))
    return record
