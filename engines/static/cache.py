"""A cache of fixed shape: rows left-aligned in buffers allocated once, each row written at its own end.

Row `b` holds its `c_b` cached tokens in columns `0 .. c_b - 1` of a buffer `[B, H, L, D]` per layer
(`L`: the longest request's prompt, new tokens and one verify pass). A pass of `q` tokens writes its keys
and values at columns `c_b .. c_b + q - 1` of its own row (`StaticLayer.update`, index writes with device
offsets) and attends over all `L` columns through a per-row, per-query mask: query `i` of row `b` (position
`c_b + i`) sees columns `0 .. c_b + i`. The masks are additive for every model (the same weights as a
boolean mask for SDPA and eager attention alike): a boolean one lets an attention function find each
row's visible columns on the host, as `models/attention.py`'s per-row split does, which a captured pass
cannot do. Columns past a row's end hold stale or zero keys and values, finite, weighted exactly zero.
Every tensor a pass creates has a shape fixed by `(B, q, L)`, and none is read on the host, so the pass
can be captured (`capture.PassRunner`). A rejected draft token's columns lie past
the row's new end: accepting a step is only new lengths, as in EXSPEC's held batch (`ops/layout.RowEndsLayer`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specaudit.engines.ops import layout
from specaudit.engines.ops.hf_call import cache_keyword


class StaticLayer(DynamicLayer):
    """Keys and values in fixed buffers `[B, H, L, D]`; `write_at` [B] (each row's cached length, set before
    every pass) says where a pass writes. `keys`/`values` are always the whole buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values  # [B, H, L, D]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.write_at: torch.Tensor | None = None  # [B]
        self.rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1)  # [B, 1]
        self.offsets = torch.arange(keys.shape[-2], device=keys.device)  # [L]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        q = key_states.shape[-2]
        columns = self.write_at.unsqueeze(1) + self.offsets[:q]  # [B, q] each row's own next columns
        self.keys[self.rows, :, columns] = key_states.transpose(1, 2)  # [B, q, H, D]
        self.values[self.rows, :, columns] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.keys.shape[-2]


class StaticCache:
    """One model's fixed buffers for a batch of `rows` rows of at most `columns` tokens, with each row's
    cached length `lengths` [B] on the device."""

    def __init__(self, model: PreTrainedModel, rows: int, columns: int) -> None:
        config = model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = len(layout.attention_layer_kinds(model))
        self.model, self.rows, self.columns = model, rows, columns
        self.dtype, self.device = model.dtype, model.device
        self.layers = [StaticLayer(torch.zeros(rows, heads, columns, head_dim, dtype=self.dtype, device=self.device),
                                   torch.zeros(rows, heads, columns, head_dim, dtype=self.dtype, device=self.device))
                       for _ in range(layers)]
        self.cache = DynamicCache()
        self.cache.layers.extend(self.layers)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)  # [B] cached tokens per row
        self.keyword = cache_keyword(model)
        self.columns_index = torch.arange(columns, device=self.device)  # [L]

    def mask(self, first: torch.Tensor, q: int) -> torch.Tensor:
        """`[B, 1, q, L]`: query i of row b (position first_b + i) sees columns 0 .. first_b + i."""
        last = first.unsqueeze(1) + self.columns_index[:q]  # [B, q]
        visible = (self.columns_index.view(1, 1, -1) <= last.unsqueeze(2)).unsqueeze(1)  # [B, 1, q, L]
        return layout.additive_mask(visible, self.dtype)

    def forward(self, input_ids: torch.Tensor, write_at: torch.Tensor) -> torch.Tensor:
        """One pass of `q` tokens per row written at `write_at` [B]: logits [B, q, V]. Fixed shapes, no host read."""
        q = input_ids.shape[1]
        for layer in self.layers:
            layer.write_at = write_at
        positions = write_at.unsqueeze(1) + self.columns_index[:q]  # [B, q]
        out = self.model(input_ids=input_ids, attention_mask=self.mask(write_at, q), position_ids=positions,
                         use_cache=True, **{self.keyword: self.cache})
        return out.logits

    def prefill(self, rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Write the prompts `tokens` [n, W] (left-aligned, `lengths` [n] real tokens each, padding after) into
        the rows `rows` [n] from column 0, and set those rows' lengths; the logits at each prompt's last token
        [n, V]. One eager pass (its width W varies): not a captured pass."""
        n, width = tokens.shape
        # the prompts' own W columns only (not the slots' whole L): every one is written by this pass, and
        # the columns past each row's end stay masked until the row's next pass writes over them
        views = [StaticLayer(layer.keys.new_zeros(n, layer.keys.shape[1], width, layer.keys.shape[-1]),
                             layer.values.new_zeros(n, layer.values.shape[1], width, layer.values.shape[-1]))
                 for layer in self.layers]
        cache = DynamicCache()
        cache.layers.extend(views)
        for view in views:
            view.write_at = torch.zeros(n, dtype=torch.long, device=self.device)
        columns = torch.arange(width, device=self.device)
        causal = columns.view(1, -1) <= columns.view(-1, 1)  # [W, W]
        visible = (causal.unsqueeze(0) & (columns.view(1, 1, -1) < lengths.view(-1, 1, 1))).unsqueeze(1)  # [n,1,W,W]
        mask = layout.additive_mask(visible, self.dtype)
        positions = columns.unsqueeze(0).expand(n, width)
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.keyword: cache})
        for layer, view in zip(self.layers, views):
            layer.keys[rows, :, :width] = view.keys
            layer.values[rows, :, :width] = view.values
        self.lengths[rows] = lengths
        return out.logits[torch.arange(n, device=self.device), lengths - 1]  # [n, V]


def static_supported(*models: PreTrainedModel | None) -> bool:
    """Every layer full attention with a mask the model takes prepared (SDPA or eager), and no experts
    (their routing reads the host)."""
    present = [m for m in models if m is not None]
    return (layout.row_ends_supported(*present)
            and all(layout.experts_implementation(m) is None for m in present))
