"""Where a divergence arises, and whether it is a bug (`structural`) or a near-tie (`numerical`).

For the first divergent position of a prompt: the engine step that emitted it, the row's
accepted counts at every step up to it, the batch at that step (rows, pad lengths, group or
fallback), and the target's top-2 margin there on the common prefix. The label is `numerical`
only when all of these hold, and the evidence is kept beside it:

- the audit runs below float64 (in float64 every token mismatch is a bug);
- the engine's logits up to that position stay within the dtype's noise of a same-dtype replay;
- the reference's own top-2 margin at that position is within that noise;
- a float64 replay of the target on the same prefix confirms the near-tie: both the reference's
  and the engine's token lie within that noise of its top logit.
"""

from __future__ import annotations

from typing import Any

import torch

from specaudit.engines.trace import Trace
from specaudit.equivalence.compare import top2

CONTEXT_TOKENS = 16

# unit roundoff of each dtype; noise = NOISE_FACTOR * eps * max(1, |top logit|)
EPS: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float64": 2.0**-53}
NOISE_FACTOR = 16.0


def dtype_noise(dtype: str, top_logit: float) -> float:
    return NOISE_FACTOR * EPS[dtype] * max(1.0, abs(top_logit))


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


def classify(
    dtype: str,
    reference_margin: float | None,
    reference_top_logit: float | None,
    reference_token: int | None,
    engine_token: int | None,
    replay: torch.Tensor | None,
    logit_error_so_far: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """The kind of a token divergence and the evidence for it. `replay` is the float64 target's
    logits [V] on the common prefix; `logit_error_so_far` is the largest difference between the
    engine's logits and a same-dtype replay along its output, up to and including this position."""
    evidence: dict[str, Any] = {"replay_float64_margin": None, "replay_float64_top2": None, "dtype_noise": None}
    if replay is not None:
        evidence["replay_float64_top2"], evidence["replay_float64_margin"] = top2(replay)
    if dtype == "float64":
        evidence["reason"] = "float64: every token mismatch is a bug"
        return "structural", evidence
    if engine_token is None or reference_token is None or reference_margin is None or replay is None:
        evidence["reason"] = "length mismatch (early or late stop): not a near-tie"
        return "structural", evidence
    noise = dtype_noise(dtype, reference_top_logit or 0.0)
    evidence["dtype_noise"] = noise
    best = float(replay.max())
    # how far below the float64 maximum each of the two candidate tokens lies
    gaps = {"reference": best - float(replay[reference_token]), "engine": best - float(replay[engine_token])}
    evidence["replay_float64_gaps"] = gaps
    evidence["logit_error_so_far"] = logit_error_so_far
    if logit_error_so_far is not None and logit_error_so_far > noise:
        evidence["reason"] = (f"the engine's logits up to here differ from a {dtype} replay by "
                              f"{logit_error_so_far:.3g}, beyond {dtype} noise {noise:.3g}")
        return "structural", evidence
    if reference_margin > noise:
        evidence["reason"] = f"reference margin {reference_margin:.3g} exceeds {dtype} noise {noise:.3g}"
        return "structural", evidence
    for who, gap in gaps.items():
        if gap > noise:
            evidence["reason"] = (f"in the float64 replay the {who} token lies {gap:.3g} below the top, "
                                  f"beyond {dtype} noise {noise:.3g}")
            return "structural", evidence
    evidence["reason"] = (
        f"near-tie: reference margin {reference_margin:.3g}; in float64 both tokens lie within "
        f"{max(gaps.values()):.3g} of the top, inside {dtype} noise {noise:.3g}"
    )
    return "numerical", evidence


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
