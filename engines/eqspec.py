"""EQSPEC: batched speculative decoding on a fixed batch, realigned after every step; and the one step
of every ragged speculative engine (EQSPEC, EXSPEC's groups, INPLACE), whose cache policy is a parameter.

Contract: token ids in, token ids out, exactly the tokens greedy decoding of each prompt alone
would give. Prompts are taken in consecutive batches of `batch_size`. `start_batch` prefills them;
then each step (`speculative_step`), for the rows still running:

1. draft:   the drafter proposes up to K tokens per row                  # [B, K]
2. verify:  one target pass over [pending token, K draft tokens]          # [B, K+1, V]
3. accept:  each row keeps its longest draft prefix equal to the target's
            greedy choices (accepted tokens), then the target's own token:
            at the first disagreement (recovered) or after all K (bonus);
            cut at the first EOS or at exactly max_new_tokens, never later.
            A sampled request (request parameters with temperature > 0) is
            decided by the rejection sampler instead (engines/acceptance.py),
            its drafts drawn from the draft's processed q, every decision
            from its own stream
4. commit:  the cache policy (`CachePolicy`) keeps each running row's
            [old cache, pending token, accepted tokens]: `Realign` (EQSPEC)
            gathers both caches so each row holds exactly them; INPLACE's
            `HolesInPlace` (engines/inplace.py) leaves the rejected columns
            in place as masked holes. The tokens get the accepted and bonus
            tokens (unpad-append-repad) and finished rows leave the batch

Per-row state is the vector `lengths[B]`, never one scalar position: position ids and attention
masks are derived from it every pass (see `engines/ops/ragged.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines import acceptance
from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.ops import layout
from specaudit.engines.ops import recurrent
from specaudit.engines.batch import BatchState, HostBook
from specaudit.engines.batch import ConsecutiveBatches
from specaudit.engines.contract import row_limits
from specaudit.engines.drafters import Drafter, ModelDrafter, draft_stage, make_drafter
from specaudit.engines.requests.rows import RowRequests, TakesRequestParams
from specaudit.engines.trace import StepRecord, Trace


class Clock:
    """Stage timer; waits for the device at stage boundaries so GPU times are real."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.last = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


@dataclass
class StepResult:
    record: StepRecord
    emitted: list[list[int]]  # per row of the step, the new tokens it appended
    logits: list[torch.Tensor] | None  # per row, the target logits of those tokens [n, V]
    finished: list[int]  # prompt indices that finished this step


def collect(trace: Trace, result: StepResult, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
    """A step's record into the trace, its tokens (and logits) onto each row's output."""
    trace.record(result.record)
    for i, row in enumerate(result.record.rows):
        outputs[row].extend(result.emitted[i])
        if result.logits is not None:
            logits[row].append(result.logits[i])


class StepState(Protocol):
    """What `start_batch` and `speculative_step` read and write of a batch: `batch.BatchState` (EQSPEC, EXSPEC)
    or `inplace.InplaceState` (INPLACE); its cache policy builds it."""

    rows: list[int]  # prompt index of each row
    lengths: torch.Tensor  # [B] real tokens per row (prompt + new, the pending one included)
    prompt_lengths: torch.Tensor  # [B]
    target_cache: DynamicCache
    host: HostBook | None  # the host's mirror of the lengths, where the engine keeps one

    @property
    def tokens(self) -> torch.Tensor: ...  # [B, W] each row's tokens, right-aligned, the last one pending (INPLACE: W = 1)

    @property
    def cache_lengths(self) -> torch.Tensor: ...  # [B] real columns in each row's caches

    def pad_length_list(self) -> list[int]: ...  # [B] columns of the target cache that are not the row's

    def append(self, tokens: torch.Tensor, emitted: torch.Tensor, emitted_list: list[int], pad_id: int) -> None: ...

    def select(self, keep: torch.Tensor) -> None: ...  # within a step, after the cache policy's commit

    def keep_rows(self, keep: torch.Tensor) -> None: ...  # between steps, caches included


class CachePolicy(Protocol):
    """What a step does with the columns of rejected draft tokens: the one thing EQSPEC, EXSPEC's groups
    and INPLACE do differently. `Realign` (here) gathers both caches after every step; `HolesInPlace`
    (engines/inplace.py) leaves rejected columns where the verify pass wrote them, masked."""

    def start(self, rows: list[int], tokens: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor,
              target_cache: DynamicCache, pad_id: int) -> StepState:
        """The batch after the target's prefill: `tokens` [B, P] the left-padded prompts, `lengths` [B] theirs,
        `first` [B] each row's first new token (pending), `target_cache` the prompts' cache."""
        ...

    def verify(self, target: PreTrainedModel, state: StepState, inputs: torch.Tensor,
               real_counts: torch.Tensor) -> torch.Tensor:
        """The target pass over `inputs` [B, K+1] after each row's cache; logits [B, K+1, V]."""
        ...

    def commit(self, state: StepState, drafter: Drafter, old_width: int, k: int, accepted_counts: torch.Tensor,
               keep: torch.Tensor, clock: Clock) -> dict[str, float]:
        """Both caches keep each running row's [old cache, pending token, accepted tokens] (`keep`: the running
        rows, `old_width` the target cache's width before the verify pass, `k` its draft columns); `state` still
        describes the batch before the step. Returns the seconds of the stages it timed itself."""
        ...

    def settle(self, state: StepState) -> None:
        """After finished rows left the batch: whatever the caches need before the next step."""
        ...


@dataclass(frozen=True)
class Realign:
    """EQSPEC's cache policy: after every step both caches are gathered so that each row holds exactly its
    accepted tokens, right-aligned (`batch.realign`). `caches=False` (EXSPEC's groups) leaves them as the
    verify pass (and the drafter's fill pass) made them: every row of the step, finished ones included,
    keeps its old columns followed by the new ones, its real columns ending at `old width + accepted + 1`;
    EXSPEC cuts each row out of them itself."""

    caches: bool = True

    def start(self, rows: list[int], tokens: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor,
              target_cache: DynamicCache, pad_id: int) -> BatchState:
        ones = torch.ones_like(lengths)
        tokens, new_lengths = ragged.append_and_repad(tokens, lengths, first.unsqueeze(1), ones, pad_id)
        return BatchState(list(rows), tokens, new_lengths, lengths.clone(), target_cache)

    def verify(self, target: PreTrainedModel, state: BatchState, inputs: torch.Tensor,
               real_counts: torch.Tensor) -> torch.Tensor:
        return batch_ops.forward(target, state.target_cache, inputs, state.cache_lengths, real_counts)  # [B, K+1, V]

    def commit(self, state: BatchState, drafter: Drafter, old_width: int, k: int, accepted_counts: torch.Tensor,
               keep: torch.Tensor, clock: Clock) -> dict[str, float]:
        if self.caches:
            drafter.commit(state, accepted_counts, keep)
            batch_ops.realign(state.target_cache, old_width, accepted_counts, state.cache_lengths, keep, state.host)
        else:
            drafter.commit(state, accepted_counts, keep, realign=False)
            recurrent.commit(state.target_cache, accepted_counts)  # every row of the step, in batch order
        return {}  # timed with the step's realign stage

    def settle(self, state: BatchState) -> None:
        return None


REALIGN = Realign()


def start_batch(
    target: PreTrainedModel,
    drafter: Drafter,
    prompts: list[list[int]],
    rows: list[int],
    pad_id: int,
    eos_token_id: int | Sequence[int] | None,
    max_new_tokens: int | torch.Tensor,  # one budget, or [B] per row
    record_logits: bool,
    grouped_prefill: bool = True,
    requests: RowRequests | None = None,
    cache: CachePolicy = REALIGN,
) -> tuple[StepState, StepResult]:
    """Prefill target and draft; the target's choice after each prompt is the row's first new token.
    `grouped_prefill=False`: the target prefills the whole batch in one padded pass. `requests`: the
    call's request parameters (engines/requests/rows.py), None for plain greedy requests. `cache`: the
    cache policy, which builds the batch's state (a `BatchState` for `Realign`)."""
    clock = Clock(target.device)
    tokens, lengths = ragged.left_pad([prompts[r] for r in rows], pad_id, target.device)
    target_cache, last_logits = batch_ops.prefill(target, tokens, lengths, grouped_prefill)  # [B, V]
    first, done = acceptance.first_tokens(last_logits, max_new_tokens, eos_token_id,
                                          requests.step(rows) if requests is not None else None)  # [B], [B]
    state = cache.start(rows, tokens, lengths, first, target_cache, pad_id)
    pad_lengths = state.pad_length_list()  # each row's left padding
    verify_seconds = clock.lap()
    drafter.prefill(state)
    draft_seconds = clock.lap()
    first_list, done_list = first.tolist(), done.tolist()
    state.keep_rows((~done).nonzero().flatten())  # rows that ended at their first token leave
    record = StepRecord(
        step=0, kind="prefill", rows=list(rows), pad_lengths=pad_lengths,
        accepted_counts=[0] * len(rows), emitted_counts=[1] * len(rows),
        seconds={"draft": draft_seconds, "verify": verify_seconds, "realign": clock.lap()},
    )
    logits = [row.unsqueeze(0) for row in last_logits] if record_logits else None
    finished = [r for r, d in zip(rows, done_list) if d]
    return state, StepResult(record, [[t] for t in first_list], logits, finished)


def speculative_step(
    target: PreTrainedModel,
    drafter: Drafter,
    state: StepState,  # a `BatchState`, or the state of `cache` (INPLACE's `InplaceState`)
    k: int,
    step: int,
    eos_token_id: int | Sequence[int] | None,
    max_new_tokens: int | torch.Tensor,  # one budget, or [B] per row of `state`
    pad_id: int,
    record_logits: bool,
    kind: str = "batch",
    cache: CachePolicy = REALIGN,
    requests: RowRequests | None = None,
) -> StepResult:
    """One speculative step on every row of `state` (all running); updates `state` in place. `cache`: what
    becomes of the rejected columns (`CachePolicy`). `requests`: the call's request parameters, handed to
    the acceptance rule for the rows of `state`."""
    clock = Clock(target.device)
    pad_lengths = state.pad_length_list()  # from the host's lengths where the engine keeps them (EQSPEC)
    rows = list(state.rows)

    # 1. draft (drafters.draft_stage): up to k tokens per row (a drafter may propose fewer, or none),
    #    a sampled row's drawn from its processed q with its own stream (engines/sampling/step.py)
    step_requests = requests.step(rows) if requests is not None else None
    drafts = draft_stage(drafter, state, k, step_requests.sampler if step_requests is not None else None, pad_id,
                         step_requests.draft_mask() if step_requests is not None else None)
    draft_tokens = drafts.tokens  # [B, K]: the row's drafts, then pad ids
    k = draft_tokens.shape[1]  # this step's width K: the longest proposal (0: a plain decoding pass)
    draft_seconds = clock.lap()

    # 2. verify: the pending token and the K draft tokens in one target pass
    old_width = ragged.cache_width(state.target_cache)
    inputs = torch.cat([state.tokens[:, -1:], draft_tokens], dim=1)  # [B, K+1]
    logits = cache.verify(target, state, inputs, drafts.drafted + 1)  # [B, K+1, V]
    verify_seconds = clock.lap()

    # 3. accept (engines/acceptance.py): per row the longest draft prefix the target agrees with
    #    (accepted tokens), then the target's own token at the first disagreement (recovered) or after
    #    all K (bonus); cut at the first EOS id or at exactly the row's budget, never later
    room = max_new_tokens - (state.lengths - state.prompt_lengths)  # [B], >= 1 for running rows
    verdict = acceptance.accept(logits, draft_tokens, room, eos_token_id, own=drafts.own, requests=step_requests,
                                draft_logits=drafts.logits)
    target_tokens, accepted_counts, emitted, done = verdict.tokens, verdict.accepted, verdict.emitted, verdict.done
    # the step's one read of per-row results: the tokens, accepted and emitted counts and stops [B, K+4];
    # with the host's lengths (`state.host`) every width and plan below is made from it, no other read
    counts = torch.stack([accepted_counts, emitted, done.long()], dim=1).to(target_tokens.dtype)  # [B, 3]
    read = torch.cat([target_tokens, counts], dim=1).tolist()
    new_rows = [row[:-3] for row in read]
    accepted_list, emitted_list, done_list = ([row[j] for row in read] for j in (-3, -2, -1))
    new_tokens = [row[:n] for row, n in zip(new_rows, emitted_list)]
    row_logits = [logits[b, :n] for b, n in enumerate(emitted_list)] if record_logits else None

    # 4. commit: the cache policy keeps each running row's [old cache, pending token, accepted tokens]
    #    (realigned, or in place beside holes); the tokens get the accepted and bonus tokens; finished
    #    rows leave the batch
    keep_list = [b for b, finished in enumerate(done_list) if not finished]
    keep = torch.tensor(keep_list, dtype=torch.long).to(done.device, non_blocking=True)  # no device read
    if layout.is_row_ends(state.target_cache):  # rows fill the holes the leaving rows make (fewest copies)
        keep = layout.fill_order(keep)
    if state.host is not None:
        state.host.accepted, state.host.keep = accepted_list, keep_list
    seconds = {"draft": draft_seconds, "verify": verify_seconds}
    if keep.numel():
        for stage, spent in cache.commit(state, drafter, old_width, k, accepted_counts, keep, clock).items():
            seconds[stage] = seconds.get(stage, 0.0) + spent
        state.append(target_tokens, emitted, emitted_list, pad_id)
        state.select(keep)
        cache.settle(state)
    else:
        state.rows = []
    seconds["realign"] = clock.lap()

    record = StepRecord(
        step=step, kind=kind, rows=rows, pad_lengths=pad_lengths, accepted_counts=accepted_list,
        emitted_counts=emitted_list, seconds=seconds, **drafts.trace_fields(record_logits),
    )
    finished = [r for r, d in zip(rows, done_list) if d]
    return StepResult(record, new_tokens, row_logits, finished)


class EQSpec(ConsecutiveBatches, TakesRequestParams):
    """EQSPEC engine: consecutive fixed batches of `batch_size` prompts."""

    name = "eqspec"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        drafter: Drafter | str | None = None,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        **_: object,
    ) -> None:
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be at least 1")
        if drafter is None and draft is None:
            raise ValueError("EQSPEC needs a draft model or a drafter")
        layout.check_supported(target, "target")  # one line naming what is missing, before any run
        self.target = target
        self.drafter = make_drafter(drafter, target, draft)
        self.batch_size = batch_size
        self.k = draft_tokens
        self.pad_id = pad_token_id if pad_token_id is not None else (target.config.pad_token_id or 0)
        self.record_logits = record_logits
        self.last_trace: Trace | None = None

    def _run_batch(self, prompts: list[list[int]], rows: list[int], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                   trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        device = self.target.device
        state, result = start_batch(self.target, self.drafter, prompts, rows, self.pad_id, eos_token_id,
                                    row_limits(max_new_tokens, rows, device), self.record_logits,
                                    requests=self.active_requests)
        self._collect(trace, result, outputs, logits)
        if state.rows and not layout.is_row_ends(state.target_cache):  # the lengths kept on the host from here
            state.host = HostBook(state.lengths.tolist())
        while state.rows:
            result = speculative_step(self.target, self.drafter, state, self.k, len(trace.steps), eos_token_id,
                                      row_limits(max_new_tokens, state.rows, device), self.pad_id, self.record_logits,
                                      requests=self.active_requests)
            self._collect(trace, result, outputs, logits)

    @property
    def proposals_from_draft_model(self) -> bool:
        return isinstance(self.drafter, ModelDrafter)

    _collect = staticmethod(collect)
