"""Audit target: Hugging Face assisted generation, `generate(assistant_model=...)`, greedy.

Contract (every engine): `generate(prompts, max_new_tokens, eos_token_id)` returns, per prompt,
only the new tokens, up to and including the first EOS, never more than `max_new_tokens`.

This is the ecosystem's default speculative decoder (Leviathan et al.'s draft-then-verify, greedy
acceptance, as implemented by `transformers`). Every 5.x release refuses a batch here, so prompts
run one at a time and `batch_size` is ignored. The draft proposes a constant `draft_tokens` per
step: the draft's `generation_config` gets `num_assistant_tokens=draft_tokens`, the "constant"
schedule and no confidence threshold for the duration of the call.

`last_trace` has one step per target forward pass, recovered from the pass's logits (accepted
count = emitted - 1, exact unless the pass was cut at EOS or `max_new_tokens`); with
`record_logits`, `last_trace.logits[p]` holds the logits the model computed, in its own dtype (what
the audit compares), and `last_generate_logits[p]` the float32 casts of them that `generate` chose
each token from (a token flipped by that cast still shows in the token comparison).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.ops import layout
from specaudit.engines.adapters._hf import LogitsTap, as_float, cut_at_eos, hf_eos, patched_generation_config
from specaudit.engines.adapters._hf import resolve_pad_id
from specaudit.engines.trace import StepRecord, Trace


class HFAssisted:
    """`target.generate(assistant_model=draft)` one prompt at a time."""

    name = "hf-assisted"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        *,
        batch_size: int = 1,
        draft_tokens: int = 4,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        **_: object,
    ) -> None:
        if draft is None:
            raise ValueError("hf-assisted needs a draft model")
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be at least 1")
        if "recurrent" in layout.attention_layer_kinds(target):
            raise layout.UnsupportedModel(
                f"hf-assisted: {layout.architecture_name(target)} keeps recurrent state, and transformers' assisted "
                "generation refuses stateful models (audit eqspec, exspec or inplace on it instead)")
        self.target = target
        self.draft = draft
        self.batch_size = batch_size  # assisted generation refuses batches: prompts run one at a time
        self.k = draft_tokens
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.record_logits = record_logits
        self.last_trace: Trace | None = None
        self.last_generate_logits: list[torch.Tensor | None] = []

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        eos_token_id = hf_eos(eos_token_id)  # a set of ids as the list transformers stops at
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        trace = Trace(num_prompts=len(prompts), draft_tokens=self.k)
        outputs: list[list[int]] = [[] for _ in prompts]
        self.last_generate_logits = [None] * len(prompts)
        if max_new_tokens <= 0:
            self.last_trace = trace
            return outputs
        draft_options = dict(
            num_assistant_tokens=self.k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
        )
        with patched_generation_config(self.draft, **draft_options), patched_generation_config(
            self.target, eos_token_id=eos_token_id, pad_token_id=self.pad_id
        ):
            for index, prompt in enumerate(prompts):
                outputs[index] = self._run_prompt(index, prompt, max_new_tokens, eos_token_id, trace)
        self.last_trace = trace
        return outputs

    def _run_prompt(
        self, index: int, prompt: list[int], max_new_tokens: int, eos_token_id: int | None, trace: Trace
    ) -> list[int]:
        device = self.target.device
        input_ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, n]
        tap = LogitsTap(self.target)
        with tap:
            out = self.target.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=self.draft,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                eos_token_id=eos_token_id,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[0, len(prompt):].tolist()
        kept = cut_at_eos(new, eos_token_id, max_new_tokens)
        chosen = torch.cat(out.logits, dim=0)[:kept]  # [n, V] float32, one row per emitted token
        computed, per_pass = _align_passes(tap.calls, chosen)
        for count in per_pass:
            trace.record(StepRecord(
                step=len(trace.steps), kind="assisted", rows=[index], pad_lengths=[0],
                accepted_counts=[max(count - 1, 0)], emitted_counts=[count],
            ))
        if self.record_logits:
            trace.logits[index] = computed
            self.last_generate_logits[index] = as_float(chosen)
        return new[:kept]


def _align_passes(calls: list[torch.Tensor], chosen: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
    """Match the target's forward passes to the emitted tokens.

    Each verification pass returns logits for [last token, candidates] (`logits_to_keep`); the
    tokens it emits are a run of those rows (accepted candidates, then the bonus token), and
    each emitted row, cast to float32, is exactly the row `generate` returned. Returns the emitted
    rows in the model's dtype [n, V] (None if the passes cannot be matched) and the number of
    tokens each pass emitted.
    """
    rows: list[torch.Tensor] = []
    per_pass: list[int] = []
    t = 0
    for logits in calls:  # [1, q, V]; q covers the prompt too where `logits_to_keep` is unsupported
        count = 0
        for row in logits[0]:
            if t < chosen.shape[0] and torch.equal(row.to(torch.float32), chosen[t]):
                rows.append(row)
                t += 1
                count += 1
            elif count:
                break  # the rows after the bonus token follow a rejected candidate
        if count:
            per_pass.append(count)
    if t != chosen.shape[0]:
        return None, []
    return as_float(torch.stack(rows)) if rows else None, per_pass
