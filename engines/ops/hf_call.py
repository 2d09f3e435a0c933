"""The one place that hands a cache to a transformers model's `forward`.

transformers renamed the cache argument: up to 5.23 a model takes `past_key_values` (pure
state-space models, Mamba and Mamba-2, take `cache_params`); 5.24 takes `cache` and warns on the old
names (removed in 5.40); 5.17, what GPU images ship, has no `cache`. A cache handed under a name
the model does not take falls into `**kwargs` unused, and every token after the first sees no state.
Every cached call in specaudit (reference, engines, drafters, prefill, the diagnosis's replays,
adapters, bench) goes through `cached_forward`, which asks the installed model's signature.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch

# in order of preference: the newest name first
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


@lru_cache(maxsize=None)
def _keyword_of(forward: Any) -> str:
    parameters = inspect.signature(forward).parameters  # follows decorators' __wrapped__
    for name in CACHE_KEYWORDS:
        if name in parameters:
            return name
    return _library_keyword()  # a forward of **kwargs alone (a wrapper): the installed release's own name


@lru_cache(maxsize=None)
def _library_keyword() -> str:
    """The cache keyword of the installed transformers' causal language models (a Llama's)."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model.forward` takes its cache on the installed transformers."""
    forward = getattr(type(model).forward, "__func__", type(model).forward)
    if "forward" in vars(model):  # a forward set on the instance (a wrapper, a test double)
        forward = model.forward
    return _keyword_of(forward)


def cached_forward(model: torch.nn.Module, cache: Any, **inputs: Any) -> Any:
    """`model(**inputs, use_cache=True)` with `cache` under the keyword the model takes; returns the
    model's output (`.logits` [B, q, V])."""
    return model(**inputs, use_cache=True, **{cache_keyword(model): cache})
