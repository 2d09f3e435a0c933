"""Plain greedy decoding of a left-padded batch with a KV cache and hand-built 4-D masks.

The loop: pad the batch on the left, build an additive [B, 1, q, kv] mask (causal, padding
hidden), prefill, then one token per step for every row, until each row has its EOS or
max_new_tokens. Variants (`bug=`):

- None: correct;
- "pos_padded": position ids counted over the padded width (column index) instead of each
  row's own tokens;
- "pos_from_one": each row's positions counted from 1;
- "mask_padding": the 4-D mask hides nothing but the future: the row's padding is attended;
- "eos_any": the whole batch stops when any row emits EOS;
- "eos_after": rows go on decoding after their EOS (the EOS is not a stop).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from foreign.cache_arg import cache_arg


class PaddedLoop:
    def __init__(self, model: Any, batch_size: int, pad_id: int, bug: str | None) -> None:
        self.model, self.batch_size, self.pad_id, self.bug = model, batch_size, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        results: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            results.extend(self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id))
        return results

    def _mask(self, keep: torch.Tensor, q: int) -> torch.Tensor:
        """keep [B, kv] (1 = a real token) -> additive mask [B, 1, q, kv] for the last q columns."""
        b, kv = keep.shape
        dtype = self.model.dtype
        rows = torch.arange(kv - q, kv).unsqueeze(1)  # [q, 1] column of each query
        cols = torch.arange(kv).unsqueeze(0)  # [1, kv]
        allowed = (cols <= rows).unsqueeze(0).expand(b, q, kv)  # [B, q, kv]
        if self.bug != "mask_padding":
            allowed = allowed & keep.bool().unsqueeze(1)
        mask = torch.zeros(b, 1, q, kv, dtype=dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
        return mask.to(self.model.device)

    def _positions(self, keep: torch.Tensor, q: int) -> torch.Tensor:
        if self.bug == "pos_padded":
            kv = keep.shape[1]
            return torch.arange(kv - q, kv).unsqueeze(0).expand(keep.shape[0], q)
        counted = keep.long().cumsum(-1) - 1  # [B, kv]
        if self.bug == "pos_from_one":
            counted = counted + 1
        return counted.clamp(min=0)[:, -q:]

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # [B, W]
        keep = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, W]
        cache = DynamicCache(config=self.model.config)
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        step_ids = ids
        while True:
            q = step_ids.shape[1]
            logits = self.model(input_ids=step_ids.to(self.model.device),
                                attention_mask=self._mask(keep, q),
                                position_ids=self._positions(keep, q).to(self.model.device),
                                **cache_arg(self.model, cache), use_cache=True).logits[:, -1]  # [B, V]
            nxt = logits.argmax(-1).cpu()  # [B]
            for b in range(len(prompts)):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    if len(out[b]) >= max_new_tokens:
                        done[b] = True
                    elif eos is not None and int(nxt[b]) == eos and self.bug != "eos_after":
                        done[b] = True
            if self.bug == "eos_any" and eos is not None and any(o and o[-1] == eos for o in out):
                break
            if all(done):
                break
            step_ids = nxt.unsqueeze(1)
            keep = torch.cat([keep, torch.ones(len(prompts), 1, dtype=keep.dtype)], dim=1)
        return out


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 0, pad_token_id: int | None = None,
             **_: Any) -> PaddedLoop:
        return PaddedLoop(target, batch_size, 0 if pad_token_id is None else int(pad_token_id), bug)
    return make


correct = _factory(None)
pos_padded = _factory("pos_padded")
pos_from_one = _factory("pos_from_one")
mask_padding = _factory("mask_padding")
eos_any = _factory("eos_any")
eos_after = _factory("eos_after")
