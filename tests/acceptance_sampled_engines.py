"""Sampled engines for the acceptance tests, named as `acceptance_sampled_engines:factory`: a planted draft
fault that keeps the sampled outputs distributed as the target's and lowers acceptance."""

from __future__ import annotations

from typing import Any

from specaudit.engines.sampling.engine import RequestSampled
from specaudit.engines.sampling.process import SamplingParams
from specaudit.testing.faults import DraftCacheNotTrimmed


def draft_cache_not_trimmed(target, draft, *, temperature: float, top_k: int, top_p: float, seed: int,
                            draft_tokens: int, batch_size: int = 64, **options: Any) -> RequestSampled:
    """EQSPEC with its draft cache not trimmed after a rejection (`DraftCacheNotTrimmed`), sampled through its
    request parameters as `--temperature` samples the shipped EQSPEC. The draft proposes from a distribution
    conditioned on the rejected tokens it kept, and the acceptance divides by that same distribution, so every
    sampled token is still distributed as the target's: only the acceptance falls."""
    fault = DraftCacheNotTrimmed(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)
    return RequestSampled(fault.inner, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed)
