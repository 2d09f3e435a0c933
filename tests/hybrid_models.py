"""Tiny hybrid and recurrent model pairs for llama.cpp servers: HF folders and GGUF f32 files.

Each family is built from a config with a fixed seed (nothing downloaded): a target, and a draft
that is the target's weights plus seeded noise (same architecture, same vocabulary). Both are saved
as float32 safetensors with the byte-level tokenizer of tests/llamacpp_models.py and converted to
GGUF f32 with llama.cpp's `convert_hf_to_gguf.py` (from `scripts/llamacpp.sh`'s cache).

The converter picks a BPE ("gpt2") vocabulary for these architectures and refuses a tokenizer whose
pre-tokenizer it does not recognise; ours has none. `convert()` therefore runs the converter with its
BPE path pointed at the Llama-HF vocabulary writer, which the tiny-llama conversion already uses for
the same tokenizer.json. The tokenizer only decides how llama.cpp maps ids to text: the audit sends
and reads token ids.

Cached under ~/.cache/specaudit/hybrid-models/<key>/<family>/ (the key hashes everything that goes in).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import llamacpp_models as lm

FORMAT = "1"  # bump when the way the folders are written changes
VOCAB = {"vocab_size": 259, "pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258,
         "tie_word_embeddings": False}

# family -> (transformers model_type, config, seed); every family: hidden 64, 4 layers
FAMILIES: dict[str, tuple[str, dict, int]] = {
    # short convolutions (LFM2): conv, attention, conv, attention
    "lfm2": ("lfm2", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3, "block_auto_adjust_ff_dim": False, "max_position_embeddings": 4096}, 2001),
    # gated delta-net with experts (Qwen3-Next): three linear-attention layers, then full attention
    "qwen3-next": ("qwen3_next", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 4096}, 2002),
    # pure Mamba-2
    "mamba2": ("mamba2", {
        "hidden_size": 64, "num_hidden_layers": 4, "expand": 2, "head_dim": 16, "num_heads": 8,
        "n_groups": 1, "state_size": 16, "conv_kernel": 4, "chunk_size": 32,
        "pad_vocab_size_multiple": 1}, 2003),
    # pure Mamba (selective scan)
    "mamba": ("mamba", {
        "hidden_size": 64, "num_hidden_layers": 4, "expand": 2, "state_size": 16, "conv_kernel": 4,
        "time_step_rank": 4, "pad_vocab_size_multiple": 1}, 2004),
    # Mamba-2 hybrid (Bamba): Mamba-2 layers with one attention layer
    "bamba": ("bamba", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_indices": [2], "mamba_n_heads": 8, "mamba_d_head": 16,
        "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": 32, "max_position_embeddings": 4096}, 2005),
}
INIT_STD = 0.2
DRAFT_NOISE = 0.03


@dataclass(frozen=True)
class HybridPair:
    family: str
    hf_target: Path
    hf_draft: Path
    gguf_target: Path
    gguf_draft: Path


def build_models(family: str):
    """The float64 target and draft of a family: matrices ~ N(0, INIT_STD^2) from the family's seed,
    vectors at their defaults; the draft is the target plus seeded noise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, config, seed = FAMILIES[family]
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config, **VOCAB), dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, param in sorted(target.named_parameters()):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * INIT_STD)
    draft = AutoModelForCausalLM.from_config(target.config, dtype=torch.float64)
    noise_gen = torch.Generator().manual_seed(seed + 1)
    target_state = target.state_dict()
    with torch.no_grad():
        for key, param in sorted(draft.state_dict().items()):
            source = target_state[key]
            scale = source.std() if source.numel() > 1 else source.abs()
            param.copy_(source + DRAFT_NOISE * scale * torch.randn(source.shape, generator=noise_gen,
                                                                   dtype=torch.float64))
    return target.eval(), draft.eval()


CONVERT = """
import sys
sys.argv = [sys.argv[0], *sys.argv[1:]]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel._set_vocab_gpt2 = TextModel._set_vocab_llama_hf  # our byte tokenizer has no pre-tokenizer
convert_hf_to_gguf.main()
"""


# Qwen3-Next's converter expects multi-token-prediction layers (asserts on a checkpoint without them)
CONVERT_ARGS = {"qwen3-next": ["--no-mtp"]}


def convert(llama_dir: Path, hf_folder: Path, out: Path, extra: list[str] = ()) -> None:
    """`convert_hf_to_gguf.py HF --outtype f32 --outfile OUT`, its BPE vocabulary path writing ours."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join([str(llama_dir), str(llama_dir / "gguf-py")])
    done = subprocess.run([sys.executable, "-c", CONVERT, str(hf_folder), "--outtype", "f32", "--outfile", str(out),
                           *extra],
                          cwd=llama_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_folder.name}:\n{done.stdout[-3000:]}")


def _key(llama_dir: Path) -> str:
    import torch
    import transformers

    digest = hashlib.sha256()
    for part in (FORMAT, json.dumps([FAMILIES, VOCAB, INIT_STD, DRAFT_NOISE, CONVERT_ARGS]), json.dumps(lm.byte_tokenizer_files()),
                 CONVERT, torch.__version__, transformers.__version__, (llama_dir / "convert_hf_to_gguf.py").read_text()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def hybrid_pair(llama_dir: Path, family: str) -> HybridPair:
    """The family's pair as HF folders (float32 safetensors) and GGUF f32 files, cached."""
    import torch

    folder = lm.CACHE_ROOT / "hybrid-models" / _key(llama_dir) / family
    pair = HybridPair(family, folder / "target", folder / "draft", folder / "target-f32.gguf", folder / "draft-f32.gguf")
    if pair.gguf_target.is_file() and pair.gguf_draft.is_file():
        return pair
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=family + "."))
    try:
        target, draft = build_models(family)
        for role, model in (("target", target), ("draft", draft)):
            model.to(torch.float32).save_pretrained(stage / role, safe_serialization=True)
            for name, text in lm.byte_tokenizer_files().items():
                (stage / role / name).write_text(text)
            convert(llama_dir, stage / role, stage / f"{role}-f32.gguf", CONVERT_ARGS.get(family, []))
        shutil.rmtree(folder, ignore_errors=True)
        stage.rename(folder)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return pair


if __name__ == "__main__":
    directory = lm.llama_cpp_dir()
    for name in sys.argv[1:] or FAMILIES:
        try:
            made = hybrid_pair(directory, name)
            print(f"{name}: {made.hf_target} {made.gguf_target}")
        except Exception as error:  # report every family, not only the first failure
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[-1500:]}")
