"""Plain greedy decoding of a right-padded batch with a KV cache and hand-built 4-D masks.

The loop: every prompt starts at column 0 with its pads after it, the prefill reads each row's first new
token at its own last real token, then each step appends one token per row at one shared column after the
widest prompt: a short prompt and its new tokens have a gap of pads between them, which the mask must hide
and the positions must skip. Variants (`bug=`):

- None: correct;
- "pos_column": each new token numbered by its column (counted over the gap) instead of the row's tokens;
- "gap_visible": the decode steps' mask hides only the future: the gap's pads are attended.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from foreign.cache_arg import cache_arg


class RightPaddedLoop:
    def __init__(self, model: Any, batch_size: int, pad_id: int, bug: str | None) -> None:
        self.model, self.batch_size, self.pad_id, self.bug = model, batch_size, pad_id, bug

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        results: list[list[int]] = []
        for i in range(0, len(prompts), self.batch_size):
            results += self._batch(prompts[i:i + self.batch_size], max_new_tokens, eos_token_id)
        return results

    def _mask(self, keep: torch.Tensor, q: int, decoding: bool) -> torch.Tensor:
        """keep [B, kv] (1 = a real token) -> additive mask [B, 1, q, kv] for the last q columns."""
        b, kv = keep.shape
        rows = torch.arange(kv - q, kv).unsqueeze(1)  # [q, 1]
        allowed = (torch.arange(kv).unsqueeze(0) <= rows).unsqueeze(0).expand(b, q, kv)  # [B, q, kv]
        if not (decoding and self.bug == "gap_visible"):
            allowed = allowed & keep.bool().unsqueeze(1)
        mask = torch.zeros(b, 1, q, kv, dtype=self.model.dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(self.model.dtype).min)
        return mask.to(self.model.device)

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts])  # [B]
        ids = torch.tensor([p + [self.pad_id] * (width - len(p)) for p in prompts])  # [B, W]
        keep = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [B, W]
        cache = DynamicCache(config=self.model.config)
        device = self.model.device
        positions = torch.arange(width).unsqueeze(0).expand(len(prompts), width)  # [B, W]
        logits = self.model(input_ids=ids.to(device), attention_mask=self._mask(keep, width, False),
                            position_ids=positions.to(device), use_cache=True,
                            **cache_arg(self.model, cache)).logits  # [B, W, V]
        token = logits[torch.arange(len(prompts)), lengths - 1].argmax(-1).cpu()  # [B]: at each row's last token
        out = [[int(t)] for t in token]
        done = [max_new_tokens <= 1 or (eos is not None and o[0] == eos) for o in out]
        step = 0
        while not all(done):
            keep = torch.cat([keep, torch.ones(len(prompts), 1, dtype=keep.dtype)], dim=1)
            position = torch.full_like(lengths, width + step) if self.bug == "pos_column" else lengths + step  # [B]
            logits = self.model(input_ids=token.unsqueeze(1).to(device), attention_mask=self._mask(keep, 1, True),
                                position_ids=position.unsqueeze(1).to(device), use_cache=True,
                                **cache_arg(self.model, cache)).logits[:, -1]  # [B, V]
            token = logits.argmax(-1).cpu()
            for b in range(len(prompts)):
                if not done[b]:
                    out[b].append(int(token[b]))
                    done[b] = len(out[b]) >= max_new_tokens or (eos is not None and out[b][-1] == eos)
            step += 1
        return out


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 0, pad_token_id: int | None = None,
             **_: Any) -> RightPaddedLoop:
        return RightPaddedLoop(target, batch_size, 0 if pad_token_id is None else int(pad_token_id), bug)
    return make


correct = _factory(None)
pos_column = _factory("pos_column")
gap_visible = _factory("gap_visible")
