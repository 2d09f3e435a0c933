"""Teacher forcing: the target's exact distribution at every token an engine sampled, given the prefix
the engine itself produced (the first token too: it comes from the prompt's pass like any other)."""

from __future__ import annotations

from typing import Iterator

import torch
from transformers import PreTrainedModel

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


def target_distributions(model: PreTrainedModel, samples: list[Sample], params: SamplingParams,
                         batch_size: int = 32) -> list[torch.Tensor]:
    """Per sample [n, V] float64: process_logits of the target's logits before each sampled token
    (`target_logits`). The model should be float64: it is the oracle."""
    return [process_logits(logits, params) for logits in _logits(model, samples, batch_size)]
