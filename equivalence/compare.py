"""Token-by-token and logit-by-logit comparison of an engine's output with the reference's.

Tokens: per prompt, exact match, matched-prefix length, first divergent position.
Logits: the target is replayed one prompt at a time along the engine's OWN output (teacher
forcing, batch size 1), and what the engine's step saw is compared with that replay, so latent
corruption shows before any token flips: in float64 a constant position offset in a RoPE model
moves logits by ~1e-8 and changes no token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class PromptComparison:
    index: int
    exact: bool
    matched_prefix: int
    first_divergence: int | None
    reference_length: int
    engine_length: int
    max_logit_error: float | None = None
    worst_logit_position: int | None = None
    failed: bool = False  # the engine failed on this prompt (a failure finding of the run)

    def to_dict(self) -> dict:
        return asdict(self)


def matched_prefix(reference: list[int], engine: list[int]) -> int:
    n = 0
    for a, b in zip(reference, engine):
        if a != b:
            break
        n += 1
    return n


def compare_tokens(index: int, reference: list[int], engine: list[int]) -> PromptComparison:
    n = matched_prefix(reference, engine)
    exact = list(reference) == list(engine)
    return PromptComparison(
        index=index, exact=exact, matched_prefix=n, first_divergence=None if exact else n,
        reference_length=len(reference), engine_length=len(engine),
    )


@torch.no_grad()
def replay_logits(target: PreTrainedModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Target logits [len(continuation), V] that choose each token of `continuation` after `prompt`,
    from one uncached forward pass of batch size 1."""
    if not continuation:
        return torch.empty(0)
    ids = torch.tensor([list(prompt) + list(continuation[:-1])], dtype=torch.long, device=target.device)
    logits = target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 :]
    return logits


def logit_error(engine_logits: torch.Tensor | None, replay: torch.Tensor) -> tuple[float | None, int | None]:
    """Largest |engine - replay| over the rows both have, and the position where it occurs."""
    if engine_logits is None or replay.numel() == 0:
        return None, None
    n = min(engine_logits.shape[0], replay.shape[0])
    if n == 0:
        return None, None
    diff = (engine_logits[:n].to(torch.float64).cpu() - replay[:n].to(torch.float64).cpu()).abs()  # [n, V]
    per_position = diff.amax(dim=1)
    worst = int(per_position.argmax())
    return float(per_position[worst]), worst


def top2(logits: torch.Tensor) -> tuple[list[list[float]], float]:
    """[[token, logit], [token, logit]] of the two largest logits, and their margin."""
    values, tokens = logits.to(torch.float64).topk(2)
    pairs = [[int(t), float(v)] for t, v in zip(tokens.tolist(), values.tolist())]
    return pairs, pairs[0][1] - pairs[1][1]
