"""The sampled audit against a served reference (`specaudit audit --temperature 1 --engine E --reference R`).

No weights in the process. The audited server's samples (seeded, one request each, `--samples` of them spread
over the prompts) are teacher-forced through the reference's `prompt_logprobs` (vLLM: the prompt and the
sample sent as one prompt; per position the log-probabilities of the reference's top N tokens and of the
sampled token). Per position the reference's distribution is cut into N + 1 bins: its top N tokens and the
rest as one bin (mass 1 - the top N's). Each sampled token becomes a randomized PIT value over those bins, the
bins ordered by descending probability (stats.randomized_pit): u = F(bin-) + v P(bin), exactly U[0, 1) when
the server samples from the reference's distribution. A chi-square test on 10 bins of u and a
Kolmogorov-Smirnov test, Holm-corrected at `--alpha`, decide.

Power: the chi-square test on n values sees a departure of total variation d between its bins with power 0.8
where d >= `stats.detectable_tv(n, 9, alpha)` (stated in the result). Merging the tail into one bin keeps
every departure that moves mass between the top N tokens or between them and the tail, and loses one that
only reorders the tail (mass below the reference's N-th token).

Only what the reference's log-probabilities describe is testable: temperature 1 without cuts (vLLM's
`prompt_logprobs` are the raw distribution); other sampling settings are refused (exit 2).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specaudit.engines.contract import capability
from specaudit.equivalence.reports.sampled import PASS
from specaudit.equivalence.rulings.thresholds import PIT_BINS, POWER, SERVED_PIT_BINS
from specaudit.equivalence.sampling import stats
from specaudit.equivalence.pipeline.settings import TEACHER_FORCING_TOP as TOP  # noqa: E402


def bins_of(entry: dict[int, float], token: int, top: int) -> tuple[list[float], int]:
    """The reference's distribution at one position cut into its top `top` tokens and the rest (one bin), in
    descending order, and the bin of `token`."""
    ranked = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))
    # `entry` holds the top N and the sampled token; the sampled token is in the top only by its rank
    head = ranked[:top]
    probs = [math.exp(v) for _, v in head]
    rest = max(0.0, 1.0 - sum(probs))
    ids = [t for t, _ in head]
    return probs + [rest], (ids.index(token) if token in ids else len(ids))


def pit_values(distributions: list[tuple[list[float], int]], generator: torch.Generator) -> torch.Tensor:
    """One randomized PIT value per position over its bins (already in descending order; the rest bin last)."""
    values = []
    jitter = torch.rand(len(distributions), generator=generator, dtype=torch.float64)
    for (probs, chosen), v in zip(distributions, jitter.tolist()):
        below = sum(probs[:chosen])
        values.append(min(below + v * probs[chosen], 1.0 - 1e-12))
    return torch.tensor(values, dtype=torch.float64)


def served_sampled_audit(engine: Any, reference: Any, prompts: list[list[int]], *, samples: int, max_new_tokens: int,
                         eos_token_id: Any, seed: int, alpha: float, top: int = TOP,
                         recorded: list[tuple[list[int], list[int]]] | None = None) -> dict[str, Any]:
    """`engine` (a SampledServer) drawn `samples` times over `prompts`, or the `recorded` samples (prompt,
    tokens) of a recording; each sample teacher-forced through `reference` (a server engine with
    `prompt_logprobs`); the tests (module docstring)."""
    from specaudit.equivalence.sampling.run import check_budget, spread

    if recorded is None:
        requests = spread(prompts, samples)
        outputs = engine.generate(requests, max_new_tokens, eos_token_id)
    else:
        requests, outputs = [list(p) for p, _ in recorded], [list(t) for _, t in recorded]
        check_budget(outputs, max_new_tokens, eos_token_id, recording=True)
    distributions: list[tuple[list[float], int]] = []
    for prompt, tokens in zip(requests, outputs):
        if not tokens:
            continue
        entries = reference.prompt_logprobs(list(prompt) + list(tokens), eos_token_id, top)
        for offset, token in enumerate(tokens):
            entry = entries[len(prompt) + offset]
            if entry and token in entry:
                distributions.append(bins_of(entry, int(token), top))
    generator = torch.Generator().manual_seed(seed)
    u = pit_values(distributions, generator)
    if u.numel() == 0:
        return {"verdict": "not tested", "samples": len(outputs), "tokens": 0, "tests": [],
                "reason": "no sampled token could be teacher-forced through the reference"}
    tests = [stats.chi_square_uniform(u, SERVED_PIT_BINS), stats.ks_uniform(u)]
    adjusted = stats.holm([t["p_value"] for t in tests])
    for test, p in zip(tests, adjusted):
        test["p_holm"] = p
    worst = min(range(len(tests)), key=lambda i: adjusted[i])
    rejected = adjusted[worst] < alpha
    detectable = stats.detectable_tv(int(u.numel()), SERVED_PIT_BINS - 1, alpha, POWER)
    tail = sum(p[-1] for p, _ in distributions) / len(distributions)
    # the report's fields (equivalence/reports/sampled.py), as the sampled audit with the weights gives them
    return {
        "verdict": "departure" if rejected else PASS, "departs": rejected,
        "p_value": adjusted[worst], "worst_test": f"all tokens ({tests[worst]['test']})", "alpha": alpha,
        "samples": len(outputs), "tokens": int(u.numel()), "top_n": top, "tests": tests,
        "effect_tv": tests[0].get("tv_observed"),
        "mean_tail_mass": tail, "detectable_tv_pooled": detectable, "detectable_tv_first_token": None,
        "power": POWER, "rounding": None,
        "pit_histogram": stats.pit_histogram(u, PIT_BINS),  # the chart's bins, as the sampled audit's
        "seeds": {"checked": False, "why": "a server's seeds are its own"},
        "speculation": capability(engine, "last_speculation"),
        "teacher_forcing": f"the reference's prompt_logprobs: its top {top} tokens and the rest as one bin",
        "power_note": (f"the chi-square test on these PIT values detects a departure of total variation {detectable:.3f} "
                       f"between its bins with power {POWER} at alpha {alpha}; a departure inside the reference's tail "
                       f"(below its top {top}, mean tail mass {tail:.3g}) is not seen"),
        **({"finding": f"all tokens: {'sharper' if float(u.mean()) < 0.5 else 'flatter'} than the reference "
                       f"(mean PIT {float(u.mean()):.3f})"} if rejected else {}),
    }
