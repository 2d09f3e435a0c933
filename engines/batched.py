"""BATCHED: plain greedy decoding of consecutive batches, no draft: the baseline of speculation.

Contract: token ids in, exactly the tokens of greedy decoding of each prompt alone out. It uses
the ragged operations of EQSPEC (`engines/ops/ragged.py`, `engines/batch.py`): left-padded prefill,
per-row position ids and masks from `lengths[B]`. Every running row appends one token per pass,
so the cache stays right-aligned with no realignment; a finished row leaves the batch with one
row-selecting gather (`BatchState.keep_rows`), timed as `realign`. The target pass is the
`verify` stage (there is nothing to verify: it is the decoding pass), so stage shares compare
with the speculative engines'. With request parameters (engines/requests/rows.py) each pass's token
is decided by the acceptance rule with no draft tokens (`acceptance.accept`, k = 0), which applies them.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines import acceptance
from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged, recurrent
from specaudit.engines.batch import BatchState
from specaudit.engines.batch import ConsecutiveBatches
from specaudit.engines.contract import row_limits
from specaudit.engines.requests.rows import TakesRequestParams
from specaudit.engines.drafters import Drafter
from specaudit.engines.eqspec import Clock, start_batch
from specaudit.engines.limits import is_eos
from specaudit.engines.trace import StepRecord, Trace


class _NoDraft(Drafter):
    """The drafter slot of `start_batch`, for an engine without a draft."""

    def prefill(self, state: BatchState) -> None:
        state.draft_cache = None


class BatchedGreedy(ConsecutiveBatches, TakesRequestParams):
    """Plain batched greedy decoding; the draft model, if given, is unused."""

    name = "batched"

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, batch_size: int = 8,
                 pad_token_id: int | None = None, record_logits: bool = False, **_: object) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.target = target
        self.batch_size = batch_size
        self.k = 0
        self.pad_id = pad_token_id if pad_token_id is not None else (target.config.pad_token_id or 0)
        self.record_logits = record_logits
        self.last_trace: Trace | None = None

    def _run_batch(self, prompts: list[list[int]], rows: list[int], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                   trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        device = self.target.device
        state, result = start_batch(self.target, _NoDraft(), prompts, rows, self.pad_id, eos_token_id,
                                    row_limits(max_new_tokens, rows, device), self.record_logits,
                                    requests=self.active_requests)
        self._collect(trace, result.record, result.emitted, result.logits, outputs, logits)
        while state.rows:
            record, emitted, row_logits = self._step(state, len(trace.steps), row_limits(max_new_tokens, state.rows, device),
                                                     eos_token_id)
            self._collect(trace, record, emitted, row_logits, outputs, logits)

    def _step(self, state: BatchState, step: int, max_new_tokens: int | torch.Tensor,
              eos_token_id: int | Sequence[int] | None) -> tuple[StepRecord, list[list[int]], list[torch.Tensor] | None]:
        clock = Clock(self.target.device)
        rows = list(state.rows)
        pad_lengths = state.pad_lengths().tolist()
        step_logits = batch_ops.forward(self.target, state.target_cache, state.tokens[:, -1:], state.cache_lengths)[:, -1]  # [B, V]
        tokens = step_logits.argmax(-1)  # [B]
        recurrent.commit(state.target_cache, torch.zeros_like(state.lengths))  # one token fed: keep its state, drop the history
        verify_seconds = clock.lap()

        room = max_new_tokens - (state.lengths - state.prompt_lengths)  # [B], >= 1
        if self.active_requests is None:
            done = (room <= 1) | is_eos(tokens, eos_token_id)
        else:  # the request parameters, through the acceptance rule with no draft tokens
            no_drafts = state.tokens.new_zeros(len(rows), 0)  # [B, 0]
            verdict = acceptance.accept(step_logits.unsqueeze(1), no_drafts, room, eos_token_id,
                                        requests=self.active_requests.step(rows))
            tokens, done = verdict.tokens[:, 0], verdict.done  # [B], [B]
        ones = torch.ones_like(state.lengths)
        state.tokens, state.lengths = ragged.append_and_repad(state.tokens, state.lengths, tokens.unsqueeze(1), ones, self.pad_id)
        token_list, done_list = torch.stack([tokens, done.long()]).tolist()
        accept_seconds = clock.lap()

        if any(done_list):
            state.keep_rows((~done).nonzero().flatten())  # the cache already holds every row's tokens but the last
        realign_seconds = clock.lap()
        record = StepRecord(
            step=step, kind="batch", rows=rows, pad_lengths=pad_lengths, accepted_counts=[0] * len(rows),
            emitted_counts=[1] * len(rows),
            seconds={"draft": 0.0, "verify": verify_seconds, "accept": accept_seconds, "realign": realign_seconds},
        )
        row_logits = [row.unsqueeze(0) for row in step_logits] if self.record_logits else None
        return record, [[t] for t in token_list], row_logits

    @staticmethod
    def _collect(trace: Trace, record: StepRecord, emitted: list[list[int]], row_logits: list[torch.Tensor] | None,
                 outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        trace.record(record)
        for i, row in enumerate(record.rows):
            outputs[row].extend(emitted[i])
            if row_logits is not None:
                logits[row].append(row_logits[i])
