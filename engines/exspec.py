"""EXSPEC: a sliding window over a pool of requests, stepped in same-length groups.

Contract: the same as EQSPEC (token ids in, exactly the tokens of greedy decoding out). Requests
wait in a FIFO pool; at most `window_size` of them are active at once. Each active sequence owns
its target and draft KV caches between steps, `n - 1` columns per layer and model (`n` = its token
count; the last token is pending, as in `engines/batch.py`), as views of the batch cache it was
cut from (`exspec_cache.RowKV`), copied once into the next batch it joins. Each call of
`ExspecPool.step` does one unit of work:

- refill:   when the window has room for a refill batch, the oldest waiting requests are
            prefilled together (`start_batch`) and enter the window;
- group:    otherwise, up to `batch_size` active sequences of the same length are stacked into
            one buffer per layer (no padding), one speculative step runs on them, and each
            sequence's new cache is cut out of the verify pass's cache with a slice (no realignment);
- fallback: otherwise up to `batch_size` sequences of the closest lengths form a padded batch
            (held: see `hold` below) and one speculative step runs on it.

Finished sequences (EOS, `max_new_tokens`, or `ExspecPool.finish`) leave the window, answered under
their request id. `EXSpec.generate` admits every prompt and steps the pool until it is empty.

Policy, chosen by measurement (`ExspecPool(min_group=..., refill_at=...)` overrides it):

- group when some length is shared by at least `min_group = B` active sequences (the shortest
  such length first, its oldest B); otherwise fall back on the B sequences whose lengths are
  closest (the shortest such run on ties): a group never trades rows for the lack of padding.
- window `W = B + ceil(B / 2)`; refill when it has room for `refill_at` sequences (or for all that
  still wait, or when it is empty), at most B per prefill: `refill_at = B` when W >= 2B, else `ceil(B / 2)`.
- `hold` (default): a padded batch is kept after its step, caches included, finished rows leaving
  it; while no full same-length group exists it runs again, the oldest other sequences of the window
  joining it in its free rows (`exspec_cache.join_rows`). Where every layer is full attention its
  caches grow at each row's own end (`layout.RowEndsLayer`): a step, a leaving row or a joining row
  copies nothing but the rows that move; otherwise (sliding windows, recurrent layers) it is
  realigned as in EQSPEC. A sequence's caches are cut out only when it leaves the held batch.
  Without `hold`: `fallback="realign"` (EQSPEC's realignment) or `"masked"` (each row cut out of
  the verify pass's cache, its left padding masked until the next stack). `wait_steps`: run the
  largest same-length group (2 rows or more) for at most this many steps before falling back.

The measurements behind this policy: reports/bench/README.md. Every step records its kind ("prefill",
"group", "fallback"), rows, padding and stage seconds ("stack", "draft", "verify", "realign", "unstack").
EXSPEC runs this algorithm on every device; the fixed-shape loop is its own engine (`fixedshape`,
engines/static/engine.py).
"""

from __future__ import annotations

import math
from collections import deque

import torch
from transformers import PreTrainedModel

from specaudit.engines.ops import layout, ragged, recurrent
from specaudit.engines.batch import BatchState
from specaudit.engines.contract import request_limits
from specaudit.engines.limits import EosIds
from specaudit.engines.drafters import Drafter, ModelDrafter, make_drafter
from specaudit.engines.eqspec import Clock, Realign, StepResult, speculative_step, start_batch
from specaudit.engines.requests.rows import RowRequests, TakesRequestParams
from specaudit.engines.exspec_cache import RowKV, Sequence, held_spans, join_rows, joinable, stack_cache, unstack_cache
from specaudit.engines.trace import StepRecord, Trace

FALLBACKS = ("realign", "masked")  # a padded fallback batch: realigned after the step, or cut out with its padding masked
DEFAULT_FALLBACK = "realign"
DEFAULT_HOLD = True  # keep a realigned padded batch while the next group is the same sequences


class ExspecPool:
    """The request pool and its window; `EXSpec.generate` and the property tests drive it."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter,
        *,
        batch_size: int,
        draft_tokens: int,
        window_size: int,
        max_new_tokens: int,
        eos_token_id: EosIds,
        pad_id: int,
        record_logits: bool = False,
        min_group: int | None = None,
        refill_at: int | None = None,
        fallback: str = DEFAULT_FALLBACK,
        wait_steps: int = 0,
        hold: bool = DEFAULT_HOLD,
        requests: RowRequests | None = None,
    ) -> None:
        if batch_size < 1 or draft_tokens < 1 or window_size < 1 or max_new_tokens < 1:
            raise ValueError("batch_size, draft_tokens, window_size and max_new_tokens must be at least 1")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
        if wait_steps < 0:
            raise ValueError("wait_steps must be at least 0")
        self.fallback, self.wait_steps, self.hold = fallback, wait_steps, hold
        self._held: tuple[BatchState, list[Sequence]] | None = None  # a realigned batch and its sequences, in row order
        self._waited = 0  # steps run on a partial same-length group since the last full one
        self.target, self.drafter = target, drafter
        self.batch_size, self.k, self.window_size = batch_size, draft_tokens, window_size
        self.max_new_tokens, self.eos_token_id, self.pad_id = max_new_tokens, eos_token_id, pad_id
        self.record_logits = record_logits
        self.requests = requests  # request parameters by request id (engines/requests/rows.py), None: plain greedy
        self.min_group = min_group if min_group is not None else batch_size
        default_refill = batch_size if window_size >= 2 * batch_size else math.ceil(batch_size / 2)
        self.refill_at = refill_at if refill_at is not None else default_refill
        self.prompts: dict[int, list[int]] = {}
        self.waiting: deque[int] = deque()  # request ids, oldest first
        self.window: list[Sequence] = []  # active sequences, in order of entry
        self.finished: dict[int, list[int]] = {}  # request id -> new tokens, in order of finishing
        self.logits: dict[int, torch.Tensor | None] = {}  # request id -> [new tokens, V] (record_logits)
        self.records: list[StepRecord] = []
        self.limits: dict[int, int] = {}  # request id -> its own max_new_tokens, where it differs

    def _budgets(self, request_ids: list[int]) -> int | torch.Tensor:
        """The pool's budget, or `[G]` per request when some request has its own."""
        if not self.limits:
            return self.max_new_tokens
        return torch.tensor([self.limits.get(r, self.max_new_tokens) for r in request_ids], dtype=torch.long,
                            device=self.target.device)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.window)

    def admit(self, prompt: list[int], request_id: int | None = None, max_new_tokens: int | None = None) -> int:
        """Queue a request (with its own budget of new tokens, else the pool's); returns its id (the
        next free integer unless given)."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError("a request's max_new_tokens must be at least 1")
        request_id = request_id if request_id is not None else max(self.prompts, default=-1) + 1
        if request_id in self.prompts:
            raise ValueError(f"request id {request_id} was already admitted")
        self.prompts[request_id] = list(prompt)
        if max_new_tokens is not None and max_new_tokens != self.max_new_tokens:
            self.limits[request_id] = max_new_tokens
        self.waiting.append(request_id)
        return request_id

    def finish(self, request_id: int) -> None:
        """End a request now: it leaves the queue or the window, answered with the tokens it has."""
        if request_id in self.waiting:
            self.waiting.remove(request_id)
            self.finished[request_id] = []
            self.logits[request_id] = None
            return
        sequence = next((s for s in self.window if s.request_id == request_id), None)
        if sequence is None:
            raise KeyError(f"request {request_id} is neither waiting nor active")
        self._release()
        self.window.remove(sequence)
        self._answer(sequence)

    def step(self) -> StepRecord | None:
        """One unit of work (refill, group step or fallback step); None when the pool is empty."""
        room = self.window_size - len(self.window)
        if self.waiting and room > 0 and (room >= min(self.refill_at, len(self.waiting)) or not self.window):
            return self._refill(min(room, self.batch_size, len(self.waiting)))
        if not self.window:
            return None
        return self._speculate(self._choose())

    def _choose(self) -> list[Sequence]:
        """The largest same-length group (shortest length on ties), its oldest `batch_size`
        sequences, if it has `min_group`; else the `batch_size` sequences of the closest lengths."""
        groups: dict[int, list[Sequence]] = {}
        for sequence in self.window:
            groups.setdefault(sequence.length, []).append(sequence)
        largest = max(groups.values(), key=lambda g: (min(len(g), self.batch_size), -g[0].length))
        if min(len(largest), self.batch_size) >= self.min_group:
            self._waited = 0
            return largest[: self.batch_size]
        if self._held is not None and joinable(self._held[0]):  # keep the held batch; the oldest others join it
            held = self._held[1]
            others = [s for s in self.window if all(s is not h for h in held)]
            return held + others[: self.batch_size - len(held)]
        if len(largest) >= 2 and self._waited < self.wait_steps:  # wait for a full group, a bounded number of steps
            self._waited += 1
            return largest
        self._waited = 0
        by_length = sorted(self.window, key=lambda s: s.length)
        size = min(self.batch_size, len(by_length))
        start = min(range(len(by_length) - size + 1), key=lambda i: by_length[i + size - 1].length - by_length[i].length)
        return by_length[start : start + size]

    def _refill(self, count: int) -> StepRecord:
        """Prefill the `count` oldest waiting requests together; they enter the window."""
        ids = [self.waiting.popleft() for _ in range(count)]
        state, result = start_batch(self.target, self.drafter, self.prompts, ids, self.pad_id, self.eos_token_id,
                                    self._budgets(ids), self.record_logits, requests=self.requests)
        clock = Clock(self.target.device)
        entered = [Sequence(rid, self.prompts[rid] + result.emitted[b], len(self.prompts[rid]), None, None)
                   for b, rid in enumerate(ids)]
        self._keep_logits(entered, result)
        by_id = {s.request_id: s for s in entered}
        if state.rows:
            width = ragged.cache_width(state.target_cache)
            cache_lengths = state.cache_lengths.tolist()
            self._cut_caches(state, [by_id[r] for r in state.rows], list(range(len(state.rows))),
                             [width - c for c in cache_lengths], [width] * len(cache_lengths))
        for sequence in entered:
            if sequence.request_id in result.finished:
                self._answer(sequence)
            else:
                self.window.append(sequence)
        result.record.seconds["unstack"] = clock.lap()
        return self._record(result)

    def caches(self, sequence: Sequence) -> tuple[RowKV | None, RowKV | None]:
        """A sequence's target and draft caches (`n - 1` columns): its own, or cut out of the held batch."""
        if self._held is None or not any(s is sequence for s in self._held[1]):
            return sequence.target_kv, sequence.draft_kv
        state, held = self._held
        row = next(i for i, s in enumerate(held) if s is sequence)
        starts, ends = held_spans(state, [sequence])
        cut = [unstack_cache(cache, [row], starts, ends)[0] if cache is not None else None
               for cache in (state.target_cache, state.draft_cache)]
        return cut[0], cut[1]

    def _release(self) -> None:
        """Cut every sequence of the held batch out of it (right-aligned, realigned), and hold nothing."""
        if self._held is not None:
            state, sequences = self._held
            self._cut_caches(state, sequences, list(range(len(sequences))), *held_spans(state, sequences))
            self._held = None

    def _speculate(self, group: list[Sequence]) -> StepRecord:
        """One speculative step on `group`: a same-length group, or a padded fallback batch."""
        clock = Clock(self.target.device)
        device = self.target.device
        same_length = len({s.length for s in group}) == 1
        hold = self.hold and not same_length

        # 1. stack: tokens [G, n] (left-padded when lengths differ) and both caches, one stack per model;
        #    or the held batch as it is, when it holds exactly these sequences
        held_ids = {id(s) for s in self._held[1]} if self._held is not None else set()
        if self._held is not None and held_ids == {id(s) for s in group}:
            (state, group), self._held = self._held, None
        elif self._held is not None and held_ids < {id(s) for s in group} and joinable(self._held[0]):
            (state, held), self._held = self._held, None
            newcomers = [s for s in group if id(s) not in held_ids]
            join_rows(state, newcomers, self.target, self.drafter, self.pad_id)
            group = held + newcomers
        else:
            self._release()
            tokens, lengths = ragged.left_pad([s.tokens for s in group], self.pad_id, device)
            prompt_lengths = torch.tensor([s.prompt_length for s in group], dtype=torch.long, device=device)
            # a batch that will be held grows at its rows' own ends (`layout.RowEndsLayer`), when the models allow;
            # its buffers have the columns the longest request admitted can need
            ends = hold and layout.row_ends_supported(self.target, self.drafter.draft)
            room = dict(row_ends=ends, rows=self.batch_size, columns=max(map(len, self.prompts.values())) + self.max_new_tokens + self.k + 1)
            state = BatchState([s.request_id for s in group], tokens, lengths, prompt_lengths,
                               stack_cache(self.target, [s.target_kv for s in group], **room))
            recurrent.load_rows(state.target_cache, [s.target_states for s in group])
            if group[0].draft_kv is not None:
                state.draft_cache = stack_cache(self.drafter.draft, [s.draft_kv for s in group], **room)
                recurrent.load_rows(state.draft_cache, [s.draft_states for s in group])
        old_lengths = [s.length for s in group]
        stack_seconds = clock.lap()

        # 2. speculate: draft, verify, accept; a group keeps its caches as the verify pass left them
        result = speculative_step(self.target, self.drafter, state, self.k, len(self.records), self.eos_token_id,
                                  self._budgets(state.rows), self.pad_id, self.record_logits,
                                  kind="group" if same_length else "fallback",
                                  cache=Realign(caches=hold or (not same_length and self.fallback == "realign")),
                                  requests=self.requests)
        clock.lap()

        # 3. unstack: append the new tokens; hold the batch, or cut each running sequence's caches out of it
        for sequence, new_tokens in zip(group, result.emitted):
            sequence.tokens.extend(new_tokens)
        self._keep_logits(group, result)
        running = [b for b, s in enumerate(group) if s.request_id not in result.finished]
        if hold and running:  # realigned: the running rows, in the batch's new order; their caches live there
            by_id = {s.request_id: s for s in group}
            self._held = (state, [by_id[r] for r in state.rows])
            for sequence in self._held[1]:
                sequence.target_kv = sequence.draft_kv = None  # no view keeps the batch they came from alive
        elif same_length:  # row b: columns 0 .. n + accepted, where the verify pass left them
            ends = [old_lengths[b] + result.record.accepted_counts[b] for b in running]
            self._cut_caches(state, [group[b] for b in running], running, [0] * len(running), ends)
        elif running and self.fallback == "masked":
            self._cut_masked(state, group, running, old_lengths, result.record.accepted_counts)
        elif running:  # realigned: the running rows, right-aligned, in batch order
            width = ragged.cache_width(state.target_cache)
            starts = [width - group[b].length + 1 for b in running]
            self._cut_caches(state, [group[b] for b in running], list(range(len(running))), starts, [width] * len(running))
        for sequence in group:
            if sequence.request_id in result.finished:
                self.window.remove(sequence)
                self._answer(sequence)
        result.record.seconds["stack"] = stack_seconds
        result.record.seconds["unstack"] = clock.lap()
        return self._record(result)

    def _cut_masked(self, state: BatchState, group: list[Sequence], running: list[int], old_lengths: list[int],
                    accepted_counts: list[int]) -> None:
        """A padded batch left as the verify pass made it: row b's columns run from the end of its
        left padding (`width - (n_b - 1)`, `width` = the stacked cache's width before the step) through
        its pending and accepted tokens (`width + accepted_b + 1`), one slice per row."""
        width = max(old_lengths) - 1
        starts = [width - (old_lengths[b] - 1) for b in running]
        ends = [width + accepted_counts[b] + 1 for b in running]
        self._cut_caches(state, [group[b] for b in running], running, starts, ends)

    def _cut_caches(self, state: BatchState, sequences: list[Sequence], rows: list[int], starts: list[int], ends: list[int]) -> None:
        for sequence, kv, states in zip(sequences, unstack_cache(state.target_cache, rows, starts, ends),
                                        recurrent.row_states(state.target_cache, rows)):
            sequence.target_kv, sequence.target_states = kv, states
        if state.draft_cache is not None:
            for sequence, kv, states in zip(sequences, unstack_cache(state.draft_cache, rows, starts, ends),
                                            recurrent.row_states(state.draft_cache, rows)):
                sequence.draft_kv, sequence.draft_states = kv, states

    def _keep_logits(self, sequences: list[Sequence], result: StepResult) -> None:
        if result.logits is not None:
            for sequence, logits in zip(sequences, result.logits):
                sequence.logits.append(logits)

    def _answer(self, sequence: Sequence) -> None:
        self.finished[sequence.request_id] = sequence.tokens[sequence.prompt_length:]
        self.logits[sequence.request_id] = torch.cat(sequence.logits) if sequence.logits else None

    def _record(self, result: StepResult) -> StepRecord:
        result.record.step = len(self.records)
        self.records.append(result.record)
        return result.record


class EXSpec(TakesRequestParams):
    """EXSPEC engine: all prompts go through one `ExspecPool` with a window of `window_size`."""

    name = "exspec"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        window_size: int | None = None,
        sort_by_length: bool = False,
        drafter: Drafter | str | None = None,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        min_group: int | None = None,
        refill_at: int | None = None,
        fallback: str = DEFAULT_FALLBACK,
        wait_steps: int = 0,
        hold: bool = DEFAULT_HOLD,
        **_: object,
    ) -> None:
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be at least 1")
        if drafter is None and draft is None:
            raise ValueError("EXSPEC needs a draft model or a drafter")
        layout.check_supported(target, "target")  # one line naming what is missing, before any run
        self.target = target
        self.drafter = make_drafter(drafter, target, draft)
        self.batch_size = batch_size
        self.k = draft_tokens
        # W = 1.5 B: room for the next refill of B / 2 while a full batch runs (2 B: more memory, slower)
        self.window_size = window_size if window_size is not None else batch_size + math.ceil(batch_size / 2)
        if self.window_size < 1:
            raise ValueError("window_size must be at least 1")
        self.sort_by_length = sort_by_length
        self.pad_id = pad_token_id if pad_token_id is not None else (target.config.pad_token_id or 0)
        self.record_logits = record_logits
        self.min_group, self.refill_at, self.fallback, self.wait_steps, self.hold = min_group, refill_at, fallback, wait_steps, hold
        self.last_trace: Trace | None = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: EosIds) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        limits = None if isinstance(max_new_tokens, int) else request_limits(max_new_tokens, len(prompts))
        requests = self.row_requests(prompts, eos_token_id)
        if requests is not None:  # each request's own max_tokens
            limits = requests.budgets(max_new_tokens)
        if limits is not None:
            max_new_tokens = max(limits, default=1)
        trace = Trace(num_prompts=len(prompts), draft_tokens=self.k,
                      proposals_from_draft_model=isinstance(self.drafter, ModelDrafter))
        if max_new_tokens <= 0 or not prompts:
            self.last_trace = trace
            return [[] for _ in prompts]
        pool = ExspecPool(
            self.target, self.drafter, batch_size=self.batch_size, draft_tokens=self.k,
            window_size=self.window_size, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
            pad_id=self.pad_id, record_logits=self.record_logits, min_group=self.min_group, refill_at=self.refill_at,
            fallback=self.fallback, wait_steps=self.wait_steps, hold=self.hold, requests=requests,
        )
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if self.sort_by_length else range(len(prompts))
        for i in order:
            pool.admit(prompts[i], request_id=i, max_new_tokens=limits[i] if limits is not None else None)
        while pool.busy:
            pool.step()
        for record in pool.records:
            trace.record(record)
        if self.record_logits:
            trace.logits = [pool.logits[i] for i in range(len(prompts))]
        self.last_trace = trace
        return [pool.finished[i] for i in range(len(prompts))]
