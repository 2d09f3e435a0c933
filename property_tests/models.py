"""Cached built-in pairs and reference outputs, built once per process (tests, plugin).

`SPECAUDIT_TEST_DEVICE` (default `cpu`) puts the pairs on another torch device, e.g. `cuda` to run the
property tests or the planted-fault hunts (`python -m specaudit.testing.faults.table`) on a GPU.
`SPECAUDIT_REFERENCE_MEMO` names a folder where the reference outputs one process computed are kept for the
others of the same run (tests/conftest.py: the test session's worker processes); the pairs are built from
seeded configs, the same in every process.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from specaudit.engines.models import zoo
from specaudit.engines.reference import ReferenceDecoder

MAX_NEW_TOKENS = 24
REFERENCE_MEMO = "SPECAUDIT_REFERENCE_MEMO"


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
    memo = os.environ.get(REFERENCE_MEMO)
    kept = Path(memo) / f"{name}-{max_new_tokens}-{dtype}-{pairs_device().replace(':', '_')}.pt" if memo else None
    if kept is not None and kept.is_file():
        return torch.load(kept, map_location=pairs_device())
    p = pair(name, dtype)
    decoder = ReferenceDecoder(p.target, record_logits=True)
    outputs = decoder.generate([list(x) for x in prompts()], max_new_tokens, None)
    if kept is not None:  # written whole, then renamed: a reader sees all of it or nothing
        partial = kept.with_suffix(f".{os.getpid()}.partial")
        torch.save((outputs, decoder.last_trace.logits), partial)
        os.replace(partial, kept)
    return outputs, decoder.last_trace.logits
