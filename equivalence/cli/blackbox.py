"""Command line for black-box engines: the audit's noise-band options, `specaudit diff` and
`specaudit replay`.

`specaudit record` (equivalence/cli/record.py) writes a live server's outputs as a recording.

Exit status: `diff` 0 when the two recordings are identical on every prompt (and hold the same
prompts), 1 when not, 2 on bad usage. `replay` 0 when the bundle's divergence no longer reproduces
or is ruled numerical, 1 when it still reproduces as structural (or was found through logits or
draft proposals, which need the engine), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specaudit.equivalence.cli.args import eos_token_ids, named_group

COMMANDS = ("diff", "replay", "record")
ENGINE_DTYPES = ["float32", "bfloat16", "float16"]


def _tolerance(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number: give a logit difference such as 0.05") from None
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give a logit difference of 0 or more")
    return number


def _add_band_options(group: Any) -> None:
    group.add_argument("--engine-dtype", choices=ENGINE_DTYPES, default=None, metavar="DTYPE",
                       help=f"the precision the engine computes in ({', '.join(ENGINE_DTYPES)}): a divergence is "
                            "numerical when the reference's margin at the split is within that dtype's noise "
                            "(16 x unit roundoff x |top logit|)")
    group.add_argument("--logit-tolerance", type=_tolerance, default=None, metavar="X",
                       help="an absolute noise band in logits (wins over --engine-dtype). With neither, the band "
                            "is measured from the engine's own log-probabilities where it gives them, else the "
                            "reference dtype's own noise")


def add_audit_options(audit: argparse.ArgumentParser) -> None:
    """The audit's options for black-box engines (recordings, live servers), in three help groups: `servers`,
    `precision` (the noise band) and `reference` (a served reference)."""
    group = named_group(audit, "servers", "black-box engines (recorded:FILE, llamacpp:URL, vllm:URL, sglang:URL, "
                        "trtllm:URL; --target alone is enough)",
                        "servers and recordings: speculation required, a plain engine")
    group.add_argument("--require-speculation", action="store_true",
                       help="fail (exit 1) unless every run shows that its engine drafted tokens: a server's "
                            "metrics counters (vLLM, llama.cpp, TensorRT-LLM) or a built-in engine's trace. "
                            "Without it, a run whose engine drafted nothing passes with the verdict "
                            "'speculation not observed'")
    group.add_argument("--plain-engine", default=None, metavar="ENGINE",
                       help="the same engine without speculation (a second server of the same model, e.g. "
                            "vllm:URL, or recorded:FILE recorded from one), run on the same prompts at each batch "
                            "size: a divergence it makes identically (same position, same token) is ruled "
                            "numerical whatever the noise band says; the reports show the three-way table")
    band = named_group(audit, "precision", "precision: the noise band (a divergence within it is numerical)",
                       "the noise band: the engine's dtype or a tolerance in logits")
    _add_band_options(band)
    served = named_group(
        audit, "reference", "a served reference (no weights in this process: the reference is a plain server of "
        "the same model)", "a served reference in place of the weights (--reference)")
    served.add_argument("--reference", default=None, metavar="ENGINE",
                        help="the reference is this engine instead of the target in process: a plain (non-"
                             "speculative) server of the same model, vllm:URL, sglang:URL, llamacpp:URL, trtllm:URL, "
                             "or recorded:FILE recorded from one. It is asked one prompt at a time (unless "
                             "--reference-batch-invariant), then again with every prompt in flight in reverse "
                             "order to measure its own determinism. A divergence is numerical where the "
                             "reference's margin there (its log-probability of its token minus the engine's, "
                             "teacher-forced through prompt_logprobs where needed) lies within the band measured "
                             "for this deployment (its re-run, the engine's log-probabilities against its own); "
                             "structural otherwise. Classes that need the weights are reported as such. Every "
                             "--engine must be a server or recording; no --target, --pair, --draft, "
                             "--plain-engine, --dtype or --device. With --temperature 1 (vllm:URL reference): "
                             "the sampled audit, each sample teacher-forced through the reference's "
                             "prompt_logprobs (see docs/reference-server.md)")
    served.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="with --reference: the served model's folder for its tokenizer and config files "
                             "(the weights are not read); needed for the built-in prompts")
    served.add_argument("--reference-batch-invariant", action="store_true",
                        help="with --reference: the reference answers alike at any batch (e.g. vLLM with "
                             "VLLM_BATCH_INVARIANT=1): ask it --batch-size prompts at a time instead of one")
    served.add_argument("--reference-top-logprobs", type=int, default=5, metavar="N",
                        help="with --reference: top log-probabilities asked of the reference per token")


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    ref = parser.add_argument_group("the reference")
    ref.add_argument("--pair", metavar="P", help="a built-in pair whose target is the reference")
    ref.add_argument("--target", metavar="PATH", help="a local Hugging Face model folder: the reference")
    ref.add_argument("--trust-remote-code", action="store_true", help="allow custom model code in --target")
    ref.add_argument("--device", default="cpu", help="torch device for the reference")


def add_parsers(commands: Any, formatter: type) -> None:
    from specaudit.equivalence.cli import record as cli_record

    diff = commands.add_parser(
        "diff", formatter_class=formatter, help="compare two recordings of the same prompts token by token",
        description="Compare two recordings (JSONL lines with prompt_ids and output_ids; e.g. a speculative "
                    "and a plain run of one server) prompt by prompt. With --pair or --target, rule each "
                    "recording's divergence from the reference as the audit rules a black-box engine.",
        epilog="exit status: 0 identical, 1 different (or prompts missing from one side), 2 bad usage")
    diff.add_argument("a", type=Path, metavar="A.jsonl")
    diff.add_argument("b", type=Path, metavar="B.jsonl")
    _add_target_options(diff)
    how = diff.add_argument_group("ruling (with a target)")
    how.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"],
                     help="the reference's dtype")
    how.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                     help="new tokens per prompt (default: the recordings' max_new_tokens, else their longest output)")
    how.add_argument("--eos-token-id", default="pair", metavar="ID[,ID...]|pair|none",
                     help="stop tokens: the target's own EOS ids, an id, a set of ids A,B, or none")
    _add_band_options(how)
    diff.add_argument("--out", type=Path, metavar="FILE", help="also write the comparison as JSON")

    replay = commands.add_parser(
        "replay", formatter_class=formatter, help="re-check one repro bundle against the reference",
        description="Decode a bundle's prompt again with the reference (the target alone) and rule on the "
                    "engine's recorded output as the audit did.",
        epilog="exit status: 0 no longer reproduces or numerical, 1 still structural, 2 bad usage")
    replay.add_argument("bundle", type=Path, metavar="BUNDLE.json")
    _add_target_options(replay)
    replay.add_argument("--dtype", default=None, choices=["float64", "float32", "bfloat16", "float16"],
                        help="the reference's dtype (default: the bundle's)")
    replay.add_argument("--engine", default=None, metavar="E",
                        help="a search bundle (OUT/bundles/search-*.json): send its requests to this engine and judge "
                             "them (default: the engine it was found on); exit 1 when the finding reproduces")
    cli_record.add_parser(commands, formatter)


def _load_target(args: argparse.Namespace, dtype: str) -> Any:
    from specaudit.engines.models import zoo

    if bool(args.pair) == bool(args.target):
        raise ValueError("give the reference as --pair P or --target PATH (one of them)")
    if args.pair:
        if args.pair not in zoo.builtin_pair_names():
            raise ValueError(f"unknown pair {args.pair!r}: use one of {', '.join(zoo.builtin_pair_names())}")
        return zoo.load_pair(args.pair, dtype=dtype, device=args.device)
    return zoo.load_pair(target_path=args.target, dtype=dtype, device=args.device,
                         trust_remote_code=args.trust_remote_code)


def _eos(value: str, pair: Any) -> int | list[int] | tuple[int, ...] | None:
    if value == "pair":
        return pair.eos_token_id
    if value == "none":
        return None
    try:
        return eos_token_ids(value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--eos-token-id: {exc}") from None


def run(args: argparse.Namespace) -> int:
    try:
        if args.command == "record":
            from specaudit.equivalence.cli import record as cli_record

            return cli_record.run(args)
        return run_diff(args) if args.command == "diff" else run_replay(args)
    except ValueError as exc:  # unreadable recordings or bundles, a bad reference: usage
        print(f"specaudit {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def run_diff(args: argparse.Namespace) -> int:
    from specaudit.engines.adapters.recorded import read_recording
    from specaudit.equivalence.blackbox.diff import diff_recordings, rule_against_reference

    a, b = read_recording(args.a), read_recording(args.b)
    diffs, compared = diff_recordings(a, b)
    differing = [d for d in diffs if d.position is not None and d.missing_from is None]
    missing = [d for d in diffs if d.missing_from is not None]
    bands = {}
    if args.pair or args.target:
        pair = _load_target(args, args.dtype)
        lengths = [line.metadata.get("max_new_tokens") for line in a + b]
        max_new = args.max_new_tokens or next((n for n in lengths if isinstance(n, int)), None) or max(
            len(line.output_ids) for line in a + b)
        bands = rule_against_reference(diffs, a, b, pair.target, args.dtype, max_new, _eos(args.eos_token_id, pair),
                                       args.engine_dtype, args.logit_tolerance)
    print(f"{compared} prompts in both recordings: {compared - len(differing)} identical, {len(differing)} differ"
          + (f"; {len(missing)} in only one of them" if missing else ""))
    for d in sorted(differing, key=lambda d: d.index):
        line = f"  prompt {d.index} ({d.prompt_length} tokens): first difference at position {d.position}: " \
               f"A {d.a_token} vs B {d.b_token}"
        for side, ruling in d.rulings.items():
            line += f"\n      {side}: {ruling['kind'] or 'equal to the reference'}" + (
                f" at {ruling['position']}: {ruling['reason']}" if ruling["kind"] else "")
        print(line)
    for d in missing:
        print(f"  prompt {d.index} of {'A' if d.missing_from == 'B' else 'B'} is missing from {d.missing_from}")
    for side, band in bands.items():
        print(f"noise band for {side}: {band['how']}")
    if args.out:
        args.out.write_text(json.dumps({"compared": compared, "identical": compared - len(differing),
                                        "differences": [vars(d) for d in differing],
                                        "missing": [vars(d) for d in missing], "noise_bands": bands},
                                       indent=1, default=str))
    return 0 if not differing and not missing else 1


def run_replay(args: argparse.Namespace) -> int:
    from specaudit.equivalence.blackbox.bundles import read_bundle, replay_bundle
    from specaudit.equivalence.search.bundle import is_search_bundle, replay_from_args

    if is_search_bundle(args.bundle):  # a search's shrunk mix: sent again to an engine and judged
        return replay_from_args(args, _load_target)
    if args.engine is not None:
        raise ValueError("--engine replays a search bundle (OUT/bundles/search-*.json); this bundle's divergence "
                         "is re-checked against the reference alone: drop --engine")
    bundle = read_bundle(args.bundle)
    dtype = args.dtype or bundle["settings"]["dtype"]
    pair = _load_target(args, dtype)
    replay_target = pair.target if dtype == "float64" else _load_target(args, "float64").target
    result = replay_bundle(bundle, pair.target, replay_target, dtype)
    print(f"bundle: {bundle['engine']} on {bundle['pair']}, prompt {bundle['prompt_index']}, recorded as "
          f"{bundle['divergence'].get('kind')} at position {bundle['divergence'].get('position')}")
    if not result["reference_matches_bundle"]:
        print("note: the reference decoded here differs from the bundle's reference output "
              "(another model, dtype or machine)")
    print(result["message"])
    return result["exit_status"]
