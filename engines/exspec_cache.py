"""EXSPEC's per-sequence caches: each active request owns its target and draft KV caches between
steps, one `RowKV` per model (per attention layer, keys and values `[heads, n - 1, head_dim]`); a
step stacks them into one batch cache and cuts each running sequence's columns back out
(`engines/exspec.py`).

Cutting copies nothing: a `RowKV` holds views of the batch cache it was cut from (which stays
alive while some row still views it), and the next stack copies each row once, straight into the
new batch. On one CPU thread a copy into fresh memory costs several times the copy itself (the
pages are faulted in on first touch: 4 s for the 720 MB cache of the bench pair's 8 longest
prompts, against 0.2 s for a copy within touched memory), so the per-sequence form must not be a
tensor of its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines.ops import layout
from specaudit.engines.ops import ragged
from specaudit.engines.ops import recurrent
from specaudit.engines.batch import BatchState


@dataclass
class RowKV:
    """One sequence's keys and values in one model: per attention layer, `(keys, values)`, each
    `[H, S, D]` (usually views into a batch cache; `S` = its cached tokens, the same in every layer)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def width(self) -> int:
        return self.layers[0][0].shape[-2] if self.layers else 0

    def tensor(self) -> torch.Tensor:
        """A copy as one tensor `[L, 2, H, S, D]` (for inspection and tests)."""
        return torch.stack([torch.stack(kv) for kv in self.layers])

    @classmethod
    def from_tensor(cls, kv: torch.Tensor) -> "RowKV":
        """From one tensor `[L, 2, H, S, D]` (views of it, no copy)."""
        return cls([(layer[0], layer[1]) for layer in kv.unbind(0)])


@dataclass
class Sequence:
    """An active request: its tokens (prompt + new) and its own caches of all but the last token."""

    request_id: int
    tokens: list[int]
    prompt_length: int
    target_kv: RowKV | None  # n - 1 columns per layer; set when it enters the window
    draft_kv: RowKV | None  # the same for the draft; None for a drafter without a cache
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, [emitted, V]
    target_states: list | None = None  # its own recurrent states (engines/ops/recurrent.py), hybrid models only
    draft_states: list | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)


def stack_cache(model: PreTrainedModel, kvs: list[RowKV], spare: int | None = None, row_ends: bool = False,
                rows: int | None = None, columns: int = 0) -> DynamicCache:
    """One batch cache from per-sequence caches, right-aligned (zero padding on the left when the
    widths differ): per layer one buffer `[G, H, W + spare, D]`, each row copied into it once, the
    next passes writing into the `spare` columns left (`layout.spare_width(W)` unless given).
    `row_ends`: left-aligned instead, each row growing at its own end, with room for `rows` rows of
    `columns` columns (`layout.RowEndsLayer`)."""
    if row_ends:
        return layout.row_ends_cache(_by_layer(kvs), [kv.width for kv in kvs], max(rows or 0, len(kvs)), columns)
    cache = layout.full_history_cache(model)  # sliding layers too: the mask applies the window
    layers = ragged.cache_layers(cache)  # attention layers (recurrent states are stacked apart)
    if len(layers) != len(kvs[0].layers):
        raise ValueError(f"{len(kvs[0].layers)} cached layers for a model with {len(layers)} attention layers")
    width = max(kv.width for kv in kvs)
    spare = layout.spare_width(width) if spare is None else spare
    for i, layer in enumerate(layers):
        _hold_rows(layer, [], [kv.layers[i] for kv in kvs], width, spare)
    return cache


def _by_layer(kvs: list[RowKV]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`[layer][row]` (keys, values) from per-row caches."""
    return [[kv.layers[i] for kv in kvs] for i in range(len(kvs[0].layers))]


def _hold_rows(layer: Any, blocks: list[tuple[torch.Tensor, torch.Tensor]], rows: list[tuple[torch.Tensor, torch.Tensor]],
               width: int, spare: int) -> None:
    """Give `layer` new buffers with `spare` columns of room holding, right-aligned in `width` columns, the
    row blocks `blocks` (keys and values `[G, H, S, D]`) and then the single rows `rows` (`[H, S, D]`)."""
    parts = blocks + [(keys.unsqueeze(0), values.unsqueeze(0)) for keys, values in rows]
    layout.hold_columns(layer, ragged.right_aligned([keys for keys, _ in parts], width, spare),
                        ragged.right_aligned([values for _, values in parts], width, spare), width)


def unstack_cache(cache: DynamicCache, rows: list[int], starts: list[int], ends: list[int]) -> list[RowKV]:
    """Cut row `rows[i]`'s columns `starts[i]:ends[i]` out of a batch cache: views, no copy."""
    layers = ragged.cache_layers(cache)
    return [RowKV([(layer.keys[b, :, start:end], layer.values[b, :, start:end]) for layer in layers])
            for b, start, end in zip(rows, starts, ends)]


def joinable(state: BatchState) -> bool:
    """Rows join a held batch through its attention caches only: recurrent states are restacked."""
    caches = [state.target_cache] + ([state.draft_cache] if state.draft_cache is not None else [])
    return not any(recurrent.tracks_states(cache) for cache in caches)


def join_rows(state: BatchState, newcomers: list[Sequence], target: PreTrainedModel, drafter: Any, pad_id: int) -> None:
    """Add `newcomers` after the rows of the held batch `state`: tokens, lengths and caches
    right-aligned to the wider width, each layer one new buffer with spare columns into which the
    held rows and every newcomer are copied once (no unstack of the held rows, no stack of their own)."""
    device = target.device
    tokens, lengths = ragged.left_pad([s.tokens for s in newcomers], pad_id, device)
    width = max(state.tokens.shape[1], tokens.shape[1])
    state.tokens = torch.cat([ragged.widen_left(state.tokens, width, 1, pad_id), ragged.widen_left(tokens, width, 1, pad_id)])
    state.lengths = torch.cat([state.lengths, lengths])
    state.prompt_lengths = torch.cat([state.prompt_lengths, torch.tensor(
        [s.prompt_length for s in newcomers], dtype=torch.long, device=device)])
    held_rows = len(state.rows)
    state.rows = state.rows + [s.request_id for s in newcomers]
    for cache, kvs in ((state.target_cache, [s.target_kv for s in newcomers]),
                       (state.draft_cache, [s.draft_kv for s in newcomers])):
        if cache is None:
            continue
        if layout.is_row_ends(cache):  # into the free rows of its buffers, nothing else moves
            layout.append_rows(cache, held_rows, _by_layer(kvs), [kv.width for kv in kvs])
            continue
        columns = max([ragged.cache_width(cache)] + [kv.width for kv in kvs])
        for i, layer in enumerate(ragged.cache_layers(cache)):
            _hold_rows(layer, [(layer.keys, layer.values)], [kv.layers[i] for kv in kvs], columns,
                       layout.spare_width(columns))


def held_spans(state: BatchState, sequences: list[Sequence]) -> tuple[list[int], list[int]]:
    """Where each sequence's `n - 1` cached columns lie in a held batch: left-aligned (row ends) or right-aligned."""
    if layout.is_row_ends(state.target_cache):
        return [0] * len(sequences), [s.length - 1 for s in sequences]
    width = ragged.cache_width(state.target_cache)
    return [width - s.length + 1 for s in sequences], [width] * len(sequences)
