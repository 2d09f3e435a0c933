"""Plain greedy decoding as a loop over `model.generate` calls: the unfinished rows are left-padded
into one batch, `generate` runs a chunk of a few tokens with the batch's attention mask and explicit
position ids, each row's new tokens are cut at its EOS and its budget, finished rows leave, and the
rest are re-padded for the next call (their positions computed afresh each call).

Variants (`bug=`):

- None: correct (each row's positions counted over its own tokens);
- "pos_padded": the position ids passed to `generate` are the column index of the padded batch.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

CHUNK = 4  # new tokens per `generate` call


class GenerateChunks:
    def __init__(self, model: Any, batch_size: int, pad_id: int, bug: str | None) -> None:
        self.model, self.batch_size, self.pad_id, self.bug = model, batch_size, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        results: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            results += self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return results

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while active:
            seqs = [prompts[r] + out[r] for r in active]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([[self.pad_id] * (width - len(s)) + s for s in seqs], device=self.model.device)
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.model.device)
            if self.bug == "pos_padded":
                positions = torch.arange(width, device=ids.device).expand_as(ids)
            else:
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
            budget = min(CHUNK, max(max_new_tokens - len(out[r]) for r in active))
            config = GenerationConfig(max_new_tokens=budget, do_sample=False, eos_token_id=eos, pad_token_id=self.pad_id)
            new = self.model.generate(input_ids=ids, attention_mask=mask, position_ids=positions,
                                      generation_config=config)[:, width:].tolist()  # [rows, <= budget]
            still = []
            for r, tokens in zip(active, new):
                tokens = tokens[:max_new_tokens - len(out[r])]
                if eos is not None and eos in tokens:
                    tokens = tokens[:tokens.index(eos) + 1]
                out[r] += tokens
                if len(out[r]) < max_new_tokens and not (eos is not None and out[r] and out[r][-1] == eos):
                    still.append(r)
            active = still
        return out


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, pad_token_id: int | None = None, **_: Any) -> GenerateChunks:
        return GenerateChunks(target, batch_size, 0 if pad_token_id is None else int(pad_token_id), bug)
    return make


correct = _factory(None)
pos_padded = _factory("pos_padded")
