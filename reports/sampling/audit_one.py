"""One sampled audit on tiny-llama (one prompt), as the tables of reports/sampling/README.md ran it:

    python reports/sampling/audit_one.py ENGINE FAULT N T TOP_K K NEW_TOKENS SEED [nodraft]

ENGINE: sampled-spec, or one of the project's engines (eqspec, exspec, inplace, batched, reference);
FAULT: a planted sampling fault (property_tests/faults/sampling.py) or `none`; `nodraft` leaves out the
tests ordered by the draft's q/p. Prints the verdict, the family's p-value and the worst test, then the
step-offset and draft-ordered tests.
"""

from __future__ import annotations

import sys
import time

import torch

from specaudit.engines.models.zoo import builtin_prompts, load_pair
from specaudit.engines.sampling.process import SamplingParams
from specaudit.engines.registry import make_engine
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.sampling import SAMPLING_FAULTS


def main(argv: list[str]) -> None:
    engine_name, fault = argv[0], argv[1]
    samples, temperature, top_k, k, new_tokens, seed = int(argv[2]), float(argv[3]), int(argv[4]), int(argv[5]), int(argv[6]), int(argv[7])
    use_draft = len(argv) <= 8 or argv[8] != "nodraft"
    torch.set_num_threads(1)
    pair = load_pair("tiny-llama")
    params = SamplingParams(temperature, top_k)
    rule = SAMPLING_FAULTS[fault]() if fault != "none" else None
    engine = make_engine(engine_name, pair.target, pair.draft, sampling=params, seed=seed, draft_tokens=k,
                         batch_size=64 if engine_name != "sampled-spec" else 8, rule=rule)
    started = time.time()
    report = sampled_audit(engine, pair.target, builtin_prompts()[:1], params, samples=samples,
                           max_new_tokens=new_tokens, eos_token_id=pair.eos_token_id, seed=seed, seed_checks=False,
                           draft=pair.draft if use_draft else None)
    print(f"{engine_name} {fault} N={samples} T={temperature} top_k={top_k} k={k} new={new_tokens}: {report['verdict']} "
          f"p={report['p_value']:.3g} worst={report['worst_test']} finding={report.get('finding')} "
          f"wall={time.time() - started:.0f}s")
    for test in report["tests"]:
        if test["scope"].startswith(("ordered", "step", "prefill")):
            print("   ", test["scope"], test["n"], f"p={test['p_value']:.3g} adj={test['p_adjusted']:.3g} "
                  f"tv_obs={test['tv_observed']:.3f} detectable={test['detectable_tv']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
