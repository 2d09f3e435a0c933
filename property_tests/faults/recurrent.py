"""Recurrent-state faults (hybrid models: gated delta-net, short convolutions, Mamba-2).

A recurrent layer keeps one state per row, not columns: after a verify pass it has absorbed the
rejected draft tokens and must be rolled back to the state after the row's accepted tokens
(`engines/recurrent.py`). Each fault is a line edit of that rollback, as serving stacks got it
wrong (vLLM #39273 and #54928, SGLang #26351 and #34043), hunted on the built-in hybrid pairs.
"""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange

RECURRENT = "specaudit.engines.recurrent"
POSITIONS = "positions = accepted_counts.clamp(max=len(cache.history) - 1)  # [B]"
ROWS = "rows = torch.arange(accepted_counts.shape[0], device=accepted_counts.device)  # [B]"
ASSIGN = "        _assign(cache, chosen)\n        cache.history = []"
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
