"""Cached built-in pairs and reference outputs, built once per process (tests, plugin).

`SPECAUDIT_TEST_DEVICE` (default `cpu`) puts the pairs on another torch device, e.g. `cuda` to run the
property tests or the planted-fault hunts (`python -m specaudit.testing.faults.table`) on a GPU.
"""

from __future__ import annotations

import functools
import os

from specaudit.engines.models import zoo
from specaudit.engines.reference import ReferenceDecoder

MAX_NEW_TOKENS = 24


def pairs_device() -> str:
    """The torch device of the cached pairs: `SPECAUDIT_TEST_DEVICE`, else `cpu`."""
    return os.environ.get("SPECAUDIT_TEST_DEVICE", "cpu")


@functools.lru_cache(maxsize=None)
def pair(name: str, dtype: str = "float64") -> zoo.ModelPair:
    return zoo.load_pair(name, dtype=dtype, device=pairs_device())


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in zoo.builtin_prompts())


@functools.lru_cache(maxsize=None)
def reference(name: str, max_new_tokens: int = MAX_NEW_TOKENS, dtype: str = "float64"):
    """Reference outputs and logits for every built-in prompt, with no EOS: (outputs, logits)."""
    p = pair(name, dtype)
    decoder = ReferenceDecoder(p.target, record_logits=True)
    outputs = decoder.generate([list(x) for x in prompts()], max_new_tokens, None)
    return outputs, decoder.last_trace.logits
