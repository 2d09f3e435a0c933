"""Structured-output faults: EQSPEC with a grammar matcher misused the ways a server can misuse it.

Each is EQSPEC itself with request state (`row_requests_class`, engines/requests/rows.py) that changes one
thing of how the grammar masks a step; audited with a constraint (`--json-schema`, `--regex`, ...) as
`--engine specaudit.testing.faults.constrained:NAME`, greedy or with `--temperature` (a class that takes request
parameters is sampled through them, engines/registry.py), and named by the class of
equivalence/blackbox/constraints.py (under sampling from the forbidden tokens' step offsets):

| fault                          | what goes wrong                                              | class                    |
|--------------------------------|--------------------------------------------------------------|--------------------------|
| `GrammarNotRolledBack`         | the rejected draft tokens stay consumed by the matcher       | `constraint_state`       |
| `BonusTokenUnmasked`           | the bonus position is taken from the unmasked logits         | `constraint_unmasked`    |
| `MaskOnePositionOff`           | verify position i gets the mask of position i-1              | `constraint_mask_offset` |
| `DraftUnmasked`                | the draft proposes unmasked: exact, acceptance falls         | none (exact; sampled: exact in distribution) |
| `GrammarLateAfterReasoning`    | a pass that began in reasoning is unmasked whole, and its tokens after the end marker never reach the grammar (vLLM #34650) | `constraint_unmasked` (a forbidden token after the marker in its pass), or `constraint_state` (the grammar restarted behind the text: a doubled `{`) |

`GrammarLateAfterReasoning` needs a constraint with a reasoning end marker (`--reasoning-end`); without one it
is EQSPEC.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specaudit.engines.constraints.draft import DraftMask
from specaudit.engines.constraints.matcher import ReasoningGate
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.requests.rows import RowRequest, RowRequests, StepRequests


class NoRollbackRequests(RowRequests):
    def rollback_rejected(self, row: RowRequest, kept: int) -> None:
        return None  # the rejected draft tokens stay in the grammar state


class UnmaskedBonusRequests(RowRequests):
    def verify_masks(self, row: RowRequest, drafts: Sequence[int], vocab_size: int) -> list[torch.Tensor]:
        masks = super().verify_masks(row, drafts, vocab_size)
        if drafts:  # the position after every draft token: the bonus token's
            masks[-1] = torch.ones_like(masks[-1])
        return masks


class OffsetMaskRequests(RowRequests):
    def verify_masks(self, row: RowRequest, drafts: Sequence[int], vocab_size: int) -> list[torch.Tensor]:
        masks = super().verify_masks(row, drafts, vocab_size)
        return masks[:1] + masks[:-1]  # position i masked with the state before draft token i-1


class UnmaskedDraftRequests(RowRequests):
    def draft_mask(self, rows: Sequence[RowRequest | None]) -> DraftMask | None:
        return None


class PassStartGate(ReasoningGate):
    """Whether the reasoning has ended is read once per verify pass (vLLM's `should_fill_bitmask` at the pass's
    start), and a pass that began in reasoning hands none of its tokens to the grammar (`should_advance` False
    for it): those after the marker are kept as text and never consumed."""

    began_in_reasoning = False

    def advance(self, token: int) -> bool:
        if self.began_in_reasoning and self.ended:
            self.tokens.append(int(token))  # past the marker, in the pass that ended the reasoning: skipped
            return True
        return super().advance(token)


class PassStartStep(StepRequests):
    def commit(self, tokens: torch.Tensor, emitted: torch.Tensor, ended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().commit(tokens, emitted, ended)
        for row in self.rows:
            if row is not None and isinstance(row.matcher, PassStartGate):
                row.matcher.began_in_reasoning = False  # the next pass (and its drafts) read the state anew
        return out


class PassStartGateRequests(RowRequests):
    def matcher(self, row: RowRequest, vocab_size: int) -> Any:
        gate = super().matcher(row, vocab_size)
        if isinstance(gate, ReasoningGate) and not isinstance(gate, PassStartGate):
            moved = PassStartGate.__new__(PassStartGate)
            moved.__dict__.update(gate.__dict__)
            row.matcher = gate = moved
        return gate

    def verify_masks(self, row: RowRequest, drafts: Sequence[int], vocab_size: int) -> list[torch.Tensor]:
        gate = self.matcher(row, vocab_size)
        if not isinstance(gate, PassStartGate) or gate.ended:
            return super().verify_masks(row, drafts, vocab_size)
        gate.began_in_reasoning = True
        row.advanced = []  # nothing consumed: the emitted tokens go through `advance` at commit
        return [torch.ones(vocab_size, dtype=torch.bool)] * (len(drafts) + 1)  # [V] each: the whole pass unmasked

    def step(self, request_ids: Sequence[int | None]) -> StepRequests:
        return PassStartStep(self, [self.rows[i] if i is not None else None for i in request_ids])


class GrammarNotRolledBack(EQSpec):
    """The grammar matcher is not rolled back over the rejected draft tokens: the next masks come from a state
    that holds them (vLLM rolls back in `grammar_bitmask` and advances the accepted tokens after)."""

    row_requests_class = NoRollbackRequests


class BonusTokenUnmasked(EQSpec):
    """The bonus position's logits are not masked: a row that accepts every draft token takes the target's
    unconstrained choice after them."""

    row_requests_class = UnmaskedBonusRequests


class MaskOnePositionOff(EQSpec):
    """Verify position i is masked with the grammar state of position i-1 (the bitmask rows shifted by one)."""

    row_requests_class = OffsetMaskRequests


class DraftUnmasked(EQSpec):
    """The draft model proposes without the grammar's mask: still exact (the target's masked choice decides),
    but every proposal the grammar forbids is rejected and acceptance falls."""

    row_requests_class = UnmaskedDraftRequests


class GrammarLateAfterReasoning(EQSpec):
    """The grammar is ignored when the reasoning ends inside the draft window (vLLM #34650, #43338, #48228): a
    verify pass that began in reasoning is unmasked at every position, the marker's followers included, and
    the grammar starts only at the next pass, from its initial state, behind the text already emitted."""

    row_requests_class = PassStartGateRequests


CONSTRAINT_FAULTS = (GrammarNotRolledBack, BonusTokenUnmasked, MaskOnePositionOff)
EXPECTED_CLASS = {"GrammarNotRolledBack": "constraint_state", "BonusTokenUnmasked": "constraint_unmasked",
                  "MaskOnePositionOff": "constraint_mask_offset"}
