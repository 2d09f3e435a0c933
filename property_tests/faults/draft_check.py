"""The draft-proposal property: every proposal of a model drafter equals the draft model's own
greedy continuation of that row's real sequence, decoded alone.

Output equivalence cannot see a broken draft cache: the target alone decides every emitted
token, so a draft that proposes from a corrupted cache only lowers acceptance. In float64 a
padded batch matches batch size 1 to ~2e-16, so a proposal that differs from the lone draft's
is a structural fault of the draft's cache, positions or mask.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from specaudit.engines.drafters import Drafter
from specaudit.engines.reference import greedy_decode
from specaudit.engines.sampling.step import StepSampler
from specaudit.engines.models.zoo import ModelPair
from specaudit.testing import models
from specaudit.testing.properties import DEFAULT_ORACLE, ReferenceOracle, build_engine, pair_key, resolve_eos
from specaudit.testing.strategies import DecodingCase


class DraftProposalFailure(AssertionError):
    """A proposal of the engine's drafter differs from the lone draft model's."""

    through = "draft tokens"

    def __init__(self, message: str, *, prompt_index: int, position: int, step: int,
                 expected: list[int], proposed: list[int]) -> None:
        super().__init__(message)
        self.prompt_index, self.position, self.step = prompt_index, position, step
        self.expected, self.proposed = expected, proposed


class RecordingDrafter(Drafter):
    """Wraps a drafter; keeps (step, prompt index, tokens generated so far, proposal) per row. Every
    member `Drafter` declares is the wrapped drafter's."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.proposals: list[tuple[int, int, int, list[int]]] = []
        self.steps = 0

    draft = property(lambda self: self.inner.draft)
    chooser = property(lambda self: self.inner.chooser)
    proposes_sampled = property(lambda self: self.inner.proposes_sampled)
    proposal_lengths = property(lambda self: self.inner.proposal_lengths)
    draft_logits = property(lambda self: self.inner.draft_logits)
    fill_seconds = property(lambda self: self.inner.fill_seconds)

    def prefill(self, state: Any) -> None:
        self.inner.prefill(state)

    def propose(self, state: Any, k: int, sampling: StepSampler | None = None) -> torch.Tensor:
        proposed = self.inner.propose(state, k) if sampling is None else self.inner.propose(state, k, sampling=sampling)
        generated = (state.lengths - state.prompt_lengths).tolist()
        for row, done, tokens in zip(state.rows, generated, proposed.tolist()):
            self.proposals.append((self.steps, row, done, tokens))
        self.steps += 1
        return proposed

    def fill(self, state: Any, accepted_counts: torch.Tensor, keep: torch.Tensor) -> None:
        self.inner.fill(state, accepted_counts, keep)

    def commit(self, state: Any, accepted_counts: torch.Tensor, keep: torch.Tensor, realign: bool = True) -> None:
        self.inner.commit(state, accepted_counts, keep, realign=realign)


_LONE_DRAFT: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def lone_draft(pair: ModelPair, prefix: list[int], k: int) -> list[int]:
    """The draft model's greedy k tokens after `prefix`, batch size 1 (cached)."""
    key = (pair_key(pair) + "/draft", tuple(prefix), k)
    if key not in _LONE_DRAFT:
        _LONE_DRAFT[key] = greedy_decode(pair.draft, list(prefix), k, None)[0]
    return _LONE_DRAFT[key]


def check_draft_proposals(engine_factory: Callable[..., Any], case: DecodingCase, *, pair: ModelPair | None = None,
                          oracle: ReferenceOracle | None = None) -> int:
    """Run the engine with its own model drafter and assert that every proposal equals the lone
    draft model's on the row's real sequence. Returns the number of proposals checked."""
    oracle = oracle or DEFAULT_ORACLE
    pair = pair if pair is not None else models.pair(case.pair, case.dtype)
    eos = resolve_eos(case, pair, oracle)
    engine = build_engine(engine_factory, case, pair, None)
    recorder = RecordingDrafter(engine.drafter)
    engine.drafter = recorder
    outputs = engine.generate(case.prompt_tokens, case.max_new_tokens, eos)
    for step, row, done, proposed in recorder.proposals:
        prefix = list(case.prompts[row].tokens) + list(outputs[row][:done])
        expected = lone_draft(pair, prefix, len(proposed))
        if proposed != expected:
            position = next(i for i, (a, b) in enumerate(zip(expected, proposed)) if a != b)
            raise DraftProposalFailure(
                f"prompt {row}, drafter step {step}, after {done} new tokens: the drafter proposed {proposed}, "
                f"the draft model alone proposes {expected} (first difference at draft position {position})\n"
                f"  {case.describe_row(row)}",
                prompt_index=row, position=done + position, step=step, expected=expected, proposed=proposed,
            )
    return len(recorder.proposals)
