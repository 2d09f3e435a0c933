"""Whether an output's text satisfies its constraint, read from the text alone (no model, no tokenizer).

`violation(constraint, text, finished)` is None when the text satisfies the constraint, else one sentence
saying how it does not. A finished output (it ended on a stop id, finish reason "stop") must be a complete
sentence: JSON that parses (the JSON kinds; a `json_object` an object) and that the constraint's grammar
accepts in full (a regex matched in full, one of the choices, a sentence of the grammar). An output cut at
its budget (finish reason "length") need only be a prefix of one. The grammar is xgrammar's, compiled over
a byte vocabulary (each byte one token), so the check is the server's own definition of the constraint,
independent of any tokenizer; the JSON parse is Python's own.
"""

from __future__ import annotations

import json
from typing import Any

from specaudit.engines.constraints import Constraint
from specaudit.engines.constraints.matcher import RowMatcher

BYTE_STOP = 256  # the byte vocabulary's one stop id


class ByteVocabulary:
    """256 byte tokens and one stop token: the vocabulary a text is checked in."""

    vocab_size = 257

    def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)] + [b""]


BYTES = ByteVocabulary()


def violation(constraint: Constraint, text: str, finished: bool) -> str | None:
    """None when `text` satisfies `constraint` (module docstring), else how it does not."""
    matcher = RowMatcher(constraint, BYTES, ByteVocabulary.vocab_size, [BYTE_STOP])
    data = text.encode("utf-8")
    for offset, byte in enumerate(data):
        if not matcher.advance(byte):
            shown = data[:offset].decode("utf-8", errors="replace")[-40:]
            return (f"the output leaves the {constraint.kind} constraint at character {len(data[:offset].decode('utf-8', errors='replace'))}"
                    f": {data[offset:offset + 1].decode('utf-8', errors='replace')!r} after {shown!r}")
    if not finished:
        return None
    if constraint.kind in ("json_schema", "json_object"):
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"the output is not JSON: {exc.msg} at character {exc.pos}"
        if constraint.kind == "json_object" and not isinstance(value, dict):
            return f"the output is JSON but no object ({type(value).__name__})"
    if not bool(matcher.allowed()[BYTE_STOP]):
        return f"the output ended before the {constraint.kind} constraint was complete (an unfinished sentence)"
    return None
