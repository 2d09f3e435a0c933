"""The drafter's proposals under a constraint: each draft position masked with the grammar state after the
row's committed output and its draft tokens so far, so that the draft proposes only tokens the grammar
admits (an unmasked draft stays exact, since the target's masked choice decides, but its forbidden
proposals are all rejected and acceptance falls).

`DraftMask` is made per pass for the rows of the batch (engines/requests/rows.py `StepRequests.draft_mask`):
`apply(logits)` masks the draft's logits `[B, V]` of the current draft position, `advance(tokens)` consumes
the proposed tokens `[B]`, and `finish()` rolls every row's matcher back to its committed output (the
verify pass advances it again over the proposals that survive).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch


class DraftMask:
    """Masks one pass's draft positions; `factories[b]` makes row b's matcher from the logits' width (None:
    an unconstrained row, or an idle slot)."""

    def __init__(self, factories: Sequence[Callable[[int], Any] | None]) -> None:
        self.factories = list(factories)
        self.matchers: list[Any] = [None] * len(self.factories)
        self.consumed = [0] * len(self.factories)  # draft tokens each matcher consumed this pass
        self.failed = [False] * len(self.factories)  # a proposal the grammar forbids: no mask after it

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with each constrained row's forbidden tokens at `-inf` (a new tensor)."""
        out = logits.clone()
        for b, factory in enumerate(self.factories):
            if factory is None or self.failed[b]:
                continue
            if self.matchers[b] is None:
                self.matchers[b] = factory(logits.shape[-1])
            if self.matchers[b].terminated:
                continue
            allowed = self.matchers[b].allowed().to(out.device)  # [V]
            out[b] = out[b].masked_fill(~allowed, -math.inf)
        return out

    def advance(self, tokens: torch.Tensor) -> None:
        """Consume each constrained row's proposal `tokens` [B]."""
        for b, token in enumerate(tokens.tolist()):
            matcher = self.matchers[b]
            if matcher is None or self.failed[b]:
                continue
            if matcher.advance(token):
                self.consumed[b] += 1
            else:
                self.failed[b] = True

    def finish(self) -> None:
        """Every matcher back at its row's committed output."""
        for b, matcher in enumerate(self.matchers):
            if matcher is not None:
                matcher.rollback(self.consumed[b])
            self.consumed[b] = 0
