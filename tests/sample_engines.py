"""User engines for the CLI and plugin tests, named as `sample_engines:factory`."""

from __future__ import annotations

from typing import Any

import torch

from specaudit.engines.eqspec import EQSpec


def make_correct(target, draft, *, batch_size: int, draft_tokens: int, **options: Any) -> EQSpec:
    """A correct user engine: EQSPEC behind a user factory."""
    return EQSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)


class _ShiftedPositions(torch.nn.Module):
    """The target, with `offset` added to batch row 0's position ids while `active`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.offset = 0
        self.active = True

    @property
    def config(self):
        return self.model.config

    @property
    def device(self):
        return self.model.device

    def forward(self, **kwargs: Any):
        positions = kwargs.get("position_ids")
        if self.active and self.offset and positions is not None:
            positions = positions.clone()
            positions[0] += self.offset
            kwargs["position_ids"] = positions
        return self.model(**kwargs)


class RowZeroPositionBug(EQSpec):
    """After a rejection, row 0 keeps counting positions past the rejected draft tokens (its
    position ids run ahead by the number of rejected tokens so far); every other row is correct."""

    def __init__(self, target, draft, **options: Any) -> None:
        super().__init__(_ShiftedPositions(target), draft, **options)

    def _collect(self, trace, result, outputs, logits) -> None:
        super()._collect(trace, result, outputs, logits)
        record, shifted = result.record, self.target
        if record.kind != "prefill" and 0 in record.rows:
            accepted = record.accepted_counts[record.rows.index(0)]
            shifted.offset += self.k - accepted
        if 0 in result.finished:
            shifted.active = False


def make_row_zero_position_bug(target, draft, *, batch_size: int, draft_tokens: int, **options: Any) -> EQSpec:
    return RowZeroPositionBug(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)


def not_an_engine(target, draft, **_: Any) -> object:
    return object()


class _Interrupts:
    def generate(self, prompts, max_new_tokens, eos_token_id):
        raise KeyboardInterrupt


def make_interrupting(target, draft, **_: Any) -> _Interrupts:
    """Stands for a user pressing Ctrl-C during a run."""
    return _Interrupts()


class OvershootsLongPrompts(EQSpec):
    """Correct on prompts of up to 1000 tokens; on a longer one it emits one token past
    max_new_tokens (the Hypothesis search never draws such prompts; the adversarial ones do)."""

    def generate(self, prompts, max_new_tokens, eos_token_id):
        outputs = super().generate(prompts, max_new_tokens, eos_token_id)
        trace = self.last_trace
        long = [i for i, p in enumerate(prompts) if len(p) > 1000 and len(outputs[i]) == max_new_tokens]
        if long:
            more = super().generate([prompts[i] for i in long], max_new_tokens + 1, eos_token_id)
            for i, out in zip(long, more):
                outputs[i] = out
        self.last_trace = trace
        return outputs


def make_overshoots_long_prompts(target, draft, *, batch_size: int, draft_tokens: int, **options: Any) -> EQSpec:
    return OvershootsLongPrompts(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)


def make_sampled_bonus_from_draft(target, draft, **options: Any):
    """A sampled user engine whose bonus token is drawn from the draft's distribution, not the target's."""
    from specaudit.testing.faults.sampling import make_fault_engine

    return make_fault_engine(target, draft, fault="bonus_from_draft", **options)
