"""The ruling of a draft proposal below float64: may the draft in its own dtype have proposed it?

The draft-fidelity check (equivalence/draft_fidelity.py) and the diagnosis (a kept draft token) ask it
of a proposal that differs from the float64 draft's choice; it is ruled on the draft as the target's
divergences are ruled (`ruler.Ruler`), the band widened to the draft's own measured departure from
float64 along the row (`departure_floor`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specaudit.equivalence.rulings.ruler import Ruler


@torch.no_grad()
def departure_floor(draft: PreTrainedModel, exact_draft: PreTrainedModel, sequence: list[int]) -> float:
    """How far the draft in its own dtype strays from the float64 draft's choices along `sequence`: the
    largest float64 gap below the top of the token it chooses (uncached, batch of one). The measured
    floor of the draft check's band below float64, as the reference's departures are the target's."""
    ids = torch.tensor([sequence], dtype=torch.long, device=draft.device)
    chosen = draft(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].argmax(-1)  # [n]
    exact = exact_draft(input_ids=ids.to(exact_draft.device),
                        attention_mask=torch.ones_like(ids).to(exact_draft.device)).logits[0].to(torch.float64)
    gaps = exact.max(-1).values - exact.gather(1, chosen.to(exact.device).unsqueeze(1)).squeeze(1)  # [n]
    return float(gaps.max())


class DraftPrecision:
    """Below float64: may the draft in its own dtype, which chooses `choice` on a prefix, have chosen
    `token` in another rounding? Ruled on the draft as the target's divergences are ruled: the float64 draft puts both within the band widened to the `dtype` draft's
    own largest departure from it (`departure_floor`). The draft-fidelity check rules a proposal with it,
    the diagnosis a kept draft token."""

    def __init__(self, dtype: str, draft: PreTrainedModel, exact_draft: PreTrainedModel) -> None:
        self.draft, self.exact_draft = draft, exact_draft
        self.ruler = Ruler(dtype, draft, exact_draft)

    def admits(self, prefix: list[int], choice: int, token: int, floor: float | None = None) -> bool:
        """`floor`: the measured departure to widen the band by; measured along `prefix` when not given."""
        if floor is None:
            floor = departure_floor(self.draft, self.exact_draft, prefix)
        return self.ruler.rule(prefix, [choice], [token], 0, floor=floor)[0] == "numerical"
