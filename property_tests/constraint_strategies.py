"""Hypothesis strategies for structured-output constraints (engines/constraints/).

Like property_tests/request_strategies.py: keyword-only bounds, everything random from Hypothesis draws,
shrinking toward the small case (the first kind, one property, one choice). Every constraint drawn is one
xgrammar compiles over a byte vocabulary, and every one admits a sentence of a few characters, so a short
budget can finish it.

    from hypothesis import given
    from specaudit.testing.constraint_strategies import constraints

    @given(constraint=constraints())
    def test_server(constraint): ...
"""

from __future__ import annotations

import json
from typing import Sequence

from hypothesis import strategies as st

from specaudit.engines.constraints import KINDS, Constraint

WORD_ALPHABET = "abcdefxyz"
REGEX_PIECES = ("[a-f]{1,3}", r"\d+", "(yes|no)", "x", "-", "[0-9]{2}", "(ab)*c")
GRAMMARS = {  # EBNF (xgrammar's, which is GBNF) and the same language in Lark
    "ebnf": ('root ::= "(" inner ")"\ninner ::= [0-9]+ | "(" inner ")"',
             'root ::= item ("," item)*\nitem ::= "a" | "b" [0-9]'),
    "lark": ('start: "(" inner ")"\ninner: /[0-9]+/ | "(" inner ")"',
             'start: item ("," item)*\nitem: "a" | "b" /[0-9]/'),
}


@st.composite
def json_schemas(draw: st.DrawFn, *, max_properties: int = 3) -> dict:
    """An object schema of 1..max_properties properties (integer, boolean, short string, enum), some required."""
    names = draw(st.lists(st.text(WORD_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=max_properties,
                          unique=True))
    types = st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"type": "string", "maxLength": 4},
                             {"enum": ["on", "off", 3]}])
    properties = {name: draw(types) for name in names}
    required = [name for name in names if draw(st.booleans())]
    schema: dict = {"type": "object", "properties": properties, "required": required}
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def constraints(draw: st.DrawFn, *, kinds: Sequence[str] = KINDS, max_choices: int = 4,
                max_regex_pieces: int = 3) -> Constraint:
    """One constraint of a kind from `kinds`: a drawn object schema, any JSON object, a regex joined from
    `REGEX_PIECES`, 1..max_choices distinct choices, or one of `GRAMMARS` in EBNF or Lark; the JSON kinds'
    whitespace rule drawn too (vLLM's `disable_any_whitespace`)."""
    kind = draw(st.sampled_from(list(kinds)))
    if kind == "json_schema":
        return Constraint("json_schema", json.dumps(draw(json_schemas())), any_whitespace=draw(st.booleans()))
    if kind == "json_object":
        return Constraint("json_object", any_whitespace=draw(st.booleans()))
    if kind == "regex":
        pieces = draw(st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=max_regex_pieces))
        return Constraint("regex", "".join(pieces))
    if kind == "choice":
        words = draw(st.lists(st.text(WORD_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=max_choices,
                              unique=True))
        return Constraint("choice", choices=tuple(words))
    syntax = draw(st.sampled_from(["ebnf", "lark"]))
    return Constraint("grammar", draw(st.sampled_from(GRAMMARS[syntax])), syntax=draw(st.sampled_from([syntax, "auto"])))
