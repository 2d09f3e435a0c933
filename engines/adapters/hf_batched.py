"""Audit target: Hugging Face `generate` on left-padded batches, no speculation.

Contract (every engine): `generate(prompts, max_new_tokens, eos_token_id)` returns, per prompt,
only the new tokens, up to and including the first EOS, never more than `max_new_tokens`.

Prompts are taken in consecutive batches of `batch_size`, left-padded with `pad_token_id`, and
handed to `target.generate(input_ids, attention_mask, do_sample=False, ...)` as a user of the
library would. This asks whether batching alone (left padding, the library's position ids and
masks, finished rows padded while others run) keeps greedy decoding equivalent. The padding is
told apart from content by the attention mask, and a row's output is cut at its first EOS, so a
pad id that is also a real token is not stripped from inside the content.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.ops import ragged
from specaudit.engines.adapters._hf import LogitsTap, as_float, cut_at_eos, hf_eos, patched_generation_config
from specaudit.engines.adapters._hf import resolve_pad_id
from specaudit.engines.trace import StepRecord, Trace


class HFBatched:
    """`generate` on consecutive left-padded batches; the draft model is unused."""

    name = "hf-batched"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        **_: object,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.target = target
        self.batch_size = batch_size
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.record_logits = record_logits
        self.last_trace: Trace | None = None
        # per prompt, the float32 casts of the model's logits that generate chose each token from [n, V]
        self.last_generate_logits: list[torch.Tensor | None] = []

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        eos_token_id = hf_eos(eos_token_id)  # a set of ids as the list transformers stops at
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        trace = Trace(num_prompts=len(prompts))
        outputs: list[list[int]] = [[] for _ in prompts]
        self.last_generate_logits = [None] * len(prompts)
        if max_new_tokens <= 0:
            self.last_trace = trace
            return outputs
        for start in range(0, len(prompts), self.batch_size):
            rows = list(range(start, min(start + self.batch_size, len(prompts))))
            self._run_batch(prompts, rows, max_new_tokens, eos_token_id, trace, outputs)
        self.last_trace = trace
        return outputs

    def _run_batch(
        self,
        prompts: list[list[int]],
        rows: list[int],
        max_new_tokens: int,
        eos_token_id: int | None,
        trace: Trace,
        outputs: list[list[int]],
    ) -> None:
        device = self.target.device
        tokens, lengths = ragged.left_pad([prompts[r] for r in rows], self.pad_id, device)  # [B, W], [B]
        width = tokens.shape[1]
        mask = ragged.padding_mask(lengths, width).long()  # [B, W]
        tap = LogitsTap(self.target)
        with patched_generation_config(self.target, eos_token_id=eos_token_id, pad_token_id=self.pad_id), tap:
            out = self.target.generate(
                input_ids=tokens,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                eos_token_id=eos_token_id,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_logits=self.record_logits,
            )
        new = out.sequences[:, width:].tolist()  # [B, n] finished rows padded after their EOS
        # generate chose each token from these float32 casts of the model's logits
        logits = torch.stack(out.logits, dim=1) if self.record_logits else None  # [B, n, V]
        kept = [cut_at_eos(row, eos_token_id, max_new_tokens) for row in new]
        # one forward pass per decoding step; its last column is the step's next-token logits
        computed = None
        if self.record_logits and len(tap.calls) == len(out.logits):
            computed = torch.stack([c[:, -1] for c in tap.calls], dim=1)  # [B, n, V]
        for i, prompt in enumerate(rows):
            outputs[prompt] = new[i][: kept[i]]
            if logits is not None:
                self.last_generate_logits[prompt] = as_float(logits[i, : kept[i]])
            if computed is not None:
                trace.logits[prompt] = as_float(computed[i, : kept[i]])
        # one record per decoding step: every row still running emits one token
        pad_lengths = (width - lengths).tolist()
        for t in range(max(kept, default=0)):
            running = [i for i in range(len(rows)) if kept[i] > t]
            trace.record(StepRecord(
                step=len(trace.steps), kind="batch", rows=[rows[i] for i in running],
                pad_lengths=[pad_lengths[i] for i in running], accepted_counts=[0] * len(running),
                emitted_counts=[1] * len(running),
            ))
