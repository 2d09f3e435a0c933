"""A tiny Llama whose greedy continuation is written down in advance, for reproducing serving bugs
that need control over the text: stop strings, penalties, logit biases, end-of-generation tokens.

`table_pair()` builds a target and a draft (4 and 2 layers; hidden 128, 2 heads of 64: vLLM's CPU
attention refuses head_dim 16) over the byte tokenizer of `llamacpp_models.byte_tokenizer_files`
(ids 0..255 are bytes, 256 `<pad>`, 257 `<s>`, 258 `</s>` = EOS). The ASCII tokens 0..127 and EOS
(which borrows slot 127, DEL) have one-hot embeddings of norm sqrt(hidden), so the final RMSNorm
leaves them as they are and the LM head reads a next-token table out of one column each:

- `abcdefghijklmnopqrstuvwxyz ` is a cycle (each letter's successor at logit 10); the second
  choice is the successor's capital at 8.5 (a margin of 1.5, that a presence penalty of 2 or a
  repetition penalty of 1.3 on the seen successor overturns); a capital continues the cycle;
- the digits count up, `0` -> `1` ... `8` -> `9`, and `9` -> EOS (10; second `0` at 9);
- after EOS (if an engine ever feeds it back) the table says `x`, so tokens generated past an EOS
  are visible;
- `.` -> space; any other ASCII character -> space at 5.

The attention layers are random and weak (they move a logit by a few hundredths, so that
log-probabilities depend on the context, not only on the last token, and a log-probability
reported for the wrong position is caught); the MLPs write nothing. The draft is the target's first
2 layers with one table entry changed (`m` -> `N` first), so draft-model speculation has both
accepted and rejected drafts. n-gram speculation is accepted once the cycle repeats.

Cached under ~/.cache/specaudit/wild-models/<key>/ as HF folders (float32 safetensors) and, for
llama.cpp, GGUF f32 files converted with llama.cpp's own converter (`gguf_files`).
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

from llamacpp_models import byte_tokenizer_files

CACHE_ROOT = Path(os.environ.get("SPECAUDIT_CACHE", Path.home() / ".cache" / "specaudit"))
MODELS_FORMAT = "1"  # bump when the models change
EOS = 258
EOS_SLOT = 127  # the embedding column EOS reads the table from (DEL, never generated)
HIDDEN, HEADS, HEAD_DIM, INNER = 128, 2, 64, 256
TARGET_LAYERS, DRAFT_LAYERS = 4, 2
CYCLE = "abcdefghijklmnopqrstuvwxyz "
FIRST, SECOND = 10.0, 8.5  # the table's logits: the successor and the second choice


def next_token_table(draft: bool = False) -> dict[int, list[tuple[int, float]]]:
    """{token: [(next token, logit), ...]}: the logits the table model gives after `token`
    (every token not listed gets 0)."""
    table: dict[int, list[tuple[int, float]]] = {}
    for index, char in enumerate(CYCLE):
        successor = CYCLE[(index + 1) % len(CYCLE)]
        second = successor.upper() if successor != " " else "."
        table[ord(char)] = [(ord(successor), FIRST), (ord(second), SECOND)]
        if char != " ":
            table[ord(char.upper())] = [(ord(successor), FIRST), (ord(second), SECOND)]
    for digit in range(9):
        table[ord(str(digit))] = [(ord(str(digit + 1)), FIRST), (ord(" "), SECOND)]
    table[ord("9")] = [(EOS, FIRST), (ord("0"), 9.0)]
    table[ord(".")] = [(ord(" "), FIRST), (ord("a"), SECOND)]
    table[EOS] = [(ord("x"), FIRST), (ord("y"), SECOND)]
    for code in range(32, 127):
        table.setdefault(code, [(ord(" "), 5.0)])
    if draft:
        table[ord("m")] = [(ord("N"), FIRST), (ord("n"), SECOND)]
    return table


def slot(token: int) -> int:
    return EOS_SLOT if token == EOS else token


@dataclass(frozen=True)
class TablePair:
    folder: Path
    target: Path
    draft: Path


def _key() -> str:
    import torch
    import transformers

    digest = hashlib.sha256()
    for part in (MODELS_FORMAT, json.dumps(next_token_table()), json.dumps(next_token_table(draft=True)),
                 json.dumps(byte_tokenizer_files()), torch.__version__, transformers.__version__):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def table_pair() -> TablePair:
    """The table target and draft as HF folders, built once and cached."""
    folder = CACHE_ROOT / "wild-models" / f"table-{_key()}"
    pair = TablePair(folder, folder / "target", folder / "draft")
    if _complete(pair):
        return pair
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        for role, layers, draft in (("target", TARGET_LAYERS, False), ("draft", DRAFT_LAYERS, True)):
            model = _build(layers, next_token_table(draft))
            model.save_pretrained(stage / role, safe_serialization=True)
            for name, text in byte_tokenizer_files().items():
                (stage / role / name).write_text(text)
        if folder.exists() and not _complete(pair):
            shutil.rmtree(folder, ignore_errors=True)
        try:
            stage.rename(folder)
        except OSError:  # another process finished it first
            if not _complete(pair):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return pair


def _complete(pair: TablePair) -> bool:
    return all((role / name).is_file() for role in (pair.target, pair.draft)
               for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _build(layers: int, table: dict[int, list[tuple[int, float]]]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=259, hidden_size=HIDDEN, intermediate_size=INNER, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         pad_token_id=256, bos_token_id=257, eos_token_id=EOS)
    model = LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(3300)
    scale = HIDDEN ** 0.5
    with torch.no_grad():
        embed = torch.randn(259, HIDDEN, generator=generator)  # [V, hidden]: non-ASCII rows, never generated
        embed[:128] = torch.eye(128) * scale  # [128, hidden]: one-hot ASCII
        embed[EOS] = torch.nn.functional.one_hot(torch.tensor(EOS_SLOT), HIDDEN).float() * scale
        model.model.embed_tokens.weight.copy_(embed)
        head = torch.zeros(259, HIDDEN)  # [V, hidden]: logit(v | t) = head[v, slot(t)] * sqrt(hidden)
        for token, choices in table.items():
            for successor, logit in choices:
                head[successor, slot(token)] = logit / scale
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            attention = layer.self_attn
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
                projection.weight.copy_(torch.randn(projection.weight.shape, generator=generator) * 0.1)
            attention.o_proj.weight.copy_(torch.randn(attention.o_proj.weight.shape, generator=generator) * 0.002)
            layer.mlp.gate_proj.weight.copy_(torch.randn(layer.mlp.gate_proj.weight.shape, generator=generator) * 0.1)
            layer.mlp.up_proj.weight.copy_(torch.randn(layer.mlp.up_proj.weight.shape, generator=generator) * 0.1)
            layer.mlp.down_proj.weight.zero_()
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
    return model


def gguf_files(llama_dir: Path) -> tuple[Path, Path]:
    """The table target and draft converted to GGUF f32 by the cached llama.cpp's converter."""
    pair = table_pair()
    files = (pair.folder / "target-f32.gguf", pair.folder / "draft-f32.gguf")
    for role, out in zip((pair.target, pair.draft), files):
        if out.is_file():
            continue
        partial = out.with_suffix(".partial")
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converter's own gguf-py
        subprocess.run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(role), "--outtype", "f32",
                        "--outfile", str(partial)],
                       check=True, cwd=llama_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        partial.rename(out)
    return files


if __name__ == "__main__":
    import torch
    from transformers import AutoModelForCausalLM

    built = table_pair()
    model = AutoModelForCausalLM.from_pretrained(built.target, dtype=torch.float64)
    for text in ("abcabc", "0123456", "hello"):
        ids = torch.tensor([list(text.encode())])
        out = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=EOS, pad_token_id=256)
        print(repr(text), "->", out[0, ids.shape[1]:].tolist(), repr(bytes(t for t in out[0, ids.shape[1]:].tolist() if t < 256).decode()))
