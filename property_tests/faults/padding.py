"""Padding faults: padding seen as content, content seen as padding, padding left inside rows."""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange


class AttentionMaskBlindToPadding(FaultEngine):
    """Attention mask blind to left padding: `ragged.padding_mask` marks every column real, so
    the prefill attends to the pad tokens and every cached pass to the zeroed padding columns."""

    changes = (
        LineChange("specaudit.engines.ops.ragged", "return columns.unsqueeze(0) >= (width - lengths).unsqueeze(1)",
                   "return torch.ones(lengths.shape[0], width, dtype=torch.bool, device=lengths.device)"),
    )


class RepadWithoutUnpad(FaultEngine):
    """Padding that accumulates (repad without unpad): `ragged.append_and_repad` appends all k+1
    verified slots of a step, the unused ones as pad tokens, instead of unpadding first; a row
    that did not take every slot has padding inside it and a pad token as its pending token."""

    changes = (
        LineChange(
            "specaudit.engines.ops.ragged",
            "source, valid = realign_index(width + new_counts, new_lengths, new_width)\n"
            "out = torch.gather(combined, 1, source.clamp(max=combined.shape[1] - 1))\n"
            "return torch.where(valid, out, torch.full_like(out, pad_id)), new_lengths",
            "unused = torch.arange(new_tokens.shape[1], device=tokens.device).unsqueeze(0) >= new_counts.unsqueeze(1)\n"
            "return torch.cat([tokens, new_tokens.masked_fill(unused, pad_id)], dim=1), new_lengths",
        ),
    )


class PadTokenTreatedAsPadding(FaultEngine):
    """A pad id that is also a real token treated as padding inside the content: `start_batch`
    counts each row's length as its tokens that differ from the pad id, so a prompt holding that
    token loses it from its length, its positions and its mask."""

    changes = (
        LineChange("specaudit.engines.eqspec", "tokens, lengths = ragged.left_pad([prompts[r] for r in rows], pad_id, target.device)",
                   "tokens, _ = ragged.left_pad([prompts[r] for r in rows], pad_id, target.device)\n"
                   "lengths = (tokens != pad_id).sum(1)"),
    )
