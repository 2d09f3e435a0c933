"""The cache keyword of the installed transformers, as a user's engine would look it up: up to 5.23 a causal
language model takes `past_key_values`, 5.24 takes `cache` (and warns on the old name, removed in 5.40)."""

from __future__ import annotations

import inspect
from typing import Any


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """`{keyword: cache}` for `model(**inputs, **cache_arg(model, cache))`."""
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache}
