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
"""

from __future__ import annotations

from typing import Sequence

import torch

from specaudit.engines.constraints.draft import DraftMask
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.requests.rows import RowRequest, RowRequests


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


CONSTRAINT_FAULTS = (GrammarNotRolledBack, BonusTokenUnmasked, MaskOnePositionOff)
EXPECTED_CLASS = {"GrammarNotRolledBack": "constraint_state", "BonusTokenUnmasked": "constraint_unmasked",
                  "MaskOnePositionOff": "constraint_mask_offset"}
