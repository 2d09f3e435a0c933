"""The exact distribution of one speculative step's output, without sampling.

A sampler takes its randomness only through `Draws` (`accept(a)`, `categorical(w)`; see
`specaudit.engines.sampling.rules`). Here a scripted `Draws` walks every branch of every decision,
the draft's own draws from q included: one run of the step per outcome, each with its exact
probability (the product of its decisions' probabilities, float64). No uniform is ever drawn.

A user's sampler plugs in as the `verify` of a `SpeculativeRule`:

    def my_verify(p, q, drafts, draws) -> list[int]:
        # p [k+1, V] and q [k, V] processed probabilities (float64), drafts [k] the draft's tokens;
        # every comparison `u < a` of a uniform draw is draws.accept(a), every draw from a
        # distribution w is draws.categorical(w); returns the emitted tokens
    rule = SpeculativeRule(verify=my_verify)

The check, on a fixed table (target logits [k+1, V], draft logits [k(+1), V]): for every emitted
prefix y_1..y_{j-1} that the step continues past, the distribution of the token at position j must
equal p_j, the target's processed distribution at that position (p_j conditional on the drafts
accepted before it: one table row per position, the standard check). The first emitted token's
marginal is the case j = 1. The departure is the largest total variation over positions and prefixes.

An acceptance whose probability is within `ROUNDING` of 0 or 1 is taken as certain: p / q is 1 - 1e-16 where
float64 rounds two equal probabilities apart (and which ones it does is the CPU kernels' choice), and the
branch it would open, with a residual of zeros, is no outcome of the sampler. The outcomes still sum to 1
within 1e-9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specaudit.engines.sampling.process import SamplingParams, process_logits
from specaudit.engines.sampling.rules import Draws, SpeculativeRule
from specaudit.equivalence.rulings.thresholds import ROUNDING


class _ScriptedDraws:
    """Follows `script` (an option index per decision), then takes option 0 and records the branching."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.path, self.counts, self.probability = script, [], [], 1.0

    def _choose(self, options: list[tuple[object, float]]) -> object:
        depth = len(self.path)
        index = self.script[depth] if depth < len(self.script) else 0
        value, probability = options[index]
        self.path.append(index)
        self.counts.append(len(options))
        self.probability *= probability
        return value

    def accept(self, probability: float) -> bool:
        a = min(1.0, max(0.0, float(probability)))
        a = 1.0 if a > 1.0 - ROUNDING else 0.0 if a < ROUNDING else a
        return bool(self._choose([(value, w) for value, w in ((True, a), (False, 1.0 - a)) if w > 0]))

    def categorical(self, weights: torch.Tensor) -> int:
        values = weights.tolist()  # [V]
        total = sum(values)
        if not total > 0 or min(values) < 0:
            raise ValueError(f"categorical weights must be non-negative with a positive sum, got {values}")
        return int(self._choose([(i, w / total) for i, w in enumerate(values) if w > 0]))  # type: ignore[arg-type]


def step_outcomes(rule: SpeculativeRule, target_logits: torch.Tensor, draft_logits: torch.Tensor,
                  params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Every emitted sequence of one step and its exact probability (they sum to 1)."""
    tables = rule.tables(target_logits, draft_logits, params)
    return outcomes_of(lambda draws: rule.run(tables, draws))


def outcomes_of(run: Callable[[Draws], Sequence[int]]) -> dict[tuple[int, ...], float]:
    """Every emitted sequence of `run` (one step of any sampler, its drafts included, taking all its
    randomness from the `Draws` it is given) and its exact probability: one run per branch of every decision."""
    outcomes: dict[tuple[int, ...], float] = {}
    pending: list[list[int]] = [[]]
    while pending:
        script = pending.pop()
        draws = _ScriptedDraws(script)
        emitted = tuple(int(t) for t in run(draws))
        outcomes[emitted] = outcomes.get(emitted, 0.0) + draws.probability
        for depth in range(len(script), len(draws.path)):  # siblings of every new decision
            pending += [draws.path[:depth] + [other] for other in range(1, draws.counts[depth])]
    return outcomes


@dataclass
class StepDeparture:
    """The largest total variation between the step's token at a position (given its prefix) and p."""

    total_variation: float
    position: int  # 0-based position in the step (0: the first emitted token)
    prefix: tuple[int, ...]
    emitted: list[float]  # the step's distribution there [V]
    target: list[float]  # p at that position [V]


def departure(outcomes: dict[tuple[int, ...], float], target_probs: torch.Tensor) -> StepDeparture:
    """Compare the step's conditional distributions with target_probs [k+1, V] at every position and prefix."""
    k_plus_1, vocab = target_probs.shape
    worst = StepDeparture(0.0, 0, (), [], target_probs[0].tolist())
    for position in range(k_plus_1):
        by_prefix: dict[tuple[int, ...], torch.Tensor] = {}
        for sequence, probability in outcomes.items():
            if len(sequence) > position:
                row = by_prefix.setdefault(sequence[:position], torch.zeros(vocab, dtype=torch.float64))
                row[sequence[position]] += probability
        for prefix, mass in by_prefix.items():
            emitted = mass / mass.sum()
            tv = 0.5 * float((emitted - target_probs[position]).abs().sum())
            if tv > worst.total_variation:
                worst = StepDeparture(tv, position, prefix, emitted.tolist(), target_probs[position].tolist())
    return worst


def step_departure(rule: SpeculativeRule, target_logits: torch.Tensor, draft_logits: torch.Tensor,
                   params: SamplingParams) -> StepDeparture:
    """The exact check of one step: `rule` on the table against the target's processed distributions."""
    outcomes = step_outcomes(rule, target_logits, draft_logits, params)
    total = sum(outcomes.values())
    if abs(total - 1.0) > 1e-9:
        raise AssertionError(f"the step's outcomes sum to {total}, not 1")
    return departure(outcomes, process_logits(target_logits, params))
