"""A batched speculative engine in a style of its own, plain torch and transformers: one target cache for the
batch, cropped each step to the shortest row's end, and each row re-fed what it needs (its tokens past that end,
its last token, the draft's proposals), left-padded with its mask. The cache holds every row's sequence but its
last token; each pass feeds from there. Every factory is `make(target, draft, *, batch_size, draft_tokens,
pad_token_id, **options)` and returns an object with `generate(prompts, max_new_tokens, eos_token_id)`.

Bugs (suffix of the factory name), each changing tokens:
- `_positions_over_padding` (`position_ids`): each token numbered by its cache column (the left padding of the
  prefill and of every re-feed counted);
- `_padding_visible` (`attention_mask`): after the prefill, the mask shows every cached column (the cache's left
  padding, and the padding of earlier re-feeds) to the re-fed queries;
- `_crop_off_by_one` (`kv_cache`): the cache and its mask are cropped one column past the shortest row's end while
  each row is re-fed from that end, so the column at the end stays visible: after the prefill each row's last
  prompt token sits in the cache twice, later a duplicated or rejected entry.

`crop_spec` without a suffix is the correct twin: exact against greedy decoding.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from outside_styles import _eos_set as eos_set, _finish as finish  # the outside engines' own output contract

POSITIONS, MASK, CROP = "positions", "mask", "crop"


class CropSpec:
    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad, self.bug = target, draft, batch_size, k, pad, bug
        params = inspect.signature(type(target).forward).parameters
        self.cache_name = "cache" if "cache" in params else "past_key_values"

    def describe(self) -> str:
        return f"crop_spec (bug: {self.bug or 'none'})"

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        eos = eos_set(eos_token_id)
        out: list[list[int]] = []
        with torch.no_grad(), torch.device(self.target.device):
            for start in range(0, len(prompts), self.batch_size):
                batch = [[int(t) for t in p] for p in prompts[start:start + self.batch_size]]
                out += self._batch(batch, max_new_tokens, eos) if max_new_tokens > 0 else [[] for _ in batch]
        return out

    def _propose(self, sequence: list[int]) -> list[int]:
        proposals, seq = [], list(sequence)
        for _ in range(self.k):
            token = int(self.draft(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            proposals.append(token)
            seq.append(token)
        return proposals

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        return self.target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{self.cache_name: cache}).logits

    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int]) -> list[list[int]]:
        rows = len(prompts)
        width = max(len(p) for p in prompts)
        pads = [width - len(p) for p in prompts]
        ids = torch.tensor([[self.pad] * n + p for n, p in zip(pads, prompts)])
        mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pads, prompts)])  # [B, columns]: 1 holds a token
        positions = (torch.arange(width).expand(rows, width) if self.bug == POSITIONS
                     else (mask.cumsum(1) - 1).clamp(min=0))
        cache = DynamicCache(config=self.target.config)
        self._forward(ids, mask, positions, cache)
        sequences = [list(p) for p in prompts]
        # per row: the column of each of its sequence's tokens the cache holds (all but the last)
        held = [list(range(n, width - 1)) for n in pads]
        ends = [width - 1] * rows  # per row: the column after its last held token
        out: list[list[int]] = [[] for _ in prompts]
        while any(len(o) < max_new_tokens and not (eos & set(o)) for o in out):
            crop = min(ends)
            keep = min(crop + 1 if self.bug == CROP else crop, cache.get_seq_length())
            if cache.get_seq_length() > keep:
                cache.crop(keep - cache.get_seq_length())  # a negative count: the columns removed from the end
            mask = mask[:, :keep]
            held = [[c for c in h if c < crop] for h in held]
            feeds, starts = [], []
            for b in range(rows):
                proposals = self._propose(sequences[b])
                feeds.append(sequences[b][len(held[b]):] + proposals)
                starts.append(len(held[b]))
            step = max(len(f) for f in feeds)
            fill = [step - len(f) for f in feeds]
            ids = torch.tensor([[self.pad] * n + f for n, f in zip(fill, feeds)])
            new = torch.tensor([[0] * n + [1] * len(f) for n, f in zip(fill, feeds)])
            if self.bug == POSITIONS:
                positions = torch.arange(keep, keep + step).expand(rows, step)
            else:
                positions = torch.tensor([[s] * n + list(range(s, s + len(f)))
                                          for s, n, f in zip(starts, fill, feeds)])
            cached = torch.ones_like(mask) if self.bug == MASK else mask
            logits = self._forward(ids, torch.cat([cached, new], 1), positions, cache)
            mask = torch.cat([mask, new], 1)
            for b in range(rows):
                need = len(feeds[b]) - self.k  # the row's own tokens fed, its last among them
                first = fill[b] + need - 1  # the query after the row's last token
                chosen = logits[b, first:first + self.k + 1].argmax(-1).tolist()
                accepted = 0
                while accepted < self.k and chosen[accepted] == feeds[b][need + accepted]:
                    accepted += 1
                emitted = chosen[:accepted + 1]
                held[b] += [keep + fill[b] + i for i in range(need + accepted)]
                ends[b] = held[b][-1] + 1
                sequences[b] += emitted
                out[b] += emitted
        return [finish(o, max_new_tokens, eos) for o in out]


def _factory(bug: str | None = None):
    def make(target: Any, draft: Any, *, batch_size: int = 4, draft_tokens: int = 3, pad_token_id: int | None = None,
             **_: Any) -> CropSpec:
        pad = pad_token_id if pad_token_id is not None else (target.config.pad_token_id or 0)
        return CropSpec(target, draft, batch_size, draft_tokens, pad, bug)
    return make


crop_spec = _factory()
crop_spec_positions_over_padding = _factory(POSITIONS)
crop_spec_padding_visible = _factory(MASK)
crop_spec_crop_off_by_one = _factory(CROP)

BUGGY: dict[str, str] = {  # each buggy factory's cause
    "crop_spec_positions_over_padding": "position_ids",
    "crop_spec_padding_visible": "attention_mask",
    "crop_spec_crop_off_by_one": "kv_cache",
}
