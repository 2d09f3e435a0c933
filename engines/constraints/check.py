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
from typing import Any, Sequence

from specaudit.engines.constraints import Constraint
from specaudit.engines.constraints.matcher import RowMatcher, token_vocabulary

BYTE_STOP = 256  # the byte vocabulary's one stop id


class ByteVocabulary:
    """256 byte tokens and one stop token: the vocabulary a text is checked in."""

    vocab_size = 257

    def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)] + [b""]


BYTES = ByteVocabulary()


def violation(constraint: Constraint, text: str | bytes, finished: bool) -> str | None:
    """None when `text` satisfies `constraint` (module docstring), else how it does not. `text` may be the
    output's bytes (`output_bytes`): an output cut inside a multi-byte character is checked as it is."""
    matcher = RowMatcher(constraint, BYTES, ByteVocabulary.vocab_size, [BYTE_STOP])
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    for offset, byte in enumerate(data):
        if not matcher.advance(byte):
            shown = data[:offset].decode("utf-8", errors="replace")[-40:]
            return (f"the output leaves the {constraint.kind} constraint at byte {offset}: {data[offset:offset + 1]!r} "
                    f"after {shown!r}")
    if not finished:
        return None
    if constraint.kind in ("json_schema", "json_object"):
        try:
            value: Any = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return f"the output is not UTF-8 at byte {exc.start}"
        except json.JSONDecodeError as exc:
            return f"the output is not JSON: {exc.msg} at character {exc.pos}"
        if constraint.kind == "json_object" and not isinstance(value, dict):
            return f"the output is JSON but no object ({type(value).__name__})"
    if not bool(matcher.allowed()[BYTE_STOP]):  # not an accepting state
        return f"the output ended before the {constraint.kind} constraint was complete (an unfinished sentence)"
    return None


_VOCABULARIES: dict[int, tuple[Any, list[bytes]]] = {}


def output_bytes(tokens: Sequence[int], tokenizer: Any, stop_ids: Sequence[int]) -> tuple[bytes, bool]:
    """The output's bytes as the grammar engine reads its tokens (xgrammar's decoded vocabulary of the
    tokenizer: a byte-fallback token is its byte, not the U+FFFD a decoder makes of a lone one) without a
    final stop id, and whether the output finished on a stop id."""
    finished = bool(tokens) and tokens[-1] in set(stop_ids)
    body = list(tokens[:-1] if finished else tokens)
    if id(tokenizer) not in _VOCABULARIES:
        size = max(len(tokenizer) if hasattr(tokenizer, "__len__") else 0, int(getattr(tokenizer, "vocab_size", 0) or 0))
        _VOCABULARIES[id(tokenizer)] = (tokenizer, list(token_vocabulary(tokenizer, size, list(stop_ids) or [0]).decoded_vocab))
    vocabulary = _VOCABULARIES[id(tokenizer)][1]
    return b"".join(vocabulary[t] if 0 <= t < len(vocabulary) else b"" for t in body), finished
