"""Recorded outputs as an engine: `recorded:FILE`.

FILE is JSONL, one line per prompt:

    {"prompt_ids": [...], "output_ids": [...],
     "logprobs": [...],          optional: per output token, the log-probability of that token
     "top_logprobs": [...],      optional: per output token, the top alternatives, as
                                 {"ID": logprob, ...}, [[ID, logprob], ...] or [{"id": ID, "logprob": x}, ...]
     "max_new_tokens": N, "eos_token_id": ID,   optional: the settings it was made with (checked);
                                 eos_token_id may be null, one id or a list [A, B] (compared as a set)
     "acceptance": {...},        optional: the server's own speculation counters for this request, the
                                 fields of server_metrics.RequestCounters (`verify_steps`, `drafted_tokens`,
                                 `accepted_tokens`, `accepted_histogram`, `per_step_accepted`, ...)
     ...}                         anything else is kept as free metadata

The prompts come from the file (`recorded_prompts`, in file order): the audit decodes exactly
these with the reference and compares. `generate` looks each prompt up by its ids (a prompt that
appears twice takes the recording's lines in order), so outputs are judged against the prompt they
were recorded for. Lines that carry `acceptance` make the run's `last_speculation` (their counters summed,
as a live server's responses: server_metrics.with_requests). A recording made with other settings than the audit's (`max_new_tokens`,
`eos_token_id` when recorded) is refused with a message that says which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specaudit.engines.adapters.server_metrics import RequestCounters, with_requests
from specaudit.engines.limits import eos_ids

KNOWN_FIELDS = ("prompt_ids", "output_ids", "logprobs", "top_logprobs")


class RecordingError(ValueError):
    """A recording that cannot be used; the message names the file and line."""


@dataclass
class RecordedLine:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per output token: {token id: log-probability}
    metadata: dict[str, Any] = field(default_factory=dict)


def _ids(value: Any, what: str, where: str, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise RecordingError(f"{where}: {what} must be a list of non-negative integer token ids")
    if not value and not allow_empty:
        raise RecordingError(f"{where}: {what} is empty; every prompt needs at least one token")
    return [int(t) for t in value]


def _recorded_eos(value: Any, where: str) -> tuple[int, ...]:
    """A recording's `eos_token_id`: null, one id or a list of ids, as the set of ids."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RecordingError(f"{where}: eos_token_id must be null, a token id or a list of token ids, not {value!r}")
    return eos_ids(ids)


def _shown(ids: tuple[int, ...]) -> str:
    return "none" if not ids else str(ids[0]) if len(ids) == 1 else "[" + ",".join(map(str, ids)) + "]"


def _alternatives(entry: Any, where: str) -> dict[int, float]:
    if entry is None:
        return {}
    if isinstance(entry, dict):
        return {int(key): float(value) for key, value in entry.items()}
    if isinstance(entry, list):
        out: dict[int, float] = {}
        for item in entry:
            if isinstance(item, dict):
                out[int(item["id"])] = float(item["logprob"])
            else:
                token, value = item
                out[int(token)] = float(value)
        return out
    raise RecordingError(f"{where}: a top_logprobs entry must be an object or a list, got {type(entry).__name__}")


def _logprobs(record: dict[str, Any], output_ids: list[int], where: str) -> list[dict[int, float]] | None:
    chosen, tops = record.get("logprobs"), record.get("top_logprobs")
    if chosen is None and tops is None:
        return None
    for name, value in (("logprobs", chosen), ("top_logprobs", tops)):
        if value is not None and (not isinstance(value, list) or len(value) != len(output_ids)):
            raise RecordingError(f"{where}: {name} must be a list with one entry per output token "
                                 f"({len(output_ids)})")
    per_token: list[dict[int, float]] = []
    try:
        for position, token in enumerate(output_ids):
            entry = _alternatives(tops[position], where) if tops is not None else {}
            if chosen is not None and chosen[position] is not None:
                entry.setdefault(token, float(chosen[position]))
            per_token.append(entry)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, RecordingError):
            raise
        raise RecordingError(f"{where}: unreadable log-probabilities ({type(exc).__name__}: {exc})") from None
    return per_token


def read_recording(path: str | Path) -> list[RecordedLine]:
    """Every line of a recording, checked (see the module docstring)."""
    source = Path(path)
    if not source.is_file():
        raise RecordingError(f"recording {str(path)!r} does not exist or is not a file: give a JSONL file "
                             "with prompt_ids and output_ids on each line")
    lines: list[RecordedLine] = []
    for number, text in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecordingError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or "prompt_ids" not in record or "output_ids" not in record:
            raise RecordingError(f"{where}: each line must be an object with prompt_ids and output_ids")
        prompt = _ids(record["prompt_ids"], "prompt_ids", where, allow_empty=False)
        output = _ids(record["output_ids"], "output_ids", where, allow_empty=True)
        metadata = {key: value for key, value in record.items() if key not in KNOWN_FIELDS}
        if "eos_token_id" in metadata:
            _recorded_eos(metadata["eos_token_id"], where)  # null, an id or a list of ids
        lines.append(RecordedLine(prompt, output, _logprobs(record, output, where), metadata))
    if not lines:
        raise RecordingError(f"recording {str(path)!r} is empty: give one JSON object per line")
    return lines


def write_recording(path: str | Path, prompts: list[list[int]], outputs: list[list[int]],
                    logprobs: list[list[dict[int, float]] | None] | None = None,
                    metadata: dict[str, Any] | None = None,
                    per_line: list[dict[str, Any] | None] | None = None) -> Path:
    """Write prompts and outputs (and per-token alternatives, when given) as a recording; `per_line` adds
    fields to each line (a request's `acceptance` counters)."""
    target = Path(path)
    with target.open("w", encoding="utf-8") as handle:
        for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            record: dict[str, Any] = {"prompt_ids": [int(t) for t in prompt], "output_ids": [int(t) for t in output]}
            if logprobs is not None and logprobs[index] is not None:
                record["top_logprobs"] = [{str(k): v for k, v in entry.items()} for entry in logprobs[index]]
            record.update(metadata or {})
            if per_line is not None and per_line[index]:
                record.update(per_line[index])
            handle.write(json.dumps(record) + "\n")
    return target


class RecordedEngine:
    """Replays a recording (`recorded:FILE`). Takes no models; `batch_size` is ignored."""

    black_box = True

    def __init__(self, path: str, *, batch_size: int = 1, **_: Any) -> None:
        self.path = str(path)
        self.lines = read_recording(path)
        self.recorded_prompts: list[list[int]] = [line.prompt_ids for line in self.lines]
        self.last_logprobs: list[list[dict[int, float]] | None] = []
        self.last_speculation: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        shared = {}
        if self.lines:
            first = self.lines[0].metadata
            shared = {key: value for key, value in first.items()
                      if key != "acceptance" and all(line.metadata.get(key) == value for line in self.lines)}
        return {"kind": "recorded", "path": self.path, "lines": len(self.lines), "metadata": shared}

    def _check_settings(self, max_new_tokens: int, eos_token_id: int | Sequence[int] | None) -> None:
        for number, line in enumerate(self.lines, 1):
            recorded = line.metadata.get("max_new_tokens")
            if recorded is not None and recorded != max_new_tokens:
                raise RecordingError(f"{self.path}: recorded with max_new_tokens={recorded} (line {number}), "
                                     f"audited with {max_new_tokens}: pass --max-new-tokens {recorded}")
            if "eos_token_id" not in line.metadata:
                continue
            recorded_eos = _recorded_eos(line.metadata["eos_token_id"], f"{self.path}:{number}")
            if set(recorded_eos) != set(eos_ids(eos_token_id)):  # a set: the order of the ids does not matter
                raise RecordingError(f"{self.path}: recorded with eos_token_id={_shown(recorded_eos)} (line {number}), "
                                     f"audited with {_shown(eos_ids(eos_token_id))}: pass --eos-token-id "
                                     f"{','.join(map(str, recorded_eos)) if recorded_eos else 'none'}")

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        self._check_settings(max_new_tokens, eos_token_id)
        unused: dict[tuple[int, ...], list[int]] = {}
        for index, line in enumerate(self.lines):
            unused.setdefault(tuple(line.prompt_ids), []).append(index)
        outputs, self.last_logprobs, counters = [], [], []
        for number, prompt in enumerate(prompts):
            queue = unused.get(tuple(int(t) for t in prompt))
            if not queue:
                raise RecordingError(f"{self.path}: prompt {number} ({len(prompt)} tokens) is not in the recording "
                                     "(or appears more often than recorded)")
            line = self.lines[queue.pop(0)]
            outputs.append(list(line.output_ids))
            self.last_logprobs.append(line.logprobs)
            counted = line.metadata.get("acceptance")
            counters.append(RequestCounters.from_json(counted) if isinstance(counted, dict) else None)
        self.last_speculation = with_requests(None, counters, [len(o) for o in outputs])
        return outputs
