"""The search's Hypothesis strategies: one request's prompt, parameters and arrival.

As property_tests/strategies.py: keyword-only bounds, everything random from Hypothesis draws, and shrinking
toward the small case: a pool prompt as the fixed audit sends it, a prefix of one token, each parameter family off unless the draw turns it
on (`st.booleans()` shrinks to False), the smallest numbers, requests in flight together (one wave).

Parameters are drawn from what the reference itself continues with (`Continuation`): a stop string is a piece of
the reference's own text, a stop id or a logit-biased id one of its own tokens, so that they land inside the
output, where a speculative engine's accepted chunk can complete them mid-burst.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from hypothesis import strategies as st

from specaudit.engines.constraints import KINDS, Constraint
from specaudit.engines.requests import RequestParams
from specaudit.testing.constraint_strategies import GRAMMARS, REGEX_PIECES, constraints

# the parameter families a request may draw, each on or off (a family off is the shrink target)
FAMILIES = ("stop", "stop_token_ids", "max_tokens", "min_tokens", "penalties", "logit_bias", "bad_words",
            "logprobs", "seed", "constraint")
PROBES = ("seeded",)  # steps beside the requests: a sampled probe with seeds (seeds.py), where the engine samples
ARRIVALS = ("join", "after", "alone")  # in flight with the wave before; a new wave others join; a wave of its own
PROMPT_KINDS = ("fresh", "shared", "identical")
FRESH_KINDS = ("pool", "random", "repeated")  # a pool prompt cut short, random ids, a repeated segment
BLOCK_SIZE = 16  # vLLM's default KV block: prefix-cache hits come in whole blocks
STOP_ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
FFFD = "\ufffd"  # a multi-byte character split across tokens: never part of a drawn stop string


@dataclass(frozen=True)
class ConstraintScope:
    """The structured outputs an engine takes, so the search draws only those: the kinds, the grammar syntaxes
    and JSON whitespace rules it applies as the reference does, and the grammar engine for the JSON kinds. A
    server takes what its dialect carries (engines/constraints/fields.py), written as it is started by default
    (EBNF, any whitespace); an in-process engine that declares `takes_constraints`, every kind.

    `reasoning_end` is where the grammar begins (`Constraint.reasoning_end`). A server applies its reasoning
    parser to every request, so every drawn constraint carries the one marker it was started with (`--reasoning-end`;
    "" for none); an in-process engine applies what each request says, so None draws one per constraint, on or
    off, from the reference's own text (`reasoning_markers`)."""

    kinds: tuple[str, ...] = ()  # (): the engine takes no constraint, the family is never drawn
    syntaxes: tuple[str, ...] = ("ebnf", "lark")
    whitespace: tuple[bool, ...] = (True, False)  # `any_whitespace` values drawn for the JSON kinds
    json_backend: str = "xgrammar"
    reasoning_end: str | None = ""  # the marker every constraint carries ("" none); None: drawn per constraint


ALL_CONSTRAINTS = ConstraintScope(kinds=KINDS, reasoning_end=None)


@dataclass(frozen=True)
class Continuation:
    """The reference's plain greedy continuation of one prompt: what the drawn parameters are taken from."""

    tokens: tuple[int, ...]
    text: str  # the tokens decoded ("" without a tokenizer)


def text_tokens(tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    """The ids a drawn prompt's own tokens (random ones, a repeated segment, a shared prefix's tail) come from: each
    that decodes alone to text (not empty, no U+FFFD, not a special token). A client sends text; a prompt that is
    not text (a lone UTF-8 continuation byte, a special token) has no defined text report, and what a server says
    of it is its detokenizer's own, with or without speculation. Without a tokenizer, every id."""
    if tokenizer is None:
        return tuple(range(vocab_size))
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    ids = [i for i in range(vocab_size) if i not in special]
    try:
        texts = tokenizer.batch_decode([[i] for i in ids])
    except (AttributeError, TypeError):
        texts = [tokenizer.decode([i]) for i in ids]
    except Exception:  # an id past the tokenizer's own vocabulary (a padded embedding): decoded one by one
        texts = []
        for i in ids:
            try:
                texts.append(tokenizer.decode([i]))
            except Exception:
                texts.append("")
    kept = tuple(i for i, text in zip(ids, texts) if text and FFFD not in text)
    return kept or tuple(range(vocab_size))


@st.composite
def prefix_lengths(draw: st.DrawFn, *, max_length: int, block_size: int = BLOCK_SIZE) -> int:
    """How many tokens a prompt shares with an earlier one (1 to `max_length`): any length, all of it but a few
    tokens (a cached prefix, then a new tail), a whole number of blocks or one token either side of it, or around a
    power of two. Shrinks toward 1."""
    if max_length <= 1:
        return 1
    kind = draw(st.sampled_from(("any", "most", "block", "power")))
    if kind == "any":
        return draw(st.integers(1, max_length))
    if kind == "most":
        return max(1, max_length - draw(st.integers(1, 4)))
    if kind == "block" and max_length >= block_size:
        blocks = draw(st.integers(1, max_length // block_size))
        return min(max_length, max(1, blocks * block_size + draw(st.sampled_from((0, -1, 1)))))
    power = draw(st.integers(0, max(0, max_length.bit_length() - 1)))
    return min(max_length, max(1, 2 ** power + draw(st.sampled_from((0, -1, 1)))))


@st.composite
def fresh_prompts(draw: st.DrawFn, *, pool: Sequence[Sequence[int]], tokens: Sequence[int], min_length: int = 1,
                  max_length: int = 64) -> tuple[str, tuple[int, ...]]:
    """(kind, prompt ids): a prompt of the pool, whole or cut to a drawn length, random ids among `tokens`
    (`text_tokens`), or a segment repeated (its continuation repeats too: what an n-gram drafter proposes from). Shrinks toward a whole pool prompt (what the fixed
    audit sends), then a shorter cut of it."""
    kinds = FRESH_KINDS if pool else FRESH_KINDS[1:]
    kind = draw(st.sampled_from(kinds))
    if kind == "pool":
        source = list(draw(st.sampled_from(list(pool))))
        # the whole prompt (up to max_length; the shrink target), cut a few tokens short (the same text, its
        # output starting elsewhere: a speculative engine's steps fall elsewhere in it), or cut to any length
        cut = draw(st.sampled_from(("whole", "short", "any")))
        whole = min(max_length, len(source))
        length = (whole if cut == "whole" else max(1, whole - draw(st.integers(1, 4))) if cut == "short" else
                  draw(st.integers(min(min_length, len(source)), whole)))
        return kind, tuple(source[:max(1, length)])
    if kind == "random":
        return kind, tuple(draw(st.lists(st.sampled_from(tokens), min_size=min_length, max_size=max_length)))
    segment = draw(st.lists(st.sampled_from(tokens), min_size=1, max_size=8))
    if pool and draw(st.booleans()):  # a piece of real text repeated
        source = list(draw(st.sampled_from(list(pool))))
        start = draw(st.integers(0, max(0, len(source) - 1)))
        segment = source[start:start + draw(st.integers(1, 12))] or segment
    repeats = draw(st.integers(2, max(2, max_length // len(segment))))
    return kind, tuple((segment * repeats)[:max_length])


@st.composite
def stop_strings(draw: st.DrawFn, *, text: str, max_length: int = 4) -> str:
    """A piece of `text` (the reference's continuation), so that it completes inside the output; with no usable
    text, a short string of letters."""
    spans = [i for i, c in enumerate(text) if c != FFFD and not c.isspace()]
    if not spans:
        return draw(st.text(STOP_ALPHABET.strip(), min_size=1, max_size=max_length))
    start = draw(st.sampled_from(spans))
    length = draw(st.integers(1, max_length))
    piece = text[start:start + length].split(FFFD)[0]
    return piece or text[start]


def text_start(text: str) -> str:
    """The plain continuation's text from its start while it is letters, digits and spaces (what a regex, a
    choice or a grammar may spell without escapes); "" where it starts otherwise."""
    out = []
    for c in text:
        if not (c.isascii() and (c.isalnum() or c == " ")):
            break
        out.append(c)
    return "".join(out)


@st.composite
def reasoning_markers(draw: st.DrawFn, *, text: str) -> str:
    """A reasoning end marker taken from the plain continuation's text past its first character (a piece of one
    to three characters, as `stop_strings`), so that the reasoning ends inside the output, where a draft window
    may hold the marker and the grammar's first tokens together (vLLM #34650)."""
    return draw(stop_strings(text=text[1:] or text, max_length=3))


@st.composite
def drawn_constraints(draw: st.DrawFn, *, continuation: Continuation, scope: ConstraintScope) -> Constraint:
    """A structured-output constraint of a kind `scope` takes, behind the reasoning end marker the scope gives
    or draws (`ConstraintScope.reasoning_end`; a drawn one shrinks toward none)."""
    constraint = draw(_constraint_of_kind(continuation=continuation, scope=scope))
    marker = scope.reasoning_end
    if marker is None:
        marker = draw(reasoning_markers(text=continuation.text)) if continuation.text and draw(st.booleans()) else ""
    return replace(constraint, reasoning_end=marker) if marker else constraint


@st.composite
def _constraint_of_kind(draw: st.DrawFn, *, continuation: Continuation, scope: ConstraintScope) -> Constraint:
    """A choice, a regex or a grammar may begin with the plain continuation's own first characters
    (`text_start`): the draft's proposals agree there, and the grammar's end (EOS forced, nothing else
    admitted) lands inside an accepted chunk; otherwise one of the property tests' constraints
    (property_tests/constraint_strategies.py), which bite at the first token."""
    kind = draw(st.sampled_from(list(scope.kinds)))
    start = text_start(continuation.text)
    if start and kind in ("choice", "regex", "grammar") and draw(st.booleans()):
        head = start[:draw(st.integers(1, min(8, len(start))))]
        if kind == "choice":
            other = draw(st.text("abcdefxyz", min_size=1, max_size=4))
            return Constraint("choice", choices=tuple(dict.fromkeys((head, other))))
        piece = draw(st.sampled_from(("", *REGEX_PIECES[:3])))
        if kind == "regex":
            return Constraint("regex", head + piece)
        tail = draw(st.sampled_from(('', ' [a-z]*', ' [0-9]+ "."')))
        return Constraint("grammar", f'root ::= "{head}"{tail}', syntax="ebnf")
    if kind in ("json_schema", "json_object"):
        drawn = draw(constraints(kinds=(kind,)))
        return Constraint(kind, drawn.text, any_whitespace=draw(st.sampled_from(scope.whitespace)),
                          backend=scope.json_backend)
    if kind == "grammar":
        syntax = draw(st.sampled_from(list(scope.syntaxes)))
        return Constraint("grammar", draw(st.sampled_from(GRAMMARS[syntax])), syntax=syntax)
    return draw(constraints(kinds=(kind,)))


def family_on() -> st.SearchStrategy[bool]:
    """Whether a request sets one parameter family: one time in three (so that a request carries one or two
    families, a bug that needs one of them alone is drawn often, and a stop string taken from the plain
    continuation is not moved away by penalties every time). Shrinks toward off."""
    return st.integers(0, 2).map(lambda drawn: drawn == 2)


def stop_positions(continuation: Continuation, stop_ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Where the plain continuation meets a stop: the index of its EOS (it ended there) and of each of `stop_ids`."""
    found = [i for i, t in enumerate(continuation.tokens) if t in set(stop_ids) | set(eos_ids)]
    return found


@st.composite
def min_tokens_values(draw: st.DrawFn, *, continuation: Continuation, stop_ids: Sequence[int],
                      eos_ids: Sequence[int], max_tokens: int) -> int:
    """A `min_tokens` that bites: any small count, or one around a position where the plain continuation stops
    (its EOS, a drawn stop id), so that the stop falls just inside or just past `min_tokens`, wherever the engine's
    steps put it. Shrinks toward 1."""
    positions = stop_positions(continuation, stop_ids, eos_ids)
    if positions and draw(st.booleans()):
        position = draw(st.sampled_from(positions))
        return max(1, min(max_tokens, position + draw(st.sampled_from((0, 1, -1, 2, -2)))))
    return draw(st.integers(1, max(1, min(8, max_tokens))))


@st.composite
def request_params(draw: st.DrawFn, *, continuation: Continuation, vocab_size: int, max_new_tokens: int,
                   families: Sequence[str] = FAMILIES, bad_words_as_text: bool = False,
                   eos_ids: Sequence[int] = (), constraint_scope: ConstraintScope = ConstraintScope()) -> RequestParams:
    """One request's parameters, each family of `families` drawn on or off, its values taken from the reference's
    `continuation` where they then bite: stop strings from its text, stop ids, logit-biased ids and banned words from
    its tokens; a small `max_tokens` (a stop or EOS near the budget's end), `min_tokens` (around where the
    continuation stops: its EOS among `eos_ids`, a drawn stop id), penalties, top
    log-probabilities, a seed (greedy: it must change nothing) and a structured-output constraint of a kind
    `constraint_scope` takes (never with `min_tokens` or banned words: either may leave a finished sentence no
    token). `bad_words_as_text`: the words as text (vLLM takes no ids), else as token ids."""
    tokens = list(continuation.tokens) or [0]
    values: dict = {}
    on = set(families)
    if not constraint_scope.kinds:
        on.discard("constraint")
    if "constraint" in on and draw(family_on()):
        values["constraint"] = draw(drawn_constraints(continuation=continuation, scope=constraint_scope))
        on -= {"min_tokens", "bad_words"}
    if "stop" in on and draw(family_on()):
        values["stop"] = tuple(draw(st.lists(stop_strings(text=continuation.text), min_size=1, max_size=2,
                                             unique=True)))
    if "stop_token_ids" in on and draw(family_on()):
        values["stop_token_ids"] = tuple(draw(st.lists(st.sampled_from(tokens), min_size=1, max_size=2, unique=True)))
    if "max_tokens" in on and draw(family_on()):
        values["max_tokens"] = draw(st.integers(1, max(1, max_new_tokens)))
    if "min_tokens" in on and draw(family_on()):
        values["min_tokens"] = draw(min_tokens_values(
            continuation=continuation, stop_ids=values.get("stop_token_ids", ()), eos_ids=eos_ids,
            max_tokens=values.get("max_tokens", max_new_tokens)))
    if "penalties" in on and draw(family_on()):
        values["repetition_penalty"] = draw(st.sampled_from((1.0, 1.3, 2.0, 0.8, 1.1)))
        values["frequency_penalty"] = draw(st.sampled_from((0.0, 1.0, 0.4, -0.3, 2.0)))
        values["presence_penalty"] = draw(st.sampled_from((0.0, 1.0, 0.5, -0.5, 2.0)))
    if "logit_bias" in on and draw(family_on()):
        ids = draw(st.lists(st.one_of(st.sampled_from(tokens), st.integers(0, vocab_size - 1)), min_size=1,
                            max_size=2, unique=True))
        values["logit_bias"] = tuple((i, draw(st.sampled_from((-100.0, -5.0, 5.0, 100.0)))) for i in ids)
    if "bad_words" in on and draw(family_on()):
        start = draw(st.integers(0, len(tokens) - 1))
        word = tuple(tokens[start:start + draw(st.integers(1, 2))])
        if bad_words_as_text:
            text = continuation.text.strip()
            if text:  # a word of letters (a server strips a word's spaces: one of spaces only bans nothing)
                begin = draw(st.integers(0, len(text) - 1))
                word = text[begin:begin + draw(st.integers(1, 4))].split(FFFD)[0].strip() or text[0]
                values["bad_words_text"] = (word,)
        else:
            values["bad_words"] = (word,)
    if "logprobs" in on and draw(family_on()):
        values["logprobs"] = draw(st.integers(0, 5))
    if "seed" in on and draw(family_on()):
        values["seed"] = draw(st.integers(0, 2 ** 16))
    if values.get("min_tokens") and values.get("max_tokens") and values["min_tokens"] > values["max_tokens"]:
        values["min_tokens"] = values["max_tokens"]
    return RequestParams(**values)


def arrivals() -> st.SearchStrategy[str]:
    """How a request arrives: joining the wave before it (in flight together, one `generate` call for an in-process
    engine), after the waves before it finished (a new wave others may join), or alone (a wave of its own). Shrinks
    toward joining: a mix whose failure does not need the order is sent as one batch, as the fixed audit sends."""
    return st.sampled_from(ARRIVALS)
