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
verification (`engines/recurrent.py`). Anything else (layers that are attention and recurrent at
once, chunked attention, layers that share another layer's cache, recurrent states kept inside the
model's modules instead of its cache: RecurrentGemma) is refused before any run by
`check_supported`, with one line naming the architecture and what is missing.

Float64 switches (eager experts, a float64 softmax) are in `engines/models/float64.py`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from specaudit.engines import recurrent


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
