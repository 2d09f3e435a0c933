"""INPLACE: batched speculative decoding that never realigns its caches after a step.

Contract: the same as EQSPEC (token ids in, exactly the tokens of greedy decoding of each prompt
alone out; at most `batch_size` rows at once, a freed row taking the next prompt: see
`engines/inplace_refill.py`; `refill=False` runs consecutive batches). What differs is what happens to the columns of
rejected draft tokens: EQSPEC gathers both caches after every step so each row holds exactly its
accepted tokens; INPLACE leaves them where the verify pass (and the draft passes) wrote them, as
holes, and keeps a validity mask per cache. The steps themselves are EQSPEC's (`eqspec.start_batch`,
`eqspec.speculative_step`); INPLACE hands them its cache policy, `HolesInPlace`, and its state,
`InplaceState`:

- `target_valid` [B, W] (and `draft_valid` [B, W'] for the draft cache): True on a column that
  holds one of the row's real tokens. Left padding of the prompts and rejected draft slots are
  False. The attention mask of every pass is `[valid, ones(q)]`: a query sees exactly its row's
  real earlier tokens (holes are finite keys and values, masked to an exact zero weight).
- Position ids count only each row's real tokens: `cache_lengths[b] + 0..q-1`, where
  `cache_lengths[b] = valid[b].sum()` (kept as `lengths - 1`, never read back from the mask).
- Per step every running row appends `k + 1` target columns (pending token + k draft tokens), of
  which the first `accepted + 1` are valid; the draft appends `k` columns (pending + k - 1 draft
  tokens; valid up to the accepted ones) and, when some row accepted all k, one fill column (valid
  only for those rows).
- Finished rows leave the batch by row selection (`index_select` on the batch dimension, the
  columns untouched). A cache is compacted (one gather per layer that right-aligns every row's
  valid columns, `ragged.gather_columns`) only when compaction would free more than
  `compact_fraction` of its width, i.e. when `width - max(real columns) > compact_fraction *
  width`. Row selection and compaction are the `realign` stage; their cost is amortised over the
  steps between them.
- Sliding-window layers (Gemma-3, Mistral): transformers applies the window by column distance
  (`engines/ops/layout.py`), and a hole would count against it. For a model with such layers the cache
  is compacted after every step that leaves a hole, so INPLACE realigns like EQSPEC there.

Sampled requests (request parameters with temperature > 0) are decided by the rejection sampler of
`engines/acceptance.py`, their drafts drawn by `InplaceDrafter` from the draft's processed q with each
request's own stream, as in EQSPEC.

Stages in each `StepRecord.seconds`: `draft` (k draft passes and the fill pass), `verify` (the
target pass), `accept` (acceptance rule and validity bookkeeping), `realign` (the pending tokens, row
selection and compaction). `pad_lengths` of a record holds each row's holes (width - real columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.ops import layout
from specaudit.engines.ops import recurrent
from specaudit.engines.batch import ConsecutiveBatches, HostBook
from specaudit.engines.contract import row_limits
from specaudit.engines.requests.rows import TakesRequestParams
from specaudit.engines.drafters import Chooser, Drafter, ModelDrafter, shared_vocab_size
from specaudit.engines.eqspec import Clock, StepResult, collect, speculative_step, start_batch
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.trace import Trace

DEFAULT_COMPACT_FRACTION = 0.25


@dataclass
class InplaceState:
    rows: list[int]  # prompt index of each row
    pending: torch.Tensor  # [B, 1] the last token of each row, not yet in any cache
    lengths: torch.Tensor  # [B] real tokens per row (prompt + new, pending included)
    prompt_lengths: torch.Tensor  # [B]
    target_cache: DynamicCache
    target_valid: torch.Tensor  # [B, W] bool
    prompt_tokens: torch.Tensor | None = None  # [B, P] left-padded prompts, for the drafter's prefill (it drops them)
    draft_cache: DynamicCache | None = None
    draft_valid: torch.Tensor | None = None  # [B, W'] bool
    host: HostBook | None = None  # INPLACE keeps no host mirror of its lengths (the step reads `state.host`)

    @property
    def tokens(self) -> torch.Tensor:  # [B, 1]; the step and the drafters read the pending token here
        return self.pending

    @property
    def cache_lengths(self) -> torch.Tensor:  # [B] real columns in each cache
        return self.lengths - 1

    def pad_length_list(self) -> list[int]:
        """Each row's holes in the target cache (width - real columns): left padding and rejected slots."""
        return (self.target_valid.shape[1] - self.cache_lengths).tolist()

    def append(self, tokens: torch.Tensor, emitted: torch.Tensor, emitted_list: list[int], pad_id: int) -> None:
        """A row that emitted `emitted[b]` of `tokens` [B, K+1] has the last of them as its new pending token."""
        self.pending = tokens.gather(1, (emitted - 1).unsqueeze(1))  # [B, 1]
        self.lengths = self.lengths + emitted

    def select(self, keep: torch.Tensor) -> None:
        """Keep the rows `keep` (ascending indices) of everything, caches included; columns untouched."""
        if keep.numel() == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.pending = self.pending.index_select(0, keep)
        self.lengths = self.lengths.index_select(0, keep)
        self.prompt_lengths = self.prompt_lengths.index_select(0, keep)
        select_cache_rows(self.target_cache, keep)
        self.target_valid = self.target_valid.index_select(0, keep)
        if self.draft_cache is not None and self.draft_valid is not None:
            select_cache_rows(self.draft_cache, keep)
            self.draft_valid = self.draft_valid.index_select(0, keep)

    keep_rows = select  # between steps too, rows leave by row selection alone


def masked_forward(model: PreTrainedModel, cache: DynamicCache, valid: torch.Tensor, inputs: torch.Tensor,
                   cache_lengths: torch.Tensor, real_counts: torch.Tensor | None = None) -> torch.Tensor:
    """One pass of `q` tokens per row after a cache with holes (past `real_counts`: pad ids); logits [B, q, V]."""
    queries = torch.ones(inputs.shape[0], inputs.shape[1], dtype=torch.bool, device=inputs.device)
    mask = torch.cat([valid, queries], dim=1).long()  # [B, W + q]
    positions = ragged.position_ids(cache_lengths, inputs.shape[1])  # [B, q]
    layout.spare_columns(cache)  # new columns written in place, not the cache copied
    if recurrent.tracks_states(cache):  # per-position recurrent states, for the rollback
        return recurrent.forward_by_token(model, cache, inputs, mask, positions, real_counts)
    return cached_forward(model, cache, input_ids=inputs, attention_mask=mask, position_ids=positions).logits


def append_valid(valid: torch.Tensor, columns: int, real_counts: torch.Tensor) -> torch.Tensor:
    """`valid` [B, W] extended by `columns` columns, of which each row's first `real_counts[b]` are real."""
    new = torch.arange(columns, device=valid.device).unsqueeze(0) < real_counts.unsqueeze(1)  # [B, columns]
    return torch.cat([valid, new], dim=1)


def select_cache_rows(cache: DynamicCache, keep: torch.Tensor) -> None:
    recurrent.select_rows(cache, keep)
    for layer in ragged.cache_layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, keep)
            layer.values = layer.values.index_select(0, keep)


def needs_compaction(valid: torch.Tensor, real_counts: torch.Tensor, fraction: float) -> bool:
    width = valid.shape[1]
    return width - int(real_counts.max().item()) > fraction * width


def has_holes(valid: torch.Tensor, real_counts: torch.Tensor) -> bool:
    """True unless every row's real columns are its rightmost ones."""
    return not torch.equal(valid, ragged.padding_mask(real_counts, valid.shape[1]))


def windowed_by_column(model: PreTrainedModel) -> bool:
    return "sliding" in layout.attention_layer_kinds(model)


def compact(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Right-align every row's valid columns (order kept) in one gather per layer; returns the new
    validity mask [B, max real]. Columns left of a row's real ones are zeroed padding."""
    real_counts = valid.sum(dim=1)  # [B]
    width, new_width = valid.shape[1], int(real_counts.max().item())
    # stable sort on the mask puts each row's holes first and its real columns after, in order
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices  # [B, W]
    source = order[:, width - new_width:]  # [B, W']
    new_valid = torch.arange(new_width, device=valid.device).unsqueeze(0) >= (new_width - real_counts).unsqueeze(1)
    for layer in ragged.cache_layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = ragged.gather_columns(layer.keys, source, new_valid)
            layer.values = ragged.gather_columns(layer.values, source, new_valid)
    return new_valid


@dataclass
class HolesInPlace:
    """INPLACE's cache policy (`eqspec.CachePolicy`): a step's rejected columns stay where the verify pass
    (and the draft passes) wrote them, as holes masked out by each cache's validity mask; a cache is
    compacted only when that frees more than `compact_fraction` of its width, or, for a model whose
    sliding-window layers count columns (`target_windowed`, `draft_windowed`), whenever it has a hole.
    `compactions` counts them (target and draft apart) until the engine resets it."""

    compact_fraction: float = DEFAULT_COMPACT_FRACTION
    target_windowed: bool = False
    draft_windowed: bool = False
    compactions: int = 0

    def start(self, rows: list[int], tokens: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor,
              target_cache: DynamicCache, pad_id: int) -> InplaceState:
        valid = ragged.padding_mask(lengths, tokens.shape[1])  # [B, P]: left padding is a hole
        return InplaceState(list(rows), first.unsqueeze(1), lengths + 1, lengths.clone(), target_cache, valid,
                            prompt_tokens=tokens)

    def verify(self, target: PreTrainedModel, state: InplaceState, inputs: torch.Tensor,
               real_counts: torch.Tensor) -> torch.Tensor:
        return masked_forward(target, state.target_cache, state.target_valid, inputs, state.cache_lengths,
                              real_counts)  # [B, K+1, V]

    def commit(self, state: InplaceState, drafter: Drafter, old_width: int, k: int, accepted_counts: torch.Tensor,
               keep: torch.Tensor, clock: Clock) -> dict[str, float]:
        accept_seconds = clock.lap()  # the acceptance rule, since the verify pass
        drafter.fill(state, accepted_counts, keep)  # a row that accepted all K: the K-th draft token's columns
        fill_seconds = clock.lap()
        # the step's K + 1 columns: pending + accepted real, the rejected ones holes
        drafter.commit(state, accepted_counts, keep)
        state.target_valid = append_valid(state.target_valid, k + 1, accepted_counts + 1)
        recurrent.commit(state.target_cache, accepted_counts)  # recurrent states: after the accepted tokens
        return {"draft": fill_seconds, "accept": accept_seconds + clock.lap()}

    def settle(self, state: InplaceState) -> None:
        """No realignment: a cache is compacted only past the threshold (every hole, for a windowed model)."""
        real = state.cache_lengths
        if (has_holes(state.target_valid, real) if self.target_windowed
                else needs_compaction(state.target_valid, real, self.compact_fraction)):
            state.target_valid = compact(state.target_cache, state.target_valid)
            self.compactions += 1
        if state.draft_cache is not None and state.draft_valid is not None:
            if (has_holes(state.draft_valid, real) if self.draft_windowed
                    else needs_compaction(state.draft_valid, real, self.compact_fraction)):
                state.draft_valid = compact(state.draft_cache, state.draft_valid)
                self.compactions += 1


class InplaceDrafter(ModelDrafter):
    """Drafting with a draft model whose cache keeps holes, like the target's: `ModelDrafter`'s proposals
    (greedy, a chooser's, or sampled), each draft pass reading the cache through its validity mask.

    With a `chooser` (see `engines.models.bench_pair.CalibratedChooser`) each proposal is the chooser's
    token instead of the draft model's own greedy one; the draft model still runs on it."""

    def __init__(self, draft: PreTrainedModel, chooser: Chooser | None = None, shared_vocab_size: int | None = None,
                 target_vocab_size: int | None = None) -> None:
        super().__init__(draft, shared_vocab_size, chooser, target_vocab_size)
        self._valid: torch.Tensor | None = None  # [B, W'] the draft cache's mask during a step's passes
        self._filled = False

    def prefill(self, state: InplaceState) -> None:
        tokens, state.prompt_tokens = state.prompt_tokens, None  # read once, here
        assert tokens is not None
        state.draft_cache, _ = batch_ops.prefill(self.draft, tokens, state.prompt_lengths)
        state.draft_valid = ragged.padding_mask(state.prompt_lengths, tokens.shape[1])

    def _begin(self, state: InplaceState) -> None:
        assert state.draft_cache is not None and state.draft_valid is not None
        self._valid = state.draft_valid
        self._filled = False

    def _draft_pass(self, state: InplaceState, token: torch.Tensor, i: int) -> torch.Tensor:
        logits = masked_forward(self.draft, state.draft_cache, self._valid, token, state.cache_lengths + i)  # [B, 1, V]
        self._valid = append_valid(self._valid, 1, torch.ones_like(state.lengths))  # this pass's input column
        return logits

    def fill(self, state: InplaceState, accepted_counts: torch.Tensor, keep: torch.Tensor) -> None:
        """A row that accepted all k needs the k-th draft token's keys and values: one more pass."""
        assert self._proposed is not None and state.draft_valid is not None
        k = self._proposed.shape[1]
        if keep.numel() and bool((accepted_counts.index_select(0, keep) == k).any()):
            valid = append_valid(state.draft_valid, k, torch.full_like(state.lengths, k))
            masked_forward(self.draft, state.draft_cache, valid, self._proposed[:, -1:], state.cache_lengths + k)
            self._filled = True

    def commit(self, state: InplaceState, accepted_counts: torch.Tensor, keep: torch.Tensor, realign: bool = True) -> None:
        """Mark the step's draft columns: pending and accepted tokens real, the rest holes.
        `state` still describes the batch before the step; rows are selected by the engine."""
        assert self._proposed is not None and state.draft_valid is not None
        k = self._proposed.shape[1]
        valid = append_valid(state.draft_valid, k, accepted_counts + 1)
        if self._filled:
            valid = torch.cat([valid, (accepted_counts == k).unsqueeze(1)], dim=1)
        state.draft_valid = valid
        recurrent.commit(state.draft_cache, accepted_counts)  # recurrent states: after the accepted tokens
        self._proposed = None


class InplaceEngine(ConsecutiveBatches, TakesRequestParams):
    """INPLACE engine: holes instead of realignment; freed rows take the next prompts (`refill`,
    default), or consecutive fixed batches (`refill=False`). Its steps are EQSPEC's (`eqspec.start_batch`,
    `eqspec.speculative_step`) under the cache policy `HolesInPlace`."""

    name = "inplace"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        drafter: Drafter | None = None,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        compact_fraction: float = DEFAULT_COMPACT_FRACTION,
        refill: bool = True,
        refill_at: int = 1,
        **_: object,
    ) -> None:
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be at least 1")
        if drafter is None and draft is None:
            raise ValueError("INPLACE needs a draft model or a drafter")
        if isinstance(drafter, str):  # prompt lookup reads each row's tokens; INPLACE keeps only the pending one
            raise ValueError(f"INPLACE takes a draft model or a drafter object, not {drafter!r} (use eqspec or exspec)")
        if compact_fraction < 0:
            raise ValueError("compact_fraction must be >= 0")
        if refill_at < 1:
            raise ValueError("refill_at must be at least 1")
        self.target = target
        self.drafter: Drafter = drafter if drafter is not None else InplaceDrafter(
            draft, shared_vocab_size=shared_vocab_size(target, draft),
            target_vocab_size=getattr(target.config, "vocab_size", None))  # a transformers config: duck-typed
        self.batch_size = batch_size
        self.k = draft_tokens
        self.pad_id = pad_token_id if pad_token_id is not None else (target.config.pad_token_id or 0)
        self.record_logits = record_logits
        self.refill, self.refill_at = refill, refill_at  # freed rows take the next prompts (engines/inplace_refill.py)
        draft_model = self.drafter.draft
        self.cache = HolesInPlace(compact_fraction, windowed_by_column(target),
                                  draft_model is not None and windowed_by_column(draft_model))
        self.last_trace: Trace | None = None

    @property
    def compact_fraction(self) -> float:
        return self.cache.compact_fraction

    @property
    def compactions(self) -> int:
        """Cache compactions (target and draft counted apart) in the last generate."""
        return self.cache.compactions

    @property
    def proposals_from_draft_model(self) -> bool:
        return isinstance(self.drafter, InplaceDrafter) and self.drafter.chooser is None

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        self.cache.compactions = 0
        return super().generate(prompts, max_new_tokens, eos_token_id)

    def _run_all(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                 trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        if not self.refill:
            return super()._run_all(prompts, max_new_tokens, eos_token_id, trace, outputs, logits)
        from specaudit.engines.inplace_refill import run_with_refill

        run_with_refill(self, prompts, max_new_tokens, eos_token_id, trace, outputs, logits)

    def _run_batch(self, prompts: list[list[int]], rows: list[int], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                   trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        device = self.target.device
        state, result = self._start(prompts, rows, row_limits(max_new_tokens, rows, device), eos_token_id)
        self._collect(trace, result, outputs, logits)
        while state.rows:
            result = self._step(state, len(trace.steps), row_limits(max_new_tokens, state.rows, device), eos_token_id)
            self._collect(trace, result, outputs, logits)

    def _start(self, prompts: list[list[int]], rows: list[int], max_new_tokens: int | torch.Tensor,
               eos_token_id: int | Sequence[int] | None) -> tuple[InplaceState, StepResult]:
        """Prefill target and draft (EQSPEC's `start_batch`, the caches' holes kept in place)."""
        return start_batch(self.target, self.drafter, prompts, rows, self.pad_id, eos_token_id, max_new_tokens,
                           self.record_logits, requests=self.active_requests, cache=self.cache)

    def _step(self, state: InplaceState, step: int, max_new_tokens: int | torch.Tensor,
              eos_token_id: int | Sequence[int] | None) -> StepResult:
        """One speculative step (EQSPEC's `speculative_step`, the rejected columns left as holes)."""
        return speculative_step(self.target, self.drafter, state, self.k, step, eos_token_id, max_new_tokens,
                                self.pad_id, self.record_logits, cache=self.cache, requests=self.active_requests)

    _collect = staticmethod(collect)
