"""`specaudit audit --temperature T [--top-p P] [--top-k K] --samples N [--seed S]`: the sampled audit.

With `--temperature`, `specaudit audit` tests sampled outputs instead of comparing greedy ones: each
`--engine` (sampled-spec, sampled-reference, the project's eqspec, exspec, inplace, batched or
reference sampled through their request parameters, hf-assisted, package.module:factory, recorded:FILE:
one line per sample, the prompt repeated, or a live server vllm:URL, llamacpp:URL, sglang:URL,
trtllm:URL with `--batch-size N` requests in flight) against the target of `--pair` (or `--target`: for
a server, the folder of the weights it serves) in float64, by teacher forcing. Writes OUT/sampling.json;
exit 0 when no departure is found, 1 on a departure (or a broken seed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_PASS, EXIT_DEPARTURE, EXIT_USAGE = 0, 1, 2


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
    group = audit.add_argument_group("sampled audit (with --temperature: test sampled outputs against the target's "
                                     "distribution instead of greedy equality)")
    group.add_argument("--temperature", type=_non_negative, default=None, metavar="T",
                       help="audit sampling at this temperature (0: greedy through the sampler)")
    group.add_argument("--top-p", type=_probability, default=1.0, metavar="P", help="nucleus cut (1: off)")
    # --top-k is the request parameters' option (equivalence/cli/request_args.py): one flag, a cut here too
    group.add_argument("--samples", type=int, default=400, metavar="N",
                       help="sampled outputs per engine, spread evenly over the prompts")
    group.add_argument("--seed", type=int, default=0, metavar="S", help="the run's seed (each request gets its own)")
    group.add_argument("--alpha", type=float, default=0.01, metavar="A",
                       help="family-wise false-positive rate of the tests together (Holm)")


def _recorded_samples(path: str) -> list[tuple[list[int], list[int]]]:
    from specaudit.engines.adapters.recorded import read_recording

    return [(line.prompt_ids, line.output_ids) for line in read_recording(path)]


def _summary(engine: str, report: dict[str, Any]) -> str:
    first = report["detectable_tv_first_token"]
    return (f"{engine}: {report['verdict']}, p = {report['p_value']:.3g} ({report['worst_test']}), "
            f"effect TV {report['effect_tv'] if report['effect_tv'] is None else round(report['effect_tv'], 3)}; {report['samples']} samples, {report['tokens']} tokens; "
            f"smallest detectable TV {report['detectable_tv_pooled']:.3f} pooled"
            + (f", {first:.3f} at the first token" if first is not None else "")
            + (f"; {report['finding']}" if report.get("finding") else "")
            + _speculation_summary(report.get("speculation")))


def _speculation_summary(speculation: dict[str, Any] | None) -> str:
    if not speculation:
        return ""
    if speculation.get("drafted_tokens") is None:
        return "; no speculation counters"
    rate = speculation.get("acceptance_rate")
    return (f"; speculation: {speculation.get('accepted_tokens')} of {speculation.get('drafted_tokens')} drafted "
            f"tokens accepted" + (f" ({rate:.2f})" if rate is not None else ""))


def run(args: argparse.Namespace) -> int:
    from specaudit.engines.models.zoo import load_pair
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.equivalence.cli.args import engine_options
    from specaudit.equivalence.prompts import load_prompts
    from specaudit.equivalence.sampling.engines import make_sampled_engine
    from specaudit.equivalence.sampling.run import sampled_audit

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if args.samples < 1:
            raise ValueError("--samples must be at least 1")
        if len(args.pair) + bool(args.target) != 1:
            raise ValueError("the sampled audit takes one pair: one --pair, or --target (and --draft for a speculative engine)")
        pair = (load_pair(args.pair[0]) if args.pair
                else load_pair(target_path=args.target, draft_path=args.draft or args.target,
                               trust_remote_code=args.trust_remote_code, allow_pickle_weights=args.allow_pickle_weights))
        eos = pair.eos_token_id if args.eos_token_id == "pair" else args.eos_token_id
        prompts = load_prompts(args.prompts, pair.tokenizer, args.num_prompts)
    except (ValueError, OSError) as exc:
        print(f"specaudit audit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    reports: dict[str, Any] = {}
    for spec in args.engine:
        try:
            recorded = _recorded_samples(spec[len("recorded:"):]) if spec.startswith("recorded:") else None
            engine = None if recorded is not None else make_sampled_engine(
                spec, pair.target, pair.draft, params, seed=args.seed, draft_tokens=args.draft_tokens,
                options=engine_options(args), batch_size=args.batch_size[0])
        except (ValueError, ImportError, AttributeError) as exc:  # a bad name or file: one line, exit 2
            print(f"specaudit audit: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        report = sampled_audit(engine, pair.target, prompts, params, samples=args.samples,
                               max_new_tokens=args.max_new_tokens, eos_token_id=eos, seed=args.seed,
                               alpha=args.alpha, recorded=recorded, draft=pair.draft)
        if engine is not None and hasattr(engine, "describe"):
            report["engine"] = engine.describe()
        reports[spec] = report
        print(_summary(spec, report), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "sampling.json"
    out.write_text(json.dumps({"pair": pair.name, "params": params.describe(), "seed": args.seed,
                               "engines": reports}, indent=1))
    print(f"wrote {out}")
    return EXIT_DEPARTURE if any(r["verdict"] != "no departure found" for r in reports.values()) else EXIT_PASS
