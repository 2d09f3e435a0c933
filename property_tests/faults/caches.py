"""KV-cache faults: a cache that keeps what a row rejected, or loses what it accepted.

The draft-cache faults change no output token or logit (the target alone decides every token);
they only change what the draft proposes, so only a check of the proposals can see them: the
draft-proposal property here (`specaudit.testing.faults.draft_check`) and the audit's draft-fidelity
check (`equivalence/draft_fidelity.py`).
"""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange

# EQSPEC's realign call (`eqspec.Realign.commit`, its cache policy, called by `speculative_step`); a fault's replacement leaves out the host's bookkeeping (`state.host`), so the
# planted counts or rows are the ones the cache is realigned by
TARGET_REALIGN = "batch_ops.realign(state.target_cache, old_width, accepted_counts, state.cache_lengths, keep, state.host)"


class TargetCacheNotTrimmed(FaultEngine):
    """Target cache not trimmed after a rejection: EQSPEC's step (`Realign.commit`) realigns the target cache
    as if every draft token had been accepted, so it keeps the rejected tokens' keys and values."""

    changes = (
        LineChange("specaudit.engines.eqspec", TARGET_REALIGN,
                   "batch_ops.realign(state.target_cache, old_width, torch.full_like(accepted_counts, k), state.cache_lengths, keep)"),
    )


class AttentionCacheCutAtPassEnd(FaultEngine):
    """Attention cache cut at the end of the verify pass: `batch.realign` keeps each row's last
    columns of the pass, its rejected draft tokens' keys and values included, while the recurrent
    states are rolled back right; on a hybrid target only the attention layers' cache is wrong.
    (Planted at the step's realign call, `Realign.commit`, as `TargetCacheNotTrimmed` is, a wrong count
    reaches the recurrent rollback too: `batch.realign` commits the states.)"""

    pairs = ("tiny-qwen3-next",)
    changes = (
        LineChange("specaudit.engines.batch", "keep_end = (old_width + accepted_counts + 1).index_select(0, keep)",
                   "keep_end = torch.full_like(accepted_counts, ragged.cache_width(cache)).index_select(0, keep)"),
        LineChange("specaudit.engines.batch", "keep_end = [old_width + accepted[i] + 1 for i in rows]",
                   "keep_end = [ragged.cache_width(cache)] * len(rows)"),  # the same plan kept on the host
    )


class CacheTrimmedToSmallestAcceptance(FaultEngine):
    """Every row trimmed to the batch's smallest acceptance: EQSPEC's step (`Realign.commit`) realigns each
    row's target cache to the fewest draft tokens any row accepted, while its tokens keep its own
    acceptance (the DSD baseline's shortcut)."""

    changes = (
        LineChange("specaudit.engines.eqspec", TARGET_REALIGN,
                   "batch_ops.realign(state.target_cache, old_width, accepted_counts.min().expand_as(accepted_counts), state.cache_lengths, keep)"),
    )


class FinishedRowsDroppedByPosition(FaultEngine):
    """Finished rows dropped from the target cache by position instead of by index:
    EQSPEC's step (`Realign.commit`) keeps the first n cache rows rather than the n rows still running, so a
    row that outlives an earlier-finishing one inherits that row's cache."""

    changes = (
        LineChange("specaudit.engines.eqspec", TARGET_REALIGN,
                   "batch_ops.realign(state.target_cache, old_width, accepted_counts, state.cache_lengths, torch.arange(keep.numel(), device=keep.device))"),
    )


class DraftCacheNotTrimmed(FaultEngine):
    """Draft cache not trimmed after a rejection: `ModelDrafter.commit` realigns the draft cache
    as if every draft token had been accepted, so the draft keeps its rejected tokens."""

    drafter_kind = "model"
    changes = (
        LineChange("specaudit.engines.drafters", "batch_ops.realign(cache, self._old_width, accepted_counts, state.cache_lengths, keep, host)",
                   "batch_ops.realign(cache, self._old_width, torch.full_like(accepted_counts, k), state.cache_lengths, keep)"),
    )


class DraftFillPassSkipped(FaultEngine):
    """Draft cache missing the k-th draft token: `ModelDrafter.commit` skips the fill pass, so a
    row that accepted all k draft tokens keeps no keys and values for the last of them."""

    drafter_kind = "model"
    changes = (
        LineChange("specaudit.engines.drafters", "if needs_fill:", "if False:"),
    )
