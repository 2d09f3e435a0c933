"""Recurrent state (gated delta-net, short convolutions, Mamba-2) in the batched engines.

A KV cache is trimmed by dropping columns; a recurrent layer keeps one state per row instead (a
convolution window and, for gated delta-net and Mamba-2, an SSM state), and a verify pass over
k+1 tokens leaves it after all k+1, rejected ones included. The engines keep it exact this way:

- Padding never enters a state. Prompts are prefilled in groups of equal length
  (`batch._prefill_by_length`: no padding at all) and the group states are placed into the batch.
  Every later pass feeds only real tokens: each row's pending token and its draft tokens.
- Per-position states. In a model with recurrent layers every cached pass of q tokens
  (`forward_by_token`) runs as q single-token passes, the decoding path of the reference decoder,
  and after each one the recurrent states of every row are kept (`cache.history`): entry i is the
  state after the i+1-th token fed since the last commit.
- Rollback. `commit(cache, accepted_counts)` gives each row `history[accepted_counts[b]]`, its
  state after its pending token and its accepted draft tokens (the bonus token is pending, not yet
  fed), and clears the history. The draft's history holds its k drafting passes and, when some row
  accepted all k, the fill pass; the target's holds the k+1 verify positions. When no row has a
  token to undo (every row accepted all it fed: a step where no row drafted anything, or where every
  draft was accepted) the live states are kept as they are.
- Rows with fewer draft tokens than the step's longest proposal (`drafters.verify_drafts`) are fed pad
  ids after their own tokens; during those one-token passes the row keeps its state (`real_counts`),
  so padding never enters a state, not even the live one.
- Rows are selected with the KV rows (`select_rows`), and EXSPEC keeps each sequence's states
  beside its KV tensor (`row_states`, `load_rows`): rows never share a state.

Attention layers of a hybrid model keep full-history KV columns, exactly as in an attention-only
model (`engines/ops/layout.py`); `ragged.cache_layers` lists only those.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from specaudit.engines.ops.hf_call import cached_forward

State = list[torch.Tensor | None]  # per recurrent layer and state slot: conv then recurrent tensors


class StateClock:
    """Seconds spent on recurrent state bookkeeping, for `specaudit bench`: `snapshot` (the states
    kept after each one-token pass, padded rows held at theirs) and `rollback` (each row given its
    state at a commit). Both lie inside the engines' draft, verify and realign stages. Counts only
    between `start` and `stop`; on CUDA each lap waits for the device."""

    def __init__(self) -> None:
        self.running = False
        self.seconds = {"snapshot": 0.0, "rollback": 0.0}

    def start(self) -> None:
        self.running, self.seconds = True, {"snapshot": 0.0, "rollback": 0.0}

    def stop(self) -> dict[str, float]:
        self.running = False
        return dict(self.seconds)

    @contextmanager
    def lap(self, stage: str, device: torch.device) -> Iterator[None]:
        if not self.running:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds[stage] += time.perf_counter() - started


STATE_CLOCK = StateClock()


def is_recurrent_layer(layer: object) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


class HybridCache(DynamicCache):
    """Full-history `DynamicLayer`s for attention layers, `LinearAttentionLayer`s for recurrent
    ones, and the per-position recurrent states of the passes since the last commit."""

    def __init__(self, layers: list) -> None:
        Cache.__init__(self, layers=layers)
        self.history: list[State] = []
        self.fed: torch.Tensor | None = None  # [B] real tokens each row fed since the last commit


def new_cache(kinds: list[str]) -> HybridCache:
    """An empty cache for the layer kinds of `layout.attention_layer_kinds` ("recurrent" or attention)."""
    return HybridCache([LinearAttentionLayer() if kind == "recurrent" else DynamicLayer() for kind in kinds])


def tracks_states(cache: object) -> bool:
    """Whether `cache` keeps recurrent states (a `HybridCache`; told by its history, not its class,
    so that copies of this module, such as the planted-fault engines', agree with it)."""
    return isinstance(getattr(cache, "history", None), list)


def _recurrent(cache: HybridCache) -> list[LinearAttentionCacheLayerMixin]:
    return [layer for layer in cache.layers if is_recurrent_layer(layer)]


def snapshot(cache: HybridCache) -> State:
    """Every recurrent tensor of the cache, cloned (the layers update theirs in place)."""
    tensors: State = []
    for layer in _recurrent(cache):
        for slot in range(layer.number_of_states):
            for states in (layer.conv_states, layer.recurrent_states):
                tensors.append(None if states[slot] is None else states[slot].clone())
    return tensors


def _assign(cache: HybridCache, tensors: State) -> None:
    """Put `tensors` (the layout of `snapshot`) into the cache's recurrent layers."""
    it = iter(tensors)
    for layer in _recurrent(cache):
        for slot in range(layer.number_of_states):
            conv, rec = next(it), next(it)
            if conv is not None:
                layer.conv_states[slot] = conv
                layer.conv_kernel_size[slot] = conv.shape[-1]
                layer.is_conv_states_initialized[slot] = True
                layer.dtype, layer.device = conv.dtype, conv.device
            if rec is not None:
                layer.recurrent_states[slot] = rec
                layer.is_recurrent_states_initialized[slot] = True
                layer.dtype, layer.device = rec.dtype, rec.device
            layer.has_previous_state[slot] = conv is not None or rec is not None


def forward_by_token(
    model: PreTrainedModel,
    cache: HybridCache,
    inputs: torch.Tensor,  # [B, q] tokens after each row's cache
    attention_mask: torch.Tensor,  # [B, W + q] 2D mask of the whole pass
    position_ids: torch.Tensor,  # [B, q]
    real_counts: torch.Tensor | None = None,  # [B] each row's first tokens that are real; the rest are pad ids
) -> torch.Tensor:
    """One cached pass of q tokens as q single-token passes; keeps the states after each. Logits [B, q, V]."""
    width = attention_mask.shape[1] - inputs.shape[1]
    q = inputs.shape[1]
    real = torch.full((inputs.shape[0],), q, device=inputs.device) if real_counts is None else real_counts  # [B]
    logits = []
    for i in range(q):
        out = cached_forward(
            model,
            cache,
            input_ids=inputs[:, i : i + 1],  # [B, 1]
            attention_mask=attention_mask[:, : width + i + 1],  # [B, W + i + 1]
            position_ids=position_ids[:, i : i + 1],  # [B, 1]
        )
        logits.append(out.logits[:, -1:])  # [B, 1, V]
        with STATE_CLOCK.lap("snapshot", inputs.device):
            padded = real <= i  # [B] rows whose token i is a pad id: they keep the state they had before it
            if bool(padded.any()):
                _assign(cache, _where(padded, cache.history[-1], snapshot(cache)))
            cache.history.append(snapshot(cache))
    cache.fed = real if cache.fed is None else cache.fed + real
    return torch.cat(logits, dim=1)  # [B, q, V]


def _where(rows: torch.Tensor, chosen: State, other: State) -> State:
    """Per row: `chosen`'s tensors where `rows` [B] is True, `other`'s elsewhere."""
    return [o if c is None else torch.where(rows.to(c.device).view(-1, *[1] * (c.dim() - 1)), c, o)
            for c, o in zip(chosen, other)]


def commit(cache: Any, accepted_counts: torch.Tensor, keep: torch.Tensor | None = None) -> None:
    """Roll every row back to its state after `accepted_counts[b] + 1` tokens of this step (its
    pending token and accepted draft tokens), then keep the rows `keep` if given."""
    if not tracks_states(cache):
        return
    with STATE_CLOCK.lap("rollback", accepted_counts.device):
        fed, cache.fed = cache.fed, None  # [B] tokens each row fed since the last commit
        if cache.history and fed is not None and not bool((accepted_counts + 1 < fed.to(accepted_counts.device)).any()):
            # nothing to undo (no row drafted anything, or every row accepted all it drafted): every live
            # state is already the row's state after its accepted tokens, padding never having entered one
            cache.history = []
        elif cache.history:
            rows = torch.arange(accepted_counts.shape[0], device=accepted_counts.device)  # [B]
            # a row that finished this step may have accepted more than was fed (no fill pass for it): it leaves the batch
            positions = accepted_counts.clamp(max=len(cache.history) - 1)  # [B]
            chosen: State = []
            for slot in range(len(cache.history[0])):
                per_position = [entry[slot] for entry in cache.history]
                if per_position[0] is None:
                    chosen.append(None)
                    continue
                stacked = torch.stack(per_position)  # [T, B, ...]
                chosen.append(stacked[positions.to(stacked.device), rows.to(stacked.device)])  # [B, ...]
            _assign(cache, chosen)
            cache.history = []
    if keep is not None:
        select_rows(cache, keep)


def select_rows(cache: Any, keep: torch.Tensor) -> None:
    """Keep the rows `keep` of every recurrent state (and of the per-position history)."""
    if not tracks_states(cache):
        return
    _assign(cache, [None if t is None else t.index_select(0, keep.to(t.device)) for t in snapshot(cache)])
    cache.history = [[None if t is None else t.index_select(0, keep.to(t.device)) for t in entry]
                     for entry in cache.history]
    if cache.fed is not None:
        cache.fed = cache.fed.index_select(0, keep.to(cache.fed.device))


def row_states(cache: Any, rows: list[int]) -> list[State | None]:
    """Each of `rows`' own recurrent states (EXSPEC keeps them with the sequence); None without any."""
    if not tracks_states(cache):
        return [None] * len(rows)
    tensors = snapshot(cache)
    return [[None if t is None else t[b].clone() for t in tensors] for b in rows]


def load_rows(cache: Any, states: list[State | None]) -> None:
    """Stack per-sequence states (from `row_states`) into the recurrent layers of a fresh batch cache."""
    if not tracks_states(cache) or not states or states[0] is None:
        return
    stacked: State = []
    for slot in range(len(states[0])):
        parts = [s[slot] for s in states]
        stacked.append(None if parts[0] is None else torch.stack(parts))  # [G, ...]
    _assign(cache, stacked)


def place_rows(cache: Any, group_cache: Any, index: torch.Tensor, batch_size: int) -> None:
    """Copy a prefill group's states into rows `index` of the batch cache (allocated on first use)."""
    if not tracks_states(cache):
        return
    group = snapshot(group_cache)
    current = snapshot(cache)
    merged: State = []
    for mine, theirs in zip(current, group):
        if theirs is None:
            merged.append(mine)
            continue
        if mine is None:
            mine = theirs.new_zeros(batch_size, *theirs.shape[1:])
        mine[index.to(mine.device)] = theirs
        merged.append(mine)
    _assign(cache, merged)
