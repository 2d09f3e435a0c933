"""Two small sampled engines on the standard rule: `SampledSpeculative` (draft k, verify with a
`SpeculativeRule`) and `SampledReference` (the target alone); and `RequestSampled`, one of the project's
engines asked for sampled tokens through its request parameters. Both take temperature, top-k, top-p
and a seed per request, and draw every random decision of a row from that row's own generator, so a
seeded request gives the same tokens alone or inside any batch. Given `request_params` (one `RequestParams`
per prompt) they also apply its penalties, logit bias, bad words (ids), min_tokens and min-p, in vLLM's
order (engines/requests/sampled.py): the processors on the row's history at each position, then the
temperature and the cuts; a speculative step processes verify position j after the first j drafts.

A constrained request (`RequestParams.constraint`; `request_tokenizer` the target's, set by the audit) keeps its
grammar state in `SampledRow.matcher` (engines/constraints/matcher.py): the mask of each position comes first,
before every processor. The reference draws from the masked, renormalized distribution and the matcher
consumes the token. A speculative step masks draft position j with the state after the committed output and
the first j drafts (the draft draws from its masked q), masks verify position j with the same state (the bonus
position after all k drafts), verifies with the masked p and q (a recovered token from the masked residual),
then rolls the matcher back over the k drafts and advances it over the emitted tokens.

No cache: each pass runs the whole sequence, right-padded in a batch. With causal attention a row's
logits at its own positions never see the padding after them, so batching changes nothing but the
rounding of the batched matrix products (float64: 1e-16, far below any decision's resolution).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from specaudit.engines.constraints.matcher import RowMatcher, row_matcher
from specaudit.engines.limits import eos_ids, request_limits
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.sampled import processed_row, request_table, sampling_of
from specaudit.engines.sampling.process import SamplingParams
from specaudit.engines.sampling.rules import Draws, SpeculativeRule, seeded_draws


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per request of a run: distinct across requests and across run seeds below 2**20 requests."""
    return [(int(seed) << 20) + i for i in range(count)]


@torch.no_grad()
def _last_logits(model: PreTrainedModel, rows: list[list[int]], width: int) -> torch.Tensor:
    """[B, width, V]: each row's logits at its last `width` positions (right padding, no mask)."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long, device=model.device)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, device=model.device)
    logits = model(input_ids=ids).logits.to(torch.float64)  # [B, L, V]
    picked = [logits[b, len(row) - width: len(row)] for b, row in enumerate(rows)]
    return torch.stack(picked).cpu()


def _finish(tokens: list[int], limit: int, eos_token_id: int | list[int] | None) -> tuple[list[int], bool]:
    """The tokens up to the limit and through the first EOS; whether the row is done."""
    stops = eos_ids(eos_token_id)
    for i, token in enumerate(tokens[:limit]):
        if token in stops:
            return tokens[: i + 1], True
    return tokens[:limit], len(tokens) >= limit


@dataclass
class SampledRow:
    """One request while it decodes: its prompt, the tokens it has so far, its parameters and stop ids
    (the EOS ids and its `stop_token_ids`: what `min_tokens` bans)."""

    prompt: list[int]
    output: list[int]
    params: RequestParams
    stop_ids: tuple[int, ...]
    matcher: RowMatcher | None = None  # a constrained request's grammar state (made at its first step)
    grammar_refusals: int = 0  # emitted tokens the matcher refused (0 under a correct mask)


def _width(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """`allowed` [V] over another model's `width` ids (a draft vocabulary of another size): ids past V forbidden."""
    if allowed.shape[0] >= width:
        return allowed[:width]
    return torch.cat([allowed, torch.zeros(width - allowed.shape[0], dtype=torch.bool)])


def _consume(row: SampledRow, tokens: list[int]) -> None:
    """The matcher advanced over the row's emitted `tokens` (a refused one counted, the state kept)."""
    if row.matcher is None:
        return
    for token in tokens:
        if not row.matcher.advance(token) and not row.matcher.terminated:
            row.grammar_refusals += 1


class _SampledEngine:
    black_box = False
    k = 0
    # one `RequestParams` per prompt of the next `generate` (set by the sampled audit, equivalence/sampling/run.py):
    # the penalties, logit bias, bad words (as ids), min_tokens and the sampler's own temperature, top-k, top-p
    # and min-p; None: every request asks for `self.params` alone
    request_params: list[RequestParams] | None = None
    penalty_scope = "output"  # presence and frequency count the output (vLLM)
    request_tokenizer: Any = None  # the target's: a constraint's grammar is compiled over its vocabulary
    takes_constraints = True  # structured outputs (docs/structured.md)

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch_size: int = 64, **_: object) -> None:
        self.target, self.draft = target, draft
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self.seed, self.batch_size = seed, batch_size

    def allowed(self, row: SampledRow, vocab_size: int) -> torch.Tensor | None:
        """[V] what the row's grammar admits next (its matcher made at the first call); None unconstrained."""
        if row.params.constraint is None:
            return None
        if row.matcher is None:
            if self.request_tokenizer is None:
                raise ValueError("a constrained request needs the target's tokenizer (request_tokenizer)")
            row.matcher = row_matcher(row.params.constraint, self.request_tokenizer, vocab_size, row.stop_ids,
                                      row.prompt)
            _consume(row, row.output)  # a row that begins with output already (a continued request)
        return row.matcher.allowed()

    def draws_for(self, seeds: list[int]) -> list[Draws]:
        """Each request's own stream."""
        return [seeded_draws(s) for s in seeds]

    def requests_for(self, count: int) -> list[RequestParams]:
        """Each request's parameters: `request_params`, else `self.params` for all."""
        if self.request_params is None:
            plain = RequestParams(temperature=self.params.temperature, top_k=self.params.top_k, top_p=self.params.top_p,
                                  min_p=self.params.min_p)
            return [plain] * count
        if len(self.request_params) != count:
            raise ValueError(f"{len(self.request_params)} request parameter sets for {count} prompts: give one per prompt")
        return list(self.request_params)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: int | list[int] | None,
                 seeds: list[int] | None = None) -> list[list[int]]:
        limits = request_limits(max_new_tokens, len(prompts))
        seeds = request_seeds(self.seed, len(prompts)) if seeds is None else list(seeds)
        eos = set(eos_ids(eos_token_id))
        rows = [SampledRow(list(prompt), [], p, tuple(sorted(eos | set(p.stop_token_ids))))
                for prompt, p in zip(prompts, self.requests_for(len(prompts)))]
        # per request, each token's offset in the step that emitted it: the drafts accepted before it in
        # that step (k: the bonus token); what the sampled audit stratifies by
        self.last_step_offsets: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            self._generate_batch(rows[chunk], limits[chunk], eos_token_id, self.draws_for(seeds[chunk]))
        return [row.output for row in rows]

    def _generate_batch(self, rows: list[SampledRow], limits: list[int], eos_token_id, draws: list[Draws]) -> None:
        offsets: list[list[int]] = [[] for _ in rows]
        live = [b for b in range(len(rows)) if limits[b] > 0]
        while live:
            steps = self.step([rows[b] for b in live], [draws[b] for b in live])
            still = []
            for b, emitted in zip(live, steps):
                rows[b].output, done = _finish(rows[b].output + emitted, limits[b], eos_token_id)
                offsets[b] = (offsets[b] + list(range(len(emitted))))[: len(rows[b].output)]
                if not done:
                    still.append(b)
            live = still
        self.last_step_offsets += offsets

    def step(self, rows: list[SampledRow], draws: list[Draws]) -> list[list[int]]:
        raise NotImplementedError


class SampledReference(_SampledEngine):
    """The target alone: each token drawn from the request's processed distribution (engines/requests/sampled.py)
    with the row's stream."""

    name = "sampled-reference"

    def step(self, rows: list[SampledRow], draws: list[Draws]) -> list[list[int]]:
        logits = _last_logits(self.target, [row.prompt + row.output for row in rows], 1)  # [B, 1, V]
        emitted = []
        for b, row in enumerate(rows):
            allowed = self.allowed(row, logits.shape[-1])  # [V] or None
            probs = request_table(logits[b], row.prompt, row.output, [], row.params, row.stop_ids, self.penalty_scope,
                                  None if allowed is None else [allowed])[0]  # [V]
            emitted.append([draws[b].categorical(probs)])
            _consume(row, emitted[-1])
        return emitted


class SampledSpeculative(_SampledEngine):
    """Draft k tokens from the draft's q (the request's temperature and cuts on the draft's logits), verify
    them with `rule` (the standard rejection sampler unless a rule is given), per row with the row's stream.
    The target's logits at verify position j are processed with the history before it (`histories`: the
    committed output and the first j drafts), so a penalty counts each token once, accepted drafts included."""

    name = "sampled-spec"
    masks_drafts = True  # a constrained row's draft proposes from its masked q (False: exact, fewer accepted)

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, draft_tokens: int = 4,
                 rule: SpeculativeRule | None = None, **options: object) -> None:
        if draft is None:
            raise ValueError("sampled-spec needs a draft model")
        super().__init__(target, draft, **options)  # type: ignore[arg-type]
        self.k = draft_tokens
        self.rule = rule or SpeculativeRule()

    def histories(self, output: list[int], drafts: list[int]) -> list[list[int]]:
        """The output each verify position's processors see: position j after the first j drafts."""
        return [output + drafts[:j] for j in range(len(drafts) + 1)]

    def processed_target(self, logits: torch.Tensor, row: SampledRow, drafts: list[int],
                         masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[k+1, V] raw target logits of one row -> [k+1, V] after the request's grammar mask (`masks`: [V] per
        verify position, None unconstrained) and processors (before its temperature)."""
        return torch.stack([processed_row(logits[j], row.prompt, history, row.params, row.stop_ids, self.penalty_scope,
                                          None if masks is None else _width(masks[j], logits.shape[-1]))
                            for j, history in enumerate(self.histories(row.output, drafts))])

    def verify_masks(self, row: SampledRow, drafts: list[int], vocab_size: int) -> list[torch.Tensor] | None:
        """[V] per verify position 0..k: the grammar state after the committed output and the first j drafts
        (the masks the drafts were drawn under, recomputed); the matcher is left at the committed output."""
        if self.allowed(row, vocab_size) is None:
            return None
        assert row.matcher is not None
        masks, consumed = [row.matcher.allowed()], 0  # [V]
        for token in drafts:
            if consumed == len(masks) - 1 and row.matcher.advance(token):
                consumed += 1
                masks.append(masks[-1] if row.matcher.terminated else row.matcher.allowed())
            else:  # past a stop id (or a forbidden draft): never accepted
                masks.append(masks[-1])
        self.rollback_drafts(row, consumed)
        return masks

    def rollback_drafts(self, row: SampledRow, consumed: int) -> None:
        """The matcher back over the `consumed` draft tokens, at the committed output."""
        assert row.matcher is not None
        row.matcher.rollback(consumed)

    def step(self, rows: list[SampledRow], draws: list[Draws]) -> list[list[int]]:
        k = self.k
        sampling = [sampling_of(row.params) for row in rows]
        extended = [row.prompt + row.output for row in rows]
        constrained = [row.params.constraint is not None for row in rows]
        consumed = [0] * len(rows)  # draft tokens each constrained row's matcher took
        width = getattr(getattr(self.target, "config", None), "vocab_size", None)  # the target's ids: the grammar's
        draft_logits = []
        for j in range(k + int(self.rule.needs_last_draft_row)):
            logits = _last_logits(self.draft, extended, 1)[:, 0]  # [B, V]
            for b, row in enumerate(rows):
                allowed = self.allowed(row, width or logits.shape[-1]) if constrained[b] else None  # [V]
                if allowed is not None and self.masks_drafts:  # the draft proposes from its masked q
                    logits[b] = logits[b].masked_fill(~_width(allowed, logits.shape[-1]), float("-inf"))
            draft_logits.append(logits)
            if j < k:
                for b, row in enumerate(extended):
                    row.append(draws[b].categorical(self.rule.draft_probs(logits[b], sampling[b])))
                    if constrained[b] and consumed[b] == j and rows[b].matcher.advance(row[-1]):
                        consumed[b] += 1
        for b, row in enumerate(rows):
            if constrained[b]:
                self.rollback_drafts(row, consumed[b])
        draft_table = torch.stack(draft_logits, dim=1)  # [B, k(+1), V]
        target_table = _last_logits(self.target, extended, k + 1)  # [B, k+1, V]
        emitted = []
        for b, row in enumerate(rows):
            drafts = extended[b][len(row.prompt) + len(row.output):]  # [k]
            masks = self.verify_masks(row, drafts, target_table.shape[-1])  # k+1 x [V] or None
            p = self.rule.target_probs(self.processed_target(target_table[b], row, drafts, masks), sampling[b])  # [k+1, V]
            q_used = self.rule.acceptance_q(draft_table[b], sampling[b])  # [k(+1), V]
            emitted.append(self.rule.verify(p, q_used, drafts, draws[b]))
            _consume(row, emitted[-1])
        return emitted


class RequestSampled:
    """One of the project's engines (`registry.REQUEST_ENGINES`) asked for sampled tokens the way any request
    asks: each prompt's `RequestParams` carries the temperature, top-k, top-p and its own seed. `generate`
    takes a seed per request like the small sampled engines; `last_step_offsets` comes from the engine's
    trace (each token's offset in the step that emitted it)."""

    # one `RequestParams` per prompt of the next `generate` (the sampled audit's penalties and the rest), each
    # given its seed here; None: `params` alone
    request_params: list[RequestParams] | None = None
    request_tokenizer: Any = None  # the target's, handed to the engine (a constraint's vocabulary, stop strings)

    def __init__(self, engine: Any, params: SamplingParams, seed: int) -> None:
        self.engine, self.params, self.seed = engine, params, seed
        self.name = engine.name
        self.takes_constraints = bool(getattr(engine, "takes_constraints", False))
        self.penalty_scope = getattr(engine, "penalty_scope", "output")
        self.last_step_offsets: list[list[int]] | None = None

    @property
    def last_trace(self) -> Any:
        """The engine's trace of the last call: its verify steps, which the sampled audit's acceptance counts."""
        return getattr(self.engine, "last_trace", None)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: Any,
                 seeds: list[int] | None = None) -> list[list[int]]:
        seeds = request_seeds(self.seed, len(prompts)) if seeds is None else list(seeds)
        given = self.request_params
        if given is not None and len(given) != len(prompts):
            raise ValueError(f"{len(given)} request parameter sets for {len(prompts)} prompts: give one per prompt")
        plain = RequestParams(temperature=self.params.temperature, top_k=self.params.top_k, top_p=self.params.top_p,
                              min_p=self.params.min_p)
        self.engine.request_params = [replace(given[i] if given is not None else plain, seed=s)
                                      for i, s in enumerate(seeds)]
        if self.request_tokenizer is not None:
            self.engine.request_tokenizer = self.request_tokenizer
        try:
            outputs = self.engine.generate(prompts, max_new_tokens, eos_token_id)
        finally:
            self.engine.request_params = None
        trace = self.engine.last_trace
        self.last_step_offsets = trace.step_offsets() if trace is not None and trace.steps else [[0] * len(o) for o in outputs]
        return outputs
