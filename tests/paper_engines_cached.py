"""The paper's published EQSPEC (github.com/eBay/spec_dec, `src/custom/batch_speculative.py` and
`src/custom/verification.py`) as a closer transformers-5 port than `paper_engines.py`: the draft
proposes through `draft.generate` with a pad-id-equality mask, the target verifies with a
`DynamicCache` that is cropped, fed the last prompt token and the drafts, and realigned after
every step by copying each row's kept columns to its new left padding, as published.

Written from a reading of that code, not copied from it. Its decisions, kept on purpose:

1. every prompt is cut to its first `max_input_len` tokens;
2. masks, unpadding and the output slice by pad-id equality; the output slice starts at the first
   non-pad token plus the count of non-pad prompt tokens;
3. a row is finished when any of its tokens equals the EOS id; a step's tokens are appended whole;
4. a step drafts min(k, the smallest room left among active rows); when every draft matches, the
   last one is replaced by the target's own choice (`first_false_positions` defaults to n - 1);
5. finished rows stay in the verify pass with one pad id as their draft and keep nothing.

The factory takes no pad option: the pad id is the one the target's config declares.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.ops.ragged import cache_layers

from paper_engines import PaperEQSpec, _declared_pad, _left_pad


def _pad_right(seqs: list[torch.Tensor], pad_id: int) -> torch.Tensor:  # [B, W]
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=seqs[0].device)
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out


@torch.no_grad()
def _verify(target: Any, ids: torch.Tensor, drafts: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
            ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The published `batch_oracle_verification` with a cache. ids [B, L], drafts [B, n], mask [B, L + n]."""
    length = ids.shape[1]
    if cache.get_seq_length() == 0:  # prefill the prompt columns
        positions = (mask[:, :length].cumsum(-1) - 1).clamp(min=0)
        cached_forward(target, cache, input_ids=ids, attention_mask=mask[:, :length], position_ids=positions)
    surplus = cache.get_seq_length() - (length - 1)
    if surplus > 0:  # the published `crop(max_length=L - 1)`; transformers 5 takes the count to remove
        cache.crop(-surplus)
    cache_position = torch.arange(length - 1, length + drafts.shape[1], device=ids.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, length - 1:]  # [B, n + 1]
    logits = cached_forward(target, cache, input_ids=torch.cat([ids[:, -1:], drafts], dim=1), attention_mask=mask,
                            cache_position=cache_position, position_ids=positions).logits[:, :-1]  # [B, n, V]
    predicted = logits.argmax(-1)  # [B, n]
    matches = predicted == drafts
    first_false = torch.where(~matches.all(1), (~matches).int().argmax(1), torch.full_like(matches[:, 0], matches.shape[1] - 1,
                                                                                        dtype=torch.long))
    bonus = predicted[torch.arange(len(ids)), first_false]  # [B]
    accepted = [drafts[b, :int(first_false[b])] for b in range(len(ids))]
    return first_false, accepted, bonus


def _realign(cache: DynamicCache, content: torch.Tensor, new_pad: torch.Tensor, old_pad: torch.Tensor,
             kept: torch.Tensor) -> None:
    """The published `realign_kv_cache`: each row's columns [old_pad, old_pad + content + kept - 1)
    copied to start at its new padding, zeros elsewhere, the cache cut to the longest row - 1."""
    width = int((content + kept).max()) - 1
    for layer in cache_layers(cache):
        keys, values = layer.keys, layer.values  # [B, H, S, D]
        new_keys = keys.new_zeros(keys.shape[0], keys.shape[1], width, keys.shape[3])
        new_values = values.new_zeros(values.shape[0], values.shape[1], width, values.shape[3])
        for b in range(keys.shape[0]):
            start, stop = int(old_pad[b]), int(old_pad[b] + content[b] + kept[b] - 1)
            new_keys[b, :, int(new_pad[b]):width] = keys[b, :, start:stop]
            new_values[b, :, int(new_pad[b]):width] = values[b, :, start:stop]
        layer.keys, layer.values = new_keys, new_values


class CachedPaperEQSpec(PaperEQSpec):
    """EQSPEC as published, with its KV cache: consecutive batches, padding found by pad-id equality."""

    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        pad, device = self.pad_id, self.target.device
        ids = _left_pad([torch.tensor(p[: self.max_input_len], dtype=torch.long, device=device) for p in prompts],
                        pad)  # [B, W]
        mask = (ids != pad).long()
        input_lengths = mask.sum(1).tolist()
        made = torch.zeros(len(prompts), dtype=torch.long)
        cache = DynamicCache()
        while True:
            done = made >= max_new_tokens
            if eos is not None:
                done |= (ids == eos).any(1).cpu()
            if bool(done.all()):
                break
            active = (~done).nonzero().flatten()
            n = min(self.k, int((max_new_tokens - made[active]).min()))
            # 1. draft: generate on the active rows, the mask by pad-id equality
            sequences = self.draft.generate(input_ids=ids[active.to(device)], attention_mask=mask[active.to(device)],
                                            max_new_tokens=n, do_sample=False, pad_token_id=pad,
                                            eos_token_id=eos, return_dict_in_generate=True).sequences
            drafts, row = [], 0
            for b in range(len(prompts)):
                if bool(done[b]):
                    drafts.append(torch.tensor([pad], dtype=torch.long, device=device))
                else:
                    drafts.append(sequences[row, ids.shape[1]:])
                    row += 1
            drafts_tensor = _pad_right(drafts, pad)  # [B, n]
            combined = torch.cat([mask, torch.ones_like(drafts_tensor)], dim=1)
            # 2. verify with the cache
            first_false, accepted, bonus = _verify(self.target, ids, drafts_tensor, combined, cache)
            # 3. accepted tokens + the target's token, nothing for finished rows; unpad, append, re-pad
            kept = first_false.cpu() + 1
            kept[done] = 0
            old_pad = (ids != pad).int().argmax(1).cpu()
            rows, content = [], []
            for b in range(len(prompts)):
                seq = ids[b, int(old_pad[b]):]
                content.append(len(seq))
                new = torch.cat([accepted[b], bonus[b:b + 1]]) if not bool(done[b]) else seq.new_zeros(0)
                rows.append(torch.cat([seq, new]))
            ids = _left_pad(rows, pad)
            lengths = torch.tensor([len(r) for r in rows])
            _realign(cache, torch.tensor(content), lengths.max() - lengths, old_pad, kept)
            made += kept
            mask = (ids != pad).long()
        outputs = []
        for b in range(len(prompts)):  # the output slice, found by pad-id equality
            real = (ids[b] != pad).nonzero().flatten()
            first = int(real[0]) if real.numel() else 0
            outputs.append(ids[b, first + input_lengths[b]:].tolist())
        return outputs


def make_eqspec(target, draft, *, batch_size: int, draft_tokens: int, max_input_len: int = 1024) -> CachedPaperEQSpec:
    return CachedPaperEQSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens,
                             pad_token_id=_declared_pad(target), max_input_len=int(max_input_len))
