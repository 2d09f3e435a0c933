"""`specaudit bench`: the parser and the runner (`bench/run.py` does the measuring)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specaudit.engines.models.bench_pair import DEFAULT_ACCEPTANCE
from specaudit.equivalence.cli.args import DTYPE_CHOICES, add_engine_path_options, engine_options
from specaudit.equivalence.cli.args import dtype as _dtype
from specaudit.equivalence.cli.args import engine_option as _option
from specaudit.equivalence.cli.args import positive as _positive

def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def _acceptance(value: str) -> float | None:
    if value == "draft":
        return None
    rate = float(value)
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1] or 'draft', got {value}")
    return rate


def add_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    from specaudit.engines.registry import BUILTIN_ENGINES

    bench = commands.add_parser(
        "bench", formatter_class=formatter,
        help="tokens per second of engines over batch sizes and draft lengths",
        description="Time each engine at each batch size (and k) on one model pair in one process: tokens/s "
                    "(median of --repeats after --warmup), stage breakdown, peak memory, ratios to batch size 1 "
                    "and to plain decoding, and the ceiling speculation could reach from the measured pass costs. "
                    "Writes OUT/bench.json, OUT/bench.md and OUT/{throughput,stages,memory}.svg.",
        epilog="examples:\n"
               "  specaudit bench --engine reference --engine batched --engine eqspec --engine exspec "
               "--engine inplace --pair bench --batch-size 1 8 --acceptance 0.8 --out out/bench\n"
               "  specaudit bench --engine batched --engine eqspec --engine exspec --engine inplace --pair bench "
               "--batch-size 1 2 4 8 16 --prompts question.jsonl --device cuda --dtype bfloat16 --out out/bench-gpu\n"
               "  specaudit bench --engine batched --engine eqspec --engine vllm:http://127.0.0.1:8001 "
               "--plain-engine vllm:http://127.0.0.1:8000 --pair bench --batch-size 8 --out out/bench-vllm\n"
               "engines: reference and hf-assisted run at batch size 1 only; reference, batched, hf-batched and "
               "hf-continuous take no k. Engines with a `drafter` parameter (eqspec, exspec, inplace) get the "
               "calibrated drafter; the others draft with the draft model itself.\n"
               "servers: --engine vllm:URL (or llamacpp:, sglang:, trtllm:) times a running server of the same pair "
               "on the same requests, at most B in flight at batch size B, on the client's wall clock whatever "
               "--clock says; its /metrics before and after give drafted and accepted tokens. --plain-engine names "
               "the same model's server without speculation: every other server of that kind is reported as "
               "speculative / plain at each batch size, as eqspec, exspec and inplace are against batched.",
    )
    what = bench.add_argument_group("what to time")
    what.add_argument("--engine", action="append", required=True, metavar="E",
                      help=f"engine (repeatable): {', '.join(BUILTIN_ENGINES)} or package.module:factory")
    what.add_argument("--plain-engine", action="append", default=[], metavar="SERVER",
                      help="a server of the same model without speculation (e.g. vllm:URL; timed too, need not be "
                           "repeated in --engine): each other server of its kind gets tokens/s / this one's as "
                           "its speculative / plain ratio; one per server kind")
    add_engine_path_options(what)
    what.add_argument("--engine-option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                      help="extra keyword for every engine factory (JSON value), e.g. compact_fraction=0.5")
    what.add_argument("--pair", default="bench", metavar="P",
                      help="model pair: bench (a ~316M Qwen3-style target and ~11M draft, random weights) or a "
                           "built-in tiny pair")
    what.add_argument("--target", metavar="PATH", help="a local Hugging Face target folder instead of --pair")
    what.add_argument("--draft", metavar="PATH", help="its draft folder")
    what.add_argument("--batch-size", nargs="+", type=_positive, default=[1, 2, 4, 8, 16], metavar="N",
                      help="batch sizes")
    what.add_argument("--draft-tokens", nargs="+", type=_positive, default=[4], metavar="K",
                      help="draft tokens per step (k)")
    what.add_argument("--acceptance", type=_acceptance, default=DEFAULT_ACCEPTANCE, metavar="A|draft",
                      help="per-token probability that a proposal is the target's greedy token (calibrated "
                           "drafter), or 'draft' for the draft model's own greedy proposals")
    how = bench.add_argument_group("how to run")
    how.add_argument("--prompts", default="builtin", metavar="FILE|builtin",
                     help="prompt set: builtin, or JSONL with input_ids, prompt, text or Spec-Bench turns")
    how.add_argument("--num-prompts", type=_positive, default=None, metavar="N",
                     help="requests: the first N prompts, the set repeated in order when it holds fewer "
                          "(default: 4 x the largest batch size)")
    how.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N", help="new tokens per request")
    how.add_argument("--output-lengths", default=None, metavar="DIST",
                     help="each request's own budget of new tokens, drawn with --seed: uniform:LO:HI or "
                          "geometric:MEAN (cut at --max-new-tokens); rows then finish at different steps "
                          "(default: every request gets --max-new-tokens)")
    how.add_argument("--repeats", type=_positive, default=3, metavar="R", help="timed runs per engine and batch size")
    how.add_argument("--warmup", type=_count, default=1, metavar="W",
                     help="untimed runs first, on the first batch: at most 8 new tokens on the CPU, "
                          "the whole budget on a GPU (every shape the timed runs meet)")
    how.add_argument("--dtype", type=_dtype, default="float32", metavar="DTYPE", help=f"model dtype ({', '.join(DTYPE_CHOICES)})")
    how.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:N]")
    how.add_argument("--seed", type=int, default=0, help="seed of the calibrated drafter's generator")
    how.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                     help="what tokens/s divides by: elapsed time, or this process's CPU time (for a CPU shared "
                          "with other work; use it with --threads 1); both are recorded")
    how.add_argument("--threads", type=_positive, default=None, metavar="N", help="torch threads (default: torch's)")
    how.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for bench.json and plots")
    return bench


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specaudit.engines.registry import EngineSpecError, resolve
    from specaudit.engines.models.zoo import builtin_pair_names
    from specaudit.bench.run import BenchConfig, run_bench
    from specaudit.bench.charts import write_plots
    from specaudit.bench.report import markdown
    from specaudit.equivalence.prompts import PromptError

    for name in args.engine:
        try:
            resolve(name)
        except EngineSpecError as exc:
            parser.error(str(exc))
    from specaudit.bench.server import check_plain_engines, is_server

    problem = check_plain_engines(args.engine, args.plain_engine)
    if problem:
        parser.error(problem)
    args.engine = list(dict.fromkeys(args.engine + args.plain_engine))  # the plain servers are timed too
    if bool(args.target) != bool(args.draft):
        parser.error("--target and --draft go together")
    if not args.target and args.pair != "bench" and args.pair not in builtin_pair_names():
        parser.error(f"unknown pair {args.pair!r}; use bench, {', '.join(builtin_pair_names())}, or --target/--draft")
    if args.output_lengths is not None:
        from specaudit.bench.run import PER_REQUEST_BUDGET_ENGINES
        from specaudit.bench.workload import parse_output_lengths

        try:
            parse_output_lengths(args.output_lengths, args.max_new_tokens)
        except ValueError as exc:
            parser.error(f"--output-lengths: {exc}")
        fixed = [e for e in args.engine if e not in PER_REQUEST_BUDGET_ENGINES and not is_server(e)]
        if fixed:
            parser.error(f"--output-lengths: {', '.join(fixed)} take one max_new_tokens for every prompt; time "
                         f"only {', '.join(PER_REQUEST_BUDGET_ENGINES)} with it")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA device is available")
    config = BenchConfig(
        engines=args.engine, pair=args.pair, target=args.target, draft=args.draft, batch_sizes=args.batch_size,
        draft_tokens=args.draft_tokens, acceptance=args.acceptance, prompts=args.prompts,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, output_lengths=args.output_lengths,
        repeats=args.repeats, warmup=args.warmup,
        dtype=args.dtype, device=args.device, seed=args.seed, engine_options=engine_options(args),
        clock=args.clock, threads=args.threads, plain_engines=args.plain_engine,
    )
    if args.clock == "cpu" and args.device.startswith("cuda"):
        parser.error("--clock cpu does not see GPU work: use --clock wall with --device cuda")
    interrupted = False
    try:
        bench = run_bench(config, args.out, log=lambda message: print(message, file=sys.stderr, flush=True))
    except PromptError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        interrupted = True
        bench = json.loads((args.out / "bench.json").read_text())
        print("\ninterrupted: the finished runs are kept in bench.json", file=sys.stderr)
    report = markdown(bench)
    (args.out / "bench.md").write_text(report)
    plots = write_plots(bench, args.out)
    print(report)
    print(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}" + "".join(f", {p}" for p in plots))
    if interrupted:
        return 130
    return 1 if any("error" in r for r in bench["runs"]) else 0
