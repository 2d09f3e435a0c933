"""Stopping faults: a row that ends late."""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange


class OvershootMaxNewTokens(FaultEngine):
    """Overshooting max_new_tokens within a step: `speculative_step` emits every accepted token
    and the bonus token even past the row's remaining budget."""

    changes = (
        LineChange("specaudit.engines.eqspec", "emitted = torch.minimum(offered, room)", "emitted = offered"),
    )


class TokensAfterEos(FaultEngine):
    """Tokens after EOS: `speculative_step` no longer cuts a step's tokens at the first EOS; the
    row still finishes, but with the rest of that step's tokens after its EOS."""

    changes = (
        LineChange("specaudit.engines.eqspec", "emitted = torch.minimum(emitted, first_eos + 1)", ""),
    )
