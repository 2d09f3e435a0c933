"""Teacher forcing: the target's exact distribution at every token an engine sampled, given the prefix
the engine itself produced (the first token too: it comes from the prompt's pass like any other)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specaudit.engines.sampling.process import SamplingParams, process_logits

Sample = tuple[list[int], list[int]]  # (prompt ids, sampled ids)


@torch.no_grad()
def target_distributions(model: PreTrainedModel, samples: list[Sample], params: SamplingParams,
                         batch_size: int = 32) -> list[torch.Tensor]:
    """Per sample [n, V] float64: process_logits of the target's logits before each sampled token.
    One forward pass per sample (right-padded in batches: causal attention never reads the padding
    after a row's own positions). The model should be float64: it is the oracle."""
    out: list[torch.Tensor] = []
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
            out.append(process_logits(logits[b, first:first + len(tokens)], params))  # [n, V]
    return out
