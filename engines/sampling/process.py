"""Sampling parameters and the processing of logits into the probabilities a token is drawn from.

The order is vLLM's (vllm/v1/sample/sampler.py `Sampler.sample`): temperature, then min-p, then top-k,
then top-p, then renormalisation. Ties are kept on every cut, so the result never depends on how a sort
orders equal values:

- min-p keeps every token whose tempered probability is at least `min_p` times the top token's (vLLM's
  `MinPLogitsProcessor`, an argmax-invariant processor run after the temperature);

- top-k keeps every token whose logit is at least the k-th largest (a tie at the k-th place keeps all
  of the tied tokens);
- top-p keeps token i when the probability mass of the tokens strictly more likely than i is below
  `top_p` (the smallest head of the distribution that reaches `top_p`, with its boundary ties).

Temperature 0 is greedy: the distribution is the one-hot of `argmax` (the first maximum, as
`engines/reference.py` chooses), so every sampler built on it reduces to the exact greedy rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. `top_k=0`, `top_p=1.0` and `min_p=0.0` switch the cuts off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be at least 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be at least 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def without(self, *, temperature: bool = False, top_k: bool = False, top_p: bool = False) -> "SamplingParams":
        """The same parameters with some left out (temperature 1, no cut): what a processor that forgets them uses."""
        return replace(self, temperature=1.0 if temperature else self.temperature,
                       top_k=0 if top_k else self.top_k, top_p=1.0 if top_p else self.top_p)

    def describe(self) -> dict[str, float | int]:
        described: dict[str, float | int] = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        if self.min_p:
            described["min_p"] = self.min_p
        return described


def _keep_top_k(scaled: torch.Tensor, k: int) -> torch.Tensor:
    """[..., V] bool: logit at least the k-th largest."""
    if k <= 0 or k >= scaled.shape[-1]:
        return torch.ones_like(scaled, dtype=torch.bool)
    kth = scaled.topk(k, dim=-1).values[..., -1:]  # [..., 1]
    return scaled >= kth


def _keep_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """[..., V] bool: probability at least min_p times the top one's, i.e. logit at least the top logit
    plus log(min_p) (the softmax's normaliser cancels)."""
    if min_p <= 0:
        return torch.ones_like(scaled, dtype=torch.bool)
    probs = torch.softmax(scaled, dim=-1)  # [..., V]
    return probs >= min_p * probs.max(-1, keepdim=True).values


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: the mass strictly above each token is below top_p."""
    if top_p >= 1:
        return torch.ones_like(probs, dtype=torch.bool)
    # mass strictly above p_i = sum of p_j over p_j > p_i; [..., V, V] is fine for the vocabularies
    # this is exact for, and a sort-based version follows for large V
    if probs.shape[-1] <= 512:
        above = (probs.unsqueeze(-2) * (probs.unsqueeze(-2) > probs.unsqueeze(-1))).sum(-1)  # [..., V]
        return above < top_p
    ordered, order = probs.sort(dim=-1, descending=True)  # [..., V]
    exclusive = ordered.cumsum(-1) - ordered
    # a tie group takes the exclusive mass of its first member: the mass strictly above it
    first = torch.searchsorted(-ordered.contiguous(), -ordered.contiguous(), right=False)
    above_sorted = exclusive.gather(-1, first)
    keep = torch.empty_like(probs, dtype=torch.bool)
    keep.scatter_(-1, order, above_sorted < top_p)
    return keep


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float64 probabilities that a sampler with `params` draws from."""
    scores = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).to(torch.float64)
    scaled = scores / params.temperature
    scaled = scaled.masked_fill(~_keep_min_p(scaled, params.min_p), float("-inf"))
    scaled = scaled.masked_fill(~_keep_top_k(scaled, params.top_k), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    probs = probs * _keep_top_p(probs, params.top_p)
    return probs / probs.sum(-1, keepdim=True)
