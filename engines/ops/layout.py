"""What the batched engines need from a model's architecture, and the caches they give it.

The engines (EQSPEC, EXSPEC, their drafters) keep every row's whole history in every layer: one
plain growing cache layer (`DynamicLayer`) per attention layer, right-aligned rows, padding on the
left. A sliding-window layer gets the same full-history layer; its window is applied by the model's
own attention mask, which transformers computes from column indices (`kv_idx > q_idx - window`).
A row's real tokens are contiguous columns, so a column difference is a position difference and the
window is the row's own, whatever its left padding (proved token- and logit-exact against the
model's own sliding cache at batch size 1 in float64 by `tests/test_architectures.py`). Per-layer
RoPE settings and attention sinks live inside the attention modules and need nothing here.

Supported: every layer a full-attention or sliding-window attention layer (the cache layer types
transformers builds for them) or a recurrent layer (gated delta-net, short convolution, Mamba-2:
transformers' `LinearAttentionLayer`), whose per-row state the engines roll back after each
verification (`engines/ops/recurrent.py`). Anything else (layers that are attention and recurrent at
once, chunked attention, layers that share another layer's cache, recurrent states kept inside the
model's modules instead of its cache: RecurrentGemma) is refused before any run by
`check_supported`, with one line naming the architecture and what is missing.

EXSPEC's held batch keeps its rows left-aligned instead, each growing at its own end
(`RowEndsLayer`, below), where every layer is full attention.

Float64 switches (eager experts, a float64 softmax) are in `engines/models/float64.py`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from specaudit.engines.ops import recurrent


class UnsupportedModel(ValueError):
    """A model the batched engines cannot run exactly; the message is one line."""


def last_logits_only(model: PreTrainedModel) -> dict[str, int]:
    """`{"logits_to_keep": 1}` when the model's forward takes it, else `{}`: a prompt pass needs only
    the last position's logits, and with a large vocabulary the others cost more than the layers."""
    import inspect

    try:
        accepts = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepts = False
    return {"logits_to_keep": 1} if accepts else {}


def architecture_name(model: PreTrainedModel) -> str:
    names = getattr(model.config, "architectures", None) or [type(model).__name__]
    return str(names[0])


def _model_cache(model: PreTrainedModel) -> DynamicCache:
    """The cache transformers itself would build for `model` (one layer per attention layer)."""
    return DynamicCache(config=model.config)


def attention_layer_kinds(model: PreTrainedModel) -> list[str]:
    """Per layer: "full", "sliding", "recurrent" or the name of an unsupported cache layer class."""
    kinds = []
    for layer in _model_cache(model).layers:
        if type(layer) is DynamicLayer:
            kinds.append("full")
        elif type(layer) is DynamicSlidingWindowLayer:
            kinds.append("sliding")
        elif type(layer) is LinearAttentionLayer:
            kinds.append("recurrent")
        else:
            kinds.append(type(layer).__name__)
    return kinds


def check_supported(model: PreTrainedModel, role: str = "model") -> None:
    """Raise `UnsupportedModel` (one line) when the engines cannot keep `model`'s caches exactly."""
    kinds = attention_layer_kinds(model)
    unsupported = sorted({k for k in kinds if k not in ("full", "sliding", "recurrent")})
    if unsupported:
        raise UnsupportedModel(
            f"{role} {architecture_name(model)}: cache layers {', '.join(unsupported)} are not supported "
            f"(the batched engines keep full-attention, sliding-window attention and recurrent layers only)"
        )
    if "recurrent" in kinds and not any(k in ("full", "sliding") for k in kinds):
        raise UnsupportedModel(
            f"{role} {architecture_name(model)}: recurrent layers only, no attention layer "
            f"(the batched engines run hybrid recurrent models, not pure state-space ones)"
        )
    if "recurrent" in kinds and not states_in_cache(model):
        raise UnsupportedModel(
            f"{role} {architecture_name(model)}: its recurrent layers keep their state inside the model's modules, "
            f"not in the cache it is given (the batched engines roll back per-row states they can reach)"
        )


def states_in_cache(model: PreTrainedModel) -> bool:
    """Whether the model's code writes its recurrent states into the cache object it is handed (the
    cache's `update_conv_state` / `update_recurrent_state`, transformers' `LinearAttentionLayer`), which
    the engines select, roll back and stack per row. RecurrentGemma keeps them in module attributes
    instead. Read from the source of the modules the model's layers come from (True when unreadable)."""
    known = getattr(model, "_specaudit_states_in_cache", None)
    if known is None:
        known = False
        for name in sorted({type(module).__module__ for module in model.modules()}):
            try:
                source = inspect.getsource(sys.modules[name])
            except (KeyError, OSError, TypeError):
                known = True
                break
            if "update_conv_state" in source or "update_recurrent_state" in source:
                known = True
                break
        model._specaudit_states_in_cache = known
    return known


class SpareColumnsLayer(DynamicLayer):
    """A full-history layer whose keys and values live in buffers with spare columns: `update` writes
    the new columns in place and `keys` / `values` are views of the filled part. `DynamicLayer.update`
    concatenates instead, a copy of the whole cache in every pass (48 copies of [8, 8, 1000, 64]
    float32: 0.14 s per pass on one CPU thread, a quarter of the bench pair's verify pass).

    When `keys` is no longer a prefix view of the buffer (an engine realigned, selected or joined
    rows: new tensors), the next update copies it into a new buffer with room to spare, as the
    concatenation would have. Columns past the view (cropped or never filled) are overwritten by the
    next update: nothing may keep a view of them."""

    SPARE_MIN = 64  # columns of room at least; else a quarter of the filled width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = getattr(self, "keys", None), getattr(self, "values", None)
        if not self.is_initialized or keys is None or not keys.numel():
            return super().update(key_states, value_states, *args, **kwargs)
        filled, new = keys.shape[-2], key_states.shape[-2]
        key_buffer, value_buffer = getattr(self, "_buffers", (None, None))
        if not (_is_prefix(keys, key_buffer) and _is_prefix(values, value_buffer) and filled + new <= key_buffer.shape[-2]):
            capacity = filled + new + max(self.SPARE_MIN, (filled + new) // 4)
            key_buffer = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])  # [B, H, C, D]
            value_buffer = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
            key_buffer[..., :filled, :] = keys
            value_buffer[..., :filled, :] = values
            self._buffers = (key_buffer, value_buffer)
        key_buffer[..., filled:filled + new, :] = key_states
        value_buffer[..., filled:filled + new, :] = value_states
        self.keys, self.values = key_buffer[..., :filled + new, :], value_buffer[..., :filled + new, :]
        return self.keys, self.values


def _is_prefix(view: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """Whether `view` is `buffer[..., :n, :]` for some n."""
    return (buffer is not None and view.data_ptr() == buffer.data_ptr() and view.shape[:-2] == buffer.shape[:-2]
            and view.shape[-1] == buffer.shape[-1] and view.stride() == buffer.stride())


def spare_width(width: int) -> int:
    """Columns of room to leave after `width` filled ones (as `SpareColumnsLayer.update` does)."""
    return max(SpareColumnsLayer.SPARE_MIN, width // 4)


def hold_columns(layer: Any, key_buffer: torch.Tensor, value_buffer: torch.Tensor, width: int) -> None:
    """Make `layer` hold the first `width` columns of buffers `[B, H, C, D]` (`C >= width`); a plain
    full-history layer keeps the buffers, and its next passes write into the columns left."""
    layer.dtype, layer.device, layer.is_initialized = key_buffer.dtype, key_buffer.device, True
    layer.keys, layer.values = key_buffer[..., :width, :], value_buffer[..., :width, :]
    if type(layer) in (DynamicLayer, SpareColumnsLayer) and key_buffer.shape[-2] > width:
        layer.__class__ = SpareColumnsLayer
        layer._buffers = (key_buffer, value_buffer)


def spare_columns(cache: Any) -> None:
    """Give every plain full-history layer of `cache` spare columns (`SpareColumnsLayer`); sliding,
    recurrent and other layer kinds keep their own update."""
    for layer in getattr(cache, "layers", None) or []:
        if type(layer) is DynamicLayer:
            layer.__class__ = SpareColumnsLayer


def full_history_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache with one full-history `DynamicLayer` per attention layer of `model`
    (sliding-window layers included: the attention mask applies their window); for a model with
    recurrent layers a `recurrent.HybridCache`, their states beside the attention layers."""
    kinds = attention_layer_kinds(model)
    if "recurrent" in kinds:
        return recurrent.new_cache(kinds)
    count = len(kinds)
    cache = DynamicCache()
    if count:
        cache.layers.extend(DynamicLayer() for _ in range(count))
    return cache


def layout_info(model: PreTrainedModel) -> dict[str, Any]:
    """Facts a report shows about how the engines run `model`."""
    kinds = attention_layer_kinds(model)
    info: dict[str, Any] = {"architecture": architecture_name(model), "layers": len(kinds)}
    recurrent_layers = kinds.count("recurrent")
    if recurrent_layers:
        info["recurrent_layers"] = recurrent_layers
    sliding = kinds.count("sliding")
    if sliding:
        window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
        info["sliding_layers"] = sliding
        info["sliding_window"] = window
    experts = experts_implementation(model)
    if experts is not None:
        info["experts_implementation"] = experts
    return info


def experts_implementation(model: PreTrainedModel) -> str | None:
    """The model's expert implementation ("eager", "grouped_mm", ...), None without experts."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return None
    return getattr(model.config, "_experts_implementation", None)


# Row ends: a batch cache whose rows are left-aligned and grow at their own ends (`cache_seqlens[B]`).
#
# The ragged caches of `engines/batch.py` right-align every row, so after a speculative step in which
# rows accepted different numbers of draft tokens every row must move (`ragged.realign_cache`: one
# copy of the whole cache per step). Here row `b` holds its `c_b` cached tokens in columns
# `0 .. c_b - 1` of a buffer `[B, H, C, D]` per layer, and a pass of `q` tokens writes its keys and
# values at columns `c_b .. c_b + q - 1` of each row's own (`RowEndsLayer.update`). Accepting a
# step is then only new lengths: a rejected draft token's columns lie past the row's new end, masked,
# and the next pass writes over them. A leaving row's place is taken by a row past the new batch size
# (`fill_order`), and joining rows copy their own columns in; nothing else is ever copied.
#
# Column = position, so the attention mask is per row and per query (`row_ends_mask`): query `i`
# of row `b` (position `c_b + i`) sees columns `0 .. c_b + i`. The columns past it hold stale or zero
# keys and values, always finite, and get weight exactly zero. The mask is handed to the model as a
# prepared 4-D mask in the form its attention implementation takes (boolean for SDPA, additive for
# eager), which transformers passes through unchanged. Only models whose attention layers are all
# full attention are kept this way (`row_ends_supported`): a sliding window or a recurrent state needs
# the right-aligned layout.


def _room(width: int) -> int:
    return width + spare_width(width)


class RowEndsLayer(DynamicLayer):
    """Keys and values in buffers `[B_cap, H, C, D]`; rows `0 .. n - 1` are the batch. `write_at` [n]
    (each row's cached length) says where a pass writes and `write_end` (max(write_at) + q, on the host)
    how many columns it shows: both set before every pass by `batch.forward`, which reads the host once per
    pass for every layer (a read per layer made EXSPEC's held batch wait for the device 24 times a pass on
    a 24-layer model)."""

    write_at: torch.Tensor | None = None
    write_end: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        assert self.write_at is not None and self.write_end is not None, \
            "a row-ends layer needs each row's length and the pass's end before a pass"
        rows, q = key_states.shape[0], key_states.shape[-2]
        end = self.write_end
        if end > self._buffers[0].shape[-2]:
            self.grow(self._buffers[0].shape[0], _room(end))
        columns = self.write_at.unsqueeze(1) + torch.arange(q, device=key_states.device)  # [n, q]
        index = torch.arange(rows, device=key_states.device).unsqueeze(1)  # [n, 1]
        key_buffer, value_buffer = self._buffers
        key_buffer[index, :, columns] = key_states.transpose(1, 2)  # [n, q, H, D] into each row's own columns
        value_buffer[index, :, columns] = value_states.transpose(1, 2)
        self.keys, self.values = key_buffer[:rows, :, :end], value_buffer[:rows, :, :end]
        return self.keys, self.values

    def grow(self, rows: int, columns: int) -> None:
        """Buffers for at least `rows` rows of `columns` columns, zeros past the old ones' contents."""
        old = self._buffers
        grown = tuple(b.new_zeros(max(rows, b.shape[0]), b.shape[1], max(columns, b.shape[-2]), b.shape[-1]) for b in old)
        for new, buffer in zip(grown, old):
            new[: buffer.shape[0], :, : buffer.shape[-2]] = buffer
        self._buffers = grown

    def show(self, rows: int, width: int) -> None:
        self.keys, self.values = self._buffers[0][:rows, :, :width], self._buffers[1][:rows, :, :width]


def is_row_ends(cache: Any) -> bool:
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(layer, RowEndsLayer) for layer in layers)


def row_ends_supported(*models: PreTrainedModel | None) -> bool:
    """Whether the models (None: no model) can run on row-ends caches: full attention in every layer, SDPA or eager."""
    present = [m for m in models if m is not None]
    return all(all(k == "full" for k in attention_layer_kinds(m)) and _mask_kind(m) is not None for m in present)


def _mask_kind(model: PreTrainedModel) -> str | None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    function = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(getattr(model.config, "_attn_implementation", None))
    return "bool" if function is sdpa_mask else "additive" if function is eager_mask else None


def row_ends_mask(model: PreTrainedModel, cache_lengths: torch.Tensor, q: int, end: int | None = None) -> torch.Tensor:
    """`[B, 1, q, S]`, S = `end` (max(c) + q, read from the device when not given): query i of row b sees
    columns 0 .. c_b + i, in the form the model's attention takes (True = attend for SDPA; 0 / the dtype's
    minimum, added to the scores, for eager)."""
    end = int(cache_lengths.max()) + q if end is None else end
    columns = torch.arange(end, device=cache_lengths.device)  # [S]
    last = cache_lengths.unsqueeze(1) + torch.arange(q, device=cache_lengths.device)  # [B, q]
    mask = (columns.view(1, 1, -1) <= last.unsqueeze(2)).unsqueeze(1)  # [B, 1, q, S]
    return additive_mask(mask, model.dtype) if _mask_kind(model) == "additive" else mask


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, the dtype's minimum elsewhere: the mask added to the attention scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


def row_ends_cache(blocks: list[list[tuple[torch.Tensor, torch.Tensor]]], lengths: list[int],
              batch_capacity: int, columns: int = 0) -> DynamicCache:
    """A row-ends cache of `len(lengths)` rows: `blocks[layer][row]` = (keys, values) `[H, n, D]` whose last
    `lengths[row]` columns are the row's (left-aligned here, zeros past them); room for `batch_capacity` rows
    of `columns` columns (a pool that knows its longest request allocates once), else for a quarter more."""
    cache = DynamicCache()
    width = max(_room(max(lengths)), columns)
    for rows in blocks:
        layer = RowEndsLayer()
        keys, values = rows[0]
        layer._buffers = (keys.new_zeros(batch_capacity, keys.shape[0], width, keys.shape[-1]),
                          values.new_zeros(batch_capacity, values.shape[0], width, values.shape[-1]))
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        cache.layers.append(layer)
    append_rows(cache, 0, blocks, lengths)
    return cache


def append_rows(cache: DynamicCache, rows: int, blocks: list[list[tuple[torch.Tensor, torch.Tensor]]],
                lengths: list[int]) -> None:
    """Copy new rows after the first `rows` of the buffers (each as in `row_ends_cache`), growing them when needed."""
    total = rows + len(lengths)
    width = max([max(lengths)] + ([cache.layers[0].keys.shape[-2]] if rows else []))  # the batch's widest row
    for layer, new_rows in zip(cache.layers, blocks):
        if total > layer._buffers[0].shape[0] or width > layer._buffers[0].shape[-2]:
            layer.grow(total, _room(width))
        for i, ((keys, values), n) in enumerate(zip(new_rows, lengths)):
            for buffer, source in zip(layer._buffers, (keys, values)):
                buffer[rows + i, :, :n] = source[:, source.shape[-2] - n:]  # past n: an earlier row's, finite
        layer.show(total, width)


def fill_order(keep: torch.Tensor) -> torch.Tensor:
    """The rows `keep` (ascending) in the order `settle_rows` keeps them with fewest moves: a row
    that stays where it is keeps its place, and each hole a leaving row makes below the new batch size
    takes one of the rows past it (one row copied per leaving row, not every row after it)."""
    kept = keep.tolist()
    staying = set(kept)
    tail = [r for r in kept if r >= len(kept)]
    order = [i if i in staying else tail.pop() for i in range(len(kept))]
    return torch.tensor(order, dtype=keep.dtype, device=keep.device)


def settle_rows(cache: DynamicCache, new_lengths: torch.Tensor, keep: torch.Tensor) -> None:
    """After a step: rows `keep` stay, row `keep[i]` becoming row `i` (copied in place when they differ:
    `fill_order` makes that one row per leaving row); `new_lengths` [len(keep)] are their cached lengths."""
    keep_list = keep.tolist()
    width = int(new_lengths.max()) if keep_list else 0
    for layer in cache.layers:
        for row, source in enumerate(keep_list):
            if source != row:
                for buffer in layer._buffers:
                    buffer[row].copy_(buffer[source])
        layer.show(len(keep_list), width)
