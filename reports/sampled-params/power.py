"""The power of the sampled audit against the planted penalty faults (property_tests/faults/sampling.py
`PENALTY_FAULTS`): the fraction of runs, each with its own seed, in which the audit rejects the faulty
engine at the family-wise alpha; and the same for the correct `sampled-spec` (its false-positive rate).

    python reports/sampled-params/power.py --repeats 10 --samples 40

Every run: the repeating pair of tests/repeat_models.py (float64 on the CPU), the prompt "xyz a", temperature 1,
presence penalty 1.5 and frequency penalty 1.0, 6 new tokens, 3 draft tokens; `sampled_audit` (the draw,
teacher forcing in float64, the tests with the draft-ordered ones, no seed checks). Prints one JSON line per
engine: rejections, the p-values, the seconds."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the models' helpers live beside the tests

from repeat_models import PENALTIES, repeat_pair  # noqa: E402
from specaudit.engines.models.zoo import load_pair  # noqa: E402
from specaudit.engines.requests import RequestParams  # noqa: E402
from specaudit.engines.sampling.engine import SampledSpeculative  # noqa: E402
from specaudit.engines.sampling.process import SamplingParams  # noqa: E402
from specaudit.equivalence.sampling.run import sampled_audit  # noqa: E402
from specaudit.testing.faults.sampling import PENALTY_FAULTS  # noqa: E402

PROMPT = list(b"xyz a")


def rejections(engine_class: type, pair, *, samples: int, repeats: int, new_tokens: int, draft_tokens: int,
               alpha: float, temperature: float) -> dict:
    request = RequestParams(temperature=temperature, **PENALTIES)
    rejected, impossible, p_values, started = 0, 0, [], time.perf_counter()
    for seed in range(repeats):
        engine = engine_class(pair.target, pair.draft, temperature=temperature, seed=1000 + seed,
                              draft_tokens=draft_tokens, batch_size=64)
        report = sampled_audit(engine, pair.target, [PROMPT], SamplingParams(temperature), samples=samples,
                               max_new_tokens=new_tokens, eos_token_id=pair.eos_token_id, seed=1000 + seed,
                               alpha=alpha, seed_checks=False, draft=pair.draft, request_params=[request])
        rejected += bool(report["departs"])
        impossible += report["impossible_count"] > 0
        p_values.append(report["p_value"])
    return {"engine": engine_class.__name__, "samples": samples, "repeats": repeats, "rejected": rejected,
            "power": rejected / repeats, "runs_with_impossible_tokens": impossible,
            "p_values": [float(f"{p:.3g}") for p in p_values], "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--engines", default="penalty_per_step,penalties_ignored,correct")
    args = parser.parse_args()
    folders = repeat_pair()
    pair = load_pair(target_path=str(folders.target), draft_path=str(folders.draft), dtype="float64", device="cpu")
    classes = {**PENALTY_FAULTS, "correct": SampledSpeculative}
    print(json.dumps({"prompt": bytes(PROMPT).decode(), "temperature": args.temperature, **PENALTIES,
                      "new_tokens": args.new_tokens, "draft_tokens": args.draft_tokens, "alpha": args.alpha}), flush=True)
    for name in args.engines.split(","):
        print(json.dumps({"name": name, **rejections(classes[name], pair, samples=args.samples, repeats=args.repeats,
                                                      new_tokens=args.new_tokens, draft_tokens=args.draft_tokens,
                                                      alpha=args.alpha, temperature=args.temperature)}), flush=True)


if __name__ == "__main__":
    main()
