"""Acceptance faults: the wrong number of tokens taken from a verified step; and, under request
parameters, a verified step's positions processed with the wrong history (`VerifyWithCommittedHistory`)."""

from __future__ import annotations

from typing import Sequence

from specaudit.engines.eqspec import EQSpec
from specaudit.engines.requests.rows import RowRequest, RowRequests
from specaudit.testing.faults.mutation import FaultEngine, LineChange


class FirstRejectedDraftAccepted(FaultEngine):
    """The first rejected draft token accepted: the acceptance rule counts one draft token more
    than the matching prefix (up to k), so the rejected token's keys and values stay in the cache
    and the target's choice after it is emitted."""

    changes = (
        LineChange("specaudit.engines.sampling.rules", "return matches.long().cumprod(dim=1).sum(dim=1)  # [B]",
                   "return (matches.long().cumprod(dim=1).sum(dim=1) + 1).clamp(max=k)  # [B]"),
    )


class BonusTokenDropped(FaultEngine):
    """Bonus token dropped: the acceptance rule offers only the accepted draft tokens, not the
    target's own next token; a row that accepts nothing makes no progress at all."""

    changes = (
        LineChange("specaudit.engines.acceptance",
                   "emitted = torch.minimum(accepted + 1, torch.as_tensor(room, device=accepted.device))  # [B]",
                   "emitted = torch.minimum(accepted, torch.as_tensor(room, device=accepted.device))  # [B]"),
    )


class BonusTokenDoubled(FaultEngine):
    """Bonus token doubled: `speculative_step` emits the step's pending token (the previous
    step's bonus token, already emitted) again before the step's own tokens."""

    changes = (
        LineChange("specaudit.engines.eqspec", "new_tokens = [row[:n] for row, n in zip(new_rows, emitted_list)]",
                   "new_tokens = [[p] + row[:n] for p, row, n in zip(inputs[:, 0].tolist(), new_rows, emitted_list)]"),
    )


class CommittedHistoryRequests(RowRequests):
    """Request state whose verify positions all see the committed output only (the drafts before a
    position left out of its history)."""

    def history(self, row: RowRequest, drafts: Sequence[int]) -> list[int]:
        return list(row.output)


class VerifyWithCommittedHistory(EQSpec):
    """Request processors applied at every verify position with the row's committed output alone: the
    draft tokens accepted before a position are left out of its history, so `min_tokens` still bans the
    stop ids where the drafts have carried the row past it (vLLM 0.32.0 at the bonus position,
    reports/wild/vllm-min-tokens-bonus.md) and penalties and banned words miss the burst's own tokens.

    Not a line edit (`mutation`): EQSPEC itself with request state whose `history` leaves the drafts out
    (engines/requests/rows.py). Audited with request parameters as
    `--engine specaudit.testing.faults.acceptance:VerifyWithCommittedHistory`; class `logits_processor`."""

    row_requests_class = CommittedHistoryRequests
