"""`specaudit audit --temperature T [--top-p P] [--top-k K] --samples N [--seed S]`: the sampled audit's options.

The greedy audit's request-parameter flags (equivalence/cli/request_args.py) go with them: the repetition,
presence and frequency penalties, `--logit-bias`, `--bad-words`, `--min-tokens` and `--min-p` are sent to the
engines and applied by the reference in vLLM's order (engines/requests/sampled.py); `--stop`,
`--stop-token-id` and `--logprobs` are refused.

With `--temperature`, `specaudit audit` tests sampled outputs instead of comparing greedy ones: each
`--engine` (sampled-spec, sampled-reference, the project's eqspec, exspec, inplace, batched or
reference sampled through their request parameters, hf-assisted, package.module:factory, recorded:FILE:
one line per sample, the prompt repeated, or a live server vllm:URL, llamacpp:URL, sglang:URL,
trtllm:URL with `--batch-size N` requests in flight) against the target of `--pair` (or `--target`: for
a server, the folder of the weights it serves), by teacher forcing in float64 on the CPU.

Every option of `specaudit audit` is honored or refused: an option that only the greedy audit uses
(`REFUSED`) is a usage error. The run itself is the one pipeline's (equivalence/pipeline/: the sampled judge,
`pipeline/sampled.py` with the weights, `pipeline/served.py` against a served reference): the same guard,
`audit.json`, reports and exit status as every audit; exit 0 when no departure is found, 1 on a departure, a
broken seed or a failed run, 2 on bad usage (one line).
"""
from __future__ import annotations

import argparse
from typing import Any

from specaudit.equivalence.rulings.thresholds import ALPHA

# `specaudit audit` options that only the greedy audit uses: (attribute, its default, why), refused when given
_GREEDY_ONLY = "it rules greedy divergences; the sampled audit tests distributions"
_NOT_SAMPLED = "the sampled judge cannot apply it (it ends or reports a sample, the tests read tokens up to EOS)"
REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("engine_dtype", None, "give --dtype D instead, the precision the sampled audit loads the pair in and measures "
                           "its rounding allowance in"),
    ("logit_tolerance", None, _GREEDY_ONLY),
    ("plain_engine", None, _GREEDY_ONLY),
    ("require_speculation", False, "the sampled audit reports a server's speculation counters but gates on none"),
    ("pad_token_id", None, "the sampled engines use the pair's own pad id"),
    ("diagnosis", "full", "the sampled audit names no causes"),
    ("diagnosis_budget", None, "the sampled audit names no causes"),
    # the penalties, --logit-bias, --bad-words, --min-tokens and --min-p are applied (equivalence/pipeline/sampled.py)
    ("stop", [], _NOT_SAMPLED), ("stop_token_id", [], _NOT_SAMPLED), ("logprobs", None, _NOT_SAMPLED),
    # --require-acceptance and --acceptance-baseline are honored (equivalence/acceptance/sampled.py)
    ("speculation", None, "the sampled expectation is the pair's draft model's overlap, sum min(p, q) per "
                          "position; a stated proposer is for greedy runs"),
    ("payoff", 0, "the payoff times greedy runs"),
)


def refusal(args: argparse.Namespace) -> str | None:
    """The usage error for the first option the sampled audit cannot honor, or None. `--no-adversarial`
    and `--no-bundles` are what it does anyway (it adds no adversarial prompts and writes no bundles)."""
    for name, default, why in REFUSED:
        if getattr(args, name, default) != default:
            flag = "--" + name.replace("_", "-")
            return f"{flag} is not used by the sampled audit (--temperature): {why}; drop it"
    for flag, values in (("--batch-size", args.batch_size), ("--dtype", args.dtype)):
        if len(values) != 1:
            return (f"{flag} {' '.join(map(str, values))}: the sampled audit takes one value; run it once per "
                    f"{flag[2:].replace('-', ' ')}")
    return None


def _probability(value: str) -> float:
    number = float(value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return number


def _non_negative(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 (greedy) or more")
    return number


def add_options(audit: argparse.ArgumentParser) -> None:
    """The sampled audit's options on the `audit` parser."""
    from specaudit.equivalence.cli.args import named_group

    group = named_group(audit, "sampling", "sampled audit (with --temperature: test sampled outputs against the "
                        "target's distribution instead of greedy equality)",
                        "the sampled audit (--temperature): top-p, samples, seed, alpha")
    group.add_argument("--temperature", type=_non_negative, default=None, metavar="T",
                       help="audit sampling at this temperature (0: greedy through the sampler)")
    group.add_argument("--top-p", type=_probability, default=1.0, metavar="P", help="nucleus cut (1: off)")
    # --top-k is the request parameters' option (equivalence/cli/request_args.py): one flag, a cut here too
    group.add_argument("--samples", type=int, default=400, metavar="N",
                       help="sampled outputs per engine, spread evenly over the prompts")
    group.add_argument("--seed", type=int, default=0, metavar="S", help="the run's seed (each request gets its own)")
    group.add_argument("--alpha", type=float, default=ALPHA, metavar="A",
                       help="family-wise false-positive rate of the tests together (Holm)")
