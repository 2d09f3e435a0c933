"""The sampled audit's power against the planted structured-output faults (specaudit.testing.faults.constrained):
in how many runs, each with its own seed, the audit rejects the engine (verdict `departure`) and names the fault's
own class; the same runs of the correct EQSPEC (its false-positive rate) and of `DraftUnmasked` (exact in
distribution, fewer drafts accepted).

    python reports/structured/sampled_power.py --repeats 20 --samples 4,8,16

Every run: tiny-llama in float64 on the CPU, four prompts with one constraint each (a JSON schema without
whitespace, a regex, a choice, an EBNF grammar: tests/test_structured_sampled.py's), temperature 1, 16 new
tokens, 4 draft tokens, `sampled_audit` with the draft-ordered tests, family-wise alpha 0.01, no seed checks.
Prints one JSON line per engine and sample count."""

from __future__ import annotations

import argparse
import json
import time

from specaudit.engines.constraints import Constraint
from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.engines.requests import RequestParams
from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.constrained import EXPECTED_CLASS

SCHEMA = ('{"type":"object","properties":{"name":{"type":"string","maxLength":6},"n":{"type":"integer"}},'
          '"required":["name","n"]}')
KINDS = [Constraint("json_schema", SCHEMA, any_whitespace=False), Constraint("regex", r"[a-f]{2,5}-\d+"),
         Constraint("choice", choices=("alpha", "beta", "gamma")),
         Constraint("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"')]
PROMPTS = [list(b"Hello"), list(b"The JSON is"), list(b"x"), list(b"answer: ")]
FAULTS = "specaudit.testing.faults.constrained"


def runs(pair, spec: str, *, samples: int, repeats: int, new_tokens: int, k: int, alpha: float) -> dict:
    params = [RequestParams(temperature=1.0, constraint=c) for c in KINDS]
    expected = EXPECTED_CLASS.get(spec.rpartition(":")[2])
    rejected = named = violating = accepted = tokens = 0
    p_values, classes, started = [], {}, time.perf_counter()
    for seed in range(repeats):
        engine = make_engine(spec, pair.target, pair.draft, batch_size=8, draft_tokens=k,
                             sampling=SamplingParams(1.0), seed=1000 + seed)
        report = sampled_audit(engine, pair.target, PROMPTS, SamplingParams(1.0), samples=samples,
                               max_new_tokens=new_tokens, eos_token_id=pair.eos_token_id, seed=1000 + seed, alpha=alpha,
                               draft=pair.draft, request_params=params, tokenizer=pair.tokenizer, draft_tokens=k,
                               seed_checks=False)
        found = report["constraints"]
        rejected += report["verdict"] == "departure"
        named += expected is not None and found["class"] == expected
        violating += found["violations"] > 0
        classes[str(found["class"])] = classes.get(str(found["class"]), 0) + 1
        accepted += sum(1 for offsets in engine.last_step_offsets for o in offsets if o >= 1)
        tokens += report["tokens"]
        p_values.append(report["p_value"])
    return {"engine": spec.rpartition(":")[2], "samples": samples, "repeats": repeats, "rejected": rejected,
            "named_own_class": named if expected else None, "runs_with_violations": violating, "classes": classes,
            "accepted_drafts_per_token": round(accepted / max(tokens, 1), 3),
            "largest_p": float(f"{max(p_values):.3g}"), "smallest_p": float(f"{min(p_values):.3g}"),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="4,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--engines", default="eqspec,GrammarNotRolledBack,BonusTokenUnmasked,MaskOnePositionOff,"
                                              "DraftUnmasked")
    args = parser.parse_args()
    pair = zoo.load_pair("tiny-llama", dtype="float64")
    for samples in (int(n) for n in args.samples.split(",")):
        for name in args.engines.split(","):
            spec = name if name == "eqspec" else f"{FAULTS}:{name}"
            print(json.dumps(runs(pair, spec, samples=samples, repeats=args.repeats, new_tokens=args.new_tokens,
                                  k=args.draft_tokens, alpha=args.alpha)), flush=True)


if __name__ == "__main__":
    main()
