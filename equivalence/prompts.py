"""Prompt sets: the built-in one, or a JSONL file.

A JSONL line holds token ids (`input_ids` or `tokens`) or text: a `prompt` or `text` field, or
Spec-Bench's `turns` (the first turn is used). Text is tokenised with the target's tokenizer.
Blank lines are skipped.

A recording (engines/adapters/recorded.py: lines with `prompt_ids` and `output_ids`) is a prompt set too:
its `prompt_ids` are the prompt, the outputs are ignored. A recorded line whose prompt an earlier recorded
line of the file already gave is skipped (a sampled run's recording has one line per sample, its prompt
repeated), so a recording yields each distinct prompt once, in the order they first appear;
`--num-prompts N` counts these distinct prompts. Lines without `output_ids` are never merged: a prompts
file may hold the same prompt twice on purpose.

Every problem is a `PromptError` (exit 2) naming the file and line: a missing or empty file, a
line that is not a JSON object, no usable field, an empty prompt, token ids that are not integers,
negative or outside the vocabulary (given `vocab_size`), and a prompt that leaves no room for
`max_new_tokens` within the model's positions (given `max_positions`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specaudit.engines.models import zoo
from specaudit.equivalence.errors import DataError

BUILTIN_NAME = "the built-in prompt set"


class PromptError(DataError):
    """A prompt set that cannot be used (exit 2); the message names the file and line."""


def _text_of(record: dict[str, Any]) -> str | None:
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    return None


# the fields that hold a prompt as token ids, first present wins: a prompts file's, then a recording's
ID_FIELDS = ("input_ids", "tokens", "prompt_ids")


def _ids_of(record: dict[str, Any], where: str) -> list[int] | None:
    name = next((key for key in ID_FIELDS if record.get(key) is not None), None)
    if name is None:
        return None
    ids = record[name]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise PromptError(f"{where}: {name} must be a list of integer token ids")
    return list(ids)


def is_recorded(record: Any) -> bool:
    """Whether a parsed line is a recording's (its prompt's `prompt_ids` with the engine's `output_ids`)."""
    return isinstance(record, dict) and "prompt_ids" in record and "output_ids" in record


def _read_lines(source: str) -> list[tuple[str, str]]:
    """(where, line) for every non-blank line of a JSONL file."""
    path = Path(source)
    if not path.exists():
        raise PromptError(f"prompt file {source!r} does not exist: give a JSONL file, or --prompts builtin")
    if not path.is_file():
        raise PromptError(f"prompt file {source!r} is not a file: give a JSONL file, or --prompts builtin")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{source}: not UTF-8 text (byte {exc.start}): give a JSONL file") from exc
    lines = [(f"{source}:{number}", line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise PromptError(f"prompt file {source!r} is empty: give one JSON object per line")
    return lines


def load_prompts(
    source: str,
    tokenizer: Any | None,
    num_prompts: int | None = None,
    *,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    max_new_tokens: int = 0,
) -> list[list[int]]:
    """Token-id prompts from `builtin` or a JSONL path, the first `num_prompts` of them, checked."""
    if num_prompts is not None and num_prompts < 1:
        raise PromptError(f"--num-prompts must be at least 1 (got {num_prompts})")
    if source == "builtin":
        # the built-in texts, in the pair's own tokens (bytes for the built-in pairs)
        encoder = tokenizer if tokenizer is not None else zoo.ByteTokenizer()
        located = [(f"{BUILTIN_NAME}, prompt {n}", _encode(encoder, text, BUILTIN_NAME))
                   for n, text in enumerate(zoo.builtin_prompt_texts(), 1)]
    else:
        located = []
        recorded: set[tuple[int, ...]] = set()  # the prompts recorded lines gave so far
        for where, line in _read_lines(source):
            if num_prompts is not None and len(located) >= num_prompts:
                break
            ids, from_recording = _parse_line(where, line, tokenizer)
            if from_recording:
                if tuple(ids) in recorded:  # another sample of a prompt already taken
                    continue
                recorded.add(tuple(ids))
            located.append((where, ids))
    if num_prompts is not None:
        located = located[:num_prompts]
    for where, ids in located:
        check_ids(where, ids, vocab_size, max_positions, max_new_tokens)
    return [ids for _, ids in located]


def _parse_line(where: str, line: str, tokenizer: Any | None) -> tuple[list[int], bool]:
    """The line's prompt as token ids, and whether the line is a recording's."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptError(f"{where}: not JSON ({exc.msg} at column {exc.colno}): the file must be JSONL, "
                          "one JSON object per line") from exc
    if not isinstance(record, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(record).__name__}: give "
                          '{"input_ids": [...]} or {"prompt": "..."}')
    ids = _ids_of(record, where)
    if ids is not None:
        return ids, is_recorded(record)
    text = _text_of(record)
    if text is None:
        keys = ", ".join(sorted(record)) or "none"
        raise PromptError(f"{where}: no usable field (found: {keys}): give input_ids, prompt, text or turns, "
                          "or a recording's prompt_ids")
    if tokenizer is None:
        raise PromptError(f"{where}: a text prompt, but the target has no tokenizer: give input_ids instead")
    return _encode(tokenizer, text, where), False


def check_ids(where: str, ids: list[int], vocab_size: int | None, max_positions: int | None,
              max_new_tokens: int) -> None:
    """`PromptError` naming `where` unless `ids` is a non-empty prompt of valid ids that leaves room
    for `max_new_tokens` within `max_positions`."""
    if not ids:
        raise PromptError(f"{where}: empty prompt: every prompt needs at least one token")
    low, high = min(ids), max(ids)
    if low < 0:
        raise PromptError(f"{where}: token id {low} is negative: token ids run from 0 to the vocabulary size - 1")
    if vocab_size is not None and high >= vocab_size:
        raise PromptError(f"{where}: token id {high} is outside the model's vocabulary (0..{vocab_size - 1}): "
                          "give ids from the target's tokenizer")
    if max_positions is not None and len(ids) + max_new_tokens > max_positions:
        raise PromptError(
            f"{where}: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the model's "
            f"{max_positions} positions: shorten the prompt or lower --max-new-tokens")


def _encode(tokenizer: Any, text: str, where: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text))
    raise PromptError(f"{where}: the tokenizer cannot encode text: give input_ids instead")
