"""Speculative decoding of a left-padded batch on preallocated static caches: the target and the draft
each hold one `StaticCache` for the whole batch, written column by column at a shared cache position
(every row writes the same columns each pass). Each step writes k + 1 columns for every row: the
pending token and k draft proposals; a row's rejected proposals stay in their columns as holes, hidden
by a per-row keep mask in the hand-built additive 4-D masks, and the next step writes after them.

Variants (`bug=`):

- None: correct (each row's positions count its own kept tokens);
- "pos_column": the position ids are the cache column (the cache position), counting the row's left
  padding and its holes;
- "pos_padded": the position ids count the row's left padding (the padded width) but not its holes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache

from foreign.cache_arg import cache_arg


class StaticCacheSpec:
    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad_id: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad_id, self.bug = target, draft, batch_size, k, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        results: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            results += self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return results

    def _positions(self, keep: torch.Tensor, start: int, q: int, pad: torch.Tensor) -> torch.Tensor:
        """keep [B, C] (1 = the row's own token, written columns and the q being written) -> positions
        [B, q] of columns start..start+q-1."""
        columns = torch.arange(start, start + q).unsqueeze(0).expand(keep.shape[0], q)
        if self.bug == "pos_column":
            return columns
        counted = keep[:, :start + q].cumsum(-1) - 1  # [B, start + q]
        if self.bug == "pos_padded":
            counted = counted + pad.unsqueeze(1)
        return counted[:, start:start + q].clamp(min=0)

    def _forward(self, model: Any, cache: StaticCache, ids: torch.Tensor, keep: torch.Tensor, start: int,
                 pad: torch.Tensor) -> torch.Tensor:
        """ids [B, q] written at columns start.. -> logits [B, q, V]."""
        b, q = ids.shape
        length = keep.shape[1]
        rows = torch.arange(start, start + q).unsqueeze(1)  # [q, 1]
        cols = torch.arange(length).unsqueeze(0)  # [1, C]
        allowed = (cols <= rows).unsqueeze(0) & keep.bool().unsqueeze(1)  # [B, q, C]
        mask = torch.zeros(b, 1, q, length, dtype=model.dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(model.dtype).min)
        device = model.device
        return model(input_ids=ids.to(device), attention_mask=mask.to(device),
                     position_ids=self._positions(keep, start, q, pad).to(device), **cache_arg(model, cache),
                     cache_position=torch.arange(start, start + q, device=device), use_cache=True).logits.cpu()

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        k, b = self.k, len(prompts)
        width = max(len(p) for p in prompts)
        length = width + (max_new_tokens + 1) * (k + 1)  # every step writes k + 1 columns
        pad = torch.tensor([width - len(p) for p in prompts])  # [B]
        keep = torch.zeros(b, length, dtype=torch.long)  # [B, C]
        for r, p in enumerate(prompts):
            keep[r, width - len(p):width] = 1
        caches = {name: StaticCache(config=model.config, max_cache_len=length)
                  for name, model in (("target", self.target), ("draft", self.draft))}
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        first = self._forward(self.target, caches["target"], ids, keep, 0, pad)[:, -1].argmax(-1)  # [B]
        self._forward(self.draft, caches["draft"], ids, keep, 0, pad)
        out = [[int(t)] for t in first]
        done = [max_new_tokens <= 1 or (eos is not None and out[r][-1] == eos) for r in range(b)]
        column = width
        while not all(done):
            pending = torch.tensor([[o[-1]] for o in out])  # [B, 1]
            keep[:, column:column + k + 1] = 1
            proposals = []
            token = pending
            for j in range(k + 1):  # k proposals, then the last one written too (its column stays aligned)
                logits = self._forward(self.draft, caches["draft"], token, keep, column + j, pad)[:, -1]
                token = logits.argmax(-1, keepdim=True)  # [B, 1]
                if j < k:
                    proposals.append(token)
            drafts = torch.cat(proposals, dim=1)  # [B, k]
            choices = self._forward(self.target, caches["target"], torch.cat([pending, drafts], dim=1), keep,
                                    column, pad).argmax(-1)  # [B, k + 1]
            for r in range(b):
                n = 0
                while n < k and int(drafts[r, n]) == int(choices[r, n]):
                    n += 1
                keep[r, column + n + 1:column + k + 1] = 0  # the rejected proposals: holes
                if done[r]:
                    continue
                emitted = drafts[r, :n].tolist() + [int(choices[r, n])]
                emitted = emitted[:max_new_tokens - len(out[r])]
                if eos is not None and eos in emitted:
                    emitted = emitted[:emitted.index(eos) + 1]
                out[r] += emitted
                done[r] = len(out[r]) >= max_new_tokens or (eos is not None and out[r][-1] == eos)
            column += k + 1
        return out


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 4, pad_token_id: int | None = None,
             **_: Any) -> StaticCacheSpec:
        pad_id = 0 if pad_token_id is None else int(pad_token_id)
        return StaticCacheSpec(target, draft, batch_size, int(draft_tokens), pad_id, bug)
    return make


correct = _factory(None)
pos_column = _factory("pos_column")
pos_padded = _factory("pos_padded")
