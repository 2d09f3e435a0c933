"""The state of one ragged batch between speculative steps, the model calls on it, and the one `generate`
shared by engines that decode their prompts in consecutive batches (`ConsecutiveBatches`).

Invariant between steps, for every row `b`: `tokens[b]` holds the row's prompt and new tokens
(right-aligned, `lengths[b]` of them); the target cache, and the draft cache when there is one,
hold the keys and values of all but the last token (`lengths[b] - 1` real columns, right-aligned);
the last token is pending: it is the first input of the next step.

An engine may keep the batch's bookkeeping on the host (`HostBook`: each row's length, and within a
step its accepted counts and the rows that go on, from the step's one read of its results): the
widths, pad lengths and realignment plans are then computed there, with no further device read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines.ops import ragged
from specaudit.engines.ops import layout
from specaudit.engines.ops import recurrent
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.contract import Capabilities
from specaudit.engines.limits import request_limits
from specaudit.engines.requests.rows import RowRequests, TakesRequestParams
from specaudit.engines.trace import Trace


@dataclass
class HostBook:
    """What the host knows of a batch without reading the device: `lengths` mirrors `BatchState.lengths`;
    within a step, after its one read, `accepted` [B] holds the rows' accepted counts and `keep` the rows
    (indices, ascending) that go on. Kept by the engine that sets it, at every change of the lengths."""

    lengths: list[int]
    accepted: list[int] | None = None
    keep: list[int] | None = None


@dataclass
class BatchState:
    rows: list[int]  # prompt index of each row
    tokens: torch.Tensor  # [B, W] right-aligned, pad placeholder on the left
    lengths: torch.Tensor  # [B] real tokens per row (prompt + new)
    prompt_lengths: torch.Tensor  # [B]
    target_cache: DynamicCache
    draft_cache: DynamicCache | None = None
    host: HostBook | None = field(default=None)  # the host's mirror of the lengths, where the engine keeps one

    @property
    def cache_lengths(self) -> torch.Tensor:  # [B]
        return self.lengths - 1

    def pad_lengths(self) -> torch.Tensor:  # [B] left padding of the target cache
        return ragged.cache_width(self.target_cache) - self.cache_lengths

    def pad_length_list(self) -> list[int]:
        """`pad_lengths()` on the host: from the host's lengths where it keeps them, else one read."""
        if self.host is None:
            return self.pad_lengths().tolist()
        width = ragged.cache_width(self.target_cache)
        return [width - (n - 1) for n in self.host.lengths]

    def append(self, tokens: torch.Tensor, emitted: torch.Tensor, emitted_list: list[int], pad_id: int) -> None:
        """Each row's first `emitted[b]` tokens of `tokens` [B, K+1] appended, right-aligned again (`emitted_list`:
        the same counts, read); the host's lengths follow, so the new width needs no device read."""
        grown = [n + e for n, e in zip(self.host.lengths, emitted_list)] if self.host is not None else None
        self.tokens, self.lengths = ragged.append_and_repad(self.tokens, self.lengths, tokens, emitted, pad_id,
                                                            max(grown) if grown else None)
        if self.host is not None and grown is not None:
            self.host.lengths = grown

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (indices, ascending), caches included, between steps."""
        if keep.numel() == self.lengths.numel():
            return
        if keep.numel() == 0:
            self.rows = []
            return
        cache_lengths = self.cache_lengths.index_select(0, keep)
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None and layout.is_row_ends(cache):
                layout.settle_rows(cache, cache_lengths, keep)
            elif cache is not None:
                keep_end = torch.full_like(cache_lengths, ragged.cache_width(cache))
                realign_with_room(cache, keep_end, cache_lengths, rows=keep)
                recurrent.select_rows(cache, keep)
        self.select(keep)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (indices, ascending) of the tokens; trims surplus padding.
        The caches are left to the caller (`realign_cache` takes the same `keep`). With a `HostBook`,
        `keep` is its `keep` and the lengths are selected on the host too (no device read)."""
        keep_list = self.host.keep if self.host is not None and self.host.keep is not None else keep.tolist()
        self.rows = [self.rows[i] for i in keep_list]
        self.lengths = self.lengths.index_select(0, keep)
        self.prompt_lengths = self.prompt_lengths.index_select(0, keep)
        if self.host is not None:
            self.host.lengths = [self.host.lengths[i] for i in keep_list]
            self.host.accepted = self.host.keep = None
            width = max(self.host.lengths, default=0)
        else:
            width = int(self.lengths.max().item()) if keep_list else 0
        self.tokens = self.tokens.index_select(0, keep)[:, self.tokens.shape[1] - width:]


def forward(
    model: PreTrainedModel,
    cache: DynamicCache,
    inputs: torch.Tensor,  # [B, q] tokens after each row's cache
    cache_lengths: torch.Tensor,  # [B] real cached positions per row
    real_counts: torch.Tensor | None = None,  # [B] each row's first tokens that are real (the rest: pad ids)
) -> torch.Tensor:
    """One cached forward pass of `q` tokens per row; returns logits [B, q, V]. A row's tokens past its
    `real_counts` are padding: rejected like draft tokens, and kept out of its recurrent states."""
    width = ragged.cache_width(cache)
    q = inputs.shape[1]
    positions = ragged.position_ids(cache_lengths, q)  # [B, q]
    if layout.is_row_ends(cache):  # each row writes at its own end; a per-query mask
        end = int(cache_lengths.max()) + q  # the pass's one host read, for every layer and the mask
        for layer in cache.layers:
            layer.write_at, layer.write_end = cache_lengths, end
        mask = layout.row_ends_mask(model, cache_lengths, q, end)  # [B, 1, q, max(c) + q]
        return cached_forward(model, cache, input_ids=inputs, attention_mask=mask, position_ids=positions).logits
    mask = ragged.attention_mask(cache_lengths, width, q)  # [B, W + q]
    layout.spare_columns(cache)  # new columns written in place, not the cache copied
    if recurrent.tracks_states(cache):  # per-position recurrent states, for the rollback
        return recurrent.forward_by_token(model, cache, inputs, mask, positions, real_counts)
    return cached_forward(model, cache, input_ids=inputs, attention_mask=mask, position_ids=positions).logits


# A pass's fixed cost (reading every weight once), in prompt tokens: a prefill group pays it once and
# every padded token slot besides. Groups of prompts of near-equal length come from minimising
# groups x PASS_OVERHEAD_TOKENS + padded token slots (`prefill_groups`).
PASS_OVERHEAD_TOKENS = 64


def prefill(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor,
            grouped: bool = True) -> tuple[DynamicCache, torch.Tensor]:
    """Run a left-padded batch of prompts through `model`.

    Returns the cache (each row's prompt, right-aligned, padding zeroed) and the logits at each
    row's last prompt token [B, V].

    Prompts are prefilled in groups of near-equal length (`prefill_groups`), each group left-padded
    only to its own longest prompt, and the group caches are placed into one right-aligned cache:
    one pass over prompts of 20 and 900 tokens would spend 880 padded token slots in every layer.
    `grouped=False` runs the whole batch in one padded pass (as an engine without grouping does).

    A padding query may attend to no key at all. With eager attention in float64 (a float mask at
    the dtype's minimum, softmax upcast to float32: -inf everywhere) its output is NaN, and a NaN
    value times a zero attention weight poisons the real rows in every later layer. When a padded
    group's pass yields anything non-finite, it is prefilled again in groups of equal length (no
    padding at all). A model with recurrent layers is always prefilled that way: a pad token must
    never enter a recurrent state.
    """
    if "recurrent" in layout.attention_layer_kinds(model):
        return _prefill_by_length(model, tokens, lengths)
    groups = prefill_groups(lengths.tolist()) if grouped else [list(range(len(lengths)))]
    if len(groups) == 1:
        cache, last_logits = _prefill_padded(model, tokens, lengths)
        if _all_finite(cache, last_logits):
            return cache, last_logits
        return _prefill_by_length(model, tokens, lengths)
    return _prefill_groups(model, tokens, lengths, groups, exact_lengths=False)


def prefill_groups(lengths: list[int], overhead: int = PASS_OVERHEAD_TOKENS) -> list[list[int]]:
    """Rows (indices into `lengths`) in groups of near-equal length that minimise `overhead` per group
    plus the padded token slots of each group (group size x its longest prompt): a partition of the
    rows sorted by length into runs, by dynamic programming over the B + 1 cut points."""
    order = sorted(range(len(lengths)), key=lambda row: lengths[row])
    best = [0.0] + [float("inf")] * len(order)  # best[j]: cost of the first j rows in order
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):  # rows order[i:j] form the last group; its longest is order[j - 1]
            cost = best[i] + overhead + (j - i) * lengths[order[j - 1]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def _prefill_padded(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor,
                    room: bool = True) -> tuple[DynamicCache, torch.Tensor]:
    """One padded pass; the cache gets spare columns for the next passes unless `room` is False (a
    group's cache, copied into the batch's)."""
    width = tokens.shape[1]
    pad = width - lengths  # [B]
    positions = (torch.arange(width, device=tokens.device).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
    cache = layout.full_history_cache(model)  # sliding layers too: the mask applies the window
    out = cached_forward(
        model,
        cache,
        input_ids=tokens,
        attention_mask=ragged.padding_mask(lengths, width).long(),
        position_ids=positions,
        **layout.last_logits_only(model),
    )
    # zero the padding columns, so that nothing a padded query produced is ever read
    if room:
        realign_with_room(cache, torch.full_like(lengths, width), lengths)
    else:
        ragged.realign_cache(cache, torch.full_like(lengths, width), lengths)
    return cache, out.logits[:, -1]


def _all_finite(cache: DynamicCache, logits: torch.Tensor) -> bool:
    checks = [torch.isfinite(logits).all()]
    for layer in ragged.cache_layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            checks += [torch.isfinite(layer.keys).all(), torch.isfinite(layer.values).all()]
    return bool(torch.stack(checks).all())  # one host sync


def _prefill_by_length(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """`prefill` without padding: one pass per distinct prompt length (a loop over lengths, not rows)."""
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(lengths.tolist()):
        groups.setdefault(n, []).append(row)
    return _prefill_groups(model, tokens, lengths, list(groups.values()), exact_lengths=True)


def _prefill_groups(model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor, groups: list[list[int]],
                    exact_lengths: bool) -> tuple[DynamicCache, torch.Tensor]:
    """One padded pass per group of rows (each left-padded to its own longest prompt), the group caches
    placed into one cache of the batch's width, right-aligned. A group whose padded pass is not finite
    is prefilled again by equal lengths (`exact_lengths`: every group already has one length)."""
    width = tokens.shape[1]
    cache = layout.full_history_cache(model)
    last_logits: torch.Tensor | None = None
    for rows in groups:
        index = torch.tensor(rows, dtype=torch.long, device=tokens.device)
        group_lengths = lengths.index_select(0, index)
        n = int(group_lengths.max().item())
        group_tokens = tokens.index_select(0, index)[:, width - n:]  # [g, n], padded to the group's longest
        group_cache, group_last = _prefill_padded(model, group_tokens, group_lengths, room=False)
        if not exact_lengths and not _all_finite(group_cache, group_last):
            group_cache, group_last = _prefill_by_length(model, group_tokens, group_lengths)
        if last_logits is None:
            last_logits = group_last.new_zeros(tokens.shape[0], group_last.shape[-1])  # [B, V]
            room = width + layout.spare_width(width)  # spare columns for the next passes
            for layer, source in zip(ragged.cache_layers(cache), ragged.cache_layers(group_cache)):
                b, h, _, d = source.keys.shape
                layout.hold_columns(layer, source.keys.new_zeros(tokens.shape[0], h, room, d),  # [B, H, W + spare, D]
                                    source.values.new_zeros(tokens.shape[0], h, room, source.values.shape[-1]), width)
        last_logits[index] = group_last
        recurrent.place_rows(cache, group_cache, index, tokens.shape[0])
        for layer, source in zip(ragged.cache_layers(cache), ragged.cache_layers(group_cache)):
            layer.keys[index, :, width - n:] = source.keys
            layer.values[index, :, width - n:] = source.values
    assert last_logits is not None
    return cache, last_logits


def realign(cache: DynamicCache, old_width: int, accepted_counts: torch.Tensor, cache_lengths: torch.Tensor,
            keep: torch.Tensor, host: HostBook | None = None) -> None:
    """After a step that appended columns from `old_width` on: keep, for each kept row, its old
    cache plus its pending token and accepted draft tokens (`accepted_counts + 1` columns). With the
    step's `HostBook` (its accepted counts and kept rows read), the plan is made on the host."""
    if layout.is_row_ends(cache):  # rejected columns lie past each row's new end: nothing moves
        layout.settle_rows(cache, (cache_lengths + accepted_counts + 1).index_select(0, keep), keep)
        return
    recurrent.commit(cache, accepted_counts, keep)  # each kept row's state after its accepted tokens
    if host is not None and host.accepted is not None and host.keep is not None:  # the same plan, on the host
        accepted, rows = host.accepted, host.keep
        keep_end = [old_width + accepted[i] + 1 for i in rows]
        new_lengths = [host.lengths[i] - 1 + accepted[i] + 1 for i in rows]  # cached + pending + accepted
        realign_with_room(cache, keep_end, new_lengths, rows=rows)
        return
    keep_end = (old_width + accepted_counts + 1).index_select(0, keep)
    new_lengths = (cache_lengths + accepted_counts + 1).index_select(0, keep)
    realign_with_room(cache, keep_end, new_lengths, rows=keep)


def realign_with_room(cache: DynamicCache, keep_end: torch.Tensor | list[int], new_lengths: torch.Tensor | list[int],
                      rows: torch.Tensor | list[int] | None = None) -> None:
    """`ragged.realign_cache` into buffers with spare columns that the next passes write into (one
    copy of the cache per step, not a second one into a roomier buffer at the next pass). The plan
    as lists (an engine that keeps its lengths on the host) costs no device read."""
    if isinstance(new_lengths, torch.Tensor):
        spare = layout.spare_width(int(new_lengths.max())) if new_lengths.numel() else 0
    else:
        spare = layout.spare_width(max(new_lengths)) if new_lengths else 0
    ragged.realign_cache(cache, keep_end, new_lengths, rows=rows, spare=spare, hold=layout.hold_columns)


class ConsecutiveBatches(Capabilities):
    """`generate` for engines that decode prompts in consecutive batches of `batch_size`.

    A subclass sets `batch_size`, `k`, `record_logits` and implements `_run_batch`, which appends
    each row's new tokens to `outputs[row]`, its logits [n, V] to `logits[row]` when recorded, and
    its steps to `trace`. A subclass that also derives from `TakesRequestParams` takes request
    parameters: `active_requests` holds the call's (None: plain greedy requests), which `_run_batch`
    hands to the acceptance rule.
    """

    batch_size: int
    k: int
    record_logits: bool
    last_trace: Trace | None
    active_requests: RowRequests | None = None

    def _run_batch(self, prompts: list[list[int]], rows: list[int], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                   trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        raise NotImplementedError

    def _run_all(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                 trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        """Every prompt, in consecutive batches of `batch_size` (an engine that refills rows overrides it)."""
        for start in range(0, len(prompts), self.batch_size):
            rows = list(range(start, min(start + self.batch_size, len(prompts))))
            self._run_batch(prompts, rows, max_new_tokens, eos_token_id, trace, outputs, logits)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        trace = Trace(num_prompts=len(prompts), draft_tokens=self.k,
                      proposals_from_draft_model=self.proposals_from_draft_model)
        outputs: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        if not isinstance(max_new_tokens, int):
            max_new_tokens = request_limits(max_new_tokens, len(prompts))
        if isinstance(self, TakesRequestParams):
            self.active_requests = self.row_requests(prompts, eos_token_id)
        if self.active_requests is not None:  # each request's own max_tokens
            max_new_tokens = self.active_requests.budgets(max_new_tokens)
        if not isinstance(max_new_tokens, int) or max_new_tokens > 0:
            self._run_all(prompts, max_new_tokens, eos_token_id, trace, outputs, logits)
        if self.record_logits:
            trace.logits = [torch.cat(parts) if parts else None for parts in logits]
        self.last_trace = trace
        return outputs
