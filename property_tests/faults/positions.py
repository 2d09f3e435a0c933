"""Position-id faults: a token numbered by anything but its index in its own row's sequence."""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange


class PositionIdsCountPadding(FaultEngine):
    """Position ids counted over padding: each new token is numbered by its column in the padded
    batch (the cache width) instead of by the row's own cache length, in `batch.forward`, so a row
    with left padding jumps ahead by its padding at every cached pass."""

    pairs = ("tiny-llama", "tiny-gpt2")
    changes = (
        LineChange("specaudit.engines.batch", "positions = ragged.position_ids(cache_lengths, q)  # [B, q]",
                   "positions = ragged.position_ids(torch.full_like(cache_lengths, width), q)"),
    )


class PositionIdsFromOne(FaultEngine):
    """Position ids off by one everywhere: numbering starts at 1 in the prefill and in every
    cached pass (an offset applied twice, as with OPT's built-in offset of 2). A constant shift:
    a RoPE model keeps its tokens and moves its logits slightly; GPT-2 changes its tokens."""

    pairs = ("tiny-llama", "tiny-gpt2")
    changes = (
        LineChange("specaudit.engines.batch", "positions = ragged.position_ids(cache_lengths, q)  # [B, q]",
                   "positions = ragged.position_ids(cache_lengths + 1, q)"),
        LineChange("specaudit.engines.batch",
                   "positions = (torch.arange(width, device=tokens.device).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)",
                   "positions = (torch.arange(width, device=tokens.device).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0) + 1"),
    )
