"""Teacher forcing: the target's exact distribution at every token an engine sampled, given the prefix
the engine itself produced (the first token too: it comes from the prompt's pass like any other).

`Processing` says how the raw logits become that distribution: the sampler's temperature and cuts alone
(`SamplingParams`), or, with `requests` (one `RequestParams` per sample), each request's whole chain in vLLM's
order (engines/requests/sampled.py): bad words, min_tokens, logit bias, the penalties, on the sample's own
history before each token (its prompt and the tokens it sampled before), then temperature, min-p, top-k,
top-p."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.sampled import request_table
from specaudit.engines.sampling.process import SamplingParams, process_logits

Sample = tuple[list[int], list[int]]  # (prompt ids, sampled ids)


def target_logits(model: PreTrainedModel, samples: list[Sample], batch_size: int = 32) -> list[torch.Tensor]:
    """Per sample [n, V] float64: the target's logits before each sampled token, unprocessed."""
    return list(_logits(model, samples, batch_size))


@torch.no_grad()
def _logits(model: PreTrainedModel, samples: list[Sample], batch_size: int) -> Iterator[torch.Tensor]:
    """Each sample's [n, V] float64 logits in turn. One forward pass per sample (right-padded in batches:
    causal attention never reads the padding after a row's own positions)."""
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        rows = [prompt + tokens[:-1] for prompt, tokens in chunk]
        longest = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long, device=model.device)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row, device=model.device)
        logits = model(input_ids=ids).logits.to(torch.float64).cpu()  # [B, L, V]
        for b, (prompt, tokens) in enumerate(chunk):
            first = len(prompt) - 1
            yield logits[b, first:first + len(tokens)]  # [n, V]


@dataclass(frozen=True)
class Processing:
    """How raw logits become the distribution sample `index`'s tokens were drawn from (module docstring).
    `requests`: one `RequestParams` per sample (bad words as ids), or None for `params` alone; `stop_ids`: what
    `min_tokens` bans (the EOS ids); `penalty_scope`: what presence and frequency count ("output": vLLM,
    SGLang; "context": llama.cpp)."""

    params: SamplingParams
    requests: Sequence[RequestParams] | None = None
    stop_ids: tuple[int, ...] = ()
    penalty_scope: str = "output"

    def table(self, index: int, sample: Sample, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] raw logits before each of the sample's tokens -> [n, V] float64 probabilities."""
        if self.requests is None:
            return process_logits(logits, self.params)
        prompt, tokens = sample
        return request_table(logits, prompt, [], tokens[: logits.shape[0]], self.requests[index], self.stop_ids,
                             self.penalty_scope)

    def row(self, index: int, sample: Sample, position: int, logits: torch.Tensor) -> torch.Tensor:
        """[V] raw logits before the sample's token at `position` -> [V] float64 probabilities."""
        if self.requests is None:
            return process_logits(logits, self.params)
        prompt, tokens = sample
        return request_table(logits.unsqueeze(0), prompt, tokens[:position], [], self.requests[index],
                             self.stop_ids, self.penalty_scope)[0]


def target_distributions(model: PreTrainedModel, samples: list[Sample], params: SamplingParams | Processing,
                         batch_size: int = 32) -> list[torch.Tensor]:
    """Per sample [n, V] float64: the target's logits before each sampled token (`target_logits`), processed
    (`params`: the sampler's alone, or a `Processing`). The model should be float64: it is the oracle."""
    processing = params if isinstance(params, Processing) else Processing(params)
    return [processing.table(index, sample, logits)
            for index, (sample, logits) in enumerate(zip(samples, _logits(model, samples, batch_size)))]
