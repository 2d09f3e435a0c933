"""Two small sampled engines on the standard rule: `SampledSpeculative` (draft k, verify with a
`SpeculativeRule`) and `SampledReference` (the target alone); and `RequestSampled`, one of the project's
engines asked for sampled tokens through its request parameters. Both take temperature, top-k, top-p
and a seed per request, and draw every random decision of a row from that row's own generator, so a
seeded request gives the same tokens alone or inside any batch. Given `request_params` (one `RequestParams`
per prompt) they also apply its penalties, logit bias, bad words (ids), min_tokens and min-p, in vLLM's
order (engines/requests/sampled.py): the processors on the row's history at each position, then the
temperature and the cuts; a speculative step processes verify position j after the first j drafts.

No cache: each pass runs the whole sequence, right-padded in a batch. With causal attention a row's
logits at its own positions never see the padding after them, so batching changes nothing but the
rounding of the batched matrix products (float64: 1e-16, far below any decision's resolution).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

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


class _SampledEngine:
    black_box = False
    k = 0
    # one `RequestParams` per prompt of the next `generate` (set by the sampled audit, equivalence/sampling/run.py):
    # the penalties, logit bias, bad words (as ids), min_tokens and the sampler's own temperature, top-k, top-p
    # and min-p; None: every request asks for `self.params` alone
    request_params: list[RequestParams] | None = None
    penalty_scope = "output"  # presence and frequency count the output (vLLM)

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch_size: int = 64, **_: object) -> None:
        self.target, self.draft = target, draft
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self.seed, self.batch_size = seed, batch_size

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
        probs = [request_table(logits[b], row.prompt, row.output, [], row.params, row.stop_ids, self.penalty_scope)[0]
                 for b, row in enumerate(rows)]  # B x [V]
        return [[d.categorical(probs[b])] for b, d in enumerate(draws)]


class SampledSpeculative(_SampledEngine):
    """Draft k tokens from the draft's q (the request's temperature and cuts on the draft's logits), verify
    them with `rule` (the standard rejection sampler unless a rule is given), per row with the row's stream.
    The target's logits at verify position j are processed with the history before it (`histories`: the
    committed output and the first j drafts), so a penalty counts each token once, accepted drafts included."""

    name = "sampled-spec"

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

    def processed_target(self, logits: torch.Tensor, row: SampledRow, drafts: list[int]) -> torch.Tensor:
        """[k+1, V] raw target logits of one row -> [k+1, V] after the request's processors (before its temperature)."""
        return torch.stack([processed_row(logits[j], row.prompt, history, row.params, row.stop_ids, self.penalty_scope)
                            for j, history in enumerate(self.histories(row.output, drafts))])

    def step(self, rows: list[SampledRow], draws: list[Draws]) -> list[list[int]]:
        k = self.k
        sampling = [sampling_of(row.params) for row in rows]
        extended = [row.prompt + row.output for row in rows]
        draft_logits = []
        for j in range(k + int(self.rule.needs_last_draft_row)):
            logits = _last_logits(self.draft, extended, 1)[:, 0]  # [B, V]
            draft_logits.append(logits)
            if j < k:
                for b, row in enumerate(extended):
                    row.append(draws[b].categorical(self.rule.draft_probs(logits[b], sampling[b])))
        draft_table = torch.stack(draft_logits, dim=1)  # [B, k(+1), V]
        target_table = _last_logits(self.target, extended, k + 1)  # [B, k+1, V]
        emitted = []
        for b, row in enumerate(rows):
            drafts = extended[b][len(row.prompt) + len(row.output):]  # [k]
            p = self.rule.target_probs(self.processed_target(target_table[b], row, drafts), sampling[b])  # [k+1, V]
            q_used = self.rule.acceptance_q(draft_table[b], sampling[b])  # [k(+1), V]
            emitted.append(self.rule.verify(p, q_used, drafts, draws[b]))
        return emitted


class RequestSampled:
    """One of the project's engines (`registry.REQUEST_ENGINES`) asked for sampled tokens the way any request
    asks: each prompt's `RequestParams` carries the temperature, top-k, top-p and its own seed. `generate`
    takes a seed per request like the small sampled engines; `last_step_offsets` comes from the engine's
    trace (each token's offset in the step that emitted it)."""

    # one `RequestParams` per prompt of the next `generate` (the sampled audit's penalties and the rest), each
    # given its seed here; None: `params` alone
    request_params: list[RequestParams] | None = None

    def __init__(self, engine: Any, params: SamplingParams, seed: int) -> None:
        self.engine, self.params, self.seed = engine, params, seed
        self.name = engine.name
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
        try:
            outputs = self.engine.generate(prompts, max_new_tokens, eos_token_id)
        finally:
            self.engine.request_params = None
        trace = self.engine.last_trace
        self.last_step_offsets = trace.step_offsets() if trace is not None and trace.steps else [[0] * len(o) for o in outputs]
        return outputs
