"""Cached built-in pairs and reference outputs, built once per process (tests, plugin).

`SPECAUDIT_TEST_DEVICE` (default `cpu`) puts the pairs on another torch device, e.g. `cuda` to run the
property tests or the planted-fault hunts (`python -m specaudit.testing.faults.table`) on a GPU.
`SPECAUDIT_REFERENCE_MEMO` names a folder where the reference outputs one process computed are kept for the
other processes and later runs (tests/conftest.py: `$SPECAUDIT_CACHE/references`, shared by the test session's
worker processes). Each file is named by what determines its contents (`reference_key`: the target's weights
and config, the prompts, the torch and transformers versions and the engines' source), so an output is read
back only where computing it again would give the same one; a changed input names another file.
"""

from __future__ import annotations

import functools
import os

import torch

from specaudit.engines.models import zoo
from specaudit.engines import reference_memo
from specaudit.engines.reference import ReferenceDecoder

MAX_NEW_TOKENS = 24
REFERENCE_MEMO = reference_memo.MEMO_VARIABLE
HUNT_MEMO = "SPECAUDIT_HUNT_MEMO"  # the planted-fault hunts' kept outcomes (property_tests/faults/hunt.py)


def pairs_device() -> str:
    """The torch device of the cached pairs: `SPECAUDIT_TEST_DEVICE`, else `cpu`."""
    return os.environ.get("SPECAUDIT_TEST_DEVICE", "cpu")


_BUILT: dict[int, tuple[str, str, torch.nn.Module]] = {}  # id(target) of each pair `pair` built -> name, dtype, target


@functools.lru_cache(maxsize=None)
def pair(name: str, dtype: str = "float64") -> zoo.ModelPair:
    built = zoo.load_pair(name, dtype=dtype, device=pairs_device())
    target = getattr(built, "target", None)  # (a test's stand-in for load_pair may return anything)
    if target is not None:
        _BUILT[id(target)] = (name, dtype, target)
    return built


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in zoo.builtin_prompts())


def reference_key(target: torch.nn.Module) -> str:
    """A digest of everything the reference outputs of `target` on the built-in prompts depend on: its config
    and weights (bytes), the prompts, the torch and transformers versions and the source of specaudit's
    engines (the reference decoder and what it calls)."""
    return reference_memo.environment_key(target, repr(prompts()).encode())


@functools.lru_cache(maxsize=None)
def reference(name: str, max_new_tokens: int = MAX_NEW_TOKENS, dtype: str = "float64"):
    """Reference outputs and logits for every built-in prompt, with no EOS: (outputs, logits)."""
    p = pair(name, dtype)
    memo = reference_memo.memo_folder()
    stem = f"{name}-{max_new_tokens}-{dtype}-{pairs_device().replace(':', '_')}-{reference_memo.kernels_tag()}"
    kept = memo / f"{stem}-{reference_key(p.target)}.pt" if memo else None
    run = reference_memo.read_run(kept, pairs_device())
    if run is None:
        decoder = ReferenceDecoder(p.target, record_logits=True)
        outputs = decoder.generate([list(x) for x in prompts()], max_new_tokens, None)
        run = (outputs, decoder.last_trace.logits)
        reference_memo.keep_run(kept, run)
    return run


def builtin_run(target: torch.nn.Module, prompt: tuple[int, ...],
                max_new_tokens: int) -> tuple[list[int], torch.Tensor] | None:
    """The reference run of a built-in prompt on the target of a pair that `pair` built (no EOS, the first
    `max_new_tokens` tokens and their logits), taken from `reference`, where both hold and the budget is within
    `MAX_NEW_TOKENS`; else None. `reference` decodes each prompt alone with `greedy_decode`, as an oracle does,
    so a truncation of its run is the run an oracle would compute."""
    built = _BUILT.get(id(target))
    index = _builtin_index().get(tuple(prompt))
    if built is None or built[2] is not target or index is None or max_new_tokens > MAX_NEW_TOKENS:
        return None
    name, dtype, _ = built
    outputs, logits = reference(name, MAX_NEW_TOKENS, dtype)
    return list(outputs[index][:max_new_tokens]), logits[index][:max_new_tokens]


@functools.lru_cache(maxsize=None)
def _builtin_index() -> dict[tuple[int, ...], int]:
    index: dict[tuple[int, ...], int] = {}
    for i, prompt in enumerate(prompts()):
        index.setdefault(prompt, i)
    return index
