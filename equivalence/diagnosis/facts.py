"""What a run's diagnosis reads: one frozen record, built once where the audit diagnoses a run.

Contract: `RunFacts` holds the run as it was audited (its prompts, references and outputs, the engine's trace
and logits, the models, the run's context for re-runs, the ruler below float64) and how far the diagnosis may
go (its mode, whether the engine's inputs can be observed, its deadline). Nothing in it changes while the run is
diagnosed; what does (the re-run budgets, the time spent, the experiments made, the reference a divergence
judged past a numerical flip is diagnosed against) lives on `core.Diagnoser`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specaudit.engines.trace import Trace
from specaudit.equivalence.rulings.ruler import Ruler
from specaudit.equivalence.run_context import RunContext


@dataclass(frozen=True)
class RunFacts:
    """One audited run, as its diagnosis reads it."""

    prompts: list[list[int]]
    references: list[list[int]]  # the audit's reference outputs
    outputs: list[list[int]]  # the engine's
    max_new_tokens: int
    eos_token_id: int | tuple[int, ...] | list[int] | None  # the EOS set: any of its ids ends a row
    pad_token_id: int | None
    trace: Trace | None = None
    engine_logits: list[torch.Tensor | None] = field(default_factory=list)  # per prompt [n, V] (None: not recorded)
    target: Any = None  # the target in the audit dtype, for replays
    draft: Any = None
    run: RunContext | None = None  # re-runs of a fresh engine (None: the engine cannot be re-run)
    batch_size: int | None = None  # the run's; with draft_tokens, for replays of an engine without a trace
    draft_tokens: int = 0
    # below float64: the run's ruler judges re-runs as the audit judged the run (rulings/ruler.py); the
    # float64 target replays the hypotheses; `reference_logits` measure the dtype's own error per prompt
    ruler: Ruler | None = None
    replay_target: Any = None
    replay_draft: Any = None  # the draft in float64 (below float64; made from `draft` when not given)
    reference_logits: list[torch.Tensor | None] = field(default_factory=list)
    # the outputs `reference_logits` were computed along (the audit's references; a divergence judged past a
    # numerical flip is diagnosed against a reference that then goes another way)
    logit_paths: list[list[int]] = field(default_factory=list)
    mode: str = "full"  # "quick": checks and replays only, no re-run of the engine
    observe_inputs: bool = True  # an in-process engine: its inputs to the target can be observed (observe.py)
    watch: Any = None  # the hooks held around the run's own call (observe.Watch; None: the run was not watched)
    deadline: float | None = None  # time.monotonic() after which no re-run starts (the time budget)
    # under request parameters: (prompt index, output position, raw logits [V]) -> the logits a correct decoder
    # chooses from there (the prompt's processors on the output's history); None: the raw logits are chosen from
    processed: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None

    def choice(self, index: int, position: int, logits: torch.Tensor) -> int:
        """The token a correct decoder chooses from raw target `logits` [V] at new token `position` of prompt `index`."""
        row = logits if self.processed is None else self.processed(index, position, logits)
        return int(row.argmax())

    def chosen_from(self, index: int, position: int, logits: torch.Tensor) -> torch.Tensor:
        """The logits [V] the choice at `position` of prompt `index` is made from (`choice`)."""
        return logits if self.processed is None else self.processed(index, position, logits)
