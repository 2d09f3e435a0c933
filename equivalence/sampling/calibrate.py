"""The false-positive rate of the sampled audit, measured: a correct engine audited under many seeds.

    python -m specaudit.equivalence.sampling.calibrate --engine sampled-spec --seeds 200 --samples 300 \\
        --temperature 0.7 --top-k 8 --max-new-tokens 3 --draft-tokens 2 --num-prompts 1

prints, per seed, the family's p-value, and at the end the fraction of seeds with p below 0.01,
0.05 and 0.1 (a calibrated family-wise test stays at or below each level).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    from specaudit.engines.models.zoo import builtin_prompts, load_pair
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.engines.registry import REQUEST_ENGINES
    from specaudit.engines.registry import make_engine
    from specaudit.equivalence.sampling.run import sampled_audit

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="sampled-spec")
    parser.add_argument("--pair", default="tiny-llama")
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the per-seed p-values here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair(args.pair)
    prompts = builtin_prompts()[: args.num_prompts]
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    p_values, started = [], time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        engine = make_engine(args.engine, pair.target, pair.draft, sampling=params, seed=seed,
                             draft_tokens=args.draft_tokens, batch_size=64 if args.engine in REQUEST_ENGINES else 8)
        report = sampled_audit(engine, pair.target, prompts, params, samples=args.samples,
                               max_new_tokens=args.max_new_tokens, eos_token_id=pair.eos_token_id, seed=seed,
                               seed_checks=False, draft=pair.draft)
        p_values.append(report["p_value"])
        print(f"seed {seed}: p = {report['p_value']:.4f} {report['worst_test']}", flush=True)
    rates = {level: sum(p < level for p in p_values) / len(p_values) for level in (0.01, 0.05, 0.1)}
    summary = {"engine": args.engine, "pair": args.pair, "params": params.describe(), "samples": args.samples,
               "seeds": args.seeds, "false_positive_rate": rates, "seconds": time.perf_counter() - started,
               "p_values": p_values}
    print(json.dumps({k: v for k, v in summary.items() if k != "p_values"}))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
