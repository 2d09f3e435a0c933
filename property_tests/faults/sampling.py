"""Planted sampling faults: each a `SpeculativeRule` that breaks one part of speculative sampling the
way a shipped engine did, for proving that the exact check (`equivalence/sampling/exact.py`) and the
statistical audit (`equivalence/sampling/audit.py`) catch and name it. `SAMPLING_FAULTS` maps each
name to its rule; `SharedStream` is an engine fault (the rule is right, the random streams are not);
`PENALTY_FAULTS` are engine faults of the request parameters' processing (a penalty counted once per
verify step, penalties ignored).

`NOT_FAULTS` are rules that look wrong but are exact: speculative sampling is correct for any draft
distribution q as long as the draft draws from the very q that the acceptance divides by, so
processing applied to the target only (the draft raw on both sides) changes the acceptance rate and
nothing else. The checks must pass them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from specaudit.engines.sampling.engine import SampledRow, SampledSpeculative
from specaudit.engines.sampling.process import SamplingParams, process_logits
from specaudit.engines.sampling.rules import Draws, GeneratorDraws, SpeculativeRule, rejection_sample_row


def _recovering_with(residual_weights):
    """A verify step that draws its recovered token from residual_weights(p_j, q_j) instead."""

    def verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int], draws: Draws) -> list[int]:
        emitted: list[int] = []
        for j, x in enumerate(drafts):
            p_x, q_x = float(p[j, x]), float(q[j, x])
            if draws.accept(1.0 if q_x <= p_x else p_x / q_x):
                emitted.append(int(x))
                continue
            return emitted + [draws.categorical(residual_weights(p[j], q[j]))]
        return emitted + [draws.categorical(p[len(drafts)])]

    return verify


def _unnormalized(p_j: torch.Tensor, q_j: torch.Tensor) -> torch.Tensor:
    """u ~ U[0, 1) searched in the cumulative residual without dividing by its total Z < 1: every u past
    Z falls off the end onto the last token of the vocabulary."""
    residual = (p_j - q_j).clamp_min(0)
    weights = residual.clone()
    weights[-1] += max(0.0, 1.0 - float(residual.sum()))
    return weights


def _unclipped(p_j: torch.Tensor, q_j: torch.Tensor) -> torch.Tensor:
    """u * Z (Z the positive mass) searched in the cumulative sum of p - q with its negative entries
    left in: the first index whose cumulative sum exceeds the point, which the running maximum decides."""
    cumulative = (p_j - q_j).cumsum(-1)  # [V], not monotone
    total = float((p_j - q_j).clamp_min(0).sum())
    reach = cumulative.clamp(0, total).cummax(-1).values  # [V]
    weights = torch.diff(reach, prepend=reach.new_zeros(1))
    weights[-1] += total - float(reach[-1])  # points past every cumulative sum: the last token
    return weights


class QFromRawLogits(SpeculativeRule):
    """transformers #47932: the draft draws from processed q, the acceptance divides by raw softmax."""

    name = "q_from_raw_logits"

    def acceptance_q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, SamplingParams(temperature=1.0))


class DraftDrawsFromRaw(SpeculativeRule):
    """DeepSpec #31: the draft draws from another distribution (raw) than the processed q it is accepted with."""

    name = "draft_draws_from_raw"

    def draft_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, SamplingParams(temperature=1.0))

    def acceptance_q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, params)


class ResidualNotNormalized(SpeculativeRule):
    name = "residual_not_normalized"

    def __init__(self) -> None:
        super().__init__(_recovering_with(_unnormalized))


class ResidualNotClipped(SpeculativeRule):
    name = "residual_not_clipped"

    def __init__(self) -> None:
        super().__init__(_recovering_with(_unclipped))


class BonusFromDraft(SpeculativeRule):
    """The bonus token drawn from the draft's distribution after its last token instead of p_{k+1}."""

    name = "bonus_from_draft"
    needs_last_draft_row = True

    def __init__(self) -> None:
        def verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int], draws: Draws) -> list[int]:
            p_bonus_from_q = torch.cat([p[: len(drafts)], q[len(drafts):len(drafts) + 1]])
            return rejection_sample_row(p_bonus_from_q, q, drafts, draws)

        super().__init__(verify)


class _UniformAtZero:
    """vllm-ascend #13730: the acceptance's uniform is always 0, so every draft with p > 0 is accepted."""

    def __init__(self, draws: Draws) -> None:
        self.draws = draws

    def accept(self, probability: float) -> bool:
        return 0.0 < probability

    def categorical(self, weights: torch.Tensor) -> int:
        return self.draws.categorical(weights)


class UniformStuckAtZero(SpeculativeRule):
    name = "uniform_stuck_at_zero"

    def __init__(self) -> None:
        super().__init__(lambda p, q, drafts, draws: rejection_sample_row(p, q, drafts, _UniformAtZero(draws)))


class _TargetMissing(SpeculativeRule):
    """vLLM #10198: a sampling parameter applied to the draft only, not to the target's p."""

    missing: dict[str, bool] = {}

    def target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, params.without(**self.missing))


class TemperatureOnDraftOnly(_TargetMissing):
    name, missing = "temperature_on_draft_only", {"temperature": True}


class TopKOnDraftOnly(_TargetMissing):
    name, missing = "top_k_on_draft_only", {"top_k": True}


class TopPOnDraftOnly(_TargetMissing):
    name, missing = "top_p_on_draft_only", {"top_p": True}


class ArgmaxWhenSampling(SpeculativeRule):
    """mistral.rs #2424: the speculative path verifies and emits the target's argmax whatever the temperature."""

    name = "argmax_when_sampling"

    def target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, SamplingParams(temperature=0.0))


class _DraftMissing(SpeculativeRule):
    """Processing applied to the target only; the draft raw on both sides: exact (see the module docstring)."""

    missing: dict[str, bool] = {}

    def draft_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return process_logits(logits, params.without(**self.missing) if not params.greedy else params)


class TemperatureOnTargetOnly(_DraftMissing):
    name, missing = "temperature_on_target_only", {"temperature": True}


class CutsOnTargetOnly(_DraftMissing):
    name, missing = "top_k_top_p_on_target_only", {"top_k": True, "top_p": True}


SAMPLING_FAULTS: dict[str, type[SpeculativeRule]] = {rule.name: rule for rule in (
    QFromRawLogits, DraftDrawsFromRaw, ResidualNotNormalized, ResidualNotClipped, BonusFromDraft,
    UniformStuckAtZero, TemperatureOnDraftOnly, TopKOnDraftOnly, TopPOnDraftOnly, ArgmaxWhenSampling)}
NOT_FAULTS: dict[str, type[SpeculativeRule]] = {rule.name: rule for rule in (TemperatureOnTargetOnly, CutsOnTargetOnly)}


class SharedStream(SampledSpeculative):
    """One random stream for the whole batch (seeded by its first request): each row's tokens depend on
    the other rows. Its distribution is right; the seed's promise (alone = in a batch) is broken."""

    name = "shared_stream"

    def draws_for(self, seeds: list[int]) -> list[Draws]:
        shared = GeneratorDraws(torch.Generator().manual_seed(int(seeds[0])))
        return [shared] * len(seeds)


class PenaltyPerStep(SampledSpeculative):
    """SGLang PR #33643's shape: under speculation the occurrence counts are updated once per verify step,
    not once per accepted token. Every verify position of a step is processed with the output committed
    before the step, so a draft accepted earlier in the same step is not yet counted at the positions after
    it: a repeated token escapes its presence and frequency penalty (and its repetition penalty) inside a step.
    Greedy-equivalence suites and one-token steps never see it."""

    name = "penalty_per_step"

    def histories(self, output: list[int], drafts: list[int]) -> list[list[int]]:
        return [list(output) for _ in range(len(drafts) + 1)]


class PenaltiesIgnored(SampledSpeculative):
    """TensorRT-LLM PR #17701's shape: the speculative path silently ignores the repetition, presence and
    frequency penalties (the request is accepted, the logits are left as they are)."""

    name = "penalties_ignored"

    def processed_target(self, logits: torch.Tensor, row: SampledRow, drafts: list[int],
                         masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        plain = replace(row.params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        return super().processed_target(logits, replace(row, params=plain), drafts, masks)


# faults of the request parameters' processing (the rule itself is right): `fault=NAME` in `make_fault_engine`
PENALTY_FAULTS: dict[str, type[SampledSpeculative]] = {PenaltyPerStep.name: PenaltyPerStep,
                                                       PenaltiesIgnored.name: PenaltiesIgnored}


def make_fault_engine(target: Any, draft: Any = None, *, fault: str, engine: str = "sampled-spec",
                      **options: Any) -> Any:
    """`specaudit.testing.faults.sampling:make_fault_engine` with `fault=NAME`: a sampled engine with one fault.
    `engine`: `sampled-spec` (default), or one of the project's engines (eqspec, exspec, inplace, batched,
    reference; `REQUEST_ENGINES` in engines/registry.py), the fault's rule then planted in the
    acceptance rule every one of them calls (engines/acceptance.py, engines/sampling/step.py)."""
    known = [*SAMPLING_FAULTS, SharedStream.name, *PENALTY_FAULTS]
    if fault not in known:
        raise ValueError(f"unknown sampling fault {fault!r}; known: {', '.join(known)}")
    if fault in PENALTY_FAULTS:
        if engine != "sampled-spec":
            raise ValueError(f"{fault} is a fault of sampled-spec's processing; the project's engines process in "
                             "engines/requests/rows.py")
        return PENALTY_FAULTS[fault](target, draft, **options)
    if engine != "sampled-spec":
        from specaudit.engines.sampling.process import SamplingParams
        from specaudit.engines.registry import make_engine

        if fault == SharedStream.name:
            raise ValueError("the shared stream is a fault of sampled-spec's streams; the project's engines keep one per request")
        params = SamplingParams(float(options.pop("temperature", 1.0)), int(options.pop("top_k", 0)),
                                float(options.pop("top_p", 1.0)))
        return make_engine(engine, target, draft, sampling=params, seed=int(options.pop("seed", 0)),
                           draft_tokens=int(options.pop("draft_tokens", 4)), batch_size=int(options.pop("batch_size", 8)),
                           rule=SAMPLING_FAULTS[fault](), **options)
    if fault == SharedStream.name:
        return SharedStream(target, draft, **options)
    return SampledSpeculative(target, draft, rule=SAMPLING_FAULTS[fault](), **options)
