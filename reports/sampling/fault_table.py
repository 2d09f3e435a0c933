"""The fault table of reports/sampling/README.md: each planted sampling fault (and the correct engines)
audited on tiny-llama, one prompt, by the sampled audit; one markdown row each.

    python reports/sampling/fault_table.py --samples 600 --temperature 0.7 --top-k 8 FAULT [FAULT ...]

FAULT is a name of `specaudit.testing.faults.sampling` (SAMPLING_FAULTS, shared_stream) or
sampled-spec / sampled-reference.
"""

from __future__ import annotations

import argparse
import time

import torch

from specaudit.engines.models.zoo import builtin_prompts, load_pair
from specaudit.engines.sampling.process import SamplingParams
from specaudit.engines.registry import make_engine
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.sampling import make_fault_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="+")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--draft-tokens", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("tiny-llama")
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    for name in args.names:
        started = time.perf_counter()
        if name in ("sampled-spec", "sampled-reference"):
            engine = make_engine(name, pair.target, pair.draft, sampling=params, seed=args.seed,
                                 draft_tokens=args.draft_tokens, batch_size=8)
        else:
            engine = make_fault_engine(pair.target, pair.draft, fault=name, temperature=params.temperature,
                                       top_k=params.top_k, top_p=params.top_p, seed=args.seed,
                                       draft_tokens=args.draft_tokens)
        report = sampled_audit(engine, pair.target, builtin_prompts()[:1], params, samples=args.samples,
                               max_new_tokens=args.max_new_tokens, eos_token_id=pair.eos_token_id, seed=args.seed)
        seeds = report["seeds"]
        print(f"| {name} | {args.samples} | {report['p_value']:.2g} | {report['verdict']} | "
              f"{report.get('finding', report['worst_test'])} | {seeds.get('alone_equals_batch')} | "
              f"{time.perf_counter() - started:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
