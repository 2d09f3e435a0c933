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

The target teacher-forces in float64 (the oracle). An engine that runs the target below float64, or on
another device (`run_model`: the target as the engine runs it), samples from probabilities that carry
rounding, a real departure that enough samples would reject. The rounding allowance bounds it: the
target run as the engine runs it teacher-forces the same tokens, and each token's allowance is
`ROUNDING_FACTOR` times the total variation between its distribution there and in float64 (the
engine's own rounding, in other batch shapes, is of the same size as this pass's: twice covers both).
Every test is then held against the largest departure its tokens' mean allowance a can make, not
against none: a PIT chi-square on n values in B bins against noncentrality 2 n B a^2 (mass a moved
between two bins), a context's chi-square against 2 n a^2 / (its least likely bin's probability),
Kolmogorov-Smirnov at its distance less a. A correct engine then passes at the stated false-positive
rate in every dtype; the power printed is the power against that shifted null. A token the float64
target cuts (probability 0) within the rounding of the cut (kept once its logits move by twice the largest
difference between the run's logits and float64's there, in its favour: a near-tie at a top-k or top-p
boundary) is a rounding cut, not a departure: counted, left out of the PIT. In float64 on the CPU no
allowance is taken and nothing changes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.sampling import stats
from specaudit.equivalence.rulings.thresholds import ALPHA, MIN_EXPECTED_PER_BIN, PIT_BINS, POWER, ROUNDING_FACTOR
from specaudit.equivalence.sampling.teacher import Processing, Sample, target_distributions, target_logits


def _null_noncentrality(test: dict[str, Any]) -> float:
    """The noncentrality of the largest departure a test's rounding allowance lets through (module docstring)."""
    allowance = test.get("rounding_tv", 0.0)
    if allowance <= 0 or test["test"] == "ks_pit":
        return 0.0
    if test["test"] == "chi_square_pit":
        return 2 * test["n"] * test["bins"] * allowance ** 2
    return 2 * test["n"] * allowance ** 2 / max(test["min_bin_probability"], 1e-300)


def _hold_against_rounding(test: dict[str, Any], allowance: float) -> dict[str, Any]:
    """`test` with its p-value against the departure `allowance` (a TV) lets through."""
    test["rounding_tv"] = allowance
    if allowance <= 0:
        return test
    if test["test"] == "ks_pit":
        test["p_value"] = stats.ks_survival(max(0.0, test["statistic"] - allowance), test["n"])
    elif test.get("df", 0) >= 1:
        test["p_value"] = stats.noncentral_chi_square_survival(test["statistic"], test["df"], _null_noncentrality(test))
    return test


def _null_binned_tv(n: int, bins: int, generator: torch.Generator) -> float:
    return stats.null_tv(torch.full((bins,), 1.0 / bins, dtype=stats.F64), n, generator)


TOWARD_DRAFT = "ordered by the draft's q/p, "  # the scope's prefix of the tests on draft-ordered u's


def _stratum_bins(mask: torch.Tensor) -> int:
    """The bins of one stratum's PIT chi-square: `PIT_BINS`, fewer where its values cannot fill each with
    `MIN_EXPECTED_PER_BIN` (a stratum with fewer than two bins is not tested)."""
    return min(PIT_BINS, int(mask.sum()) // MIN_EXPECTED_PER_BIN)


def _offset_scope(offset: int) -> str:
    return "prefill tokens" if offset < 0 else f"step offset {offset}"


def _draft_distributions(draft: PreTrainedModel, samples: list[Sample], params: SamplingParams | Processing,
                         target_probs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sample [n, V]: the draft's processed distribution before each sampled token (teacher forced on
    the same prefix), on the target's vocabulary (ids the draft lacks: 0; ids past the target's: dropped).
    Only the order of the tokens comes from it: any order leaves a correct sampler's u's uniform."""
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


def _kept_within_rounding(model: PreTrainedModel, run_model: PreTrainedModel, samples: list[Sample],
                          cut: list[tuple[int, int, int]], processing: Processing) -> list[bool]:
    """For each (sample, position, token) the float64 target cuts: whether the processing keeps the token once
    its logits move as far as the engine's rounding can take them, in the token's favour (its logit up, every
    other down, by `ROUNDING_FACTOR` times the largest difference there between the run's logits and float64's).
    A near-tie at a top-k or top-p boundary falls either way below float64; only a token cut by more than the
    rounding is one the target never gives."""
    wanted = sorted({index for index, _, _ in cut})
    chosen = [samples[i] for i in wanted]
    exact = dict(zip(wanted, target_logits(model, chosen)))
    rounded = dict(zip(wanted, target_logits(run_model, chosen)))
    kept = []
    for index, position, token in cut:
        logits = exact[index][position]  # [V]
        reach = ROUNDING_FACTOR * float((rounded[index][position] - logits).abs().max())
        favoured = logits - reach
        favoured[token] = logits[token] + reach
        kept.append(reach > 0 and float(processing.row(index, samples[index], position, favoured)[token]) > 0)
    return kept


def audit_samples(model: PreTrainedModel, samples: list[Sample], params: SamplingParams, *, alpha: float = ALPHA,
                  seed: int = 0, min_context: int = 50, max_context_tests: int = 64,
                  offsets: list[list[int]] | None = None, draft: PreTrainedModel | None = None,
                  run_model: PreTrainedModel | None = None, requests: list[Any] | None = None,
                  stop_ids: tuple[int, ...] = (), penalty_scope: str = "output", tokenizer: Any = None,
                  on_tables: Callable[[list[torch.Tensor], list[torch.Tensor] | None], None] | None = None
                  ) -> dict[str, Any]:
    """The sampled audit of `samples` against `model` (the float64 target). Returns the report's dict.
    `offsets`: per sample, each token's offset in the step that emitted it; `draft`: the draft model;
    `run_model`: the target as the engine runs it, for the rounding allowance (module docstring);
    `requests`: one `RequestParams` per sample, whose processors (penalties, logit bias, bad words as ids,
    min_tokens banning `stop_ids`), grammar mask (a constraint, over `tokenizer`'s vocabulary) and cuts the
    target's distribution takes (teacher.py `Processing`); `on_tables`: called once with each sample's processed
    target and draft distributions [n, V] (the draft's None without `draft`), which the acceptance record's
    expectation reads (equivalence/acceptance/sampled.py)."""
    # the PIT's own stream, apart from every request's ((seed << 20) + i, engines/sampling/engine.py)
    generator = torch.Generator().manual_seed((1 << 62) + seed)
    processing = Processing(params, requests, tuple(stop_ids), penalty_scope, tokenizer)
    if requests is not None and len(requests) != len(samples):
        raise ValueError(f"{len(requests)} request parameter sets for {len(samples)} samples: give one per sample")
    probs = target_distributions(model, samples, processing)
    # the draft's q as the engines' drafters draw from it: the request's temperature and cuts on its raw logits,
    # under the request's grammar mask where it has a constraint
    draft_processing = (params if requests is None
                        else Processing(params, [replace(r, repetition_penalty=1.0, presence_penalty=0.0,
                                                         frequency_penalty=0.0, logit_bias=(), bad_words=(),
                                                         min_tokens=0) for r in requests], tuple(stop_ids),
                                        penalty_scope, tokenizer))
    draft_probs = _draft_distributions(draft, samples, draft_processing, probs) if draft is not None else None
    if on_tables is not None:
        on_tables(probs, draft_probs)
    # [n] per sample: each token's rounding allowance (0 in float64 on the CPU)
    run_probs = target_distributions(run_model, samples, processing) if run_model is not None else None
    allowances = ([ROUNDING_FACTOR * 0.5 * (r - p).abs().sum(-1) for r, p in zip(run_probs, probs)]
                  if run_probs is not None else [torch.zeros(len(sampled), dtype=stats.F64) for _, sampled in samples])
    tokens, positions, table, contexts = [], [], [], defaultdict(list)
    cut = []  # (sample, position, token) that the float64 target gives probability 0
    for index, ((prompt, sampled), p) in enumerate(zip(samples, probs)):
        for position, token in enumerate(sampled):
            if float(p[position, token]) <= 0:
                cut.append((index, position, token))
            tokens.append(token)
            positions.append(position)
            table.append(p[position])
            contexts[(tuple(prompt), tuple(sampled[:position]))].append(len(tokens) - 1)
    impossible = [{"sample": i, "position": j, "token": t} for i, j, t in cut]
    if run_model is not None and cut:
        impossible = [entry for entry, kept in zip(impossible, _kept_within_rounding(model, run_model, samples, cut,
                                                                                   processing)) if not kept]
    rounding_cuts = len(cut) - len(impossible)
    if not tokens:
        raise ValueError("no sampled tokens to audit")
    all_probs = torch.stack(table)  # [N, V]
    allow = torch.cat(allowances)  # [N]
    token_ids = torch.tensor(tokens)
    jitter = torch.rand(len(tokens), generator=generator, dtype=stats.F64)  # [N]
    u = stats.randomized_pit(all_probs, token_ids, jitter)
    possible = ~torch.isnan(u)
    position_ids = torch.tensor(positions)
    offset_ids = torch.tensor([o for sample_offsets in offsets for o in sample_offsets]) if offsets is not None else None
    if offset_ids is not None and offset_ids.numel() != len(tokens):
        raise ValueError(f"{offset_ids.numel()} step offsets for {len(tokens)} sampled tokens: give one per token")

    def mean_allowance(mask: torch.Tensor) -> float:
        return float(allow[mask].mean()) if bool(mask.any()) else 0.0

    tests: list[dict[str, Any]] = []
    pooled = u[possible]
    tests.append(_hold_against_rounding({**stats.chi_square_uniform(pooled, PIT_BINS), "scope": "all tokens"},
                                        mean_allowance(possible)))
    tests.append(_hold_against_rounding({**stats.ks_uniform(pooled), "scope": "all tokens"}, mean_allowance(possible)))
    for position in sorted(set(positions)):
        mask = possible & (position_ids == position)
        bins = _stratum_bins(mask)
        if bins >= 2:
            tests.append(_hold_against_rounding({**stats.chi_square_uniform(u[mask], bins),
                                                 "scope": f"output position {position}"}, mean_allowance(mask)))
    if offset_ids is not None:
        for offset in sorted(set(offset_ids.tolist())):
            mask = possible & (offset_ids == offset)
            bins = _stratum_bins(mask)
            if bins >= 2:
                tests.append(_hold_against_rounding({**stats.chi_square_uniform(u[mask], bins),
                                                     "scope": _offset_scope(offset)}, mean_allowance(mask)))
    if draft_probs is not None:
        # the same jitter: only the order changes, so under the target each u is uniform as before
        u_draft = stats.randomized_pit(all_probs, token_ids, jitter,
                                       order=stats.draft_ratio_order(all_probs, torch.cat(draft_probs)))
        tests.append(_hold_against_rounding({**stats.chi_square_uniform(u_draft[possible], PIT_BINS),
                                             "scope": TOWARD_DRAFT + "all tokens"}, mean_allowance(possible)))
        for offset in sorted(set(offset_ids.tolist())) if offset_ids is not None else []:
            mask = possible & (offset_ids == offset)
            bins = _stratum_bins(mask)
            if bins >= 2:
                test = {**stats.chi_square_uniform(u_draft[mask], bins), "scope": TOWARD_DRAFT + _offset_scope(offset)}
                tests.append(_hold_against_rounding(test, mean_allowance(mask)))
    big = sorted((key for key, rows in contexts.items() if len(rows) >= min_context),
                 key=lambda key: -len(contexts[key]))[:max_context_tests]
    for key in big:
        rows = torch.tensor(contexts[key])
        counts = torch.bincount(token_ids[rows], minlength=all_probs.shape[1]).to(stats.F64)
        test = stats.chi_square_counts(counts, all_probs[rows[0]])
        if test["df"] >= 1:
            test["tv_null"] = stats.null_tv(all_probs[rows[0]], len(rows), generator)
            tests.append(_hold_against_rounding({**test, "scope": f"context: prompt of {len(key[0])} tokens, "
                                                 f"prefix {list(key[1])}"}, float(allow[rows].max())))
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
            test["detectable_tv"] = stats.detectable_tv(test["n"], test["df"], family_alpha, POWER,
                                                        null_noncentrality=_null_noncentrality(test))
    worst = min(range(len(tests)), key=lambda i: adjusted[i])
    departs = bool(impossible) or adjusted[worst] < alpha
    pooled_test, contexts_tested = tests[0], [t for t in tests if t["test"] == "chi_square_context"]
    first_contexts = [t for t in contexts_tested if t["scope"].endswith("prefix []")]
    report: dict[str, Any] = {
        "params": params.describe(), "alpha": alpha,
        # each prompt's request parameters beside the sampler's (None: the sampler's alone)
        "request_params": (None if requests is None else
                           [json.loads(text) for text in dict.fromkeys(json.dumps(r.to_dict(), sort_keys=True)
                                                                       for r in requests)]), "samples": len(samples), "tokens": len(tokens),
        "tests": tests, "impossible_tokens": impossible[:20], "impossible_count": len(impossible),
        "p_value": 0.0 if impossible else adjusted[worst],
        "departs": departs,
        "worst_test": tests[worst]["scope"] + f" ({tests[worst]['test']})",
        # the worst test's TV between its bins, less what sampling noise alone gives at its n
        "effect_tv": tests[worst].get("tv_excess"),
        "detectable_tv_pooled": pooled_test["detectable_tv"],
        "detectable_tv_first_token": min((t["detectable_tv"] for t in first_contexts), default=None),
        "power": POWER,
        # the pooled PIT values in PIT_BINS equal bins (uniform under a correct sampler): the report's chart
        "pit_histogram": stats.pit_histogram(pooled, PIT_BINS),
        # below float64 or off the CPU: what the tests allowed for the engine's rounding (module docstring)
        "rounding": None if run_probs is None else {
            "dtype": str(next(run_model.parameters()).dtype).removeprefix("torch."),
            "device": str(next(run_model.parameters()).device), "factor": ROUNDING_FACTOR,
            "allowance_tv_mean": float(allow.mean()), "allowance_tv_max": float(allow.max()),
            "cut_tokens": rounding_cuts},
    }
    if departs:
        scope = tests[worst]["scope"]
        report["finding"] = ("tokens the target never gives (probability 0 after the processing)" if impossible
                             else f"{scope}: leaning toward the draft's distribution" if scope.startswith(TOWARD_DRAFT)
                             else f"{scope}: {_direction(pooled)}")
    return report
