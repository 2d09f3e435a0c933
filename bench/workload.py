"""The bench's serving-shaped workload: many requests through a few rows, with their own lengths.

- Requests: `num_prompts` prompts go through batch size B (default N = 4 x the largest batch size).
  When the prompt set holds fewer, it is repeated in order (`prompts_repeated` in bench.json).
- Output lengths: every request gets `max_new_tokens` new tokens unless `output_lengths` names a
  distribution; then request i gets its own budget (an EOS can still end it earlier), drawn once
  from a `torch.Generator` seeded with the bench's seed, so every engine serves the same requests:
    `uniform:LO:HI`     each budget uniform on LO..HI (inclusive)
    `geometric:MEAN`    geometric with mean MEAN (at least 1), cut at `max_new_tokens`
  Rows then finish at different steps. Engines that refill (EXSPEC's pool, INPLACE,
  hf-continuous) take the next request into a freed row; static ones (batched, EQSPEC) run batch
  after batch, each until its longest row is done.
- Row utilisation: the share of row-steps that did useful work, `sum over decoding steps of the
  rows that ran / (B x decoding steps)`. A static batch whose rows have finished keeps running
  with fewer rows; EXSPEC's pool steps a group of at most B of its window.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specaudit.engines.trace import Trace

DISTRIBUTIONS = ("uniform:LO:HI", "geometric:MEAN")


def parse_output_lengths(spec: str, max_new_tokens: int) -> tuple[str, tuple[float, ...]]:
    """(`uniform` | `geometric`, parameters) from `uniform:LO:HI` or `geometric:MEAN`; ValueError otherwise."""
    name, _, rest = spec.partition(":")
    try:
        values = tuple(float(v) for v in rest.split(":")) if rest else ()
    except ValueError:
        values = ()
    if name == "uniform" and len(values) == 2 and all(v.is_integer() for v in values):
        low, high = int(values[0]), int(values[1])
        if not 1 <= low <= high <= max_new_tokens:
            raise ValueError(f"output lengths {spec!r}: need 1 <= LO <= HI <= max_new_tokens ({max_new_tokens})")
        return name, (low, high)
    if name == "geometric" and len(values) == 1:
        if not 1.0 <= values[0] <= max_new_tokens:
            raise ValueError(f"output lengths {spec!r}: need 1 <= MEAN <= max_new_tokens ({max_new_tokens})")
        return name, values
    raise ValueError(f"output lengths {spec!r}: use one of {', '.join(DISTRIBUTIONS)}")


def draw_output_lengths(spec: str, count: int, max_new_tokens: int, seed: int) -> list[int]:
    """`count` per-request budgets from the distribution `spec`, seeded; each within 1..max_new_tokens."""
    name, params = parse_output_lengths(spec, max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    if name == "uniform":
        low, high = int(params[0]), int(params[1])
        return torch.randint(low, high + 1, (count,), generator=generator).tolist()
    mean = params[0]
    if mean <= 1.0:
        return [1] * count
    p = 1.0 / mean  # P(length = n) = (1 - p)^(n - 1) p, n >= 1
    uniform = torch.rand(count, generator=generator, dtype=torch.float64)
    lengths = (torch.log1p(-uniform) / math.log1p(-p)).floor().long() + 1
    return lengths.clamp(1, max_new_tokens).tolist()


def serving_prompts(prompts: list[list[int]], count: int) -> list[list[int]]:
    """`count` requests from the prompt set, repeated in order when it holds fewer."""
    if not prompts:
        raise ValueError("no prompts")
    return [list(prompts[i % len(prompts)]) for i in range(count)]


def row_utilisation(trace: Trace | None, batch_size: int) -> float | None:
    """Rows that ran / (batch size x decoding steps), over the trace's non-prefill steps."""
    steps = [s for s in (trace.steps if trace is not None else []) if s.kind != "prefill"]
    if not steps:
        return None
    return sum(len(s.rows) for s in steps) / (batch_size * len(steps))


def workload_record(prompts: list[list[int]], budgets: list[int] | None, spec: str | None, max_new_tokens: int,
                    repeated: bool) -> dict[str, Any]:
    """What bench.json says about the requests."""
    lengths = budgets if budgets is not None else [max_new_tokens] * len(prompts)
    return {
        "requests": len(prompts), "prompts_repeated": repeated,
        "output_lengths": spec or f"fixed:{max_new_tokens}",
        "budgets": lengths, "mean_budget": sum(lengths) / len(lengths),
        "prompt_tokens": sum(map(len, prompts)),
    }
