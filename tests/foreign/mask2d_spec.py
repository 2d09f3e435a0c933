"""Speculative decoding on a left-padded batch with one `DynamicCache` per model and 2-D attention masks (the
library builds the 4-D ones).

Every row writes k + 1 columns a step, its pending token and its k proposals, in both caches (the draft gets its
k-th proposal in one more pass), so the rows stay aligned; rejected proposals stay as holes, hidden by zeros in
the 2-D mask. Variants (`bug=`):

- None: correct: each row's positions count its visible columns (`mask.cumsum(-1) - 1`);
- "library_positions": no position ids passed, so the library numbers every column, padding and holes included;
- "holes_visible": the rejected columns are left at 1 in the mask, attended and counted.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from foreign.cache_arg import cache_arg


class Mask2DSpec:
    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad_id: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad_id, self.bug = target, draft, batch_size, k, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        results: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            results += self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return results

    def _call(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Logits [B, q, V] of `ids` [B, q]; `mask` [B, kv] covers the cache and the q new columns."""
        extra: dict[str, Any] = {}
        if self.bug != "library_positions":
            extra["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:].to(model.device)
        return model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=True,
                     **extra, **cache_arg(model, cache)).logits.cpu()

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        rows, k = len(prompts), self.k
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # [B, W]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, W]
        target_cache, draft_cache = DynamicCache(config=self.target.config), DynamicCache(config=self.draft.config)
        pending = self._call(self.target, ids, mask, target_cache)[:, -1].argmax(-1)  # [B]
        self._call(self.draft, ids, mask, draft_cache)
        out = [[int(t)] for t in pending]
        done = [max_new_tokens <= 1 or (eos is not None and o[-1] == eos) for o in out]
        ones = lambda n: torch.ones(rows, n, dtype=mask.dtype)  # noqa: E731
        while not all(done):
            draft_mask, token, proposals = mask, pending, []
            for _ in range(k):  # one column a pass: pending, then each proposal
                draft_mask = torch.cat([draft_mask, ones(1)], 1)
                token = self._call(self.draft, token[:, None], draft_mask, draft_cache)[:, -1].argmax(-1)
                proposals.append(token)
            drafted = torch.stack(proposals, 1)  # [B, k]
            self._call(self.draft, drafted[:, -1:], torch.cat([draft_mask, ones(1)], 1), draft_cache)
            choices = self._call(self.target, torch.cat([pending[:, None], drafted], 1), torch.cat([mask, ones(k + 1)], 1),
                                 target_cache).argmax(-1)  # [B, k + 1]
            accepted = (drafted == choices[:, :k]).long().cumprod(1).sum(1)  # [B]
            step = ones(k + 1)  # the step's columns in both caches: pending, accepted, then holes
            if self.bug != "holes_visible":
                for b in range(rows):
                    step[b, 1 + int(accepted[b]):] = 0
            mask = torch.cat([mask, step], 1)
            for b in range(rows):
                n = int(accepted[b])
                for token in drafted[b, :n].tolist() + [int(choices[b, n])]:
                    if not done[b]:
                        out[b].append(token)
                        done[b] = len(out[b]) >= max_new_tokens or (eos is not None and token == eos)
            pending = choices[torch.arange(rows), accepted]  # [B]: each row's correction or bonus token
        return out


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 4, pad_token_id: int | None = None,
             **_: Any) -> Mask2DSpec:
        return Mask2DSpec(target, draft, batch_size, int(draft_tokens), 0 if pad_token_id is None else int(pad_token_id), bug)
    return make


correct = _factory(None)
library_positions = _factory("library_positions")
holes_visible = _factory("holes_visible")
