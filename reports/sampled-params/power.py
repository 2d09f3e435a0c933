"""The power of the sampled audit against the planted penalty faults (property_tests/faults/sampling.py
`PENALTY_FAULTS`): the fraction of runs, each with its own seed, in which the audit rejects the faulty
engine at the family-wise alpha; and the same for the correct `sampled-spec` (the false-positive rate).

    python reports/sampled-params/power.py --repeats 10 --samples 400

Every run: tiny-llama in float64 on the CPU, the first built-in prompt, the request parameters below,
`sampled_audit` (draw, teacher forcing, tests, seed checks off). Prints one JSON line per engine."""

from __future__ import annotations

import argparse
import json
import time

from specaudit.engines.models.zoo import builtin_prompts, load_pair
from specaudit.engines.requests import RequestParams
from specaudit.engines.sampling.engine import SampledSpeculative
from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.sampling import PENALTY_FAULTS

TEMPERATURE = 1.0
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.5}


def rejections(engine_class: type, pair, prompts, *, samples: int, repeats: int, new_tokens: int, draft_tokens: int,
               alpha: float, top_k: int) -> dict:
    request = RequestParams(temperature=TEMPERATURE, top_k=top_k, **PENALTIES)
    rejected, impossible, p_values, started = 0, 0, [], time.perf_counter()
    for seed in range(repeats):
        engine = engine_class(pair.target, pair.draft, temperature=TEMPERATURE, top_k=top_k, seed=1000 + seed,
                              draft_tokens=draft_tokens, batch_size=64)
        report = sampled_audit(engine, pair.target, prompts, SamplingParams(TEMPERATURE, top_k), samples=samples,
                               max_new_tokens=new_tokens, eos_token_id=pair.eos_token_id, seed=1000 + seed,
                               alpha=alpha, seed_checks=False, draft=pair.draft, request_params=[request])
        rejected += bool(report["departs"])
        p_values.append(report["p_value"])
        impossible += report["impossible_count"] > 0
    return {"engine": engine_class.__name__, "samples": samples, "repeats": repeats, "rejected": rejected,
            "power": rejected / repeats,
            "runs_with_impossible_tokens": impossible, "p_values": [round(p, 6) for p in p_values],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--top-k", type=int, default=0, help="0: off (the tests alone decide; with a cut, a token the "
                                                             "penalized cut removes is a departure on its own)")
    parser.add_argument("--engines", default="penalty_per_step,penalties_ignored,correct")
    args = parser.parse_args()
    pair = load_pair("tiny-llama")
    prompts = builtin_prompts()[:1]
    classes = {**PENALTY_FAULTS, "correct": SampledSpeculative}
    print(json.dumps({"temperature": TEMPERATURE, "top_k": args.top_k, **PENALTIES, "new_tokens": args.new_tokens, "draft_tokens": args.draft_tokens,
                      "alpha": args.alpha}), flush=True)
    for name in args.engines.split(","):
        print(json.dumps({"name": name, **rejections(classes[name], pair, prompts, samples=args.samples,
                                                      repeats=args.repeats, new_tokens=args.new_tokens,
                                                      draft_tokens=args.draft_tokens, alpha=args.alpha,
                                                      top_k=args.top_k)}), flush=True)


if __name__ == "__main__":
    main()
