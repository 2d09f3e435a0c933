"""Per-step records that engines expose for attribution and timing.

An engine that keeps a `last_trace: Trace` after `generate` lets the harness say, for any output
position, which step produced it, what the batch looked like then, and what the row accepted up
to that point. Everything here is plain Python data, cheap to serialise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill"; "batch" (EQSPEC, INPLACE, batched), "group" (EXSPEC same-length group), "fallback"
    # (EXSPEC padded), "fixedshape" (the fixed-shape engine's loop)
    rows: list[int]  # prompt index of each row, in batch order
    pad_lengths: list[int]  # left padding of each row's target cache when the step began
    accepted_counts: list[int]  # accepted draft tokens per row, 0..k
    emitted_counts: list[int]  # tokens appended per row: accepted + bonus, cut at EOS / max_new_tokens
    seconds: dict[str, float] = field(default_factory=dict)  # draft, verify, realign
    proposed: list[list[int]] | None = None  # each row's own draft tokens (k, or fewer), when recorded
    drafted_counts: list[int] | None = None  # draft tokens per row when a drafter proposed fewer than k

    def drafted(self, k: int) -> int:
        """Draft tokens the step's rows proposed."""
        return sum(self.drafted_counts) if self.drafted_counts is not None else k * len(self.rows)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Trace:
    num_prompts: int
    draft_tokens: int = 0
    # True when every proposal is the draft model's own greedy choice: the audit then checks them
    proposals_from_draft_model: bool = False
    steps: list[StepRecord] = field(default_factory=list)
    # per prompt, the target logits each emitted token was chosen from: [n_new, V], or None
    logits: list[torch.Tensor | None] = field(default_factory=list)
    # per prompt, the step that emitted each new token (index into `steps`; -1 for the prefill token)
    emitted_at: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.logits:
            self.logits = [None] * self.num_prompts
        if not self.emitted_at:
            self.emitted_at = [[] for _ in range(self.num_prompts)]

    def step_offsets(self) -> list[list[int]]:
        """Per prompt, each new token's offset in the step that emitted it: how many of that step's draft
        tokens were accepted before it (a step's first token: 0; the bonus token after k accepted drafts: k);
        -1 for a prefill's token, which no verify step decides. The sampled audit stratifies by it
        (equivalence/sampling/audit.py)."""
        offsets: list[list[int]] = [[] for _ in range(self.num_prompts)]
        for step in self.steps:
            for row, count in zip(step.rows, step.emitted_counts):
                offsets[row].extend([-1] * count if step.kind == "prefill" else range(count))
        return offsets

    def record(self, step: StepRecord) -> None:
        index = len(self.steps)
        self.steps.append(step)
        for row, count in zip(step.rows, step.emitted_counts):
            self.emitted_at[row].extend([index] * count)

    def accepted_history(self, prompt_index: int, up_to_step: int | None = None) -> list[int]:
        """The row's accepted counts at every step it took part in, up to and including `up_to_step`."""
        history = []
        for index, step in enumerate(self.steps):
            if up_to_step is not None and index > up_to_step:
                break
            if prompt_index in step.rows:
                history.append(step.accepted_counts[step.rows.index(prompt_index)])
        return history

    def totals(self) -> dict[str, Any]:
        seconds: dict[str, float] = {}
        kinds: dict[str, int] = {}
        group_sizes: list[int] = []
        accepted = proposed = 0
        for step in self.steps:
            for stage, value in step.seconds.items():
                seconds[stage] = seconds.get(stage, 0.0) + value
            kinds[step.kind] = kinds.get(step.kind, 0) + 1
            group_sizes.append(len(step.rows))
            if step.kind != "prefill":  # a prefill drafts nothing
                accepted += sum(step.accepted_counts)
                proposed += step.drafted(self.draft_tokens)
        return {
            "steps": len(self.steps),
            "step_kinds": kinds,
            "mean_rows_per_step": (sum(group_sizes) / len(group_sizes)) if group_sizes else 0.0,
            "acceptance_rate": (accepted / proposed) if proposed else None,
            "seconds": seconds,
        }
