"""The standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), per row.

Notation (vLLM's vocabulary). At one step the draft proposed x_1..x_k, drawn from its processed
distributions q_1..q_k; the target's processed distributions at the same positions are p_1..p_{k+1}
(p_{k+1} follows the last draft token). For j = 1..k, draw u_j ~ U[0, 1):

- x_j is an **accepted** token when u_j < min(1, p_j(x_j) / q_j(x_j));
- at the first rejection j, a **recovered** token is drawn from the normalized residual
  r_j = max(0, p_j - q_j) / sum(max(0, p_j - q_j)) and the step ends;
- when all k drafts are accepted, a **bonus** token is drawn from p_{k+1}.

Then the token emitted at position j, given that the step reached it, has the distribution
q_j(y) min(1, p_j(y)/q_j(y)) + (1 - sum_x min(q_j(x), p_j(x))) r_j(y) = min(q_j, p_j)(y) + max(0, p_j - q_j)(y)
= p_j(y): the target's own, whatever q is, as long as the draft drew from the same q that the
acceptance divides by. With temperature 0, p and q are one-hot: a draft is accepted exactly when it
is the target's argmax, and the recovered token is the argmax: the exact greedy rule.

Randomness enters only through a `Draws` object, one per row (a request's own seeded
`torch.Generator` in `GeneratorDraws`), as two decisions: `accept(probability)` and
`categorical(weights)`. A sampler written against that interface can be checked exactly, without
sampling: `specaudit.equivalence.sampling.exact` enumerates every outcome of every decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from specaudit.engines.sampling.process import SamplingParams, process_logits


class Draws(Protocol):
    """The random decisions a sampler makes. `accept(a)` is True with probability min(1, max(0, a));
    `categorical(w)` returns index i with probability w_i / sum(w) (w >= 0, sum > 0)."""

    def accept(self, probability: float) -> bool: ...

    def categorical(self, weights: torch.Tensor) -> int: ...


class GeneratorDraws:
    """`Draws` from one `torch.Generator`: u ~ U[0, 1) in float64, accept iff u < a; a categorical by
    the inverse of the cumulative weights (searching u * total)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def accept(self, probability: float) -> bool:
        return self.uniform() < probability

    def categorical(self, weights: torch.Tensor) -> int:
        weights = weights.to(torch.float64)
        cumulative = weights.cumsum(-1)  # [V]
        point = torch.tensor([self.uniform() * float(cumulative[-1])], dtype=torch.float64)
        index = int(torch.searchsorted(cumulative, point, right=True))
        # rounding can put the point at the total: the last token with weight
        return min(index, int(weights.nonzero()[-1]))


def seeded_draws(seed: int) -> GeneratorDraws:
    """A request's own random stream."""
    return GeneratorDraws(torch.Generator().manual_seed(int(seed)))


def greedy_accepted(target_tokens: torch.Tensor, drafts: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy rule (`engines/acceptance.py`'s default; the standard rule at temperature 0): [B] accepted
    draft tokens, the longest prefix of `drafts` [B, k] equal to `target_tokens[:, :k]` (a column where
    `own` [B, k] is False, a pad slot of a shorter proposal, is never accepted)."""
    k = drafts.shape[1]
    matches = drafts == target_tokens[:, :k]  # [B, k]
    if own is not None:
        matches &= own
    return matches.long().cumprod(dim=1).sum(dim=1)  # [B]


def rejection_sample_row(p: torch.Tensor, q: torch.Tensor, drafts: list[int], draws: Draws) -> list[int]:
    """One row's step. p [k+1, V] target, q [k, V] draft (both processed, float64), drafts [k].
    Returns the emitted tokens: the accepted drafts, then one recovered or bonus token."""
    emitted: list[int] = []
    for j, x in enumerate(drafts):
        p_x, q_x = float(p[j, x]), float(q[j, x])
        ratio = 1.0 if q_x <= p_x else p_x / q_x  # min(1, p/q); q_x = 0 (never drafted) accepts
        if draws.accept(ratio):
            emitted.append(int(x))
            continue
        residual = (p[j] - q[j]).clamp_min(0)  # [V]
        if not float(residual.sum()) > 0:  # p == q to rounding: a rejection has probability 0
            residual = p[j]
        emitted.append(draws.categorical(residual))
        return emitted
    emitted.append(draws.categorical(p[len(drafts)]))
    return emitted


VerifyFn = Callable[[torch.Tensor, torch.Tensor, list[int], Draws], list[int]]


class SpeculativeRule:
    """What a sampled speculative step does with the logits, in four replaceable parts:
    the target's processed p (acceptance and bonus), the draft's processed q that it draws
    from, the q the acceptance divides by (the same q in a correct sampler), and the verify step."""

    name = "standard"
    needs_last_draft_row = False  # reads the draft's distribution after its last token (a draft pass k + 1)

    def __init__(self, verify: VerifyFn = rejection_sample_row) -> None:
        self.verify = verify

    def target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, params)

    def draft_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, params)

    def acceptance_q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return self.draft_probs(logits, params)

    def tables(self, target_logits: torch.Tensor, draft_logits: torch.Tensor, params: SamplingParams
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p [k+1, V], the q the draft draws from [k(+1), V], the q the acceptance uses [k(+1), V])."""
        return (self.target_probs(target_logits, params), self.draft_probs(draft_logits, params),
                self.acceptance_q(draft_logits, params))

    def run(self, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], draws: Draws) -> list[int]:
        """The draft draws x_j from its q_j, then the verify step runs; returns the emitted tokens."""
        p, q_drawn, q_used = tables
        drafts = [draws.categorical(q_drawn[j]) for j in range(p.shape[0] - 1)]
        return self.verify(p, q_used, drafts, draws)

    def step(self, target_logits: torch.Tensor, draft_logits: torch.Tensor, params: SamplingParams,
             draws: Draws) -> list[int]:
        """One step on a fixed table: target_logits [k+1, V]; draft_logits [k, V] or [k+1, V] (a last
        row is the draft's distribution after its last token, which a correct sampler never uses)."""
        return self.run(self.tables(target_logits, draft_logits, params), draws)


@dataclass
class StepOutput:
    """A batch's step: per row the accepted drafts and the final (recovered or bonus) token."""

    accepted: list[list[int]]
    final: list[int]
    bonus: list[bool]  # the final token is the bonus (all k accepted), else recovered

    @property
    def emitted(self) -> list[list[int]]:
        return [row + [last] for row, last in zip(self.accepted, self.final)]

    def as_tensor(self, k: int) -> torch.Tensor:
        """[B, k+1] emitted tokens, -1 after each row's last."""
        out = torch.full((len(self.final), k + 1), -1, dtype=torch.long)
        for b, row in enumerate(self.emitted):
            out[b, : len(row)] = torch.tensor(row)
        return out


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     draws: list[Draws], verify: VerifyFn = rejection_sample_row) -> StepOutput:
    """The batch's step, row by row with each row's own `Draws`.
    target_probs [B, k+1, V], draft_probs [B, k, V], draft_tokens [B, k]."""
    accepted, final, bonus = [], [], []
    k = draft_tokens.shape[1]
    for b in range(draft_tokens.shape[0]):
        row = verify(target_probs[b], draft_probs[b], [int(t) for t in draft_tokens[b]], draws[b])
        accepted.append(row[:-1])
        final.append(row[-1])
        bonus.append(len(row) == k + 1)
    return StepOutput(accepted, final, bonus)
