"""Speculative sampling inside the project's batched engines: each row of a pass with its own
parameters and its own random stream, decided by one `SpeculativeRule` (engines/sampling/rules.py).

`StepSampler` is the `Sampler` that `engines/acceptance.accept` calls for a pass whose rows sample
(the rows' `RowRequests` build it: engines/requests/rows.py). Per row `b` of the pass, with m_b its
own draft tokens x_1..x_m (`own[b]`), target logits [m_b+1, V] and the draft logits [m_b, V] the
drafter drew them from:

- p_j = rule.target_probs(target logits row j, params_b) (temperature, top-k, top-p: `process_logits`);
- q_j = rule.acceptance_q(draft logits row j, params_b), the very distribution `draft_tokens` drew
  x_j from (`rule.draft_probs`, the same function in the standard rule); a drafter that gives no
  logits (prompt lookup, a scripted drafter, any deterministic proposer) proposed x_j with
  certainty, so q_j is the one-hot of x_j;
- `rule.verify(p, q, drafts, draws_b)`: x_j **accepted** while u_j < min(1, p_j(x_j)/q_j(x_j)); at the
  first rejection a **recovered** token from the normalized residual max(0, p_j - q_j); after m_b
  acceptances a **bonus** token from p_{m_b+1}. The emitted token at each position then has the
  distribution p_j exactly (rules.py has the derivation), for any q the draft drew from.

A greedy row (temperature 0, or no sampling) in the same pass takes the greedy rule: the target's
argmax, the longest matching draft prefix (`acceptance.greedy_accepted`), exactly as without sampling.
Every random decision of a row comes from that row's `Draws` (its request's own seeded generator), in
the row's own order: its drafts of a step, then that step's verify decisions. Nothing depends on the
other rows, so a seeded request gives the same tokens alone and inside any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specaudit.engines.sampling.process import SamplingParams
from specaudit.engines.sampling.rules import Draws, SpeculativeRule, greedy_accepted


@dataclass
class RowSampling:
    """One sampled request: what it asks for and its own random stream."""

    params: SamplingParams
    draws: Draws


class StepSampler:
    """The `acceptance.Sampler` of one pass: `rows[b]` a row's `RowSampling`, None for a greedy row."""

    def __init__(self, rows: list[RowSampling | None], rule: SpeculativeRule) -> None:
        self.rows, self.rule = rows, rule

    def draft_tokens(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[B] the draft's next token per row from its logits [B, V]: drawn from
        q = rule.draft_probs(logits, params) with the row's stream, the argmax for a greedy row."""
        tokens = draft_logits.argmax(-1)  # [B]
        for b, row in enumerate(self.rows):
            if row is not None:
                q = self.rule.draft_probs(draft_logits[b].to("cpu", torch.float64), row.params)  # [V]
                tokens[b] = row.draws.categorical(q)
        return tokens

    def __call__(self, target_logits: torch.Tensor, drafts: torch.Tensor, own: torch.Tensor,
                 draft_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """target_logits [B, k+1, V] (processed by the rows' request parameters), drafts [B, k], own [B, k],
        draft_logits [B, k, V] or None (one-hot q) -> tokens [B, k+1] (a row's accepted drafts, then its
        recovered or bonus token; the columns after them are never emitted) and accepted [B]."""
        tokens = target_logits.argmax(-1)  # [B, k+1]: the greedy rows' tokens
        accepted = greedy_accepted(tokens, drafts, own)  # [B]
        own_counts = own.long().sum(1).tolist()
        for b, row in enumerate(self.rows):
            if row is None:
                continue
            m = own_counts[b]
            row_drafts = drafts[b, :m].tolist()  # [m]
            p = self.rule.target_probs(target_logits[b, : m + 1].to("cpu", torch.float64), row.params)  # [m+1, V]
            if draft_logits is None:  # a deterministic proposal: q_j is the one-hot of x_j
                q = torch.nn.functional.one_hot(drafts[b, :m].cpu(), p.shape[-1]).to(torch.float64)  # [m, V]
            else:
                q = self.rule.acceptance_q(draft_logits[b, :m].to("cpu", torch.float64), row.params)  # [m, V]
            emitted = self.rule.verify(p, q, row_drafts, row.draws)  # accepted drafts, then one token
            tokens[b, : len(emitted)] = torch.tensor(emitted, dtype=tokens.dtype, device=tokens.device)
            accepted[b] = len(emitted) - 1
        return tokens, accepted
