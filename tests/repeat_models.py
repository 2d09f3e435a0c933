"""A tiny Llama that likes to repeat itself, for penalties under sampling: after `a` the next token is `a` at
logit 10, `b` at 9, `c` at 8 (and the same rotated after `b` and `c`; every other printable character leads
to `a`). A presence penalty of 1.5 with a frequency penalty of 1.0 turns the first choice into the third after
one occurrence, so an engine that misses an occurrence (counted once per verify step, or not at all) draws
another distribution by a total variation near 0.3 wherever it misses it.

Built as `tests/wild_models.py` builds its table model (the same Llama of one-hot ASCII embeddings and a
next-token table in the LM head, weak random attention; 4 target layers, 2 draft layers with the same table,
so drafts are accepted most of the time), over the same byte tokenizer; a real HF folder, so the command line
(`--target`, `--draft`) and a vLLM server load it. Cached under ~/.cache/specaudit/wild-models/repeat-<key>/.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from llamacpp_models import byte_tokenizer_files
from wild_models import CACHE_ROOT, DRAFT_LAYERS, EOS, MODELS_FORMAT, TARGET_LAYERS, TablePair, _build, _complete

LOOP = "abc"
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0}


def repeat_table() -> dict[int, list[tuple[int, float]]]:
    """{token: [(next token, logit), ...]}: each of `abc` repeats itself first, then the next two in turn."""
    table: dict[int, list[tuple[int, float]]] = {}
    for index, char in enumerate(LOOP):
        table[ord(char)] = [(ord(LOOP[(index + shift) % 3]), 10.0 - shift) for shift in range(3)]
    for code in range(32, 127):
        table.setdefault(code, [(ord("a"), 10.0)])
    table[EOS] = [(ord("x"), 10.0)]
    return table


def _key() -> str:
    import torch
    import transformers

    digest = hashlib.sha256()
    for part in (MODELS_FORMAT, "repeat", json.dumps(repeat_table()), json.dumps(byte_tokenizer_files()),
                 torch.__version__, transformers.__version__):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def repeat_pair() -> TablePair:
    """The repeating target and draft as HF folders (float32 safetensors), built once and cached."""
    folder = CACHE_ROOT / "wild-models" / f"repeat-{_key()}"
    pair = TablePair(folder, folder / "target", folder / "draft")
    if _complete(pair):
        return pair
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        for role, layers in (("target", TARGET_LAYERS), ("draft", DRAFT_LAYERS)):
            _build(layers, repeat_table()).save_pretrained(stage / role, safe_serialization=True)
            for name, text in byte_tokenizer_files().items():
                (stage / role / name).write_text(text)
        try:
            stage.rename(folder)
        except OSError:  # another process finished it first
            if not _complete(pair):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return pair
