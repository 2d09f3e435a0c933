"""Two small sampled engines on the standard rule: `SampledSpeculative` (draft k, verify with a
`SpeculativeRule`) and `SampledReference` (the target alone); and `RequestSampled`, one of the project's
engines asked for sampled tokens through its request parameters. Both take temperature, top-k, top-p
and a seed per request, and draw every random decision of a row from that row's own generator, so a
seeded request gives the same tokens alone or inside any batch.

No cache: each pass runs the whole sequence, right-padded in a batch. With causal attention a row's
logits at its own positions never see the padding after them, so batching changes nothing but the
rounding of the batched matrix products (float64: 1e-16, far below any decision's resolution).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from specaudit.engines.limits import eos_ids, request_limits
from specaudit.engines.sampling.process import SamplingParams, process_logits
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


class _SampledEngine:
    black_box = False
    k = 0

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch_size: int = 64, **_: object) -> None:
        self.target, self.draft = target, draft
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self.seed, self.batch_size = seed, batch_size

    def draws_for(self, seeds: list[int]) -> list[Draws]:
        """Each request's own stream."""
        return [seeded_draws(s) for s in seeds]

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: int | list[int] | None,
                 seeds: list[int] | None = None) -> list[list[int]]:
        limits = request_limits(max_new_tokens, len(prompts))
        seeds = request_seeds(self.seed, len(prompts)) if seeds is None else list(seeds)
        # per request, each token's offset in the step that emitted it: the drafts accepted before it in
        # that step (k: the bonus token); what the sampled audit stratifies by
        self.last_step_offsets: list[list[int]] = []
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            outputs += self._generate_batch(prompts[chunk], limits[chunk], eos_token_id, self.draws_for(seeds[chunk]))
        return outputs

    def _generate_batch(self, prompts: list[list[int]], limits: list[int], eos_token_id, draws: list[Draws]
                        ) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in prompts]
        offsets: list[list[int]] = [[] for _ in prompts]
        live = [b for b in range(len(prompts)) if limits[b] > 0]
        while live:
            steps = self.step([prompts[b] + outputs[b] for b in live], [draws[b] for b in live])
            still = []
            for b, emitted in zip(live, steps):
                outputs[b], done = _finish(outputs[b] + emitted, limits[b], eos_token_id)
                offsets[b] = (offsets[b] + list(range(len(emitted))))[: len(outputs[b])]
                if not done:
                    still.append(b)
            live = still
        self.last_step_offsets += offsets
        return outputs

    def step(self, rows: list[list[int]], draws: list[Draws]) -> list[list[int]]:
        raise NotImplementedError


class SampledReference(_SampledEngine):
    """The target alone: each token drawn from process_logits(target logits) with the row's stream."""

    name = "sampled-reference"

    def step(self, rows: list[list[int]], draws: list[Draws]) -> list[list[int]]:
        probs = process_logits(_last_logits(self.target, rows, 1)[:, 0], self.params)  # [B, V]
        return [[d.categorical(probs[b])] for b, d in enumerate(draws)]


class SampledSpeculative(_SampledEngine):
    """Draft k tokens from the draft's processed q, verify them with `rule` (the standard rejection
    sampler unless a rule is given), per row with the row's stream."""

    name = "sampled-spec"

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, draft_tokens: int = 4,
                 rule: SpeculativeRule | None = None, **options: object) -> None:
        if draft is None:
            raise ValueError("sampled-spec needs a draft model")
        super().__init__(target, draft, **options)  # type: ignore[arg-type]
        self.k = draft_tokens
        self.rule = rule or SpeculativeRule()

    def step(self, rows: list[list[int]], draws: list[Draws]) -> list[list[int]]:
        k, params = self.k, self.params
        extended = [list(row) for row in rows]
        draft_logits = []
        for j in range(k + int(self.rule.needs_last_draft_row)):
            logits = _last_logits(self.draft, extended, 1)[:, 0]  # [B, V]
            draft_logits.append(logits)
            if j < k:
                q = self.rule.draft_probs(logits, params)  # [B, V]
                for b, row in enumerate(extended):
                    row.append(draws[b].categorical(q[b]))
        draft_table = torch.stack(draft_logits, dim=1)  # [B, k(+1), V]
        target_table = _last_logits(self.target, extended, k + 1)  # [B, k+1, V]
        p = self.rule.target_probs(target_table, params)  # [B, k+1, V]
        q_used = self.rule.acceptance_q(draft_table, params)  # [B, k(+1), V]
        return [self.rule.verify(p[b], q_used[b], extended[b][len(rows[b]):], draws[b]) for b in range(len(rows))]


class RequestSampled:
    """One of the project's engines (`registry.REQUEST_ENGINES`) asked for sampled tokens the way any request
    asks: each prompt's `RequestParams` carries the temperature, top-k, top-p and its own seed. `generate`
    takes a seed per request like the small sampled engines; `last_step_offsets` comes from the engine's
    trace (each token's offset in the step that emitted it)."""

    def __init__(self, engine: Any, params: SamplingParams, seed: int) -> None:
        self.engine, self.params, self.seed = engine, params, seed
        self.name = engine.name
        self.last_step_offsets: list[list[int]] | None = None

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: Any,
                 seeds: list[int] | None = None) -> list[list[int]]:
        from specaudit.engines.requests import RequestParams

        seeds = request_seeds(self.seed, len(prompts)) if seeds is None else list(seeds)
        self.engine.request_params = [RequestParams(temperature=self.params.temperature, top_k=self.params.top_k,
                                                    top_p=self.params.top_p, seed=s) for s in seeds]
        try:
            outputs = self.engine.generate(prompts, max_new_tokens, eos_token_id)
        finally:
            self.engine.request_params = None
        trace = self.engine.last_trace
        self.last_step_offsets = trace.step_offsets() if trace is not None and trace.steps else [[0] * len(o) for o in outputs]
        return outputs
