"""Engines written as a team outside the project would write them (issue 59, item 4): plain torch and
transformers calls, nothing imported from specaudit. Six batching styles, each as a correct engine and as
the same engine with one planted bug. Every factory is `make(target, draft, *, batch_size, draft_tokens,
pad_token_id, **options)` and returns an object with `generate(prompts, max_new_tokens, eos_token_id)`
(greedy; per prompt the new tokens, the first EOS kept, never more than max_new_tokens).

Styles:
- `at_once`: every prompt handed over in one left-padded batch, `batch_size` ignored; one shared
  `DynamicCache`; a row that finishes is evicted from the batch (`batch_select_indices` on the cache);
- `buckets`: prompts sorted by length, left-padded buckets of `batch_size` (little padding), outputs
  put back in the caller's order;
- `arrivals`: batches of `batch_size` in the order requests arrive, which a process-wide count of calls
  seeds: the same prompts handed over again are batched otherwise (a server's history decides);
- `slots`: continuous batching with `batch_size` slots; each admitted prompt is prefilled alone into its
  own cache, and every decode step stacks the live slots' caches left-padded with zeros into one batch,
  then splits it back; a finished row's slot takes the next prompt at once;
- `right_padded`: one right-padded batch, one shared cache; new tokens are appended after the padded
  width, so the padding stays between each row's prompt and its new tokens, hidden by the mask;
- `spec_solo_draft`: speculative decoding (k = `draft_tokens`); the draft proposes for each row alone
  (its own cache, no padding), the target prefills the whole batch left-padded and verifies all live
  rows together, its per-row caches stacked left-padded with zeros and cropped back to the accepted
  tokens after each verify pass.

Bugs (suffix of the factory name):
- `_positions_over_padding` (`position_ids`): every query numbered by its column in the padded width
  (the left padding, or the right padding and the stacked zeros, counted);
- `_padding_visible` (`attention_mask`): the mask shows the padding to every query (all ones);
- `spec_solo_draft_stale_cache` (`kv_cache`): the target's caches are never cropped after a verify pass,
  so the rejected proposals stay in them and every later query reads them (positions still counted by
  the accepted tokens).

The factory without a suffix is the correct twin of each: exact against greedy decoding.
"""

from __future__ import annotations

import inspect
import random
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

POSITIONS, MASK, STALE = "positions", "mask", "stale"


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(e) for e in eos_token_id)


def _done(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in eos for t in tokens)


def _finish(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _cache_arg(model: Any, cache: DynamicCache) -> dict[str, Any]:
    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _forward(model: Any, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
             cache: DynamicCache) -> torch.Tensor:
    """Logits [B, q, V]."""
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                 **_cache_arg(model, cache)).logits


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    real = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return ids, real


def _stack(model: Any, caches: list[DynamicCache]) -> tuple[DynamicCache, list[int], int]:
    """One batch cache from per-row caches, each left-padded with zeros to the longest: (cache, lengths, width)."""
    lengths = [c.get_seq_length() for c in caches]
    width = max(lengths)
    batch = DynamicCache(config=model.config)
    if width == 0:
        return batch, lengths, 0
    full = caches[lengths.index(width)]  # a row with entries: the shapes of the zeros for the empty ones
    for layer in range(len(full.layers)):
        keys, values = [], []
        for cache, n in zip(caches, lengths):
            if n == 0:
                k = full.layers[layer].keys[:, :, :0]
                v = full.layers[layer].values[:, :, :0]
            else:
                k, v = cache.layers[layer].keys, cache.layers[layer].values
            keys.append(F.pad(k, (0, 0, width - n, 0)))
            values.append(F.pad(v, (0, 0, width - n, 0)))
        batch.update(torch.cat(keys), torch.cat(values), layer)
    return batch, lengths, width


def _split(model: Any, batch: DynamicCache, drop: list[int]) -> list[DynamicCache]:
    """Per-row caches from a batch cache, each without its first `drop[b]` (padding) entries."""
    rows = []
    for b, d in enumerate(drop):
        cache = DynamicCache(config=model.config)
        for layer in range(len(batch.layers)):
            cache.update(batch.layers[layer].keys[b:b + 1, :, d:].clone(),
                         batch.layers[layer].values[b:b + 1, :, d:].clone(), layer)
        rows.append(cache)
    return rows


def _crop_to(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class _Engine:
    """What every style shares: the contract's `generate` around the style's `_run`."""

    style = ""

    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad: int, bug: str | None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad, self.bug = target, draft, batch_size, k, pad, bug

    def describe(self) -> str:
        return f"outside_styles {self.style} (bug: {self.bug or 'none'})"

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        if not prompts:
            return []
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        eos = _eos_set(eos_token_id)
        with torch.no_grad(), torch.device(self.target.device):
            out = self._run([[int(t) for t in p] for p in prompts], max_new_tokens, eos)
        return [_finish(o, max_new_tokens, eos) for o in out]

    def _run(self, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int]) -> list[list[int]]:
        raise NotImplementedError

    def _left_padded_greedy(self, prompts: list[list[int]], max_new_tokens: int,
                            eos: frozenset[int]) -> list[list[int]]:
        """Greedy decoding of one left-padded batch, one shared cache; finished rows leave the batch."""
        model = self.target
        ids, real = _left_pad(prompts, self.pad)
        cache = DynamicCache(config=model.config)
        out: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))  # prompt index of each batch row
        step = ids
        while live:
            q, width = step.shape[1], real.shape[1]
            if self.bug == POSITIONS:
                positions = torch.arange(width - q, width).expand(len(live), q)
            else:
                positions = (real.cumsum(-1) - 1).clamp(min=0)[:, -q:]
            mask = torch.ones_like(real) if self.bug == MASK else real
            chosen = _forward(model, step, mask, positions, cache)[:, -1].argmax(-1)  # [live]
            for b, token in zip(live, chosen.tolist()):
                out[b].append(int(token))
            keep = [i for i, b in enumerate(live) if not _done(out[b], max_new_tokens, eos)]
            if len(keep) < len(live):
                if keep:
                    cache.batch_select_indices(torch.tensor(keep))
                live = [live[i] for i in keep]
                real, chosen = real[keep], chosen[keep]
            step = chosen.unsqueeze(1)
            real = torch.cat([real, torch.ones(len(live), 1, dtype=real.dtype)], dim=1)
        return out


class AtOnce(_Engine):
    style = "at_once"

    def _run(self, prompts, max_new_tokens, eos):
        return self._left_padded_greedy(prompts, max_new_tokens, eos)  # batch_size ignored


class Buckets(_Engine):
    style = "buckets"

    def _run(self, prompts, max_new_tokens, eos):
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), self.batch_size):
            bucket = order[start:start + self.batch_size]
            for i, tokens in zip(bucket, self._left_padded_greedy([prompts[i] for i in bucket], max_new_tokens, eos)):
                out[i] = tokens
        return out


class Arrivals(_Engine):
    """Batches formed in the order requests "arrive", which changes from one call to the next (a process-wide count
    of calls seeds the order, as a server's history would): a second call of the same prompts batches otherwise."""

    style = "arrivals"
    calls = 0  # shared by every instance: the process's history

    def _run(self, prompts, max_new_tokens, eos):
        Arrivals.calls += 1
        order = list(range(len(prompts)))
        random.Random(Arrivals.calls).shuffle(order)
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, tokens in zip(batch, self._left_padded_greedy([prompts[i] for i in batch], max_new_tokens, eos)):
                out[i] = tokens
        return out


class Slots(_Engine):
    """Continuous batching: `batch_size` slots, each row with its own cache, stacked for every decode step."""

    style = "slots"

    def _admit(self, prompt: list[int]) -> tuple[DynamicCache, int]:
        cache = DynamicCache(config=self.target.config)
        positions = torch.arange(len(prompt)).unsqueeze(0)
        logits = _forward(self.target, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                          positions, cache)
        return cache, int(logits[0, -1].argmax())

    def _run(self, prompts, max_new_tokens, eos):
        out: list[list[int]] = [[] for _ in prompts]
        waiting = list(range(len(prompts)))
        slots: list[tuple[int, DynamicCache]] = []  # (prompt index, its cache: every token but the last new one)
        while waiting or slots:
            while waiting and len(slots) < self.batch_size:
                i = waiting.pop(0)
                cache, token = self._admit(prompts[i])
                out[i].append(token)
                if not _done(out[i], max_new_tokens, eos):
                    slots.append((i, cache))
            if not slots:
                continue
            batch, lengths, width = _stack(self.target, [c for _, c in slots])
            step = torch.tensor([[out[i][-1]] for i, _ in slots])
            real = torch.tensor([[0] * (width - n) + [1] * (n + 1) for n in lengths], dtype=torch.long)
            if self.bug == POSITIONS:
                positions = torch.full((len(slots), 1), width)
            else:
                positions = torch.tensor([[n] for n in lengths])
            mask = torch.ones_like(real) if self.bug == MASK else real
            chosen = _forward(self.target, step, mask, positions, batch)[:, -1].argmax(-1).tolist()
            caches = _split(self.target, batch, [width - n for n in lengths])
            kept = []
            for (i, _), cache, token in zip(slots, caches, chosen):
                out[i].append(int(token))
                if not _done(out[i], max_new_tokens, eos):
                    kept.append((i, cache))
            slots = kept
        return out


class RightPadded(_Engine):
    style = "right_padded"

    def _run(self, prompts, max_new_tokens, eos):
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._batch(prompts[start:start + self.batch_size], max_new_tokens, eos)
        return out

    def _batch(self, prompts, max_new_tokens, eos):
        model, b = self.target, len(prompts)
        width = max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.tensor([p + [self.pad] * (width - len(p)) for p in prompts], dtype=torch.long)
        real = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.long)
        cache = DynamicCache(config=model.config)
        positions = torch.arange(width).expand(b, width)  # the prompt's own tokens are numbered right either way
        mask = torch.ones_like(real) if self.bug == MASK else real
        logits = _forward(model, ids, mask, positions, cache)  # [B, W, V]
        chosen = logits[torch.arange(b), lengths - 1].argmax(-1)  # each row's last real token
        out: list[list[int]] = [[int(t)] for t in chosen.tolist()]
        t = 0
        while not all(_done(o, max_new_tokens, eos) for o in out):
            real = torch.cat([real, torch.ones(b, 1, dtype=real.dtype)], dim=1)
            if self.bug == POSITIONS:
                positions = torch.full((b, 1), width + t)
            else:
                positions = (lengths + t).unsqueeze(1)
            mask = torch.ones_like(real) if self.bug == MASK else real
            chosen = _forward(model, chosen.unsqueeze(1), mask, positions, cache)[:, -1].argmax(-1)
            for o, token in zip(out, chosen.tolist()):
                o.append(int(token))  # a finished row keeps decoding; its extra tokens are cut at the end
            t += 1
        return out


class SpecSoloDraft(_Engine):
    """Speculative: the draft proposes for each row alone; the target verifies the batch's live rows together."""

    style = "spec_solo_draft"

    def _run(self, prompts, max_new_tokens, eos):
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._batch(prompts[start:start + self.batch_size], max_new_tokens, eos)
        return out

    def _draft_call(self, cache: DynamicCache, tokens: list[int], start: int) -> torch.Tensor:
        positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
        return _forward(self.draft, torch.tensor([tokens]), None, positions, cache)[0]  # [q, V]

    def _propose(self, cache: DynamicCache, history: list[int], length: int, pending: int) -> list[int]:
        """k greedy draft tokens after `pending`; `history[:length]` is what the cache should hold before it."""
        _crop_to(cache, length)
        have = cache.get_seq_length()
        if have < length:
            self._draft_call(cache, history[have:length], have)
        proposals, fed = [], pending
        for i in range(self.k):
            fed = int(self._draft_call(cache, [fed], length + i)[-1].argmax())
            proposals.append(fed)
        return proposals

    def _prefill_target(self, prompts: list[list[int]]) -> list[DynamicCache]:
        """Per-row target caches of every prompt token but the last, from one left-padded batch pass."""
        heads = [p[:-1] for p in prompts]
        if max(len(h) for h in heads) == 0:
            return [DynamicCache(config=self.target.config) for _ in prompts]
        ids, real = _left_pad(heads, self.pad)
        width = ids.shape[1]
        if self.bug == POSITIONS:
            positions = torch.arange(width).expand(len(prompts), width)
        else:
            positions = (real.cumsum(-1) - 1).clamp(min=0)
        mask = torch.ones_like(real) if self.bug == MASK else real
        batch = DynamicCache(config=self.target.config)
        _forward(self.target, ids, mask, positions, batch)
        return _split(self.target, batch, [width - len(h) for h in heads])

    def _batch(self, prompts, max_new_tokens, eos):
        k = self.k
        target_caches = self._prefill_target(prompts)
        draft_caches = [DynamicCache(config=self.draft.config) for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        lengths = [len(p) - 1 for p in prompts]  # tokens of each row before its pending one
        pending = [p[-1] for p in prompts]
        live = list(range(len(prompts)))
        while live:
            proposals = [self._propose(draft_caches[i], prompts[i] + out[i], lengths[i], pending[i]) for i in live]
            batch, cached, width = _stack(self.target, [target_caches[i] for i in live])
            step = torch.tensor([[pending[i]] + props for i, props in zip(live, proposals)])  # [live, k + 1]
            real = torch.tensor([[0] * (width - n) + [1] * (n + k + 1) for n in cached], dtype=torch.long)
            if self.bug == POSITIONS:
                positions = torch.arange(width, width + k + 1).expand(len(live), k + 1)
            else:
                positions = torch.tensor([[lengths[i] + j for j in range(k + 1)] for i in live])
            mask = torch.ones_like(real) if self.bug == MASK else real
            choices = _forward(self.target, step, mask, positions, batch).argmax(-1).tolist()  # [live, k + 1]
            caches = _split(self.target, batch, [width - n for n in cached])
            still = []
            for i, props, row_choices, cache in zip(live, proposals, choices, caches):
                accepted = 0
                while accepted < k and props[accepted] == row_choices[accepted]:
                    accepted += 1
                if self.bug != STALE:
                    _crop_to(cache, cache.get_seq_length() - (k - accepted))  # drop the rejected proposals
                target_caches[i] = cache
                out[i] += props[:accepted] + [int(row_choices[accepted])]
                lengths[i] += accepted + 1
                pending[i] = int(row_choices[accepted])
                if not _done(out[i], max_new_tokens, eos):
                    still.append(i)
            live = still
        return out


def _factory(kind: type[_Engine], bug: str | None = None):
    def make(target: Any, draft: Any, *, batch_size: int = 4, draft_tokens: int = 4, pad_token_id: int | None = None,
             **_: Any) -> _Engine:
        pad = 0 if pad_token_id is None else int(pad_token_id)
        return kind(target, draft, max(1, int(batch_size)), max(1, int(draft_tokens or 4)), pad, bug)
    return make


at_once = _factory(AtOnce)
at_once_positions_over_padding = _factory(AtOnce, POSITIONS)
at_once_padding_visible = _factory(AtOnce, MASK)
buckets = _factory(Buckets)
buckets_positions_over_padding = _factory(Buckets, POSITIONS)
buckets_padding_visible = _factory(Buckets, MASK)
arrivals = _factory(Arrivals)
arrivals_positions_over_padding = _factory(Arrivals, POSITIONS)
arrivals_padding_visible = _factory(Arrivals, MASK)
slots = _factory(Slots)
slots_positions_over_padding = _factory(Slots, POSITIONS)
slots_padding_visible = _factory(Slots, MASK)
right_padded = _factory(RightPadded)
right_padded_positions_over_padding = _factory(RightPadded, POSITIONS)
right_padded_padding_visible = _factory(RightPadded, MASK)
spec_solo_draft = _factory(SpecSoloDraft)
spec_solo_draft_stale_cache = _factory(SpecSoloDraft, STALE)
spec_solo_draft_positions_over_padding = _factory(SpecSoloDraft, POSITIONS)
spec_solo_draft_padding_visible = _factory(SpecSoloDraft, MASK)

CORRECT = ("at_once", "buckets", "arrivals", "slots", "right_padded", "spec_solo_draft")
BUGGY = {  # engine -> (its correct twin, the cause it plants)
    "at_once_positions_over_padding": ("at_once", "position_ids"),
    "at_once_padding_visible": ("at_once", "attention_mask"),
    "buckets_positions_over_padding": ("buckets", "position_ids"),
    "buckets_padding_visible": ("buckets", "attention_mask"),
    "arrivals_positions_over_padding": ("arrivals", "position_ids"),
    "arrivals_padding_visible": ("arrivals", "attention_mask"),
    "slots_positions_over_padding": ("slots", "position_ids"),
    "slots_padding_visible": ("slots", "attention_mask"),
    "right_padded_positions_over_padding": ("right_padded", "position_ids"),
    "right_padded_padding_visible": ("right_padded", "attention_mask"),
    "spec_solo_draft_stale_cache": ("spec_solo_draft", "kv_cache"),
    "spec_solo_draft_positions_over_padding": ("spec_solo_draft", "position_ids"),
    "spec_solo_draft_padding_visible": ("spec_solo_draft", "attention_mask"),
}
