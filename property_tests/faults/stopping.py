"""Stopping faults: a row that ends late."""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange


class OvershootMaxNewTokens(FaultEngine):
    """Overshooting max_new_tokens within a step: the acceptance rule emits every accepted token
    and the bonus token even past the row's remaining budget."""

    changes = (
        LineChange("specaudit.engines.acceptance",
                   "emitted = torch.minimum(accepted + 1, torch.as_tensor(room, device=accepted.device))  # [B]",
                   "emitted = accepted + 1  # [B]"),
    )


class TokensAfterEos(FaultEngine):
    """Tokens after EOS: the acceptance rule no longer cuts a step's tokens at the first EOS; the
    row still finishes, but with the rest of that step's tokens after its EOS."""

    changes = (
        LineChange("specaudit.engines.acceptance", "emitted = torch.where(ended, first_eos + 1, emitted)", ""),
    )
