"""Speculative decoding with holes and no cache: each batch is one left-padded tensor; every step
appends k draft tokens to every row, the target scores the whole tensor again, and the rejected
draft tokens stay where they are as holes, masked out (only the bonus token is written after them).
The draft also recomputes over the whole tensor. Positions come from the mask.

Variants (`bug=`):

- None: correct;
- "pos_padded": positions are the column index: padding and holes counted;
- "pos_holes": positions counted over the holes (the padding is skipped, rejected slots are not);
- "mask_holes": the rejected slots stay visible to later queries;
- "mask_padding": the padding is visible (the mask marks only holes);
- "accept_extra": the first mismatching draft token is kept too.
"""

from __future__ import annotations

from typing import Any

import torch


class HolesSpec:
    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad_id: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad_id, self.bug = target, draft, batch_size, k, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        done: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            done += self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return done

    def _forward(self, model: Any, tokens: torch.Tensor, real: torch.Tensor, holes: torch.Tensor) -> torch.Tensor:
        """tokens, real (1 = prompt or kept token), holes (1 = a rejected slot): [B, L] -> logits [B, L, V]."""
        seen = real.clone()
        if self.bug == "mask_holes":
            seen = real | holes
        if self.bug == "mask_padding":
            seen = 1 - holes
        if self.bug == "pos_padded":
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        elif self.bug == "pos_holes":
            started = (real | holes).cumsum(-1) > 0
            positions = (started.long().cumsum(-1) - 1).clamp(min=0)
        else:
            positions = (real.cumsum(-1) - 1).clamp(min=0)
        device = model.device
        return model(input_ids=tokens.to(device), attention_mask=seen.to(device),
                     position_ids=positions.to(device)).logits.cpu()

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        b, width = len(prompts), max(len(p) for p in prompts)
        tokens = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # [B, L]
        real = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, L]
        holes = torch.zeros_like(real)
        # first token from the target alone
        first = self._forward(self.target, tokens, real, holes)[:, -1].argmax(-1)  # [B]
        out = [[int(first[r])] for r in range(b)]
        tokens = torch.cat([tokens, first.unsqueeze(1)], 1)
        real = torch.cat([real, torch.ones(b, 1, dtype=real.dtype)], 1)
        holes = torch.cat([holes, torch.zeros(b, 1, dtype=holes.dtype)], 1)
        finished = [len(o) >= max_new_tokens or (eos is not None and o[-1] == eos) for o in out]
        while not all(finished):
            start = tokens.shape[1]
            for _ in range(self.k):  # draft k tokens for every row
                logits = self._forward(self.draft, tokens, real, holes)[:, -1]
                tokens = torch.cat([tokens, logits.argmax(-1).unsqueeze(1)], 1)
                real = torch.cat([real, torch.ones(b, 1, dtype=real.dtype)], 1)
                holes = torch.cat([holes, torch.zeros(b, 1, dtype=holes.dtype)], 1)
            choice = self._forward(self.target, tokens, real, holes)[:, start - 1:].argmax(-1)  # [B, k + 1]
            bonus = torch.full((b, 1), self.pad_id, dtype=tokens.dtype)
            bonus_real = torch.zeros(b, 1, dtype=real.dtype)
            for r in range(b):
                drafts = tokens[r, start:]
                if finished[r]:
                    real[r, start:] = 0  # a finished row's slots are padding
                    continue
                n = 0
                while n < self.k and int(drafts[n]) == int(choice[r, n]):
                    n += 1
                keep = n + 1 if self.bug == "accept_extra" and n < self.k else n
                emitted = drafts[:keep].tolist() + ([] if keep > n else [int(choice[r, n])])
                real[r, start + keep:] = 0
                holes[r, start + keep:] = 1
                if keep == n:
                    bonus[r, 0], bonus_real[r, 0] = int(choice[r, n]), 1
                room = max_new_tokens - len(out[r])
                emitted = emitted[:room]
                if eos is not None and eos in emitted:
                    emitted = emitted[:emitted.index(eos) + 1]
                out[r] += emitted
                finished[r] = len(out[r]) >= max_new_tokens or (eos is not None and out[r][-1] == eos)
            tokens = torch.cat([tokens, bonus], 1)
            real = torch.cat([real, bonus_real], 1)
            holes = torch.cat([holes, 1 - bonus_real], 1)
        return out


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 4, pad_token_id: int | None = None,
             **_: Any) -> HolesSpec:
        return HolesSpec(target, draft, batch_size, int(draft_tokens), 0 if pad_token_id is None else int(pad_token_id), bug)
    return make


correct = _factory(None)
pos_padded = _factory("pos_padded")
pos_holes = _factory("pos_holes")
mask_holes = _factory("mask_holes")
mask_padding = _factory("mask_padding")
accept_extra = _factory("accept_extra")
