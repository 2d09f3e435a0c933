"""Draft fidelity: are an engine's proposals the draft model's own greedy choices?

Greedy verification makes the output independent of the draft, so a draft cache that drifts out
of step (not trimmed after a rejection, missing the last draft token) changes no output token or
logit; it only lowers acceptance. It does show in the proposals: with a correct draft cache, every
proposal that follows accepted tokens equals the draft model's greedy choice on that prefix, and
all of those choices come from one uncached draft pass over the row's final sequence.

Checked only for engines whose trace says the proposals come from greedy decoding with the draft
model (`Trace.proposals_from_draft_model`). Below float64 the choices come from the draft in float64
and a proposal that differs is kept only when `accept` (`rulings.DraftPrecision`, on the draft) does not
put it within the precision's reach.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from specaudit.engines.trace import Trace
from specaudit.equivalence.records import Divergence


@torch.no_grad()
def draft_choices(draft: PreTrainedModel, sequence: list[int]) -> list[int]:
    """`choices[i]`: the draft's greedy next token after `sequence[: i + 1]`."""
    ids = torch.tensor([sequence], dtype=torch.long, device=draft.device)
    return draft(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].argmax(-1).tolist()


def first_draft_mismatches(
    trace: Trace, draft: PreTrainedModel, prompts: list[list[int]], outputs: list[list[int]], skip: set[int],
    accept: Callable[[int, int, int, int], bool] | None = None,
) -> dict[int, dict[str, Any]]:
    """Per prompt (not in `skip`), the first proposal that is not the draft's greedy choice;
    `accept(row, prefix length, choice, proposal)` lets a differing proposal pass (below float64: a
    proposal within the precision's reach)."""
    generated = [0] * len(prompts)  # tokens each row had emitted before the step
    choices: dict[int, list[int]] = {}
    found: dict[int, dict[str, Any]] = {}
    for index, step in enumerate(trace.steps):
        for b, row in enumerate(step.rows):
            if step.proposed is not None and row not in skip and row not in found:
                start = len(prompts[row]) + generated[row]  # tokens in the row when it drafted
                if row not in choices:
                    choices[row] = draft_choices(draft, list(prompts[row]) + list(outputs[row]))
                # proposal j follows the accepted proposals before it, which are in the output
                checkable = min(step.accepted_counts[b] + 1, step.emitted_counts[b], len(step.proposed[b]))
                for j in range(checkable):
                    expected = choices[row][start + j - 1]
                    if step.proposed[b][j] != expected and not (
                            accept is not None and accept(row, start + j, expected, step.proposed[b][j])):
                        found[row] = {"step": index, "position": generated[row] + j,
                                      "draft_token": expected, "proposed_token": step.proposed[b][j]}
                        break
            generated[row] += step.emitted_counts[b]
    return found


def draft_divergence(prompt_index: int, mismatch: dict[str, Any], trace: Trace) -> Divergence:
    """A divergence record (kind structural, detected by the draft check), at the step that proposed the token."""
    from dataclasses import replace

    from specaudit.equivalence.rulings.record import make_divergence, step_context

    return make_divergence(
        prompt_index=prompt_index, position=mismatch["position"], reference_token=mismatch["draft_token"],
        engine_token=mismatch["proposed_token"], margin=None, kind="structural", detected_by="draft",
        logit_error=None, evidence={"reason": "the engine proposed a token that the draft model, run alone on the same "
                                              "prefix, does not choose: its draft cache is out of step with the row "
                                              "(outputs stay exact; acceptance drops)"},
        context=None, text=None,
        emitted=replace(step_context(trace, prompt_index, mismatch["position"]), step=mismatch["step"]))
