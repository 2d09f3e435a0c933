"""Speculative decoding with one KV cache per row: a list of (target cache, draft cache) pairs, the
rows of a batch stepped one after another (batch of one each pass), caches cropped back after
every verification.

Variants (`bug=`):

- None: correct;
- "no_crop": the target cache keeps the rejected draft tokens' entries;
- "pos_rejected": caches are cropped, but each row's position counter goes on past its rejected
  slots (it advances by k + 1 every step);
- "accept_extra": the first mismatching draft token is kept too;
- "bonus_twice": the bonus token is emitted twice when every draft token is accepted;
- "overshoot": the last step's tokens are not cut at max_new_tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from foreign.cache_arg import cache_arg


def _crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` entries (transformers 5 crops by a negative count of entries to drop)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class RowCacheSpec:
    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.bug = target, draft, batch_size, k, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        results: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            results += self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return results

    def _step(self, model: Any, cache: DynamicCache, tokens: list[int], start: int) -> torch.Tensor:
        ids = torch.tensor([tokens], device=model.device)
        positions = torch.arange(start, start + len(tokens), device=model.device).unsqueeze(0)
        mask = torch.ones(1, cache.get_seq_length() + len(tokens), dtype=torch.long, device=model.device)
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_arg(model, cache),
                     use_cache=True).logits[0].cpu()  # [len(tokens), V]

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        rows = []
        for p in prompts:  # per row: caches, the token not yet in the caches, its position, output
            t_cache, d_cache = DynamicCache(config=self.target.config), DynamicCache(config=self.draft.config)
            first = int(self._step(self.target, t_cache, p, 0)[-1].argmax())
            self._step(self.draft, d_cache, p, 0)
            rows.append({"t": t_cache, "d": d_cache, "next": first, "pos": len(p), "out": [first]})
        for row in rows:
            while len(row["out"]) < max_new_tokens and not (eos is not None and row["out"][-1] == eos):
                self._speculate(row, max_new_tokens, eos)
        return [row["out"] for row in rows]

    def _speculate(self, row: dict, max_new_tokens: int, eos: int | None) -> None:
        k, pos = self.k, row["pos"]
        proposals, token = [], row["next"]
        for j in range(k):
            token = int(self._step(self.draft, row["d"], [token], pos + j)[-1].argmax())
            proposals.append(token)
        choices = self._step(self.target, row["t"], [row["next"]] + proposals, pos).argmax(-1).tolist()  # [k + 1]
        n = 0
        while n < k and proposals[n] == choices[n]:
            n += 1
        if self.bug == "accept_extra" and n < k:
            emitted = proposals[:n + 1]
        elif self.bug == "bonus_twice" and n == k:
            emitted = proposals + [choices[k], choices[k]]
        else:
            emitted = proposals[:n] + [choices[n]]
        kept = pos + n + 1  # the cached tokens: everything before, the pending token, n accepted drafts
        if self.bug != "no_crop":
            _crop_to(row["t"], kept)
        _crop_to(row["d"], kept)
        if n == k:  # the draft never saw its own last proposal
            self._step(self.draft, row["d"], [proposals[-1]], pos + k)
        if self.bug != "overshoot":
            emitted = emitted[:max_new_tokens - len(row["out"])]
        if eos is not None and eos in emitted:
            emitted = emitted[:emitted.index(eos) + 1]
        row["out"] += emitted
        row["next"] = emitted[-1]
        row["pos"] = pos + k + 1 if self.bug == "pos_rejected" else pos + len(emitted)
        if self.bug == "no_crop":
            row["pos"] = pos + len(emitted)


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 4, **_: Any) -> RowCacheSpec:
        return RowCacheSpec(target, draft, batch_size, int(draft_tokens), bug)
    return make


correct = _factory(None)
no_crop = _factory("no_crop")
pos_rejected = _factory("pos_rejected")
accept_extra = _factory("accept_extra")
bonus_twice = _factory("bonus_twice")
overshoot = _factory("overshoot")
