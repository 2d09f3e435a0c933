"""Reference runs kept on disk: greedy decoding computed by one process, read back by the others and by later runs.

`SPECAUDIT_REFERENCE_MEMO` names the folder (unset: nothing is kept, every reference is decoded). A file is named
by what determines its contents: a digest of the request (`request_digest`: prompts, budget, stop ids, device)
in its stem and a digest of everything else the outputs depend on in its key (`environment_key`: the target's
config and weights, as bytes; the torch and transformers versions; the kernels this process computes with on
the CPU (`cpu_kernels`: a run under ATen's other vector kernels or another processor rounds differently below
float64); the source of specaudit's engines, the reference decoder and what it calls). A file is read back only where decoding again would give the same tokens
and logits; a changed input names another file, and writing that file removes the one it replaces (the same
stem under an older key).

The test session sets the variable (tests/conftest.py: `$SPECAUDIT_CACHE/references`); so can a user whose CI
audits the same target on every change.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch

MEMO_VARIABLE = "SPECAUDIT_REFERENCE_MEMO"


def memo_folder() -> Path | None:
    """The folder `SPECAUDIT_REFERENCE_MEMO` names, or None."""
    folder = os.environ.get(MEMO_VARIABLE)
    return Path(folder) if folder else None


def update_with_model(digest: "hashlib._Hash", model: torch.nn.Module) -> None:
    """Feed `model`'s class, config (with the attention and experts implementations, which the config's JSON
    leaves out) and weights (their bytes) into `digest`."""
    config = model.config
    implementations = [getattr(config, name, None) for name in ("_attn_implementation", "_experts_implementation")]
    digest.update(f"{type(model).__module__}.{type(model).__qualname__}|{implementations}|".encode())
    digest.update(config.to_json_string().encode())
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().to("cpu").contiguous().flatten().view(torch.uint8).numpy().tobytes())


def cpu_description() -> tuple[str, list[str]]:
    """The processor's model name and instruction-set flags (x86 `flags`, Arm `Features`) as Linux lists them
    for its first core; ("", []) where there is no /proc/cpuinfo."""
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[-1].strip()
            elif line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[-1].split()
                break
    except OSError:  # not Linux
        pass
    return model, flags


def cpu_kernels() -> str:
    """What decides the CPU's rounding in this process: the ATen vector kernels in use (`ATEN_CPU_CAPABILITY`
    chooses others), oneDNN's instruction-set cap (`ONEDNN_MAX_CPU_ISA`) and the processor's model and
    instruction-set flags (bfloat16 matmuls take other paths on a processor with AVX512-BF16 or AMX)."""
    processor = platform.processor() or platform.machine()
    model, flags = cpu_description()
    flags_digest = hashlib.sha256(f"{model}|{' '.join(flags)}".encode()).hexdigest()[:8]
    return (f"{torch.backends.cpu.get_cpu_capability()}|onednn:{os.environ.get('ONEDNN_MAX_CPU_ISA', 'native')}|"
            f"{processor}|{flags_digest}")


def kernels_tag() -> str:
    """The chosen kernels in a file name (`avx2`, `default-onednn_avx2`): runs under other kernels on one machine
    are kept beside each other, not in place of each other."""
    tag = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{tag}-onednn_{onednn.lower()}" if onednn else tag


@lru_cache(maxsize=1)
def _engines_source_digest() -> bytes:
    engines = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(engines.rglob("*.py")):
        digest.update(str(source.relative_to(engines)).encode())
        digest.update(source.read_bytes())
    return digest.digest()


def environment_key(target: torch.nn.Module, *extra: bytes) -> str:
    """16 hex digits of everything but the request that a reference run of `target` depends on (and `extra`)."""
    import transformers

    digest = hashlib.sha256()
    digest.update(f"{torch.__version__}|{transformers.__version__}|{cpu_kernels()}|".encode())
    update_with_model(digest, target)
    for part in extra:
        digest.update(part)
    digest.update(_engines_source_digest())
    return digest.hexdigest()[:16]


def request_digest(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   eos_token_ids: Sequence[int], device: Any) -> str:
    """12 hex digits of a reference request: the prompts, the budget (one, or one per prompt), the stop ids, the
    device."""
    budget = max_new_tokens if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
    text = repr(([[int(t) for t in p] for p in prompts], budget, sorted(int(i) for i in eos_token_ids), str(device)))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def safe_name(name: str) -> str:
    """`name` (a pair's) as a part of a file name: letters, digits and `_.+-` kept, at most 60 characters."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)[:60]


def run_path(folder: Path, name: str, target: torch.nn.Module, request: str, key: str) -> Path:
    """The file of a kept run in `folder`: `name` (safe), the target's dtype, the CPU kernels and the request
    digest in its stem, the environment key last (what `keep_file` replaces)."""
    dtype = str(target.dtype).removeprefix("torch.")
    return folder / f"{safe_name(name)}-{dtype}-{kernels_tag()}-{request}-{key}.pt"


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


def read_run(path: Path | None, device: Any) -> Any | None:
    """What `keep_run` kept at `path` (tensors on `device`); None where there is nothing to read (no memo, no
    file, a file torch cannot read: decoding again replaces it)."""
    if path is None or not path.is_file():
        return None
    try:
        return torch.load(path, map_location=device)
    except Exception:  # a truncated or foreign file: not an answer
        return None


def keep_run(path: Path | None, run: Any) -> None:
    """Keep `run` (lists of token ids, tensors) at `path`; nothing when `path` is None."""
    if path is None:
        return
    buffer = io.BytesIO()
    torch.save(run, buffer)
    keep_file(path, buffer.getvalue())
