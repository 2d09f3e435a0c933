"""Testing sampled outputs against the target's own distribution (see `stats` for the statistics).

Every sampled token becomes a randomized PIT value under the target's processed distribution given
the engine's own prefix (`teacher`). The family of tests, corrected together by Holm:

- all u's pooled (chi-square on 20 bins, and Kolmogorov-Smirnov);
- the u's at each output position (the first sampled token, the second, ...), where there are enough;
- each context (prompt and prefix) with at least `min_context` samples: its tokens counted against
  its distribution (the first position of every prompt is one context for all its samples);
- with `offsets` (an engine that says, per token, how many of its step's drafts were accepted before
  it): the u's at each step offset j. Whether a token sits at offset j is settled before it is drawn,
  so under a correct sampler each stratum is uniform too; offset k holds the bonus tokens alone, where
  a fault of the bonus token is not diluted by the other tokens;
- with `draft` (the draft model, float64): the u's again with the tokens ordered by the draft's ratio
  q/p on the same prefix (`stats.draft_ratio_order`), pooled and per offset: a sampler that leans
  toward the draft's distribution (bonus from q, the uniform stuck at 0) piles these near 0 in every
  context, where the p-ordered u's of different contexts cancel.

A token the target gives probability 0 (outside top-k/top-p, or not the argmax at temperature 0) is
a departure on its own: p-value 0.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from transformers import PreTrainedModel

from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.sampling import stats
from specaudit.equivalence.sampling.teacher import Sample, target_distributions

PIT_BINS = 20
POWER = 0.8


def _null_binned_tv(n: int, bins: int, generator: torch.Generator) -> float:
    return stats.null_tv(torch.full((bins,), 1.0 / bins, dtype=stats.F64), n, generator)


TOWARD_DRAFT = "ordered by the draft's q/p, "  # the scope's prefix of the tests on draft-ordered u's


def _offset_scope(offset: int) -> str:
    return "prefill tokens" if offset < 0 else f"step offset {offset}"


def _draft_distributions(draft: PreTrainedModel, samples: list[Sample], params: SamplingParams,
                         target_probs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sample [n, V]: the draft's processed distribution before each sampled token (teacher forced on
    the same prefix), on the target's vocabulary (ids the draft lacks: 0; ids past the target's: dropped)."""
    out = []
    for q, p in zip(target_distributions(draft, samples, params), target_probs):
        vocab = p.shape[-1]
        q = q[:, :vocab] if q.shape[-1] >= vocab else torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
        out.append(q)
    return out


def _direction(u: torch.Tensor) -> str:
    mean = float(u.mean())
    return ("sharper than the target (too much mass on its likely tokens)" if mean < 0.5
            else "flatter than the target (too much mass on its unlikely tokens)")


def audit_samples(model: PreTrainedModel, samples: list[Sample], params: SamplingParams, *, alpha: float = 0.01,
                  seed: int = 0, min_context: int = 50, max_context_tests: int = 64,
                  offsets: list[list[int]] | None = None, draft: PreTrainedModel | None = None) -> dict[str, Any]:
    """The sampled audit of `samples` against `model` (the float64 target). Returns the report's dict.
    `offsets`: per sample, each token's offset in the step that emitted it; `draft`: the draft model
    (module docstring)."""
    # the PIT's own stream, apart from every request's ((seed << 20) + i, engines/sampling/engine.py)
    generator = torch.Generator().manual_seed((1 << 62) + seed)
    probs = target_distributions(model, samples, params)
    draft_probs = _draft_distributions(draft, samples, params, probs) if draft is not None else None
    tokens, positions, table, contexts = [], [], [], defaultdict(list)
    impossible = []
    for index, ((prompt, sampled), p) in enumerate(zip(samples, probs)):
        for position, token in enumerate(sampled):
            if float(p[position, token]) <= 0:
                impossible.append({"sample": index, "position": position, "token": token})
            tokens.append(token)
            positions.append(position)
            table.append(p[position])
            contexts[(tuple(prompt), tuple(sampled[:position]))].append(len(tokens) - 1)
    if not tokens:
        raise ValueError("no sampled tokens to audit")
    all_probs = torch.stack(table)  # [N, V]
    token_ids = torch.tensor(tokens)
    jitter = torch.rand(len(tokens), generator=generator, dtype=stats.F64)  # [N]
    u = stats.randomized_pit(all_probs, token_ids, jitter)
    possible = ~torch.isnan(u)
    position_ids = torch.tensor(positions)
    offset_ids = torch.tensor([o for sample_offsets in offsets for o in sample_offsets]) if offsets is not None else None
    if offset_ids is not None and offset_ids.numel() != len(tokens):
        raise ValueError(f"{offset_ids.numel()} step offsets for {len(tokens)} sampled tokens: give one per token")

    tests: list[dict[str, Any]] = []
    pooled = u[possible]
    tests.append({**stats.chi_square_uniform(pooled, PIT_BINS), "scope": "all tokens"})
    tests.append({**stats.ks_uniform(pooled), "scope": "all tokens"})
    for position in sorted(set(positions)):
        at = u[possible & (position_ids == position)]
        bins = min(PIT_BINS, at.numel() // 5)
        if bins >= 2:
            tests.append({**stats.chi_square_uniform(at, bins), "scope": f"output position {position}"})
    if offset_ids is not None:
        for offset in sorted(set(offset_ids.tolist())):
            at = u[possible & (offset_ids == offset)]
            bins = min(PIT_BINS, at.numel() // 5)
            if bins >= 2:
                tests.append({**stats.chi_square_uniform(at, bins), "scope": _offset_scope(offset)})
    if draft_probs is not None:
        # the same jitter: only the order changes, so under the target each u is uniform as before
        u_draft = stats.randomized_pit(all_probs, token_ids, jitter,
                                       order=stats.draft_ratio_order(all_probs, torch.cat(draft_probs)))
        tests.append({**stats.chi_square_uniform(u_draft[possible], PIT_BINS), "scope": TOWARD_DRAFT + "all tokens"})
        for offset in sorted(set(offset_ids.tolist())) if offset_ids is not None else []:
            at = u_draft[possible & (offset_ids == offset)]
            bins = min(PIT_BINS, at.numel() // 5)
            if bins >= 2:
                tests.append({**stats.chi_square_uniform(at, bins), "scope": TOWARD_DRAFT + _offset_scope(offset)})
    big = sorted((key for key, rows in contexts.items() if len(rows) >= min_context),
                 key=lambda key: -len(contexts[key]))[:max_context_tests]
    for key in big:
        rows = torch.tensor(contexts[key])
        counts = torch.bincount(token_ids[rows], minlength=all_probs.shape[1]).to(stats.F64)
        test = stats.chi_square_counts(counts, all_probs[rows[0]])
        if test["df"] >= 1:
            test["tv_null"] = stats.null_tv(all_probs[rows[0]], len(rows), generator)
            tests.append({**test, "scope": f"context: prompt of {len(key[0])} tokens, prefix {list(key[1])}"})
    for test in tests:
        if test["test"] == "chi_square_pit":
            test["tv_null"] = _null_binned_tv(test["n"], test["bins"], generator)
        if "tv_null" in test:
            test["tv_excess"] = max(0.0, test["tv_observed"] - test["tv_null"])
    adjusted = stats.holm([t["p_value"] for t in tests])
    family_alpha = alpha / len(tests)  # Holm's first step: what the strongest test is held to
    for test, p_adjusted in zip(tests, adjusted):
        test["p_adjusted"] = p_adjusted
        if "df" in test:
            test["detectable_tv"] = stats.detectable_tv(test["n"], test["df"], family_alpha, POWER)
    worst = min(range(len(tests)), key=lambda i: adjusted[i])
    departs = bool(impossible) or adjusted[worst] < alpha
    pooled_test, contexts_tested = tests[0], [t for t in tests if t["test"] == "chi_square_context"]
    first_contexts = [t for t in contexts_tested if t["scope"].endswith("prefix []")]
    report: dict[str, Any] = {
        "params": params.describe(), "alpha": alpha, "samples": len(samples), "tokens": len(tokens),
        "tests": tests, "impossible_tokens": impossible[:20], "impossible_count": len(impossible),
        "p_value": 0.0 if impossible else adjusted[worst],
        "departs": departs,
        "worst_test": tests[worst]["scope"] + f" ({tests[worst]['test']})",
        # the worst test's TV between its bins, less what sampling noise alone gives at its n
        "effect_tv": tests[worst].get("tv_excess"),
        "detectable_tv_pooled": pooled_test["detectable_tv"],
        "detectable_tv_first_token": min((t["detectable_tv"] for t in first_contexts), default=None),
        "power": POWER,
    }
    if departs:
        scope = tests[worst]["scope"]
        report["finding"] = ("tokens the target never gives (probability 0 after the processing)" if impossible
                             else f"{scope}: leaning toward the draft's distribution" if scope.startswith(TOWARD_DRAFT)
                             else f"{scope}: {_direction(pooled)}")
    return report
