"""Drafters propose `k` tokens per row; the target verifies them.

`ModelDrafter` runs a draft model with its own KV cache, kept aligned with the target's: after
each step it holds exactly the row's accepted tokens (never re-running the draft over the whole
sequence). `PromptLookupDrafter` copies what followed the row's last n-gram earlier in the row
(prompt lookup, vLLM's n-gram speculation): where the n-gram never occurred it proposes nothing.
`ScriptedDrafter` is for tests: it proposes the reference's own next tokens for a chosen number of
positions and then a wrong one, or nothing, so a test dictates each row's acceptance.

Every drafter derives from `Drafter`, which declares each member an engine may call or read, with its
default; the engines read them as attributes, never probing. A drafter may propose fewer than k tokens
for a row, none included: after `propose` it then holds `proposal_lengths` [B]. The engines verify `1 + m` tokens per row, m the step's longest proposal
(`verify_drafts`): a row's own draft tokens, then pad ids that are never accepted
(`accepted_prefix`) and never enter a recurrent state (`recurrent.forward_by_token`). A step where
no row drafted anything is a one-token decoding pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.ops import layout
from specaudit.engines.ops import recurrent
from specaudit.engines.batch import BatchState
from specaudit.engines.constraints.draft import DraftMask
from specaudit.engines.sampling.step import StepSampler


class DraftVocabularyError(ValueError):
    """A token outside the ids that target and draft share (a padded vocabulary: see
    engines/models/model_files.py): a draft proposal there is a draft error; a target token there cannot be
    fed to the draft."""


def shared_vocab_size(target: PreTrainedModel | None, draft: PreTrainedModel | None) -> int | None:
    """The ids both models have: the smaller vocabulary (None when either is unknown)."""
    sizes = [getattr(getattr(model, "config", None), "vocab_size", None) for model in (target, draft)]
    return min(sizes) if all(isinstance(size, int) for size in sizes) else None


def check_proposals(proposed: torch.Tensor, shared: int | None, proposer_vocab_size: int | None = None) -> None:
    """Raise `DraftVocabularyError` when a proposal [B, k] lies outside the shared ids. A proposer whose
    own vocabulary lies inside them (`proposer_vocab_size`) cannot: no device read then."""
    if shared is None or (proposer_vocab_size is not None and proposer_vocab_size <= shared):
        return
    outside = proposed >= shared  # [B, k]
    if bool(outside.any()):
        row, column = (int(i) for i in outside.nonzero()[0])
        raise DraftVocabularyError(
            f"draft error: the draft proposed token {int(proposed[row, column])} (batch row {row}, draft position "
            f"{column}), outside the {shared} ids it shares with the target (0..{shared - 1}); a draft with a "
            "padded vocabulary must never choose a padding id")


def check_draft_inputs(tokens: torch.Tensor, draft: PreTrainedModel, target_vocab_size: int | None = None) -> None:
    """Raise `DraftVocabularyError` when a token the draft must read lies outside its vocabulary. Tokens
    the target chose cannot when the target's vocabulary (`target_vocab_size`) lies inside the draft's: no
    device read then."""
    size = getattr(getattr(draft, "config", None), "vocab_size", None)
    if isinstance(size, int) and target_vocab_size is not None and target_vocab_size <= size:
        return
    if isinstance(size, int) and tokens.numel() and int(tokens.max()) >= size:
        raise DraftVocabularyError(
            f"the target chose token {int(tokens.max())}, which the draft's vocabulary ({size} ids) does not have: "
            "the target's padding ids must never win (they do in this pair)")


def proposal_lengths(drafter: Drafter, proposals: torch.Tensor) -> torch.Tensor:
    """[B] draft tokens each row really proposed: the drafter's `proposal_lengths`, else all k."""
    lengths = drafter.proposal_lengths
    if lengths is None:
        return torch.full(proposals.shape[:1], proposals.shape[1], dtype=torch.long, device=proposals.device)
    return lengths.to(proposals.device)


def verify_drafts(proposals: torch.Tensor, lengths: torch.Tensor, pad_id: int,
                  longest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft columns of a verify pass: [B, m] (m the longest proposal), each row's own draft tokens
    then pad ids, and [B, m] True on a row's own draft tokens. `longest`: m where the host knows it (a
    drafter that always proposes k), else one read."""
    m = longest if longest is not None else (int(lengths.max()) if lengths.numel() else 0)
    own = torch.arange(m, device=proposals.device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, m]
    return torch.where(own, proposals[:, :m], torch.full_like(proposals[:, :m], pad_id)), own


def own_proposals(proposals: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Each row's own draft tokens, for the trace."""
    return [row[:n] for row, n in zip(proposals.tolist(), lengths.tolist())]


@dataclass
class Drafts:
    """One step's drafts for the rows of a batch, as the verify pass and the acceptance rule take them."""

    proposals: torch.Tensor  # [B, k] what the drafter returned (past a row's own count: filler)
    drafted: torch.Tensor  # [B] how many of them are the row's own
    tokens: torch.Tensor  # [B, m] the verified draft columns: each row's own drafts, then pad ids
    own: torch.Tensor  # [B, m] True on a row's own drafts
    logits: torch.Tensor | None  # [B, m, V] what a sampled row's drafts were drawn from (None: greedy)
    counted: bool  # the drafter said how many each row proposed (`proposal_lengths`)

    def trace_fields(self, record_logits: bool) -> dict[str, Any]:
        """The step record's `proposed` (with `record_logits`) and `drafted_counts` (a counting drafter)."""
        return {"proposed": own_proposals(self.proposals, self.drafted) if record_logits else None,
                "drafted_counts": self.drafted.tolist() if self.counted else None}


def draft_stage(drafter: Drafter, state: object, k: int, sampling: StepSampler | None, pad_id: int,
                mask: DraftMask | None = None) -> Drafts:
    """Step 1 of every speculative engine: up to k tokens per row (a drafter may propose fewer, or none),
    a sampled row's drafts drawn from its processed q with its own stream (engines/sampling/step.py);
    `mask`: the constrained rows' grammar masks (engines/constraints/draft.py), applied by a drafter that
    declares `takes_draft_mask` to each draft position's logits and rolled back after the proposals."""
    drafter.draft_mask = mask if drafter.takes_draft_mask else None
    try:
        proposals, draft_logits = propose(drafter, state, k, sampling)  # [B, k], [B, k, V] or None
    finally:
        if drafter.draft_mask is not None:
            drafter.draft_mask.finish()
        drafter.draft_mask = None
    drafted = proposal_lengths(drafter, proposals)  # [B]
    counted = drafter.proposal_lengths is not None
    longest = None if counted else proposals.shape[1]  # a drafter that always proposes k: no read
    tokens, own = verify_drafts(proposals, drafted, pad_id, longest)  # [B, m]
    if draft_logits is not None:
        draft_logits = draft_logits[:, :tokens.shape[1]]  # [B, m, V]: the verified draft columns
    return Drafts(proposals, drafted, tokens, own, draft_logits, counted)


class Chooser:
    """What chooses each proposal instead of the draft model's greedy token (the bench's
    `engines.models.bench_pair.CalibratedChooser`); the draft model still runs on the chosen tokens."""

    on_device: bool = False  # chooses on the device, reading nothing on the host (the fixed-shape engine needs it)

    def begin(self, rows: list[int] | torch.Tensor, generated: torch.Tensor, pending: torch.Tensor, k: int) -> None:
        raise NotImplementedError

    def choose(self, i: int, draft_greedy: torch.Tensor) -> torch.Tensor:  # [B]
        raise NotImplementedError


class Drafter:
    """What an engine calls and reads of a drafter, each optional member declared here once with its default;
    every drafter derives from it. `prefill` and `propose` are its own; the rest it keeps when it has them.

    Under sampling (a pass with sampled rows) the engine calls `propose(state, k, sampling=...)` on a drafter
    that declares `proposes_sampled` and reads its `draft_logits` [B, k, V] after it; any other drafter
    proposes as it always does, and its proposals count as certain (q the one-hot of each token:
    engines/sampling/step.py)."""

    draft: PreTrainedModel | None = None  # the draft model it runs (None: it runs none)
    chooser: Chooser | None = None  # what chooses its proposals instead of the draft model's greedy tokens
    proposes_sampled: bool = False  # `propose` takes `sampling` and leaves `draft_logits`
    proposal_lengths: torch.Tensor | None = None  # [B] after `propose`: each row's own count (None: all k)
    draft_logits: torch.Tensor | None = None  # [B, k, V] after a sampled `propose`: what its drafts were drawn from
    fill_seconds: float = 0.0  # its fill passes' time, where it times them (the bench moves it to the draft stage)
    takes_draft_mask: bool = False  # masks its proposals with `draft_mask` (structured outputs)
    draft_mask: DraftMask | None = None  # during `propose`: the constrained rows' grammar masks (None: none)

    def prefill(self, state: Any) -> None:
        """Before the first step, on the prompts: the draft's cache (`state.draft_cache`, None without one)."""
        raise NotImplementedError

    def propose(self, state: Any, k: int, sampling: StepSampler | None = None) -> torch.Tensor:  # [B, k]
        raise NotImplementedError

    def fill(self, state: Any, accepted_counts: torch.Tensor, keep: torch.Tensor) -> None:
        """After the acceptance, before `commit`, in a cache that keeps holes (INPLACE): the columns of the
        k-th draft token for rows that accepted all k. Nothing by default."""
        return None

    def commit(self, state: Any, accepted_counts: torch.Tensor, keep: torch.Tensor, realign: bool = True) -> None:
        """After the acceptance: the draft's cache keeps each row's accepted tokens. Nothing by default."""
        return None


class ModelDrafter(Drafter):
    """Drafting with a draft model whose cache lives in `state.draft_cache`: each proposal is the draft
    model's greedy token, or, with a `chooser` (the bench's `engines.models.bench_pair.CalibratedChooser`),
    the chooser's token; the draft model runs on the chosen tokens either way, so its cache holds what the
    row accepted. `fill_seconds` adds up the fill passes, which the ragged engines time inside their realign
    stage (the bench moves them to the draft stage), when a chooser is set."""

    proposes_sampled = True
    takes_draft_mask = True

    def __init__(self, draft: PreTrainedModel, shared_vocab_size: int | None = None, chooser: Chooser | None = None,
                 target_vocab_size: int | None = None) -> None:
        layout.check_supported(draft, "draft")
        self.draft: PreTrainedModel = draft
        self.shared_vocab_size = shared_vocab_size  # proposals past it are draft errors (padded vocabularies)
        self.target_vocab_size = target_vocab_size  # the target's ids: inside the draft's, its tokens need no check
        self.chooser = chooser
        self.fill_seconds = 0.0
        self._proposed: torch.Tensor | None = None  # [B, k] last proposal, for the fill pass
        self.draft_logits: torch.Tensor | None = None  # [B, k, V] what a sampled proposal was drawn from
        self._old_width = 0

    def prefill(self, state: BatchState) -> None:
        # every row holds its prompt and one new token; the pending last column is not cached
        state.draft_cache, _ = batch_ops.prefill(self.draft, state.tokens[:, :-1], state.cache_lengths)

    def propose(self, state: BatchState, k: int, sampling: StepSampler | None = None) -> torch.Tensor:
        """[B, k] draft tokens: greedy, or with `sampling` (a pass with sampled rows) each sampled row's
        token drawn from its processed q with its own stream; then `draft_logits` [B, k, V] holds the
        logits each was drawn from, for the acceptance (None when greedy)."""
        self._begin(state)
        token = state.tokens[:, -1:]  # [B, 1] pending token
        check_draft_inputs(token, self.draft, self.target_vocab_size)
        if self.chooser is not None:
            if sampling is not None:
                raise ValueError("a calibrated chooser proposes greedy drafts only; sampled requests need the draft model's own")
            self.chooser.begin(list(state.rows), state.lengths - state.prompt_lengths, token[:, 0], k)
        proposed, rows = [], []
        for i in range(k):
            logits = self._draft_pass(state, token, i)  # [B, 1, V]
            if self.draft_mask is not None:  # a constrained row proposes only what its grammar admits
                logits = self.draft_mask.apply(logits[:, -1]).unsqueeze(1)  # [B, 1, V]
            if sampling is not None:
                rows.append(logits[:, -1])
                token = sampling.draft_tokens(logits[:, -1]).unsqueeze(1)  # [B, 1]
            else:
                greedy = logits[:, -1].argmax(-1)  # [B]
                token = (greedy if self.chooser is None else self.chooser.choose(i, greedy)).unsqueeze(1)  # [B, 1]
            proposed.append(token)
            if self.draft_mask is not None:
                self.draft_mask.advance(token[:, 0])
        self.draft_logits = torch.stack(rows, dim=1) if rows else None  # [B, k, V]
        self._proposed = torch.cat(proposed, dim=1)  # [B, k]
        # the draft model's own proposals lie inside its vocabulary; a chooser's may not
        own_vocab = getattr(getattr(self.draft, "config", None), "vocab_size", None) if self.chooser is None else None
        check_proposals(self._proposed, self.shared_vocab_size, own_vocab if isinstance(own_vocab, int) else None)
        return self._proposed

    def _begin(self, state: BatchState) -> None:
        self._old_width = ragged.cache_width(state.draft_cache)  # where the step's columns start, for commit

    def _draft_pass(self, state: BatchState, token: torch.Tensor, i: int) -> torch.Tensor:
        """The draft's i-th pass of a step on `token` [B, 1]: its logits [B, 1, V]."""
        return batch_ops.forward(self.draft, state.draft_cache, token, state.cache_lengths + i)

    def commit(self, state: BatchState, accepted_counts: torch.Tensor, keep: torch.Tensor, realign: bool = True) -> None:
        """Realign the draft cache to the rows' accepted tokens; `state` still describes the batch
        before the step. A row that accepted all k needs the k-th draft token's keys and values,
        which the k drafting passes never computed: one fill pass adds them when any row needs it.
        With `realign=False` only the fill pass runs: every row keeps its columns up to
        `old width + accepted + 1`, and the caller cuts each row out itself (EXSPEC)."""
        assert self._proposed is not None
        k = self._proposed.shape[1]
        cache = state.draft_cache
        host = state.host if state.host is not None and state.host.accepted is not None else None
        if host is not None:  # the step's accepted counts, already read (engines/batch.py's HostBook)
            needs_fill = any(host.accepted[i] == k for i in host.keep or [])
        else:
            needs_fill = bool(keep.numel()) and bool((accepted_counts.index_select(0, keep) == k).any())
        if needs_fill:
            timed = self.chooser is not None  # the bench's drafter: its fill passes timed (a GPU waited for)
            started = _now(self.draft.device) if timed else 0.0
            batch_ops.forward(self.draft, cache, self._proposed[:, -1:], state.cache_lengths + k)
            if timed:
                self.fill_seconds += _now(self.draft.device) - started
        if realign:
            batch_ops.realign(cache, self._old_width, accepted_counts, state.cache_lengths, keep, host)
        else:
            recurrent.commit(cache, accepted_counts)  # recurrent states: every row, in batch order
        self._proposed = None


def _now(device: torch.device) -> float:
    """Wall seconds, after the device's queued work (a GPU's fill pass timed as it runs)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


Schedule = Callable[[int, int], int]  # (prompt index, row's step number) -> tokens to get right


NO_DRAFT = -1  # a schedule value: the row proposes nothing that step


class ScriptedDrafter(Drafter):
    """Proposes `schedule(prompt, step)` of the reference's next tokens, then a wrong token.

    `reference_outputs[p]` is the reference decoder's output for prompt `p`. Past the end of the
    reference output the proposal repeats its last token; those positions never count, because a
    correct engine stops there. A schedule value >= k proposes k correct tokens (all accepted);
    `NO_DRAFT` proposes nothing (`proposal_lengths` 0 for that row).
    """

    def __init__(self, reference_outputs: list[list[int]], schedule: Schedule, vocab_size: int) -> None:
        self.reference_outputs = reference_outputs
        self.schedule = schedule
        self.vocab_size = vocab_size
        self.row_steps: dict[int, int] = {}
        self.proposal_lengths: torch.Tensor | None = None

    def prefill(self, state: BatchState) -> None:
        state.draft_cache = None

    def propose(self, state: BatchState, k: int) -> torch.Tensor:
        generated = (state.lengths - state.prompt_lengths).tolist()
        proposals, lengths = [], []
        for prompt, done in zip(state.rows, generated):  # host-side script, test-only
            step = self.row_steps.get(prompt, 0)
            self.row_steps[prompt] = step + 1
            scheduled = self.schedule(prompt, step)
            lengths.append(0 if scheduled == NO_DRAFT else k)
            right = min(max(scheduled, 0), k)
            ref = self.reference_outputs[prompt]
            tail = ref[done : done + k] or [0]
            row = (tail + [tail[-1]] * k)[:k]
            if right < k:
                row[right] = (ref[done + right] + 1) % self.vocab_size if done + right < len(ref) else row[right]
            proposals.append(row)
        device = state.tokens.device
        self.proposal_lengths = torch.tensor(lengths, dtype=torch.long, device=device) if 0 in lengths else None
        return torch.tensor(proposals, dtype=torch.long, device=device)

    def commit(self, state: BatchState, accepted_counts: torch.Tensor, keep: torch.Tensor, realign: bool = True) -> None:
        return None


class PromptLookupDrafter(Drafter):
    """Prompt lookup (n-gram speculation): for each row, the latest earlier occurrence of its last n
    tokens (n from `max_ngram` down to `min_ngram`) and up to k tokens that followed it there; a row
    whose n-grams never occurred earlier proposes nothing (`proposal_lengths` 0). No draft model."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.proposal_lengths: torch.Tensor | None = None

    def prefill(self, state: BatchState) -> None:
        state.draft_cache = None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens of `tokens`."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    def propose(self, state: BatchState, k: int) -> torch.Tensor:
        width = state.tokens.shape[1]
        rows = [self.lookup(row[width - n:], k) for row, n in zip(state.tokens.tolist(), state.lengths.tolist())]
        device = state.tokens.device
        self.proposal_lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
        return torch.tensor([r + [0] * (k - len(r)) for r in rows], dtype=torch.long, device=device)  # [B, k]

    def commit(self, state: BatchState, accepted_counts: torch.Tensor, keep: torch.Tensor, realign: bool = True) -> None:
        return None


def propose(drafter: Drafter, state: object, k: int, sampling: StepSampler | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafter's [B, k] proposals and, under sampling, the draft logits [B, k, V] they were drawn from
    (None: greedy, or a drafter that proposes deterministically, whose q is the one-hot of its tokens)."""
    if sampling is None or not drafter.proposes_sampled:
        return drafter.propose(state, k), None
    proposals = drafter.propose(state, k, sampling=sampling)
    return proposals, drafter.draft_logits


def make_drafter(drafter: Drafter | str | None, target: PreTrainedModel, draft: PreTrainedModel | None) -> Drafter:
    """The engine's drafter: a given one, `"prompt-lookup"`, or the draft model's (`ModelDrafter`)."""
    if drafter == "prompt-lookup":
        return PromptLookupDrafter()
    if isinstance(drafter, str):
        raise ValueError(f"unknown drafter {drafter!r}: use prompt-lookup, or give a draft model")
    return drafter if drafter is not None else ModelDrafter(draft, shared_vocab_size(target, draft),
                                                            target_vocab_size=output_ids(target))


def output_ids(model: PreTrainedModel | None) -> int | None:
    """How many ids `model` can choose: the rows of its output embedding (its logits' width), None when unknown."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
