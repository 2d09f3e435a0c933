"""Two position-id bugs written as a user would, as `position_engines:factory` engines, and their
correct twins. Each engine is EQSPEC with one wrapper between it and the target that rewrites the
position ids of every target pass; nothing else differs, and nothing here knows how the audit
diagnoses a divergence.

- `make_positions_over_padding`: each query is numbered by its column in the padded batch (left
  padding counted), in the prefill and in every cached pass;
- `make_positions_over_rejected`: each row keeps counting past the draft tokens it rejected, as an
  engine that leaves rejected slots in its cache as masked holes and numbers by column would.

`make_*_twin` build the same engines with the rewrite switched off: they must be exact.
"""

from __future__ import annotations

from typing import Any

import torch

from specaudit.engines.eqspec import EQSpec, speculative_step, start_batch


class _PositionRewrite(torch.nn.Module):
    """The target, with the position ids of each call rewritten by `self.rewrite`."""

    def __init__(self, model: torch.nn.Module, mode: str | None) -> None:
        super().__init__()
        self.model = model
        self.mode = mode  # None (correct), "padding" or "rejected"
        self.rejected = torch.zeros(0, dtype=torch.long)  # [B] rejected slots so far per row

    @property
    def config(self):
        return self.model.config

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype

    def forward(self, **kwargs: Any):
        positions = kwargs.get("position_ids")
        mask = kwargs.get("attention_mask")
        if self.mode == "padding" and mask is not None and mask.dim() == 2:
            q = kwargs["input_ids"].shape[1]
            width = mask.shape[1]
            columns = torch.arange(width - q, width, device=mask.device)  # [q] column of each query
            kwargs["position_ids"] = columns.unsqueeze(0).expand(mask.shape[0], q)
        elif self.mode == "rejected" and positions is not None and self.rejected.numel() == positions.shape[0]:
            kwargs["position_ids"] = positions + self.rejected.to(positions.device).unsqueeze(1)
        return self.model(**kwargs)


class PositionBugEngine(EQSpec):
    """EQSPEC over a target whose position ids are rewritten (see the module docstring)."""

    def __init__(self, target, draft, mode: str | None, **options: Any) -> None:
        super().__init__(_PositionRewrite(target, mode), draft, **options)

    def _run_batch(self, prompts, rows, max_new_tokens, eos_token_id, trace, outputs, logits) -> None:
        wrapper: _PositionRewrite = self.target
        rejected: dict[int, int] = {r: 0 for r in rows}
        wrapper.rejected = torch.zeros(0, dtype=torch.long)  # the prefill is numbered correctly
        # one padded prefill pass over the batch, as an engine written without prefill grouping does
        state, result = start_batch(self.target, self.drafter, prompts, rows, self.pad_id, eos_token_id,
                                    max_new_tokens, self.record_logits, grouped_prefill=False)
        self._collect(trace, result, outputs, logits)
        while state.rows:
            wrapper.rejected = torch.tensor([rejected[r] for r in state.rows], dtype=torch.long)
            result = speculative_step(self.target, self.drafter, state, self.k, len(trace.steps), eos_token_id,
                                      max_new_tokens, self.pad_id, self.record_logits)
            for row, accepted in zip(result.record.rows, result.record.accepted_counts):
                rejected[row] += self.k - accepted
            self._collect(trace, result, outputs, logits)


def _make(mode: str | None):
    def factory(target, draft, *, batch_size: int, draft_tokens: int, **options: Any) -> PositionBugEngine:
        return PositionBugEngine(target, draft, mode, batch_size=batch_size, draft_tokens=draft_tokens, **options)
    return factory


make_positions_over_padding = _make("padding")
make_positions_over_rejected = _make("rejected")
make_positions_over_padding_twin = _make(None)
make_positions_over_rejected_twin = _make(None)
