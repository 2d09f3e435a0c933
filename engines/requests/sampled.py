"""One sampled request's whole chain, from the target's raw logits to the distribution its token is drawn from.

vLLM's order (vllm/v1/sample/sampler.py, `Sampler.forward` then `Sampler.sample`):

1. the logits processors of `engines/requests` (`process`): bad words, min_tokens, logit bias, then the
   penalties (repetition, then frequency and presence), each on the request's history at that position:
   the prompt and the output before the token;
2. temperature, then min-p, then top-k, then top-p (`engines/sampling/process.py` `process_logits`, with
   `sampling_of(params)`).

Under speculation the history of verify position j is the committed output and the first j draft tokens
(`request_table`): a penalty counts every token before the one it decides, accepted drafts included, once
each. A constrained request's grammar mask comes before step 1 (vLLM applies its bitmask to the logits before
its sampler): every token the grammar forbids at that position is `-inf`, so the temperature and the cuts
renormalize over the admitted tokens alone. The sampled audit's reference (equivalence/sampling/teacher.py) and the project's sampled engines
(engines/sampling/engine.py, engines/requests/rows.py) compute the same rows with these functions.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from specaudit.engines.requests import RequestParams, process
from specaudit.engines.sampling.process import SamplingParams, process_logits

# the fields whose processors change a sampled request's logits before its temperature
PROCESSOR_FIELDS = ("bad_words", "min_tokens", "logit_bias", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")


def sampling_of(params: RequestParams) -> SamplingParams:
    """The sampler's own part of a request: temperature, top-k (-1: off), top-p and min-p."""
    return SamplingParams(temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p,
                          min_p=params.min_p)


def has_processors(params: RequestParams) -> bool:
    """Whether a processor before the temperature can change this request's logits."""
    return any(name in PROCESSOR_FIELDS for name in params.sent())


def processed_row(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], params: RequestParams,
                  stop_ids: Iterable[int], penalty_scope: str = "output",
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[V] raw logits -> [V] float64 logits after the processors (step 1), with `output` the tokens before;
    `allowed` [V]: the tokens a constraint's grammar admits there, masked first (None: unconstrained)."""
    if not has_processors(params) and allowed is None:
        return logits.to(torch.float64)
    return process(logits, prompt, output, params, stop_ids, penalty_scope, allowed=allowed).greedy


def request_table(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], continuation: Sequence[int],
                  params: RequestParams, stop_ids: Iterable[int], penalty_scope: str = "output",
                  allowed: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """[n, V] raw logits -> [n, V] float64 probabilities: position j's distribution given the prompt, `output`
    and the first j tokens of `continuation` (a verify step's drafts, or the sampled tokens themselves);
    `allowed`: a constrained request's grammar mask [V] per position (engines/constraints/matcher.py), first."""
    stops = list(stop_ids)
    rows = [processed_row(logits[j], prompt, list(output) + list(continuation[:j]), params, stops, penalty_scope,
                          allowed[j] if allowed is not None else None)
            for j in range(logits.shape[0])]
    table = torch.stack(rows) if rows else logits.to(torch.float64)  # [n, V]
    return process_logits(table, sampling_of(params))
