"""Structured outputs: a request's constraint on its output text, as a typed record.

A `Constraint` says what the output must be, in the kinds a server takes:

- `json_schema`: JSON valid under the schema in `text` (a JSON document);
- `json_object`: any JSON object (vLLM compiles it as the schema `{"type": "object"}`);
- `regex`: text matching the regular expression `text` in full;
- `choice`: exactly one of `choices` (vLLM turns it into the grammar `root ::= "a" | "b"`, `choice_grammar`);
- `grammar`: text of the context-free grammar `text`, in `syntax` "ebnf" (xgrammar's EBNF, which is
  llama.cpp's GBNF) or "lark"; "auto" reads it as vLLM does (`grammar_is_likely_lark`: Lark unless a line
  holds `::=`).

`backend` is the grammar engine that applies it ("xgrammar", vLLM's and SGLang's default; "llguidance", what
llama.cpp applies to a JSON schema; another is refused, never approximated), `any_whitespace` its whitespace rule for the JSON kinds
(vLLM's `disable_any_whitespace` is its negation: False allows no whitespace between JSON tokens).
`reasoning_end` is the text of a reasoning section's end marker (`</think>`): the grammar applies from the
token after it on (a server started with `--reasoning-parser`; a server setting, never a request field).

How a constraint is applied to each step's logits (masking, EOS, speculation) is engines/constraints/matcher.py;
whether a finished output satisfies it is `violation` (engines/constraints/check.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
SYNTAXES = ("auto", "ebnf", "lark")
BACKENDS = ("xgrammar", "llguidance")  # the grammar engines the reference applies exactly


class ConstraintError(ValueError):
    """A constraint that cannot be applied: no grammar engine installed, or a grammar it refuses."""


@dataclass(frozen=True)
class Constraint:
    """One request's structured-output constraint (module docstring)."""

    kind: str
    text: str = ""  # the schema (JSON text), the regex or the grammar; empty for json_object and choice
    choices: tuple[str, ...] = ()  # choice only
    syntax: str = "auto"  # grammar only
    backend: str = "xgrammar"
    any_whitespace: bool = True  # JSON kinds: vLLM's `not disable_any_whitespace`
    reasoning_end: str = ""  # the reasoning section's end marker: the grammar starts after it ("" none)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "choices", tuple(str(c) for c in self.choices))
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"grammar backend {self.backend!r}: the reference applies {', '.join(BACKENDS)} only "
                             "(the audited server's engine must be the reference's)")
        if self.syntax not in SYNTAXES:
            raise ValueError(f"grammar syntax {self.syntax!r}: use one of {', '.join(SYNTAXES)}")
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("a choice constraint needs at least one choice")
            if any(c == "" for c in self.choices):
                raise ValueError("a choice constraint's choices must not be empty strings")
        elif self.choices:
            raise ValueError(f"choices belong to a choice constraint, not {self.kind}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema: a schema is a JSON object")
            set_(self, "text", json.dumps(schema))  # one spelling per schema, its key order kept (xgrammar emits properties in it)
        elif self.kind == "regex":
            if not self.text:
                raise ValueError("regex: an empty pattern")
            if "\x00" in self.text:
                raise ValueError("regex: a NUL character is never meaningful in a pattern (vLLM refuses it)")
        elif self.kind == "grammar" and not self.text.strip():
            raise ValueError("grammar: an empty grammar")
        elif self.kind in ("json_object", "choice") and self.text:
            raise ValueError(f"a {self.kind} constraint takes no text")
        if not isinstance(self.reasoning_end, str) or (self.reasoning_end and not self.reasoning_end.strip()):
            raise ValueError("reasoning_end: the end marker's text (for example </think>), not blank")

    @property
    def grammar_syntax(self) -> str:
        """A grammar's syntax, "ebnf" or "lark" ("auto": vLLM's `grammar_is_likely_lark`)."""
        if self.syntax != "auto":
            return self.syntax
        for line in self.text.split("\n"):
            line = re.sub(r"(#|//).*$", "", line).strip()
            if line and "::=" in line:
                return "ebnf"
        return "lark"

    def describe(self) -> str:
        """One line: the kind and its text, shortened."""
        body = " | ".join(self.choices) if self.kind == "choice" else self.text
        body = body if len(body) <= 60 else body[:57] + "..."
        after = f" after {self.reasoning_end}" if self.reasoning_end else ""
        return (f"{self.kind}: {body}" if body else self.kind) + after

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, the fields that differ from their defaults (the inverse of `from_dict`)."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "json_schema":
            out["schema"] = json.loads(self.text)
        elif self.text:
            out["text"] = self.text
        if self.choices:
            out["choices"] = list(self.choices)
        if self.syntax != "auto":
            out["syntax"] = self.syntax
        if self.backend != "xgrammar":
            out["backend"] = self.backend
        if not self.any_whitespace:
            out["any_whitespace"] = False
        if self.reasoning_end:
            out["reasoning_end"] = self.reasoning_end
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Constraint":
        """From a prompts file's `constraint` object: `kind` and `schema` (an object or its text), `text`
        (regex, grammar), `choices`, `syntax`, `backend`, `any_whitespace`, `reasoning_end`; an unknown key raises
        ValueError."""
        known = {"kind", "schema", "text", "choices", "syntax", "backend", "any_whitespace", "reasoning_end"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown constraint field(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
        if "kind" not in data:
            raise ValueError(f"a constraint needs a kind: one of {', '.join(KINDS)}")
        values = {k: v for k, v in data.items() if k != "schema"}
        if "schema" in data:
            schema = data["schema"]
            values["text"] = schema if isinstance(schema, str) else json.dumps(schema)
        if isinstance(values.get("choices"), str):
            values["choices"] = [values["choices"]]
        return cls(**values)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """vLLM's `choice_as_grammar`: `root ::= "a" | "b"`, each choice an escaped EBNF literal."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(escape(c) for c in choice) + '"' for choice in choices)


def vocabulary_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each of `vocab_size` ids as bytes, for a grammar engine's vocabulary: a tokenizer's own `token_bytes()`
    (the built-in byte tokenizer), else each id decoded alone; ids past the tokenizer's are empty (specials)."""
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):
        encoded = list(own())
    else:
        encoded = [tokenizer.decode([i]).encode("utf-8") for i in range(getattr(tokenizer, "vocab_size", vocab_size))]
    return (encoded + [b""] * vocab_size)[:vocab_size]
