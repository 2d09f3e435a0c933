"""Switches that make a model compute in float64 throughout, for the float64 oracle.

Some transformers kernels quietly leave float64:

- mixtures of experts run through `torch._grouped_mm` by default, which has no float64 path (it
  raises); the model's eager expert loop computes the same thing in any dtype;
- the eager attention of several families (Gemma-2, which cannot use SDPA because of its logit
  soft-capping; any model loaded with `attn_implementation="eager"`) upcasts the softmax to
  float32, so its logits carry float32 noise (~1e-7) that depends on how many masked columns a row
  has: a float64 audit could not tell it from a bug. `float64_eager_attention` is the same eager
  attention (scaling, soft-capping, attention sinks, GQA) with the softmax in float64.

- recurrent layers (gated delta-net, Mamba-2) run their recurrences in float32, every RMS norm normalises
  in float32 and expert routers take their softmax in float32: `engines/models/float64_recurrent.py`.

`prepare_float64` applies all three where they apply and returns notes saying what it switched; the
oracle and the engines share the model object, so they share the switch. Nothing changes below
float64.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from transformers import PreTrainedModel

from specaudit.engines.models.float64_recurrent import prepare_recurrent_float64
from specaudit.engines.ops.layout import experts_implementation

FLOAT64_EAGER = "specaudit_float64_eager"
# the keyword arguments of a model's eager attention that `float64_eager_attention` honours
_UNDERSTOOD = {"module", "query", "key", "value", "attention_mask", "scaling", "dropout", "softcap", "kwargs",
               "sliding_window", "s_aux"}


def float64_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, q, D]
    key: torch.Tensor,  # [B, Hkv, S, D]
    value: torch.Tensor,  # [B, Hkv, S, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1, q, >=S] additive
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with the softmax in the inputs' dtype (never upcast to float32)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, Hq, q, S]
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    sinks = getattr(module, "sinks", None)  # attention sinks (GPT-OSS): one extra logit per head
    if sinks is not None:
        sink = sinks.to(weights.dtype).reshape(1, -1, 1, 1).expand(weights.shape[0], -1, weights.shape[2], 1)
        combined = torch.cat([weights, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(weights, dim=-1)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()  # [B, q, Hq, Dv]
    return out, probs


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FLOAT64_EAGER, float64_eager_attention)
    AttentionMaskInterface.register(FLOAT64_EAGER, eager_mask)


def _eager_upcasts(model: PreTrainedModel) -> bool:
    """Whether the model's own eager attention leaves float64 and ours computes the same thing."""
    function = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
        parameters = set(inspect.signature(function).parameters)
    except (OSError, TypeError, ValueError):
        return False
    return "dtype=torch.float32" in source and parameters <= _UNDERSTOOD


def prepare_float64(model: PreTrainedModel) -> list[str]:
    """Make `model` (already float64) compute in float64 throughout; notes on what was switched."""
    notes = []
    experts = experts_implementation(model)
    if experts is not None and experts != "eager":
        model.set_experts_implementation("eager")
        notes.append(f"experts: eager (the default {experts} has no float64 path)")
    if getattr(model.config, "_attn_implementation", None) == "eager" and _eager_upcasts(model):
        _register()
        model.set_attn_implementation(FLOAT64_EAGER)
        notes.append("attention: eager with a float64 softmax (the model's eager attention upcasts it to float32)")
    notes += prepare_recurrent_float64(model)  # gated delta-net, Mamba-2: recurrences in float64
    return notes
