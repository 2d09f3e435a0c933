"""The model forwards of the diagnosis's replays: one row, batch size 1, under any position ids and mask.

`replay_all` runs a whole sequence uncached: the target's replays under a hypothesis, which change
positions or visibility anywhere in the row. `GrowingReplay` serves the loop that rebuilds a draft model's
steps (the rejected slots of an engine without a trace): each proposal is the last-token argmax of a sequence
that differs from the one before it only near its end. It keeps the key/value cache of the longest prefix
whose slots are unchanged and feeds the rest; a slot's keys and values depend only on its token, its
position and the slots its query sees, so that prefix's cache is what a whole replay would compute again
(up to the rounding of a different matmul shape: the loops take the argmax). Models whose cache is not
one plain attention cache per layer (recurrent layers, sliding windows) are replayed whole.
"""

from __future__ import annotations

from typing import Any

import torch


def position_limit(model: Any) -> int | None:
    """The model's position table size, where it has one."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, key, None)
        if isinstance(value, int):
            return value
    return None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: Any, hidden: float | None = None) -> torch.Tensor:
    """[1, 1, Q, K] additive mask from `allowed` [Q, K] (key j visible to query i); `hidden`: the value of a hidden
    entry (the dtype's lowest by default: a query that may read nothing then averages every key; -inf: it reads
    nothing, as attention under a boolean mask computes it)."""
    mask = torch.zeros(1, 1, *allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed.to(device).view(1, 1, *allowed.shape),
                             torch.finfo(dtype).min if hidden is None else hidden)


@torch.no_grad()
def replay_all(target: Any, ids: list[int], positions: list[int], allowed: torch.Tensor | None = None,
               window: torch.Tensor | None = None, hidden: float | None = None) -> torch.Tensor | None:
    """The target's logits [L, V] at every token of `ids` at `positions`, batch size 1, no cache, under
    the causal mask or `allowed` [L, L] (key j visible to query i); `window` [L, L]: what the sliding-window
    layers see instead (handed as the masks per layer type); `hidden`: the value of a hidden entry (`additive_mask`);
    None when the model refuses them."""
    limit = position_limit(target)
    if limit is not None and max(positions) >= limit:
        return None
    device = target.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)
    # without `allowed`, causal; with it, an additive [1, 1, L, L] mask, taken by the model as it is
    mask = torch.ones_like(input_ids) if allowed is None else additive_mask(allowed, target.dtype, device, hidden)
    if allowed is not None and window is not None:
        mask = {"full_attention": mask, "sliding_attention": additive_mask(window, target.dtype, device, hidden)}
    try:
        out = target(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    except (IndexError, RuntimeError, ValueError):
        return None
    return out.logits[0]


@torch.no_grad()
def replay_last(target: Any, ids: list[int], positions: list[int], allowed: torch.Tensor | None = None
                ) -> torch.Tensor | None:
    """The target's logits [V] after `ids` at `positions`, batch size 1, no cache; None when the
    model refuses those positions (beyond its position table)."""
    logits = replay_all(target, ids, positions, allowed)
    return None if logits is None else logits[-1]


def plain_attention_cache(model: Any) -> bool:
    """Whether every layer of the model's cache is a plain key/value cache that can be cropped to any
    length and read under any mask (no recurrent state, no sliding window)."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=model.config).layers
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def feed_after(model: Any, cache: Any, ids: list[int], positions: list[int], allowed: torch.Tensor,
               start: int) -> torch.Tensor | None:
    """The logits [L - start, V] of slots start.. of `ids`, fed after `cache` (holding slots ..start) under
    `allowed` [L, L]; None when the model raises."""
    from specaudit.engines.ops.hf_call import cached_forward

    device = model.device
    try:
        out = cached_forward(
            model, cache,
            input_ids=torch.tensor([ids[start:]], dtype=torch.long, device=device),  # [1, L - start]
            position_ids=torch.tensor([positions[start:]], dtype=torch.long, device=device),
            attention_mask=additive_mask(allowed[start:], model.dtype, device))  # [1, 1, L - start, L]
    except (IndexError, RuntimeError, ValueError):
        return None
    return out.logits[0]


def unchanged_slots(cached: tuple[list[int], list[int], torch.Tensor], ids: list[int], positions: list[int],
                    allowed: torch.Tensor | None, limit: int) -> int:
    """How many leading slots (at most `limit`) have the token, position and visible slots they have in `cached`
    (ids, positions, allowed [n, n]); `allowed` None: causal, as `cached` is where it is left unchecked."""
    cached_ids, cached_positions, cached_allowed = cached
    limit = min(len(cached_ids), limit)
    same = 0
    while same < limit and cached_ids[same] == ids[same] and cached_positions[same] == positions[same]:
        same += 1
    if same and allowed is not None:
        rows_equal = (allowed[:same, :same] == cached_allowed[:same, :same]).all(dim=1)  # [same]
        changed = (~rows_equal).nonzero()  # rows whose query sees otherwise
        if changed.numel():
            same = int(changed[0])
    return same


class GrowingReplay:
    """`replay_last` of one model over a sequence of slots that mostly grows at its end, reusing the key/value
    cache of the longest unchanged prefix (see the module)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cacheable = plain_attention_cache(model)
        self.cache: Any = None
        self.ids: list[int] = []  # the slots in the cache: their tokens,
        self.positions: list[int] = []  # positions
        self.allowed = torch.zeros(0, 0, dtype=torch.bool)  # and what each query saw [n, n]

    @torch.no_grad()
    def last(self, ids: list[int], positions: list[int], allowed: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model's logits [V] at the last of `ids` at `positions` under `allowed` [L, L] (causal when
        None); None when the model refuses them."""
        if not self.cacheable:
            return replay_last(self.model, ids, positions, allowed)
        limit = position_limit(self.model)
        if limit is not None and max(positions) >= limit:
            return None
        from transformers import DynamicCache

        total = len(ids)
        if allowed is None:
            allowed = torch.ones(total, total, dtype=torch.bool).tril()
        # the last slot is always fed: its logits are the answer
        start = (unchanged_slots((self.ids, self.positions, self.allowed), ids, positions, allowed, total - 1)
                 if self.cache is not None else 0)
        if self.cache is None or start == 0:
            self.cache = DynamicCache(config=self.model.config)
            start = 0
        elif start < len(self.ids):
            for layer in self.cache.layers:  # [1, H, n, D] -> [1, H, start, D] (`crop`'s argument differs across releases)
                layer.keys, layer.values = layer.keys[..., :start, :], layer.values[..., :start, :]
        logits = feed_after(self.model, self.cache, ids, positions, allowed, start)
        if logits is None:
            self.cache = None
            return replay_last(self.model, ids, positions, allowed)
        self.ids, self.positions, self.allowed = list(ids), list(positions), allowed.clone()
        return logits[-1]


class PrefixReplay:
    """Replays of one model under hypotheses that share a prefix with one causal sequence (the plain replay's
    prompt and new tokens): that sequence's key/value cache is computed once, and each replay feeds its slots
    from the first whose token, position or visible slots differ from it (or from the first row asked for)."""

    def __init__(self, model: Any, ids: list[int], positions: list[int]) -> None:
        self.model = model
        self.ids, self.positions = list(ids), list(positions)
        self.cacheable = plain_attention_cache(model) and len(ids) > 1
        # what each of the sequence's queries sees [P, P], for the models whose replays can share its cache
        self.causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril() if self.cacheable else None
        self.cache: Any = None
        self.pinned: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: the sequence's keys, values [1, H, P, D]

    def _pin(self) -> bool:
        """The pinned sequence's cache, computed on first use; False where the model refuses it."""
        if self.pinned:
            return True
        from transformers import DynamicCache

        from specaudit.engines.ops.hf_call import cached_forward

        device = self.model.device
        self.cache = DynamicCache(config=self.model.config)
        try:
            cached_forward(self.model, self.cache, input_ids=torch.tensor([self.ids], dtype=torch.long, device=device),
                           position_ids=torch.tensor([self.positions], dtype=torch.long, device=device),
                           attention_mask=torch.ones(1, len(self.ids), dtype=torch.long, device=device))
        except (IndexError, RuntimeError, ValueError):
            self.cacheable = False
            return False
        self.pinned = [(layer.keys, layer.values) for layer in self.cache.layers]
        return True

    @torch.no_grad()
    def rows(self, ids: list[int], positions: list[int], allowed: torch.Tensor | None = None,
             first: int = 0) -> torch.Tensor | None:
        """The model's logits [L - first, V] at rows first.. of `ids` at `positions` under `allowed` [L, L]
        (causal when None), as `replay_all(...)[first:]` computes them; None when the model refuses them."""
        limit = position_limit(self.model)
        if limit is not None and max(positions) >= limit:
            return None
        shared = unchanged_slots((self.ids, self.positions, self.causal), ids, positions, allowed, first) if self.cacheable else 0
        if shared == 0 or not self._pin():
            logits = replay_all(self.model, ids, positions, allowed)
            return None if logits is None else logits[first:]
        for layer, (keys, values) in zip(self.cache.layers, self.pinned):  # the shared slots' entries, as views
            layer.keys, layer.values = keys[..., :shared, :], values[..., :shared, :]
        total = len(ids)
        if allowed is None:
            allowed = torch.ones(total, total, dtype=torch.bool).tril()
        logits = feed_after(self.model, self.cache, ids, positions, allowed, shared)
        if logits is None:
            logits = replay_all(self.model, ids, positions, allowed)
            return None if logits is None else logits[first:]
        return logits[first - shared:]
