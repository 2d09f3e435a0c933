"""Expected acceptance: what the proposer reaches along the reference's outputs, per draft position.

Greedy verification emits the target's greedy tokens whatever the draft proposes, so the reference's
output of each prompt fixes every verify step once the proposer is known. The replay (`replay`) walks each
output as the engines do (engines/eqspec.py `speculative_step`, engines/static/loop.py):

- the prefill emits the output's first token; while the row runs, a verify step starts after `g` emitted
  tokens: the proposer proposes from prompt + output[:g] (up to k tokens; the engines never clip k near
  the budget or at EOS, so neither does the replay);
- accepted = the longest prefix of the proposals equal to the target's greedy continuation there: the
  output's next tokens, and past the output's end (an EOS, or the budget) the target's own greedy tokens,
  EOS or not, since the verify pass scores the drafts past the row's stop as well;
- the step emits accepted + 1 tokens (accepted, then the recovered or bonus token), cut at the output's
  end: the next step starts at min(g + accepted + 1, len(output)), and the row ends there.

Proposers:

- `DraftModelProposer`: the draft model's greedy tokens, one uncached forward per token, stopping at the
  first proposal the target rejects (later ones never count). In float64 with the engine's own draft this
  is exact: the project's engines count the same numbers (tests/test_acceptance_expected.py). Below
  float64 a proposal may differ from the float64 draft's choice within the draft's precision
  (equivalence/rulings/draft.py): the expectation is then an estimate, bounded by how often the draft
  precision ruling admits a different proposal, and no excess over it is called impossible.
- `NgramProposer` (prompt lookup): the longest suffix n-gram of the context, n from `max_ngram` down to
  `min_ngram` (and at most len - 1), matched at an earlier occurrence that ends before the context's last
  token, and up to k tokens that followed it, cut at the context's end. `occurrence="earliest"` is vLLM's
  rule (vllm/v1/spec_decode/ngram_proposer.py `_find_longest_matched_ngram_and_propose_tokens`: of the
  matches of the longest n-gram it keeps the earliest); `"latest"` is the project's `PromptLookupDrafter`.
  vLLM also clips k at its max_model_len, which an audit's short outputs never reach. Exact.

`baseline` reads an earlier audit's observed counts instead: an expectation with sampling error, which the
findings compare with a two-sample test. Under sampling the expectation is a sum of acceptance probabilities
with its variance (equivalence/acceptance/sampled.py), compared with a z-test.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from specaudit.equivalence.acceptance.observed import ObservedAcceptance


@dataclass(frozen=True)
class ExpectedAcceptance:
    method: str  # "draft-model replay", "n-gram replay", "baseline", "sampled overlap"
    exact: bool  # the counts the engine must show (a replay in the engine's own precision), not an estimate
    k: int
    verify_steps: int
    # [K] verify steps whose first k+1 proposals the target accepts (sampled: the sum of their probabilities)
    accepted_per_position: tuple[float, ...]
    drafts_per_position: tuple[int, ...]  # [K] verify steps whose proposer made a proposal at k
    note: str = ""  # what bounds it where it is not exact
    per_prompt_accepted: tuple[tuple[int, ...], ...] = field(default=(), compare=False)  # [prompts][K]
    # sampled: [K] the variance of the accepted count, sum of alpha (1 - alpha) over the steps that reached k
    variance_per_position: tuple[float, ...] | None = None

    @property
    def drafted_tokens(self) -> int:
        return sum(self.drafts_per_position)

    @property
    def accepted_tokens(self) -> float:
        return sum(self.accepted_per_position)

    @property
    def rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    def position_rates(self) -> tuple[float | None, ...]:
        return tuple((a / d) if d else None for a, d in zip(self.accepted_per_position, self.drafts_per_position))

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("per_prompt_accepted")
        record["accepted_per_position"] = list(self.accepted_per_position)
        record["drafts_per_position"] = list(self.drafts_per_position)
        if self.variance_per_position is not None:
            record["variance_per_position"] = list(self.variance_per_position)
        record.update(drafted_tokens=self.drafted_tokens, accepted_tokens=self.accepted_tokens, rate=self.rate)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> ExpectedAcceptance:
        return cls(method=record["method"], exact=bool(record["exact"]), k=int(record["k"]),
                   verify_steps=int(record["verify_steps"]),
                   accepted_per_position=tuple(_count(v) for v in record["accepted_per_position"]),
                   drafts_per_position=tuple(int(v) for v in record["drafts_per_position"]),
                   note=str(record.get("note", "")),
                   variance_per_position=(tuple(float(v) for v in record["variance_per_position"])
                                          if record.get("variance_per_position") is not None else None))


def _count(value: Any) -> float:
    """A count as JSON kept it: an int where it is one (a replay), else a sum of probabilities (sampled)."""
    return int(value) if float(value).is_integer() else float(value)


# how the target's greedy token is chosen from its raw logits [V] after the tokens so far (a request's processors)
Chooser = Callable[[torch.Tensor, list[int]], int]


class TargetContinuation:
    """The target's greedy tokens after a prompt: the reference's output, then (computed on demand) the
    target's greedy tokens past its end, EOS or not. `choose`: the request's processing of the raw logits
    (penalties, bias, bad words, min_tokens on the tokens so far) where the run has request parameters, so the
    tokens past the end are the ones the engine's verify pass compares the drafts with; None: the argmax."""

    def __init__(self, target: Any, prompt: list[int], output: list[int], choose: Chooser | None = None,
                 grammar: Any = None) -> None:
        self.target, self.prompt, self.tokens, self.choose = target, list(prompt), list(output), choose
        self.grammar = grammar  # a structured-output request's matcher (engines/constraints/matcher.py), or None
        self._advanced = 0  # tokens the grammar consumed

    def at(self, index: int) -> int:
        while len(self.tokens) <= index:
            logits = _last_logits(self.target, self.prompt + self.tokens)  # [V]
            self.tokens.append(int(logits.argmax()) if self.choose is None else self.choose(logits, self.tokens))
        return self.tokens[index]

    def allowed_at(self, index: int) -> torch.Tensor | None:
        """[V] the tokens the request's grammar admits after the first `index` tokens, as a constrained
        drafter's mask there (engines/constraints/draft.py `DraftMask`); None without a grammar, or where it
        has ended (the drafter is not masked past a stop id)."""
        if self.grammar is None:
            return None
        if index > 0:
            self.at(index - 1)
        if index < self._advanced:
            self.grammar.rollback(self._advanced - index)
            self._advanced = index
        while self._advanced < index:
            if not self.grammar.advance(self.tokens[self._advanced]):
                return None  # a token the grammar forbids: the drafter's mask stops there too
            self._advanced += 1
        return None if self.grammar.terminated else self.grammar.allowed()


class Proposer(Protocol):
    """A proposer replayed along the reference: at a verify step after `emitted` tokens of `continuation`,
    how many tokens it proposes (at most k) and the proposals, lazily. The replay asks for proposal i + 1
    only after proposal i equalled the continuation's token, so a proposer may read its context off the
    continuation (one teacher-forced pass per prompt, not one pass per proposal)."""

    name: str

    def proposals(self, continuation: TargetContinuation, emitted: int, k: int) -> tuple[int, Iterator[int]]: ...


def _last_logits(model: Any, sequence: list[int]) -> torch.Tensor:
    """The model's logits after `sequence` [V]: one uncached forward of a batch of one."""
    return _logits(model, sequence)[-1]


def _logits(model: Any, sequence: list[int]) -> torch.Tensor:
    """The model's logits after every prefix of `sequence` [n, V]: one uncached forward of a batch of one."""
    device = next(model.parameters()).device
    ids = torch.tensor([sequence], dtype=torch.long, device=device)  # [1, n]
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]  # [n, V]


class DraftModelProposer:
    """The draft model's k greedy tokens (argmax over its whole vocabulary, as `ModelDrafter` takes them; under
    a structured-output grammar over the tokens it admits there, as `ModelDrafter` masks them): proposal i
    after `emitted` tokens is the draft's choice after prompt + continuation[:emitted + i], read off one
    teacher-forced pass over prompt + continuation (again only when the continuation grew)."""

    name = "draft-model replay"

    def __init__(self, draft: Any) -> None:
        self.draft = draft
        # the continuation, and the draft's logits after each of its prefixes [n, V]
        self._logits: tuple[TargetContinuation | None, torch.Tensor | None] = (None, None)

    def _choice(self, continuation: TargetContinuation, index: int) -> int:
        """The draft's greedy token after prompt + continuation[:index]."""
        of, logits = self._logits
        position = len(continuation.prompt) + index - 1
        if of is not continuation or logits is None or position >= logits.shape[0]:
            logits = _logits(self.draft, continuation.prompt + continuation.tokens)  # [n, V]
            self._logits = (continuation, logits)
        allowed = continuation.allowed_at(index)  # [V] or None
        row = logits[position] if allowed is None else logits[position].masked_fill(~allowed.to(logits.device),
                                                                                     float("-inf"))
        return int(row.argmax())

    def proposals(self, continuation: TargetContinuation, emitted: int, k: int) -> tuple[int, Iterator[int]]:
        def tokens() -> Iterator[int]:
            for i in range(k):
                yield self._choice(continuation, emitted + i)
        return k, tokens()


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup (module docstring): `occurrence` "earliest" (vLLM) or "latest" (PromptLookupDrafter)."""

    min_ngram: int = 1
    max_ngram: int = 3
    occurrence: str = "earliest"
    name: str = "n-gram replay"

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        total = len(tokens)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            tail = list(tokens[total - n:])
            starts = range(0, total - n) if self.occurrence == "earliest" else range(total - n - 1, -1, -1)
            for start in starts:
                if list(tokens[start:start + n]) == tail:
                    return list(tokens[start + n:start + n + k])
        return []

    def proposals(self, continuation: TargetContinuation, emitted: int, k: int) -> tuple[int, Iterator[int]]:
        found = self.lookup(continuation.prompt + continuation.tokens[:emitted], k)
        return len(found), iter(found)


@torch.no_grad()
def replay_row(proposer: Proposer, target: Any, prompt: list[int], output: list[int], k: int,
               accepted_at: list[int], drafts_at: list[int], choose: Chooser | None = None, grammar: Any = None) -> int:
    """Replay one prompt's verify steps; adds its counts into `accepted_at` and `drafts_at` [K]. Returns
    its verify steps. `choose`: the target's greedy choice under the request's parameters; `grammar`: the
    request's fresh matcher, the draft's mask (`TargetContinuation`)."""
    continuation = TargetContinuation(target, prompt, output, choose, grammar)
    emitted, steps = 1, 0  # the prefill's token
    while emitted < len(output):
        count, proposals = proposer.proposals(continuation, emitted, k)
        accepted = 0
        for position, token in enumerate(proposals):
            if position >= count or token != continuation.at(emitted + position):
                break
            accepted += 1
        for position in range(count):
            drafts_at[position] += 1
        for position in range(accepted):
            accepted_at[position] += 1
        emitted = min(emitted + accepted + 1, len(output))
        steps += 1
    return steps


def replay(proposer: Proposer, target: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
           k: int, *, exact: bool = True, note: str = "", rows: Sequence[int] | None = None,
           choosers: Sequence[Chooser | None] | None = None,
           grammars: Sequence[Callable[[], Any] | None] | None = None) -> ExpectedAcceptance:
    """The expected counts of `proposer` with k draft tokens along the reference `outputs` of `prompts`
    (the rows `rows`, default all: a prompt the engine failed on is left out of both sides). `choosers`: per
    prompt, the target's greedy choice under its request parameters (None: the argmax); `grammars`: per
    prompt, a maker of its structured-output matcher (None: unconstrained), which masks the draft model."""
    accepted_at, drafts_at = [0] * k, [0] * k
    steps, per_prompt = 0, []
    for index in (range(len(prompts)) if rows is None else rows):
        before = list(accepted_at)
        make = grammars[index] if grammars is not None else None
        steps += replay_row(proposer, target, list(prompts[index]), list(outputs[index]), k, accepted_at, drafts_at,
                            choosers[index] if choosers is not None else None, make() if make is not None else None)
        per_prompt.append(tuple(a - b for a, b in zip(accepted_at, before)))
    return ExpectedAcceptance(method=proposer.name, exact=exact, k=k, verify_steps=steps,
                              accepted_per_position=tuple(accepted_at), drafts_per_position=tuple(drafts_at),
                              note=note, per_prompt_accepted=tuple(per_prompt))


def from_baseline(observed: ObservedAcceptance, source: str) -> ExpectedAcceptance | None:
    """An earlier run's observed per-position counts as the expectation (with sampling error)."""
    if observed.accepted_per_position is None or observed.drafts_per_position is None:
        return None
    return ExpectedAcceptance(
        method="baseline", exact=False, k=len(observed.drafts_per_position),
        verify_steps=observed.verify_steps or 0, accepted_per_position=observed.accepted_per_position,
        drafts_per_position=observed.drafts_per_position,
        note=f"an earlier audit's observed counts ({source}): compared with a two-sample test")


@dataclass(frozen=True)
class ProposerSpec:
    """What the user states the audited engine's proposer is (`--speculation`): `draft:k=4` (the pair's draft
    model, greedy) or `ngram:k=4,min=2,max=5[,occurrence=earliest|latest]`."""

    kind: str  # "draft" or "ngram"
    k: int
    min_ngram: int = 1
    max_ngram: int = 3
    occurrence: str = "earliest"

    def describe(self) -> str:
        if self.kind == "draft":
            return f"draft:k={self.k}"
        return f"ngram:k={self.k},min={self.min_ngram},max={self.max_ngram},occurrence={self.occurrence}"


def parse_spec(text: str) -> ProposerSpec:
    """`draft:k=4` or `ngram:k=4,min=2,max=5[,occurrence=latest]`; ValueError with one line otherwise."""
    kind, _, rest = text.partition(":")
    if kind not in ("draft", "ngram"):
        raise ValueError(f"--speculation {text!r}: the proposer is 'draft' or 'ngram' (e.g. ngram:k=4,min=2,max=5)")
    values: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        name, equals, value = part.partition("=")
        if not equals:
            raise ValueError(f"--speculation {text!r}: {part!r} is not name=value")
        values[name.strip()] = value.strip()
    allowed = {"k"} if kind == "draft" else {"k", "min", "max", "occurrence"}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"--speculation {text!r}: unknown parameter {unknown[0]!r} (takes {', '.join(sorted(allowed))})")
    if "k" not in values:
        raise ValueError(f"--speculation {text!r}: k (draft tokens per step) is required, e.g. {kind}:k=4")
    try:
        numbers = {name: int(values[name]) for name in ("k", "min", "max") if name in values}
    except ValueError:
        raise ValueError(f"--speculation {text!r}: k, min and max are whole numbers") from None
    spec = ProposerSpec(kind=kind, k=numbers["k"], min_ngram=numbers.get("min", 1), max_ngram=numbers.get("max", 3),
                        occurrence=values.get("occurrence", "earliest"))
    if spec.k < 1 or not 1 <= spec.min_ngram <= spec.max_ngram:
        raise ValueError(f"--speculation {text!r}: needs k >= 1 and 1 <= min <= max")
    if spec.occurrence not in ("earliest", "latest"):
        raise ValueError(f"--speculation {text!r}: occurrence is 'earliest' (vLLM) or 'latest'")
    return spec
