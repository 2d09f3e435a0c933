"""Request parameters on the project's own engines: each row's request state, and what one verify pass
needs of it.

`RowRequests` holds, per request id (the prompt's index), the prompt, its `RequestParams`, its stop ids
(the EOS ids and its `stop_token_ids`), the new tokens it has committed so far and, for stop strings,
the text the search window starts after. An engine that takes request parameters builds one per
`generate` (`TakesRequestParams.row_requests`), takes each row's budget from it (`max_tokens`, else
the call's `max_new_tokens`) and hands `RowRequests.step(rows)` (`StepRequests`) to the acceptance
rule (`engines/acceptance.py`), which then, per row `b` and verify position `i`:

- processes the target's logits row `[V]` with the processors of `engines/requests` (`process`, vLLM's
  order, then `min_p` and `top_k`, which never move the argmax) and the row's history at that position:
  the prompt, the committed output and the row's first `i` draft tokens (`StepRequests.process`); the
  prefill's first token is position 0 with an empty output;
- ends the row at the first of its own stop ids (`StepRequests.stops`): `min_tokens` has banned them
  while the row had fewer tokens, so none ends it early;
- cuts the accepted burst at the token that completes a stop string, searched as the reference
  searches it (`engines/requests/reference.py`: only once more than `min_tokens` tokens exist, only
  where the string ends in the text the token added), and commits the emitted tokens as the rows'
  output (`StepRequests.commit`).

A sampled request (`RequestParams.temperature` > 0; `top_k`, `top_p`, `seed`) gets its own random stream
here (`RowRequest.sampling`: its `SamplingParams` and a generator seeded with its `seed`, a fresh seed
when it has none), made anew by every `generate`, so the same seed gives the same tokens; a step whose
rows sample hands the acceptance rule a `StepSampler` (`StepRequests.sampler`, engines/sampling/step.py)
that decides those rows with the engine's `SpeculativeRule` (the standard one unless a test plants
another) and the drafter draws their draft tokens through it.

A constrained request (`RequestParams.constraint`, engines/constraints/) keeps its grammar state in
`RowRequest.matcher` (made at its first pass, the logits' width known): `StepRequests.process` masks
position `i` with the tokens the grammar admits after the committed output and the row's first `i` draft
tokens (`verify_masks`, which advances the matcher over the draft tokens and leaves them consumed);
`commit` then rolls back the draft tokens that were not emitted (`rollback_rejected`) and consumes the
recovered or bonus token. Before the verify pass the drafter's proposals are masked the same way
(`StepRequests.draft_mask`, engines/constraints/draft.py), or acceptance falls.

A row whose parameters change no logit (stop strings, stop ids, `max_tokens` alone) skips the
processing; a step none of whose rows changes a logit returns the logits as they are. Drafts are
proposals: nothing here touches the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from specaudit.engines.constraints.draft import DraftMask
from specaudit.engines.constraints.matcher import RowMatcher, row_matcher
from specaudit.engines.contract import Capabilities
from specaudit.engines.limits import eos_ids, request_limits
from specaudit.engines.requests import PENALTY_SCOPES, RequestParams, process, with_bad_words_resolved
from specaudit.engines.requests.reference import find_stop, text_for
from specaudit.engines.requests.sampled import sampling_of
from specaudit.engines.sampling.rules import SpeculativeRule, seeded_draws
from specaudit.engines.sampling.step import RowSampling, StepSampler

# the fields whose processors can change a logit row (the others only stop a row or size it)
LOGIT_FIELDS = ("bad_words", "min_tokens", "logit_bias", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "min_p", "top_k", "constraint")


@dataclass
class RowRequest:
    """One request's parameters and its state while it decodes."""

    prompt: list[int]
    params: RequestParams
    stop_ids: tuple[int, ...]  # sorted: the EOS ids and the request's stop_token_ids
    changes_logits: bool  # some processor can change a logit row
    output: list[int] = field(default_factory=list)  # the new tokens committed so far
    sampling: RowSampling | None = None  # a sampled request's parameters and stream (None: greedy)
    previous_text: str = ""  # stop strings: the output's text before its last token (the search window's start)
    matcher: RowMatcher | None = None  # a constrained request's grammar state (made at its first pass)
    advanced: list[int] = field(default_factory=list)  # the draft tokens the matcher consumed this pass
    grammar_refusals: int = 0  # emitted tokens the matcher refused (a wrong mask or state; 0 in a correct engine)


class RowRequests:
    """Every request of one `generate` call, by request id (the prompt's index)."""

    def __init__(self, prompts: Sequence[Sequence[int]], params: Sequence[RequestParams],
                 eos_token_id: int | Sequence[int] | None, tokenizer: Any = None, penalty_scope: str = "output",
                 rule: SpeculativeRule | None = None) -> None:
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} request parameter sets for {len(prompts)} prompts: give one per prompt")
        if penalty_scope not in PENALTY_SCOPES:
            raise ValueError(f"penalty_scope must be one of {PENALTY_SCOPES}, got {penalty_scope!r}")
        if tokenizer is None and any(p.stop for p in params):
            raise ValueError("stop strings need the target's tokenizer to detokenize the output (request_tokenizer)")
        eos = set(eos_ids(eos_token_id))
        self.tokenizer, self.penalty_scope = tokenizer, penalty_scope
        self.rule = rule if rule is not None else SpeculativeRule()
        if self.rule.needs_last_draft_row:
            raise ValueError(f"the sampling rule {self.rule.name!r} reads the draft's distribution after its last "
                             "token, which the project's drafters do not compute")
        self.rows: list[RowRequest] = []
        for prompt, p in zip(prompts, params):
            p = with_bad_words_resolved(p, tokenizer)
            # a sampled request's top-k and min-p are its sampler's cuts (engines/sampling/process.py), not processors'
            changes = any(name in LOGIT_FIELDS and not (p.sampled and name in ("top_k", "min_p")) for name in p.sent())
            self.rows.append(RowRequest(list(prompt), p, tuple(sorted(eos | set(p.stop_token_ids))), changes,
                                        sampling=row_sampling(p)))

    def budgets(self, max_new_tokens: int | Sequence[int]) -> list[int]:
        """Each request's budget of new tokens: its `max_tokens`, else the call's (one for all, or per prompt)."""
        limits = request_limits(max_new_tokens, len(self.rows))
        return [r.params.max_tokens if r.params.max_tokens is not None else n for r, n in zip(self.rows, limits)]

    def history(self, row: RowRequest, drafts: Sequence[int]) -> list[int]:
        """The output a verify position is processed with: the committed tokens, then the draft tokens
        before that position."""
        return row.output + list(drafts)

    def matcher(self, row: RowRequest, vocab_size: int) -> RowMatcher:
        """The row's grammar state, made at its first use over `vocab_size` ids."""
        if row.matcher is None:
            assert row.params.constraint is not None
            row.matcher = row_matcher(row.params.constraint, self.tokenizer, vocab_size, row.stop_ids, row.prompt)
        return row.matcher

    def verify_masks(self, row: RowRequest, drafts: Sequence[int], vocab_size: int) -> list[torch.Tensor]:
        """[V] per verify position 0..len(drafts): the tokens the grammar admits after the committed output
        and the draft tokens before that position. The matcher consumes the draft tokens (`row.advanced`)
        until one it forbids (or a stop id): the positions after it repeat the last mask (never accepted)."""
        matcher = self.matcher(row, vocab_size)
        row.advanced = []
        masks = [matcher.allowed()]  # [V]
        for token in drafts:
            if len(row.advanced) == len(masks) - 1 and matcher.advance(token):
                row.advanced.append(token)
                masks.append(masks[-1] if matcher.terminated else matcher.allowed())
            else:  # a forbidden draft token, or one after it: never accepted
                masks.append(masks[-1])
        return masks

    def rollback_rejected(self, row: RowRequest, kept: int) -> None:
        """Undo the draft tokens the matcher consumed past the first `kept` (they were not emitted)."""
        assert row.matcher is not None
        row.matcher.rollback(len(row.advanced) - kept)

    def draft_mask(self, rows: Sequence[RowRequest | None]) -> DraftMask | None:
        """What masks the drafter's proposals for `rows` (None when no row is constrained)."""
        if not any(row is not None and row.params.constraint is not None for row in rows):
            return None
        return DraftMask([self.matcher_factory(row) for row in rows])

    def matcher_factory(self, row: RowRequest | None) -> Any:
        """A function of the logits' width making the row's matcher (None: an unconstrained row)."""
        if row is None or row.params.constraint is None:
            return None
        return lambda vocab_size: self.matcher(row, vocab_size)

    def step(self, request_ids: Sequence[int | None]) -> "StepRequests":
        """The requests of one pass's rows, in batch order (None: an idle slot, left unprocessed)."""
        return StepRequests(self, [self.rows[i] if i is not None else None for i in request_ids])


def row_sampling(params: RequestParams) -> RowSampling | None:
    """A sampled request's `RowSampling`: its parameters, and a generator seeded with its seed (a seed
    drawn from torch's global generator when it has none); None for a greedy request."""
    if not params.sampled:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, ()))
    return RowSampling(sampling_of(params), seeded_draws(seed))


class StepRequests:
    """The rows of one verify pass (or prefill), in batch order; what `acceptance.accept` calls."""

    def __init__(self, requests: RowRequests, rows: list[RowRequest | None]) -> None:
        self.requests, self.rows = requests, rows
        sampled = [row.sampling if row is not None else None for row in rows]
        # the pass's sampler when some row samples (None: every row greedy, the greedy rule decides)
        self.sampler = StepSampler(sampled, requests.rule) if any(s is not None for s in sampled) else None

    def process(self, target_logits: torch.Tensor, drafts: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
        """`target_logits` [B, k+1, V] processed per row and position with the row's history there (float64
        where any row changes; the logits themselves when none does). `drafts` [B, k]; `own` [B, k] True
        on a row's own draft tokens: positions after them are never accepted and stay unprocessed."""
        changing = [b for b, row in enumerate(self.rows) if row is not None and row.changes_logits]
        if not changing:
            return target_logits
        processed = target_logits.to(torch.float64, copy=True)  # [B, k+1, V]
        draft_lists = drafts.tolist()
        own_counts = own.long().sum(1).tolist() if own is not None else [drafts.shape[1]] * drafts.shape[0]
        scope = self.requests.penalty_scope
        for b in changing:
            row = self.rows[b]
            assert row is not None
            count = min(own_counts[b], drafts.shape[1])
            masks = (self.requests.verify_masks(row, draft_lists[b][:count], processed.shape[-1])
                     if row.params.constraint is not None else None)
            for i in range(count + 1):
                output = self.requests.history(row, draft_lists[b][:i])
                rows = process(processed[b, i], row.prompt, output, row.params, row.stop_ids, scope,
                               allowed=masks[i] if masks is not None else None)
                # a sampled row's cuts (top-k, top-p) and temperature are its sampling rule's to apply
                processed[b, i] = rows.greedy if row.sampling is not None else rows.post_sampling
        return processed

    def stops(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, k+1] bool: which of `tokens` [B, k+1] are stop ids of their row (an idle slot: none)."""
        out = torch.zeros_like(tokens, dtype=torch.bool)  # [B, k+1]
        for b, row in enumerate(self.rows):
            if row is not None and row.stop_ids:
                out[b] = torch.isin(tokens[b], torch.tensor(row.stop_ids, dtype=tokens.dtype, device=tokens.device))
        return out

    def commit(self, tokens: torch.Tensor, emitted: torch.Tensor, ended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each row's emitted tokens `tokens[b, :emitted[b]]` to its output, cut at the token that
        completes a stop string; returns the new `emitted` [B] and `ended` [B] (True where a stop string
        ended the row)."""
        token_lists, counts = tokens.tolist(), emitted.tolist()
        cut = list(counts)
        stopped = [False] * len(counts)
        for b, row in enumerate(self.rows):
            if row is None or counts[b] <= 0:
                if row is not None and row.matcher is not None:
                    self._advance_grammar(row, [])
                continue
            params, tokenizer = row.params, self.requests.tokenizer
            for j, token in enumerate(token_lists[b][:counts[b]]):
                row.output.append(token)
                if not params.stop:
                    continue
                text = text_for(tokenizer, row.output)
                found = find_stop(text, len(row.previous_text), params.stop) if len(row.output) > params.min_tokens else None
                row.previous_text = text
                if found is not None:
                    cut[b], stopped[b] = j + 1, True
                    break
        for b, row in enumerate(self.rows):
            if row is not None and row.matcher is not None and counts[b] > 0:
                self._advance_grammar(row, token_lists[b][:cut[b]])
        if not any(stopped):
            return emitted, ended
        new_emitted = torch.tensor(cut, dtype=emitted.dtype, device=emitted.device)  # [B]
        return new_emitted, ended | torch.tensor(stopped, dtype=torch.bool, device=ended.device)


    def draft_mask(self) -> DraftMask | None:
        """What masks the drafter's proposals this pass (None: no row is constrained)."""
        return self.requests.draft_mask(self.rows)

    def _advance_grammar(self, row: RowRequest, emitted: list[int]) -> None:
        """The matcher after the pass: the draft tokens it consumed that were emitted stay, the rest are
        rolled back, and the emitted tokens after them (the recovered or bonus token) are consumed."""
        assert row.matcher is not None
        kept = 0
        while kept < min(len(row.advanced), len(emitted)) and row.advanced[kept] == emitted[kept]:
            kept += 1
        self.requests.rollback_rejected(row, kept)
        for token in emitted[kept:]:
            if not row.matcher.advance(token) and not row.matcher.terminated:
                row.grammar_refusals += 1  # never under a correct mask; the matcher keeps its state (as vLLM's)
        row.advanced = []


class TakesRequestParams(Capabilities):
    """What an engine that takes request parameters declares: the audit sets `request_params` (one
    `RequestParams` per prompt) and `request_tokenizer` (the target's, for stop strings) before `generate`
    (equivalence/blackbox/requests_run.py); `penalty_scope` says what presence and frequency count."""

    request_params: list[RequestParams] | None = None
    request_tokenizer: Any = None
    penalty_scope: str = "output"
    row_requests_class: type[RowRequests] = RowRequests
    sampling_rule: SpeculativeRule | None = None  # the rule a sampled request is decided by (None: the standard one)
    takes_constraints = True  # structured outputs: a constraint in `request_params` is applied (engines/constraints/)

    def row_requests(self, prompts: Sequence[Sequence[int]], eos_token_id: int | Sequence[int] | None) -> RowRequests | None:
        """This call's requests, or None when no prompt asks anything of a plain greedy request (the
        engine then runs its plain path, unchanged)."""
        params = self.request_params
        if params is None or all(p.is_plain() for p in params):
            return None
        if self.sampling_rule is not None:
            return self.row_requests_class(prompts, params, eos_token_id, self.request_tokenizer, self.penalty_scope,
                                           rule=self.sampling_rule)
        return self.row_requests_class(prompts, params, eos_token_id, self.request_tokenizer, self.penalty_scope)
