"""Recurrent-state faults (hybrid models: gated delta-net, short convolutions, Mamba-2).

A recurrent layer keeps one state per row, not columns: after a verify pass it has absorbed the
rejected draft tokens and must be rolled back to the state after the row's accepted tokens
(`engines/ops/recurrent.py`). Each fault is a line edit of that rollback, as serving stacks got it
wrong (vLLM #39273 and #54928, SGLang #26351 and #34043), hunted on the built-in hybrid pairs.

The last two live where rows propose different numbers of draft tokens (a prompt-lookup drafter
finds nothing for some rows, as in vLLM #39273's n-gram speculation): the verify pass then feeds
pad ids after a shorter row's drafts, and a step may leave nothing to roll back. Their hunts draw
acceptance schedules with steps where a row proposes no draft at all.
"""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange
from specaudit.testing.strategies import NO_DRAFTS, NO_DRAFTS_PARTIAL

RECURRENT = "specaudit.engines.ops.recurrent"
POSITIONS = "positions = accepted_counts.clamp(max=len(cache.history) - 1)  # [B]"
ROWS = "rows = torch.arange(accepted_counts.shape[0], device=accepted_counts.device)  # [B]"
ASSIGN = "        _assign(cache, chosen)\n        cache.history = []"
KEEP_PADDED = "_assign(cache, _where(padded, cache.history[-1], snapshot(cache)))"
NOTHING_TO_UNDO = ("# state is already the row's state after its accepted tokens, padding never having entered one\n"
                   "cache.history = []")
HYBRID_PAIRS = ("tiny-lfm2", "tiny-qwen3-next")


class RecurrentStateNotRolledBack(FaultEngine):
    """Recurrent state not rolled back after a rejection: `recurrent.commit` keeps every row's state
    after the last token of the verify pass, rejected draft tokens included (SGLang #26351)."""

    pairs = HYBRID_PAIRS
    changes = (LineChange(RECURRENT, POSITIONS, "positions = torch.full_like(accepted_counts, len(cache.history) - 1)  # [B]"),)


class RecurrentStateAdvancedByRejected(FaultEngine):
    """Recurrent state advanced by the first rejected token: `recurrent.commit` rolls each row back
    to one token past its accepted ones (vLLM #54928: verify and prefill mixed on gated delta-net)."""

    pairs = HYBRID_PAIRS
    changes = (LineChange(RECURRENT, POSITIONS, "positions = (accepted_counts + 1).clamp(max=len(cache.history) - 1)  # [B]"),)


class ConvStateResetMidSequence(FaultEngine):
    """Convolution state reset in mid-sequence: `recurrent.commit` zeroes the convolution windows
    after the rollback (SGLang #34043: the conv state zeroed on a cache hit)."""

    pairs = HYBRID_PAIRS
    changes = (LineChange(RECURRENT, ASSIGN,
                          "        _assign(cache, [None if t is None else (t * 0 if i % 2 == 0 else t) for i, t in enumerate(chosen)])\n"
                          "        cache.history = []"),)


class RecurrentStateFromAnotherRow(FaultEngine):
    """Another row's recurrent state: `recurrent.commit` takes each row's rolled-back state from
    its neighbour in the batch (a per-row gather with the wrong row index)."""

    pairs = HYBRID_PAIRS
    changes = (LineChange(RECURRENT, ROWS, "rows = torch.arange(accepted_counts.shape[0], device=accepted_counts.device).roll(1)  # [B]"),)


class PadTokensFedIntoState(FaultEngine):
    """Pad tokens fed into the recurrent state: `recurrent.forward_by_token` lets a row whose
    drafts are shorter than the step's longest consume the pad ids after them, so a row that keeps
    its live state (nothing to roll back) carries the padding on."""

    pairs = HYBRID_PAIRS
    schedule_kinds = (NO_DRAFTS,)
    changes = (LineChange(RECURRENT, KEEP_PADDED, "pass"),)


class StateStaleAfterZeroDraftStep(FaultEngine):
    """State left stale after a step with zero drafts: when no row has a token to roll back,
    `recurrent.commit` keeps the live states but not clearing the per-position states of that pass,
    so the next rollback picks a state from it (vLLM #39273: a step with no drafts reads stale state).
    A step where every draft was accepted leaves nothing to roll back too; the hunt draws schedules
    that never accept every draft, so what it finds comes from steps with zero drafts."""

    pairs = HYBRID_PAIRS
    schedule_kinds = (NO_DRAFTS_PARTIAL,)
    changes = (LineChange(RECURRENT, NOTHING_TO_UNDO,
                          "# state is already the row's state after its accepted tokens, padding never having entered one\n"
                          "pass"),)
