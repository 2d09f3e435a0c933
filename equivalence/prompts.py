"""Prompt sets: the built-in one, or a JSONL file.

A JSONL line holds token ids (`input_ids` or `tokens`) or text: a `prompt` or `text` field, or
Spec-Bench's `turns` (the first turn is used). Text is tokenised with the target's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specaudit.engines import zoo


class PromptError(ValueError):
    pass


def _text_of(record: dict[str, Any]) -> str | None:
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    return None


def load_prompts(source: str, tokenizer: Any | None, num_prompts: int | None = None) -> list[list[int]]:
    """Token-id prompts from `builtin` or a JSONL path, the first `num_prompts` of them."""
    if source == "builtin":
        # the built-in texts, in the pair's own tokens (bytes for the built-in pairs)
        encoder = tokenizer if tokenizer is not None else zoo.ByteTokenizer()
        prompts = [_encode(encoder, text) for text in zoo.builtin_prompt_texts()]
    else:
        path = Path(source)
        if not path.is_file():
            raise PromptError(f"prompt file {source!r} does not exist")
        prompts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{source}:{number}: not JSON ({exc.msg})") from exc
            ids = record.get("input_ids", record.get("tokens")) if isinstance(record, dict) else None
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                prompts.append(list(ids))
                continue
            text = _text_of(record) if isinstance(record, dict) else None
            if text is None:
                raise PromptError(f"{source}:{number}: needs `input_ids`, `prompt`, `text` or `turns`")
            if tokenizer is None:
                raise PromptError(f"{source}:{number}: text prompt, but the target has no tokenizer")
            prompts.append(_encode(tokenizer, text))
    prompts = [p for p in prompts if p]
    if num_prompts is not None:
        if num_prompts < 1:
            raise PromptError("--num-prompts must be at least 1")
        prompts = prompts[:num_prompts]
    if not prompts:
        raise PromptError(f"no prompts in {source!r}")
    return prompts


def _encode(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text))
    raise PromptError("the tokenizer cannot encode text")
