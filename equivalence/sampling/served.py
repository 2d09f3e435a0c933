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

from specaudit.equivalence.sampling import stats

PIT_BINS = 10
TOP = 20  # vLLM's default max_logprobs


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
                         eos_token_id: Any, seed: int, alpha: float, top: int = TOP) -> dict[str, Any]:
    """`engine` (a SampledServer) drawn `samples` times over `prompts`; each sample teacher-forced through
    `reference` (a server engine with `prompt_logprobs`); the tests (module docstring)."""
    from specaudit.equivalence.sampling.run import spread

    requests = spread(prompts, samples)
    outputs = engine.generate(requests, max_new_tokens, eos_token_id)
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
    tests = [stats.chi_square_uniform(u, PIT_BINS), stats.ks_uniform(u)]
    adjusted = stats.holm([t["p_value"] for t in tests])
    for test, p in zip(tests, adjusted):
        test["p_holm"] = p
    worst = min(range(len(tests)), key=lambda i: adjusted[i])
    rejected = adjusted[worst] < alpha
    return {
        "verdict": "departs from the reference's distribution" if rejected else "consistent with the reference",
        "rejected": rejected, "p_value": adjusted[worst], "worst_test": tests[worst]["test"], "alpha": alpha,
        "samples": len(outputs), "tokens": int(u.numel()), "top_n": top, "tests": tests,
        "mean_tail_mass": sum(p[-1] for p, _ in distributions) / len(distributions),
        "detectable_tv_pooled": stats.detectable_tv(int(u.numel()), PIT_BINS - 1, alpha),
        "speculation": getattr(engine, "last_speculation", None),
        "power": ("the chi-square test on these PIT values detects a departure of total variation "
                  f"{stats.detectable_tv(int(u.numel()), PIT_BINS - 1, alpha):.3f} between its bins with power 0.8 at "
                  f"alpha {alpha}; a departure inside the reference's tail (below its top {top}, mean tail mass "
                  f"{sum(p[-1] for p, _ in distributions) / len(distributions):.3g}) is not seen"),
    }


def run(args: Any) -> int:
    """`specaudit audit --temperature 1 --engine SERVER --reference vllm:URL [--tokenizer DIR]`: writes
    OUT/sampling.json; exit 0 consistent, 1 departs (or a server failed), 2 bad usage."""
    import json
    import sys

    from specaudit.engines.adapters.sampled_servers import make_sampled_server
    from specaudit.engines.registry import black_box_prefix, make_engine
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.equivalence.cli.args import engine_options
    from specaudit.equivalence.errors import UsageError, one_line
    from specaudit.equivalence.served_audit import ServedConfig, _eos, _prompts, load_served

    def usage(message: str) -> int:
        print(f"specaudit audit: error: {one_line(message)}", file=sys.stderr)
        return 2

    if args.temperature != 1.0 or args.top_p != 1.0 or args.top_k != 0:
        return usage(f"--reference with --temperature {args.temperature:g} (top-p {args.top_p:g}, top-k {args.top_k}): "
                     "the reference's prompt log-probabilities describe temperature 1 without cuts; give "
                     "--temperature 1 (no --top-p, --top-k), or --target for other settings")
    if black_box_prefix(args.reference) != "vllm":
        return usage(f"--reference {args.reference}: the sampled audit teacher-forces through prompt_logprobs, "
                     "which only vllm:URL gives here")
    if not 0 < args.alpha < 1 or args.samples < 1:
        return usage("--alpha must lie in (0, 1) and --samples be at least 1")
    config = ServedConfig(engines=args.engine, reference=args.reference, tokenizer=args.tokenizer,
                          prompts=args.prompts, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                          eos_token_id=args.eos_token_id, adversarial=False)
    try:
        served_model = load_served(config.tokenizer)
        eos = _eos(config, served_model)
        prompts, _ = _prompts(config, served_model)
        reference = make_engine(args.reference, None, None, batch_size=1, draft_tokens=1, **engine_options(args))
        engines = {spec: make_sampled_server(spec, SamplingParams(temperature=1.0), seed=args.seed,
                                             batch_size=args.batch_size[0], **engine_options(args))
                   for spec in args.engine}
    except (UsageError, ValueError) as exc:
        return usage(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    results, status = {}, 0
    for spec, engine in engines.items():
        try:
            result = served_sampled_audit(engine, reference, prompts, samples=args.samples,
                                          max_new_tokens=args.max_new_tokens, eos_token_id=eos, seed=args.seed,
                                          alpha=args.alpha)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # a server that fails: the finding is that it failed
            result = {"verdict": "failed", "error": one_line(f"{type(exc).__name__}: {exc}")}
        results[spec] = result
        status = max(status, 0 if result["verdict"] == "consistent with the reference" else 1)
        line = (f"{spec}: {result['verdict']}" + (f", p = {result['p_value']:.3g} ({result['worst_test']}); "
                f"{result['samples']} samples, {result['tokens']} tokens; {result['power']}" if "p_value" in result
                else f": {result.get('error') or result.get('reason')}"))
        print(line)
    (args.out / "sampling.json").write_text(json.dumps(
        {"mode": "served-reference", "reference": args.reference, "temperature": 1.0, "seed": args.seed,
         "engines": results}, indent=1, default=str))
    print(f"wrote {args.out / 'sampling.json'}")
    return status
