"""Teacher forcing: the target's exact distribution at every token an engine sampled, given the prefix
the engine itself produced (the first token too: it comes from the prompt's pass like any other).

`Processing` says how the raw logits become that distribution: the sampler's temperature and cuts alone
(`SamplingParams`), or, with `requests` (one `RequestParams` per sample), each request's whole chain in vLLM's
order (engines/requests/sampled.py): bad words, min_tokens, logit bias, the penalties, on the sample's own
history before each token (its prompt and the tokens it sampled before), then temperature, min-p, top-k,
top-p. A constrained request (`RequestParams.constraint`) is masked first at each position with what its
grammar admits after the prompt's output so far (engines/constraints/matcher.py `masks_along`, over the
tokenizer's vocabulary as the engines build it: `tokenizer`), so the distribution is the masked, renormalized
one a constrained sampler draws from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.constraints.matcher import masks_along
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
    SGLang; "context": llama.cpp); `tokenizer`: the target's, whose vocabulary a constraint's grammar is compiled
    over (needed when a request carries a constraint)."""

    params: SamplingParams
    requests: Sequence[RequestParams] | None = None
    stop_ids: tuple[int, ...] = ()
    penalty_scope: str = "output"
    tokenizer: Any = None

    def masks(self, index: int, before: Sequence[int], tokens: Sequence[int], vocab_size: int,
              prompt: Sequence[int] = ()) -> list[torch.Tensor] | None:
        """[V] per token of `tokens` (after `before`, the output after `prompt`): what sample `index`'s grammar
        admits; None unconstrained."""
        constraint = self.requests[index].constraint if self.requests is not None else None
        if constraint is None:
            return None
        if self.tokenizer is None:
            raise ValueError("a constrained request's distribution needs the target's tokenizer (Processing.tokenizer)")
        return masks_along(constraint, self.tokenizer, vocab_size, self.stop_ids, tokens, before, prompt)

    def table(self, index: int, sample: Sample, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] raw logits before each of the sample's tokens -> [n, V] float64 probabilities."""
        if self.requests is None:
            return process_logits(logits, self.params)
        prompt, tokens = sample
        continuation = tokens[: logits.shape[0]]
        return request_table(logits, prompt, [], continuation, self.requests[index], self.stop_ids,
                             self.penalty_scope, self.masks(index, [], continuation, logits.shape[-1], prompt))

    def row(self, index: int, sample: Sample, position: int, logits: torch.Tensor) -> torch.Tensor:
        """[V] raw logits before the sample's token at `position` -> [V] float64 probabilities."""
        if self.requests is None:
            return process_logits(logits, self.params)
        prompt, tokens = sample
        masks = self.masks(index, tokens[:position], tokens[position:position + 1], logits.shape[-1], prompt)
        return request_table(logits.unsqueeze(0), prompt, tokens[:position], [], self.requests[index],
                             self.stop_ids, self.penalty_scope, masks)[0]


def target_distributions(model: PreTrainedModel, samples: list[Sample], params: SamplingParams | Processing,
                         batch_size: int = 32) -> list[torch.Tensor]:
    """Per sample [n, V] float64: the target's logits before each sampled token (`target_logits`), processed
    (`params`: the sampler's alone, or a `Processing`). The model should be float64: it is the oracle."""
    processing = params if isinstance(params, Processing) else Processing(params)
    return [processing.table(index, sample, logits)
            for index, (sample, logits) in enumerate(zip(samples, _logits(model, samples, batch_size)))]
