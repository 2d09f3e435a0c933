"""The anatomy of an observed target: where the hooks go, and how a hook reads a cache, a mask and a config.

Contract: every function here reads a transformers model, its cache or a mask as it is handed to a module,
changes nothing, and answers None (or a plain default) where the object is not of the form it knows. These
are duck-typed reads of transformers objects (configs, caches, modules), which differ between model families
and library versions.

1. Where to hook: `embedding_owner` (the module that takes the input ids), `position_module` (the one that
   consumes the position ids), `attention_module` (the first full-attention layer, or sliding-window layer).
2. What a call hands over: `bind_arguments` (its arguments by name), `allowed_reads` (which columns each query
   may read, from the mask an attention layer receives).
3. What a cache holds: `first_recurrent_layer` and `state_parts` (the first recurrent layer's state, per part).
4. What the model is: `layer_types`, `sliding_window`, `has_recurrent_layers`, and `observable` (why its inputs
   cannot be judged by observation, or None).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from specaudit.equivalence.rulings.thresholds import HIDDEN_MASK_FRACTION

POSITION_MODULE_NAMES = ("wpe", "embed_positions")


def keeps_state(layer: Any) -> bool:
    """A cache layer that keeps a recurrent state (a convolution window, an SSM state)."""
    return hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states")


def first_recurrent_layer(cache: Any) -> Any:
    """The cache's first layer that keeps a recurrent state (None: none)."""
    return next((layer for layer in getattr(cache, "layers", None) or [] if keeps_state(layer)), None)


def state_parts(layer: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A recurrent cache layer's state, per part (`provenance.STATE_PARTS`): its convolution windows (the last `kernel` columns
    of each) and its SSM states, each a list of [B, ...] tensors in key order."""
    kernels = getattr(layer, "conv_kernel_size", None) or {}
    convs = []
    for key, conv in sorted((getattr(layer, "conv_states", None) or {}).items()):
        if isinstance(conv, torch.Tensor):
            kernel = kernels.get(key) if isinstance(kernels, dict) else None
            convs.append(conv[..., -kernel:] if kernel else conv)
    ssm = [state for _, state in sorted((getattr(layer, "recurrent_states", None) or {}).items())
           if isinstance(state, torch.Tensor)]
    return convs, ssm


def layer_types(model: Any) -> list[str] | None:
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None) or getattr(getattr(config, "text_config", None), "layer_types", None)
    return list(types) if types else None


def sliding_window(model: Any) -> int | None:
    """The window (in tokens, the query's own included) of the model's sliding-window layers; None: it has none."""
    types = layer_types(model)
    if not types or "sliding_attention" not in types:
        return None
    config = model.config
    window = getattr(config, "sliding_window", None) or getattr(getattr(config, "text_config", None),
                                                                 "sliding_window", None)
    return int(window) if window else None


def bind_arguments(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by parameter name, those caught by a `**kwargs` parameter among them (the signature of
    a method read once per function: the hooks bind every call of the run)."""
    underlying = getattr(function, "__func__", None)
    try:
        if underlying is not None:  # a bound method: its function's signature, `self` bound to the instance
            signature = _signature(underlying)
            bound = dict(signature.bind_partial(function.__self__, *args, **kwargs).arguments)
            bound.pop(next(iter(signature.parameters)), None)
        else:
            signature = _signature(function)
            bound = dict(signature.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError, StopIteration):
        return dict(kwargs)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
            bound = {**bound.pop(name), **bound}
    return bound


@functools.lru_cache(maxsize=512)
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)


def embedding_owner(model: Any) -> Any:
    """The module that takes the input ids: the parent of the token embedding (a base model, or its decoder
    where the language model calls that directly, as OPT does)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for _, module in model.named_modules():
        if embeddings is not None and any(child is embeddings for child in module.children()):
            return module
    return getattr(model, "base_model", None) or model


def position_module(model: Any) -> tuple[str, Any] | None:
    """The module that consumes the position ids: a learned position table or the rotary embedding."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in POSITION_MODULE_NAMES or ("Rotary" in type(module).__name__ and "local" not in leaf):
            return leaf, module
    return None


def attention_module(model: Any, types: list[str] | None, sliding: bool = False, last: bool = False) -> Any:
    """The first full-attention layer (the mask it receives is what every such layer receives), or with `sliding`
    the first sliding-window layer, or with `last` the last of them (the layer whose cache entries a provenance
    fingerprint reads); `types`: the model's layer types (None: every layer attends in full)."""
    found = None
    for _, module in model.named_modules():
        name = type(module).__name__
        if not name.endswith("Attention") or "Rotary" in name:
            continue
        index = getattr(module, "layer_idx", None)
        kind = types[index] if types and isinstance(index, int) and index < len(types) else "full_attention"
        if (kind == "sliding_attention") == sliding:
            if not last:
                return module
            found = module
    return found


def consumed_positions(leaf: str, module: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The position ids a call hands the module that consumes them (`position_module`): its `position_ids`, OPT's
    positions from the 2-D mask it is handed, or a learned table's input; None when none can be read."""
    bound = bind_arguments(module.forward, args, kwargs)
    positions = bound.get("position_ids")
    if positions is None and leaf == "embed_positions":  # OPT: from the mask it is handed
        mask = bound.get("attention_mask")
        cut = int(bound.get("cache_length", bound.get("past_key_values_length", 0)) or 0)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            positions = ((mask.long().cumsum(1) * mask.long()) - 1)[:, cut:]
    if positions is None and leaf == "wpe":  # an Embedding: its input is the position ids
        positions = bound.get("input")
    return positions if isinstance(positions, torch.Tensor) else None


def allowed_reads(mask: Any, batch: int, q: int, kv: int, last: bool = False) -> torch.Tensor | None:
    """[B, q, kv] bool from a mask as an attention layer receives it ([B|1, 1|H, q, kv] bool or additive);
    None when it is not a tensor of that shape. `last`: a sliding-window layer's mask, which may cover only the
    last columns (those its cache still holds, and the call's own)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    mask = mask[:, 0].detach().cpu()
    if mask.shape[-2] != q:
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min * HIDDEN_MASK_FRACTION
    width = mask.shape[-1]
    if width >= kv:
        return mask.expand(batch, q, width)[..., :kv]
    if not last:
        return None
    out = torch.zeros(batch, q, kv, dtype=torch.bool, device="cpu")
    out[..., kv - width:] = mask.expand(batch, q, width)
    return out


def has_recurrent_layers(model: Any) -> bool:
    try:
        from transformers import DynamicCache

        return any(keeps_state(layer) for layer in DynamicCache(config=model.config).layers)
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def observable(model: Any) -> str | None:
    """Why the inputs of `model` cannot be judged by observation (None: they can): each layer of its cache must be
    an attention cache, full or a sliding window, or a recurrent state (its state read at each call), with at
    least one full attention layer (its keys follow the slots)."""
    if model is None:
        return "no target model in the process"
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=model.config).layers
    except (ImportError, AttributeError, TypeError, ValueError):
        return "the target's cache could not be built from its config"
    full = [layer for layer in layers if type(layer) is DynamicLayer
            or (keeps_state(layer) and isinstance(layer, DynamicLayer) and getattr(layer, "sliding_window", None) is None)]
    windowed = [layer for layer in layers if type(layer) is not DynamicLayer and isinstance(layer, DynamicLayer)
                and getattr(layer, "sliding_window", None) is not None]
    recurrent = [layer for layer in layers if keeps_state(layer) and not isinstance(layer, DynamicLayer)]
    if not full or len(full) + len(windowed) + len(recurrent) != len(layers):
        return ("the target's cache is not an attention cache per layer (or a recurrent state) with a full "
                "attention layer among them (sliding windows alone, or layers of another kind)")
    if windowed and sliding_window(model) is None:
        return "the target's sliding-window layers do not say their window"
    return None

