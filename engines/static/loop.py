"""The speculative loop of the fixed-shape engine: one host read per step.

Contract: the engines' (token ids in, exactly the tokens of greedy decoding of each prompt alone out,
first EOS id kept, never more than the row's budget). A loop has `B` slots of `L` columns (a length
bucket) and lives as long as its engine: its buffers and prepared passes serve every `generate` call
that needs that (B, L) (`reset` starts a call). A slot holds a request until it finishes and is then
refilled (`refill=True`) or left idle until every slot is done (consecutive batches). Per-slot state lives on the device (`lengths[B]`, the pending token, the
token before it, new tokens so far, the budget, running or not); the host mirrors only which request
each slot holds. Each step, for every slot (idle ones computed and masked out of every update):

1. draft:   the draft model feeds [the token before the pending one, the pending token] at c - 1 (so
            its cache holds every accepted token, the k-th draft token of a fully accepted step
            included) and then proposes k tokens greedily                              # [B, k]
2. verify:  one target pass over [pending token, k draft tokens], written at c         # [B, k+1, V]
3. accept:  `engines/acceptance.py`: the accepted draft tokens, then the recovered or bonus token,
            cut at the first EOS id or the budget
4. read:    one transfer to the host of accepted, emitted, done, the target's tokens and the proposals
5. advance: c += accepted + 1 on running slots; pending = bonus; previous = the last accepted token

Rejected draft tokens need no trimming: their columns lie past the row's new end, masked, and the next
pass writes over them. Every pass has one shape per (B, q, L) (`capture.PassRunner` prepares it once and
replays it, as a CUDA graph on a GPU); the prefill of new requests is one eager pass per refill.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines import acceptance
from specaudit.engines.drafters import DraftVocabularyError, shared_vocab_size
from specaudit.engines.limits import EosIds
from specaudit.engines.requests.rows import RowRequests, StepRequests
from specaudit.engines.static.cache import StaticCache
from specaudit.engines.static.capture import Capture, PassRunner, eager
from specaudit.engines.trace import StepRecord, Trace


class StageClock:
    """Stage seconds without a host sync: CUDA events read after the step's one transfer; wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """The spans between consecutive marks (after the step's read, when every event has completed)."""
        if self.cuda:
            self.marks[-1].synchronize()  # the last mark was recorded after the step's read: wait for it
            spans = [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return spans


@dataclass
class Slots:
    """Per-slot state on the device (all [B])."""

    pending: torch.Tensor  # the last emitted token, not cached yet
    previous: torch.Tensor  # the token before it (cached at column c - 1)
    generated: torch.Tensor  # new tokens so far, the pending one included
    budget: torch.Tensor  # max new tokens of the slot's request
    running: torch.Tensor  # bool


class StaticLoop:
    """`batch_size` slots of `columns` columns on fixed-shape target and draft caches, for an engine's lifetime."""

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None, *, batch_size: int, k: int, columns: int,
                 capture: Capture = eager, pool: Any = None) -> None:
        self.k, self.columns = k, columns
        self.eos: EosIds = None
        self.record_logits, self.chooser = False, None
        self.row_requests: RowRequests | None = None  # the call's request parameters (None: plain greedy)
        self.device = target.device
        self.target = StaticCache(target, batch_size, columns)
        self.target_pass = PassRunner(self.target, "target", capture, pool)
        self.draft = StaticCache(draft, batch_size, columns) if draft is not None and k else None  # None: plain decoding
        self.draft_pass = PassRunner(self.draft, "draft", capture, pool) if self.draft is not None else None
        self.shared = shared_vocab_size(target, draft) or int(target.config.vocab_size)
        self.draft_vocab = int(getattr(getattr(draft, "config", None), "vocab_size", self.shared))
        zeros = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.slots = Slots(zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone(), zeros.bool())
        self.requests: list[int | None] = [None] * batch_size  # the request each slot holds (host mirror)
        self.request_ids = torch.full((batch_size,), -1, dtype=torch.long, device=self.device)  # the same, on the device
        self.clock = StageClock(self.device)

    def reset(self, eos_token_id: EosIds, record_logits: bool, chooser: Any = None,
              row_requests: RowRequests | None = None) -> None:
        """Start a `generate` call: every slot free and empty; the buffers and prepared passes stay."""
        self.eos, self.record_logits, self.chooser = eos_token_id, record_logits, chooser
        self.row_requests = row_requests
        for tensor in (self.slots.pending, self.slots.previous, self.slots.generated, self.slots.budget,
                       self.target.lengths, *([self.draft.lengths] if self.draft is not None else [])):
            tensor.zero_()
        self.slots.running.zero_()
        self.request_ids.fill_(-1)
        self.requests = [None] * len(self.requests)

    @property
    def captures(self) -> Counter[tuple[str, int, int, int]]:
        """Preparations per pass shape (role, B, q, L) over the loop's lifetime."""
        runners = [self.target_pass, *([self.draft_pass] if self.draft_pass is not None else [])]
        return sum((r.captures for r in runners), Counter())

    @torch.no_grad()
    def admit(self, slots: list[int], requests: list[int], prompts: Sequence[Sequence[int]],
              budgets: list[int]) -> tuple[list[int], list[bool], list[torch.Tensor] | None]:
        """Prefill `prompts` into `slots` (one eager pass per model); the first new token of each, whether the
        request is already done, and its logits [1, V] when recorded. Reads the host once."""
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        width = max(len(p) for p in prompts)
        tokens = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        last = self.target.prefill(rows, tokens, lengths)  # [n, V]
        if self.draft is not None:
            self.draft.prefill(rows, tokens, lengths)
        budget = torch.tensor(budgets, dtype=torch.long, device=self.device)
        first, done = acceptance.first_tokens(last, budget, self.eos,
                                              self.row_requests.step(requests) if self.row_requests is not None else None)  # [n], [n]
        s = self.slots
        s.pending[rows], s.previous[rows] = first, tokens[torch.arange(len(slots), device=self.device), lengths - 1]
        s.generated[rows], s.budget[rows], s.running[rows] = 1, budget, ~done
        for slot, request in zip(slots, requests):
            self.requests[slot] = request
        self.request_ids[rows] = torch.tensor(requests, dtype=torch.long, device=self.device)
        first_list, done_list = torch.stack([first, done.long()]).tolist()
        logits = [row.unsqueeze(0) for row in last] if self.record_logits else None
        return first_list, [bool(d) for d in done_list], logits

    @torch.no_grad()
    def step(self) -> tuple[list[int], list[list[int]], list[int], list[bool], list[list[int]], list[torch.Tensor] | None, dict[str, float]]:
        """One speculative step of every slot. Returns, for the slots that were running (in slot order):
        their slots, emitted tokens, accepted counts, whether each finished, the proposals, the logits of the
        emitted tokens [n, V] when recorded, and the stage seconds."""
        s, k, c = self.slots, self.k, self.target.lengths
        self.clock.mark()
        # 1. draft: [previous, pending] at c - 1, then k - 1 more greedy tokens (k = 0: plain decoding)
        drafts = s.pending.new_zeros(s.pending.shape[0], 0)  # [B, 0]
        if self.draft_pass is not None:
            if self.chooser is not None:
                self.chooser.begin(self.request_ids, s.generated, s.pending, k)
            logits = self.draft_pass.run(torch.stack([s.previous, s.pending], dim=1), (c - 1).clamp(min=0))  # [B, 2, V]
            proposals = [self._choose(0, logits[:, -1])]
            for i in range(1, k):
                logits = self.draft_pass.run(proposals[-1].unsqueeze(1), c + i)  # [B, 1, V]
                proposals.append(self._choose(i, logits[:, -1]))
            drafts = torch.stack(proposals, dim=1)  # [B, k]
        self.clock.mark()
        # 2. verify: the pending token and the k draft tokens in one target pass
        inputs = torch.cat([s.pending.unsqueeze(1), drafts], dim=1)  # [B, k+1]
        verify_logits = self.target_pass.run(inputs, c)  # [B, k+1, V]
        self.clock.mark()
        # 3. accept (engines/acceptance.py); an idle slot's room is <= 0, and its verdict is never used
        verdict = acceptance.accept(verify_logits, drafts, s.budget - s.generated, self.eos, requests=self._step_requests())
        targets, accepted, emitted, done = verdict.tokens, verdict.accepted, verdict.emitted, verdict.done
        outside = (drafts >= self.shared).any(1)  # [B] padded vocabularies: a draft error, or a target token the
        if self.draft is not None:  # draft cannot read
            outside |= (targets >= self.draft_vocab).any(1)
        # 4. read: the step's one transfer to the host
        table = torch.cat([torch.stack([accepted, emitted, done.long(), s.running.long(), outside.long()], dim=1),
                           targets, drafts], dim=1).tolist()  # [B, 5 + (k+1) + k]
        # 5. advance the slots that go on (device): accepted columns stay, the bonus token is pending; a slot that
        #    finished keeps its length, so that its idle passes stay inside the buffers
        c.add_((accepted + 1) * (s.running & ~done))
        s.generated.add_(emitted * s.running)
        s.previous.copy_(torch.where(s.running, inputs.gather(1, accepted.unsqueeze(1)).squeeze(1), s.previous))
        s.pending.copy_(torch.where(s.running, targets.gather(1, accepted.unsqueeze(1)).squeeze(1), s.pending))
        s.running &= ~done
        slots, tokens, counts, finished, proposed, kept = [], [], [], [], [], []
        for slot, row in enumerate(table):
            a, n, is_done, was_running, bad = row[:5]
            if not was_running:
                continue
            if bad:
                raise DraftVocabularyError(f"slot {slot}: a draft token or a target token outside the {self.shared} "
                                           "ids both models have (a padded vocabulary must never choose a padding id)")
            slots.append(slot)
            tokens.append(row[5:5 + n])
            counts.append(a)
            finished.append(bool(is_done))
            proposed.append(row[6 + k:6 + 2 * k])
            if self.record_logits:
                kept.append(verify_logits[slot, :n].clone())  # the graph's output is overwritten by the next replay
        self.clock.mark()
        draft_s, verify_s, accept_s = self.clock.seconds()
        return (slots, tokens, counts, finished, proposed, kept if self.record_logits else None,
                {"draft": draft_s, "verify": verify_s, "realign": accept_s})

    def _step_requests(self) -> StepRequests | None:
        """The request parameters of the running slots (an idle slot: none), read on the host; None without."""
        if self.row_requests is None:
            return None
        running = self.slots.running.tolist()
        return self.row_requests.step([r if on else None for r, on in zip(self.requests, running)])

    def _choose(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        greedy = logits.argmax(-1)  # [B]
        return greedy if self.chooser is None else self.chooser.choose(i, greedy)


STEP_KIND = "fixedshape"  # the trace's kind of a speculative step of this loop


def run(loop: StaticLoop, prompts: Sequence[Sequence[int]], limits: list[int], requests: list[int], trace: Trace,
        outputs: list[list[int]], logits: list[list[torch.Tensor]], *, refill: bool) -> None:
    """Decode the prompts `requests` (indices into `prompts` and `limits`, each limit >= 1) through `loop`'s
    slots: refill a slot as soon as it frees (`refill`), or run consecutive batches (each slot idle once done
    until the whole batch is). Fills `outputs`, `logits` (when recorded) and `trace`, by prompt index."""
    capacity = len(loop.requests)
    waiting = list(requests)
    free = list(range(capacity))

    def collect(slots: list[int], requests: list[int], tokens: list[list[int]], row_logits: Any,
                finished: list[bool]) -> None:
        """Each request's new tokens (and logits); the slots of finished requests freed."""
        for i, request in enumerate(requests):
            outputs[request].extend(tokens[i])
            if row_logits is not None:
                logits[request].append(row_logits[i])
            if finished[i]:
                free.append(slots[i])
        free.sort()

    def admit() -> None:
        """Prefill the oldest waiting requests into free slots (lowest first)."""
        count = min(len(free), len(waiting))
        into, requests = [free.pop(0) for _ in range(count)], [waiting.pop(0) for _ in range(count)]
        started = time.perf_counter()
        first, done, first_logits = loop.admit(into, requests, [prompts[r] for r in requests],
                                               [limits[r] for r in requests])
        collect(into, requests, [[token] for token in first], first_logits, done)
        trace.record(StepRecord(step=len(trace.steps), kind="prefill", rows=requests, pad_lengths=[0] * count,
                                accepted_counts=[0] * count, emitted_counts=[1] * count,
                                seconds={"verify": time.perf_counter() - started}))

    while waiting or len(free) < capacity:
        if waiting and free and (refill or len(free) == capacity):
            admit()
            continue
        taken, tokens, counts, finished, proposed, step_logits, seconds = loop.step()
        held = [loop.requests[slot] for slot in taken]
        collect(taken, held, tokens, step_logits, finished)
        trace.record(StepRecord(step=len(trace.steps), kind=STEP_KIND, rows=held, pad_lengths=[0] * len(held),
                                accepted_counts=counts, emitted_counts=[len(t) for t in tokens], seconds=seconds,
                                proposed=proposed if step_logits is not None else None))
