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
import hashlib
import io
import os
from pathlib import Path

import torch

from specaudit.engines.models import zoo
from specaudit.engines.reference import ReferenceDecoder

MAX_NEW_TOKENS = 24
REFERENCE_MEMO = "SPECAUDIT_REFERENCE_MEMO"
HUNT_MEMO = "SPECAUDIT_HUNT_MEMO"  # the planted-fault hunts' kept outcomes (property_tests/faults/hunt.py)


def pairs_device() -> str:
    """The torch device of the cached pairs: `SPECAUDIT_TEST_DEVICE`, else `cpu`."""
    return os.environ.get("SPECAUDIT_TEST_DEVICE", "cpu")


_BUILT: dict[int, tuple[str, str]] = {}  # id(target) of each pair `pair` built -> (name, dtype)


@functools.lru_cache(maxsize=None)
def pair(name: str, dtype: str = "float64") -> zoo.ModelPair:
    built = zoo.load_pair(name, dtype=dtype, device=pairs_device())
    _BUILT[id(built.target)] = (name, dtype)
    return built


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in zoo.builtin_prompts())


def update_with_model(digest: "hashlib._Hash", model: torch.nn.Module) -> None:
    """Feed `model`'s config and weights (their bytes) into `digest`."""
    digest.update(model.config.to_json_string().encode())
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().to("cpu").contiguous().flatten().view(torch.uint8).numpy().tobytes())


def keep_file(path: Path, contents: bytes) -> None:
    """Write `path` whole, then rename (a reader sees all of it or nothing), and remove the files beside it that
    differ only in their key (the last `-`-separated part of the name): the same thing kept under inputs that
    changed since."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(contents)
    os.replace(partial, path)
    stem = path.name.rsplit("-", 1)[0]
    for stale in path.parent.glob(f"{stem}-*{path.suffix}"):
        if stale != path and len(stale.name) == len(path.name):
            stale.unlink(missing_ok=True)


def reference_key(target: torch.nn.Module) -> str:
    """A digest of everything the reference outputs of `target` on the built-in prompts depend on: its config
    and weights (bytes), the prompts, the torch and transformers versions and the source of specaudit's
    engines (the reference decoder and what it calls)."""
    import transformers

    import specaudit.engines

    digest = hashlib.sha256()
    digest.update(f"{torch.__version__}|{transformers.__version__}|".encode())
    update_with_model(digest, target)
    digest.update(repr(prompts()).encode())
    engines = Path(specaudit.engines.__file__).parent
    for source in sorted(engines.rglob("*.py")):
        digest.update(str(source.relative_to(engines)).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def reference(name: str, max_new_tokens: int = MAX_NEW_TOKENS, dtype: str = "float64"):
    """Reference outputs and logits for every built-in prompt, with no EOS: (outputs, logits)."""
    return _reference(name, max_new_tokens, dtype)


def builtin_run(target: torch.nn.Module, prompt: tuple[int, ...],
                max_new_tokens: int) -> tuple[list[int], torch.Tensor] | None:
    """The reference run of a built-in prompt on the target of a pair that `pair` built (no EOS, the first
    `max_new_tokens` tokens and their logits), taken from `reference`, where both hold and the budget is within
    `MAX_NEW_TOKENS`; else None. `reference` decodes each prompt alone with `greedy_decode`, as an oracle does,
    so a truncation of its run is the run an oracle would compute."""
    built = _BUILT.get(id(target))
    index = _builtin_index().get(tuple(prompt))
    if built is None or index is None or max_new_tokens > MAX_NEW_TOKENS:
        return None
    name, dtype = built
    if pair(name, dtype).target is not target:
        return None
    outputs, logits = reference(name, MAX_NEW_TOKENS, dtype)
    return list(outputs[index][:max_new_tokens]), logits[index][:max_new_tokens]


@functools.lru_cache(maxsize=None)
def _builtin_index() -> dict[tuple[int, ...], int]:
    index: dict[tuple[int, ...], int] = {}
    for i, prompt in enumerate(prompts()):
        index.setdefault(prompt, i)
    return index


@functools.lru_cache(maxsize=None)
def _reference(name: str, max_new_tokens: int, dtype: str):
    p = pair(name, dtype)
    memo = os.environ.get(REFERENCE_MEMO)
    stem = f"{name}-{max_new_tokens}-{dtype}-{pairs_device().replace(':', '_')}"
    kept = Path(memo) / f"{stem}-{reference_key(p.target)}.pt" if memo else None
    if kept is not None and kept.is_file():
        return torch.load(kept, map_location=pairs_device())
    decoder = ReferenceDecoder(p.target, record_logits=True)
    outputs = decoder.generate([list(x) for x in prompts()], max_new_tokens, None)
    if kept is not None:
        buffer = io.BytesIO()
        torch.save((outputs, decoder.last_trace.logits), buffer)
        keep_file(kept, buffer.getvalue())
    return outputs, decoder.last_trace.logits
