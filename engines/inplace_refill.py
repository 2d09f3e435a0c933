"""INPLACE with refill: a freed row takes the next waiting prompt while the other rows keep decoding.

Contract: the same as INPLACE (token ids in, exactly the tokens of greedy decoding of each prompt
alone out). Instead of consecutive batches, at most `batch_size` rows run at once; prompts wait in
order. Whenever at least `refill_at` rows are free (or every row is, or fewer prompts wait), the
oldest waiting prompts are prefilled together (INPLACE's own `_start`: target and draft) and their
rows join the running batch (`join_rows`):

- both caches get the width of the wider one: the narrower rows get zero columns on the left,
  marked not valid (exactly like a prompt's left padding), so every row's real columns keep
  their order and nothing a row reads changes;
- position ids and the attention mask come, as always in INPLACE, from each row's `lengths` and
  validity mask, never from the column a token sits in: a row that joins late sees only itself.

The join is timed as `realign` in the prefill record (the step that brought the rows in). Models
with recurrent layers do not join rows yet (`joinable`): they run consecutive batches.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines.ops import layout, ragged, recurrent
from specaudit.engines.contract import row_limits
from specaudit.engines.eqspec import Clock, StepResult
from specaudit.engines.trace import Trace


class InplaceRows(Protocol):
    """What a join reads and writes of `engines.inplace.InplaceState` (which imports this module)."""

    rows: list[int]
    pending: torch.Tensor  # [B, 1]
    lengths: torch.Tensor  # [B]
    prompt_lengths: torch.Tensor  # [B]
    target_cache: DynamicCache
    target_valid: torch.Tensor  # [B, W]
    draft_cache: DynamicCache | None
    draft_valid: torch.Tensor | None  # [B, W']


class RefillingEngine(Protocol):
    """What the refill loop calls of `engines.inplace.InplaceEngine`."""

    target: PreTrainedModel
    batch_size: int
    refill_at: int

    def _start(self, prompts: list[list[int]], rows: list[int], max_new_tokens: Any,
               eos_token_id: int | Sequence[int] | None) -> tuple[Any, StepResult]: ...

    def _step(self, state: Any, step: int, max_new_tokens: Any, eos_token_id: int | Sequence[int] | None) -> StepResult: ...

    @staticmethod
    def _collect(trace: Trace, result: StepResult, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None: ...


def join_caches(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache, other_valid: torch.Tensor) -> torch.Tensor:
    """Append `other`'s rows to `cache` (in place), both right-aligned to the wider width; returns
    the joined validity mask `[B + B', W]`."""
    width = max(valid.shape[1], other_valid.shape[1])
    ragged.join_cache_rows(cache, other, width, layout.spare_width(width), layout.hold_columns)  # room for the next passes
    return torch.cat([ragged.widen_left(valid, width, 1, False), ragged.widen_left(other_valid, width, 1, False)], dim=0)  # [B+B', W]


def join_rows(state: InplaceRows, new: InplaceRows) -> None:
    """Add the rows of `new` (freshly prefilled) after the rows of `state`, caches included."""
    state.rows = state.rows + new.rows
    state.pending = torch.cat([state.pending, new.pending])  # [B+B', 1]
    state.lengths = torch.cat([state.lengths, new.lengths])
    state.prompt_lengths = torch.cat([state.prompt_lengths, new.prompt_lengths])
    state.target_valid = join_caches(state.target_cache, state.target_valid, new.target_cache, new.target_valid)
    if state.draft_cache is not None and new.draft_cache is not None:
        assert state.draft_valid is not None and new.draft_valid is not None
        state.draft_valid = join_caches(state.draft_cache, state.draft_valid, new.draft_cache, new.draft_valid)


def joinable(state: InplaceRows) -> bool:
    """Rows join only caches of attention layers: a model with recurrent layers (per-row states, rolled
    back after each step) waits until its batch is done, as consecutive batches do."""
    caches = [state.target_cache] + ([state.draft_cache] if state.draft_cache is not None else [])
    return not any(recurrent.tracks_states(cache) for cache in caches)


def run_with_refill(engine: RefillingEngine, prompts: list[list[int]], max_new_tokens: int | list[int],
                    eos_token_id: int | Sequence[int] | None, trace: Trace, outputs: list[list[int]],
                    logits: list[list[torch.Tensor]]) -> None:
    """Decode every prompt with at most `engine.batch_size` rows, refilling freed rows in order."""
    device = engine.target.device
    waiting = deque(range(len(prompts)))
    state: Any = None  # the running rows (an InplaceState), None before the first prefill
    while waiting or (state is not None and state.rows):
        running = len(state.rows) if state is not None else 0
        free = engine.batch_size - running
        if waiting and free > 0 and (running == 0 or (free >= min(engine.refill_at, len(waiting)) and joinable(state))):
            rows = [waiting.popleft() for _ in range(min(free, len(waiting)))]
            new, result = engine._start(prompts, rows, row_limits(max_new_tokens, rows, device), eos_token_id)
            clock = Clock(device)
            if new.rows:
                if state is None or not state.rows:
                    state = new
                else:
                    join_rows(state, new)
            result.record.seconds["realign"] += clock.lap()
            engine._collect(trace, result, outputs, logits)
            continue
        assert state is not None
        result = engine._step(state, len(trace.steps), row_limits(max_new_tokens, state.rows, device), eos_token_id)
        engine._collect(trace, result, outputs, logits)
