"""Sampled requests with seeds, judged by what a seed promises (the search's `seeded` step, equivalence/search/
machine.py): no token-by-token reference exists for a sample, but three facts hold for any correct engine.

1. **The same seed twice gives the same output**, sent together with another request or alone: a request's
   output does not depend on the requests beside it (TensorRT-LLM #17599 ignored per-request seeds;
   vllm-ascend #13608 advanced a request's random stream in steps where it had no drafts, so its samples moved with
   its neighbours').
2. **Distinct seeds differ as the target's distribution says they should**: `SEED_SAMPLES` requests with distinct
   seeds all choosing the same first token has probability sum_i p_i ** SEED_SAMPLES under the target's
   distribution at that temperature (float64, the reference's logits at the prompt's last position); all of their
   outputs identical where that is below `SEED_ALPHA` is a finding.
3. **Unseeded requests are independent**: the same test over `SEED_SAMPLES` unseeded requests sent one after
   another (TensorRT-LLM #19487: unseeded requests shared one random stream, so consecutive ones sampled alike).

A failed fact is a structural divergence of class `seeded_sampling` naming which (`processor`: "same seed",
"distinct seeds", "unseeded"). The checks are made only where the engine takes a sampled request: a live server
(engines/adapters/sampled_servers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specaudit.equivalence.records import Divergence
from specaudit.equivalence.rulings.record import finding

SEED_SAMPLES = 6  # requests with distinct seeds (and unseeded ones) per probe
SEED_ALPHA = 1e-3  # the chance, under the target's distribution, of the identical outputs that make a finding
TEMPERATURES = (1.0, 1.5)
CLASS = "seeded_sampling"  # its fix: equivalence/blackbox/outputs.py REQUEST_FIXES


@dataclass(frozen=True)
class SeedProbe:
    """One sampled probe of request `request`'s prompt at `temperature`, seeds from `seed` on."""

    request: int
    temperature: float
    seed: int


class SeededSampler:
    """`sample(prompts, seeds, max_new_tokens, eos)`: a live server's sampled outputs at one temperature (seeds
    None: unseeded requests, sent one after another)."""

    def __init__(self, server: Any, temperature: float) -> None:
        self.server, self.temperature = server, temperature

    def sample(self, prompts: list[list[int]], seeds: list[int] | None, max_new_tokens: int, eos: Any) -> list[list[int]]:
        from specaudit.engines.adapters.sampled_servers import SampledServer
        from specaudit.engines.sampling.process import SamplingParams

        server = SampledServer(self.server, SamplingParams(temperature=self.temperature), seed=0,
                               seed_requests=seeds is not None)
        if seeds is None:  # one after another: what a shared stream would give alike
            return [server.generate([p], max_new_tokens, eos, seeds=[0])[0] for p in prompts]
        return server.generate(prompts, max_new_tokens, eos, seeds=list(seeds))


def sampler_for(engine: Any, temperature: float) -> SeededSampler | None:
    """A sampler of `engine`, or None where it takes no sampled requests (an in-process greedy engine)."""
    from specaudit.engines.adapters.sampled_servers import SAMPLED_DIALECTS

    inner = getattr(engine, "_engine", engine)  # equivalence/search/arrival.py wraps it
    if getattr(inner, "dialect", None) in SAMPLED_DIALECTS:
        return SeededSampler(inner, temperature)
    return None


def first_token_collision(logits: torch.Tensor, temperature: float, samples: int) -> float:
    """sum_i p_i ** samples: the chance that `samples` independent samples of the first new token all agree, from
    the target's raw logits at the prompt's last position ([V])."""
    p = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    return float((p ** samples).sum())


def probe_findings(index: int, probe: SeedProbe, prompt: Sequence[int], sampler: SeededSampler,
                   first_logits: torch.Tensor, max_new_tokens: int, eos: Any) -> tuple[list[Divergence], dict[str, Any]]:
    """The three facts (module docstring) checked for one probe, `first_logits` the target's at the prompt's last
    position (the reference's plain continuation already has them); (findings, what was seen)."""
    prompt = [int(t) for t in prompt]
    seed = probe.seed
    together = sampler.sample([prompt, prompt], [seed, seed + 1], max_new_tokens, eos)
    alone = sampler.sample([prompt], [seed], max_new_tokens, eos)[0]
    distinct = [together[0]] + sampler.sample([prompt] * (SEED_SAMPLES - 1),
                                              [seed + 2 + i for i in range(SEED_SAMPLES - 1)], max_new_tokens, eos)
    unseeded = sampler.sample([prompt] * SEED_SAMPLES, None, max_new_tokens, eos)
    chance = first_token_collision(first_logits, probe.temperature, SEED_SAMPLES)
    seen = {"temperature": probe.temperature, "seed": seed, "same_seed": [together[0], alone],
            "distinct_seeds_identical": all(o == distinct[0] for o in distinct),
            "unseeded_identical": all(o == unseeded[0] for o in unseeded), "chance_all_identical": chance}
    found: list[Divergence] = []
    if together[0] != alone:
        where = next((i for i, (a, b) in enumerate(zip(together[0], alone)) if a != b),
                     min(len(together[0]), len(alone)))
        found.append(finding(index, where, CLASS, "seed-replay",
                             f"seed {seed} at temperature {probe.temperature:g} gave {together[0][:8]}... sent beside "
                             f"another request and {alone[:8]}... alone: the same seed must give the same output",
                             {"processor": "same seed", "together": together[0], "alone": alone}))
    for name, outputs, what in (("distinct seeds", distinct, f"{SEED_SAMPLES} distinct seeds from {seed + 2}"),
                                ("unseeded", unseeded, f"{SEED_SAMPLES} unseeded requests, one after another")):
        if chance < SEED_ALPHA and all(o == outputs[0] for o in outputs):
            found.append(finding(index, 0, CLASS, "seed-replay",
                                 f"{what} at temperature {probe.temperature:g} all gave {outputs[0][:8]}...: the "
                                 f"target's distribution gives that {chance:.2g} chance (their first tokens alone)",
                                 {"processor": name, "output": outputs[0], "chance": chance}))
    return found, seen
