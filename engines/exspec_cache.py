"""EXSPEC's per-sequence caches: each active request owns its target and draft KV caches between
steps, one tensor `[layers, 2, heads, n - 1, head_dim]` per model; a step stacks them into one batch
cache and cuts each running sequence's columns back out (`engines/exspec.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines import layout
from specaudit.engines import ragged
from specaudit.engines import recurrent
from specaudit.engines.batch import BatchState


@dataclass
class Sequence:
    """An active request: its tokens (prompt + new) and its own caches of all but the last token."""

    request_id: int
    tokens: list[int]
    prompt_length: int
    target_kv: torch.Tensor | None  # [L, 2, H, n-1, D]; set when it enters the window
    draft_kv: torch.Tensor | None  # [L', 2, H', n-1, D'], None for a drafter without a cache
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, [emitted, V]
    target_states: list | None = None  # its own recurrent states (engines/recurrent.py), hybrid models only
    draft_states: list | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)


def stack_cache(model: PreTrainedModel, kvs: list[torch.Tensor]) -> DynamicCache:
    """One batch cache from per-sequence caches `[L, 2, H, S_b, D]`, right-aligned (zero padding
    on the left when the lengths differ): one stack (or one copy per row), then per-layer views."""
    lengths = [kv.shape[-2] for kv in kvs]
    width = max(lengths)
    if min(lengths) == width:
        stacked = torch.stack(kvs, dim=2)  # [L, 2, G, H, S, D]
    else:
        layers, _, heads, _, dim = kvs[0].shape
        stacked = kvs[0].new_zeros(layers, 2, len(kvs), heads, width, dim)  # [L, 2, G, H, W, D]
        for b, kv in enumerate(kvs):
            stacked[:, :, b, :, width - kv.shape[-2]:] = kv
    cache = layout.full_history_cache(model)  # sliding layers too: the mask applies the window
    layers = ragged.cache_layers(cache)  # attention layers (recurrent states are stacked apart)
    if len(layers) != stacked.shape[0]:
        raise ValueError(f"{len(kvs[0])} cached layers for a model with {len(layers)} attention layers")
    for layer, layer_kv in zip(layers, stacked.unbind(0)):
        layer.dtype, layer.device, layer.is_initialized = stacked.dtype, stacked.device, True
        layer.keys, layer.values = layer_kv[0], layer_kv[1]  # [G, H, W, D] each
    return cache


def unstack_cache(cache: DynamicCache, rows: list[int], starts: list[int], ends: list[int]) -> list[torch.Tensor]:
    """Cut row `rows[i]`'s columns `starts[i]:ends[i]` out of a batch cache, as `[L, 2, H, S, D]` views."""
    stacked = torch.stack([torch.stack((layer.keys, layer.values)) for layer in ragged.cache_layers(cache)])  # [L, 2, G, H, W, D]
    return [stacked[:, :, b, :, start:end] for b, start, end in zip(rows, starts, ends)]


def joinable(state: BatchState) -> bool:
    """Rows join a held batch through its attention caches only: recurrent states are restacked."""
    caches = [state.target_cache] + ([state.draft_cache] if state.draft_cache is not None else [])
    return not any(recurrent.tracks_states(cache) for cache in caches)


def join_rows(state: BatchState, newcomers: list[Sequence], target: PreTrainedModel, drafter: Any, pad_id: int) -> None:
    """Add `newcomers` (their own caches stacked) after the rows of the held batch `state`: tokens,
    lengths and caches right-aligned to the wider width (one copy of the held caches, not an unstack
    of every row and a new stack)."""
    device = target.device
    tokens, lengths = ragged.left_pad([s.tokens for s in newcomers], pad_id, device)
    width = max(state.tokens.shape[1], tokens.shape[1])
    state.tokens = torch.cat([ragged.widen_left(state.tokens, width, 1, pad_id), ragged.widen_left(tokens, width, 1, pad_id)])
    state.lengths = torch.cat([state.lengths, lengths])
    state.prompt_lengths = torch.cat([state.prompt_lengths, torch.tensor(
        [s.prompt_length for s in newcomers], dtype=torch.long, device=device)])
    state.rows = state.rows + [s.request_id for s in newcomers]
    for cache, model, kvs in ((state.target_cache, target, [s.target_kv for s in newcomers]),
                              (state.draft_cache, getattr(drafter, "draft", None), [s.draft_kv for s in newcomers])):
        if cache is not None:  # a drafter with a cache has its model as `draft`
            new = stack_cache(model, kvs)
            ragged.join_cache_rows(cache, new, max(ragged.cache_width(cache), ragged.cache_width(new)))
