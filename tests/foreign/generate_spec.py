"""Speculative decoding around `model.generate`: the draft proposes with `draft.generate(...)` on the
left-padded batch, the target checks every proposal in one pass over the whole padded sequence (no
target cache), and the batch is re-padded from each row's token list after every step.

Variants (`bug=`):

- None: correct;
- "pos_padded": the target pass numbers tokens by their column in the padded batch;
- "mask_padding": the target pass attends to the padding (an all-ones mask);
- "accept_extra": one draft token past the first mismatch is kept (acceptance off by one);
- "overshoot": a step's tokens are not cut at max_new_tokens;
- "eos_after": tokens after a row's EOS are kept.
"""

from __future__ import annotations

from typing import Any

import torch


class GenerateSpec:
    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad_id: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad_id, self.bug = target, draft, batch_size, k, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        answers: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            answers += self._decode(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return answers

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        seqs = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        device = self.target.device
        while live:
            ids, mask = self._pad([seqs[i] for i in live])
            drafted = self.draft.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                          max_new_tokens=self.k, min_new_tokens=self.k, do_sample=False,
                                          pad_token_id=self.pad_id, eos_token_id=None)
            proposals = drafted[:, ids.shape[1]:].cpu()  # [B, k]
            full = torch.cat([ids, proposals], dim=1)  # [B, W + k]
            full_mask = torch.cat([mask, torch.ones_like(proposals)], dim=1)
            if self.bug == "mask_padding":
                full_mask = torch.ones_like(full_mask)
            if self.bug == "pos_padded":
                positions = torch.arange(full.shape[1]).expand_as(full)
            else:
                positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.target(input_ids=full.to(device), attention_mask=full_mask.to(device),
                                 position_ids=positions.to(device)).logits  # [B, W + k, V]
            choices = logits[:, ids.shape[1] - 1:].argmax(-1).cpu()  # [B, k + 1]
            still = []
            for b, i in enumerate(live):
                n = 0
                while n < self.k and int(proposals[b, n]) == int(choices[b, n]):
                    n += 1
                if self.bug == "accept_extra" and n < self.k:
                    tokens = proposals[b, :n + 1].tolist()
                else:
                    tokens = proposals[b, :n].tolist() + [int(choices[b, n])]
                if eos is not None and eos in tokens and self.bug != "eos_after":
                    tokens = tokens[:tokens.index(eos) + 1]
                if self.bug != "overshoot":
                    tokens = tokens[:max_new_tokens - len(new[i])]
                new[i] += tokens
                seqs[i] += tokens
                ended = eos is not None and eos in new[i] and self.bug != "eos_after"
                if not ended and len(new[i]) < max_new_tokens:
                    still.append(i)
            live = still
        return new


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 4, pad_token_id: int | None = None,
             **_: Any) -> GenerateSpec:
        return GenerateSpec(target, draft, batch_size, int(draft_tokens), 0 if pad_token_id is None else int(pad_token_id),
                            bug)
    return make


correct = _factory(None)
pos_padded = _factory("pos_padded")
mask_padding = _factory("mask_padding")
accept_extra = _factory("accept_extra")
overshoot = _factory("overshoot")
eos_after = _factory("eos_after")
