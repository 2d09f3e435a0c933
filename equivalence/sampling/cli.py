"""`specaudit audit --temperature T [--top-p P] [--top-k K] --samples N [--seed S]`: the sampled audit.

With `--temperature`, `specaudit audit` tests sampled outputs instead of comparing greedy ones: each
`--engine` (sampled-spec, sampled-reference, the project's eqspec, exspec, inplace, batched or
reference sampled through their request parameters, hf-assisted, package.module:factory, recorded:FILE:
one line per sample, the prompt repeated, or a live server vllm:URL, llamacpp:URL, sglang:URL,
trtllm:URL with `--batch-size N` requests in flight) against the target of `--pair` (or `--target`: for
a server, the folder of the weights it serves), by teacher forcing in float64 on the CPU.

Every option of `specaudit audit` is honored or refused: the pair is loaded on `--device` in `--dtype`
(one of each) for the in-process engines, each engine's `generate` calls are guarded as in the greedy
audit (`--timeout`, the output contract: a failed run, exit 1), and an option that only the greedy
audit uses (`REFUSED`) is a usage error. Writes OUT/audit.json (after each engine; the greedy audit's
schema, each run with `mode` "sampled"), then OUT/report.md and OUT/report.html with their sampled
section and charts (equivalence/reports/sampled.py); exit 0 when no departure is found, 1 on a
departure, a broken seed or a failed run, 2 on bad usage (one line).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_PASS, EXIT_DEPARTURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# `specaudit audit` options that only the greedy audit uses: (attribute, its default, why), refused when given
_GREEDY_ONLY = "it rules greedy divergences; the sampled audit tests distributions"
_NOT_SAMPLED = "the sampled audit samples with temperature, top-k and top-p alone"
REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("engine_dtype", None, "give --dtype D instead, the precision the sampled audit loads the pair in and measures "
                           "its rounding allowance in"),
    ("logit_tolerance", None, _GREEDY_ONLY),
    ("plain_engine", None, _GREEDY_ONLY),
    ("require_speculation", False, "the sampled audit reports a server's speculation counters but gates on none"),
    ("pad_token_id", None, "the sampled engines use the pair's own pad id"),
    ("diagnosis", "full", "the sampled audit names no causes"),
    ("diagnosis_budget", None, "the sampled audit names no causes"),
    ("stop", [], _NOT_SAMPLED), ("stop_token_id", [], _NOT_SAMPLED), ("min_tokens", 0, _NOT_SAMPLED),
    ("repetition_penalty", 1.0, _NOT_SAMPLED), ("presence_penalty", 0.0, _NOT_SAMPLED),
    ("frequency_penalty", 0.0, _NOT_SAMPLED), ("logit_bias", [], _NOT_SAMPLED), ("bad_words", [], _NOT_SAMPLED),
    ("min_p", 0.0, _NOT_SAMPLED), ("logprobs", None, _NOT_SAMPLED),
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


def _float64_copy_fits(pair: Any) -> tuple[bool, float, float | None]:
    """Whether a float64 copy of the pair fits in the host's available memory: (fits, GiB needed, GiB free)."""
    models = [m for m in (pair.target, pair.draft) if m is not None]
    needed = sum(p.numel() for m in models for p in m.parameters()) * 8 / 2 ** 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) / 2 ** 20
                return needed < 0.8 * free, needed, free
    except OSError:
        pass
    return True, needed, None


def _load(args: argparse.Namespace, dtype: str, device: str) -> Any:
    from specaudit.engines.models.zoo import load_pair

    if args.pair:
        return load_pair(args.pair[0], dtype=dtype, device=device)
    return load_pair(target_path=args.target, draft_path=args.draft or args.target, dtype=dtype, device=device,
                     trust_remote_code=args.trust_remote_code, allow_pickle_weights=args.allow_pickle_weights)


def _usage_error(message: str) -> int:
    from specaudit.equivalence.errors import one_line

    print(f"specaudit audit: error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    import datetime
    import torch
    from specaudit import __version__
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.equivalence import validate
    from specaudit.equivalence.cli.args import engine_options
    from specaudit.equivalence.errors import one_line
    from specaudit.equivalence.prompts import load_prompts
    from specaudit.equivalence.reports.markdown import write_reports
    from specaudit.equivalence.runner import machine_info, write_json
    from specaudit.equivalence.sampling.engines import make_sampled_engine
    from specaudit.equivalence.sampling.run import guarded_sampled_audit, sampled_run

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if args.samples < 1:
            raise ValueError("--samples must be at least 1")
        if not 0 < args.alpha < 1:
            raise ValueError(f"--alpha {args.alpha}: give a family-wise false-positive rate between 0 and 1, e.g. 0.01")
        if len(args.pair) + bool(args.target) != 1:
            raise ValueError("the sampled audit takes one pair: one --pair, or --target (and --draft for a speculative engine)")
        refused = refusal(args)
        if refused:
            raise ValueError(refused)
        dtype, device = args.dtype[0], args.device
        validate.check_device(device, [dtype])
        pair = _load(args, dtype, device)
        # the oracle: the target (and draft) in float64 on the CPU; the pair itself when it is loaded so
        on_cpu_in_float64 = dtype == "float64" and torch.device(device).type == "cpu"
        if not on_cpu_in_float64:
            fits, needed, free = _float64_copy_fits(pair)
            if not fits:
                raise ValueError(f"teacher forcing needs the pair in float64 on the CPU ({needed:.1f} GiB) and "
                                 f"{free:.1f} GiB are free: audit a smaller model of the same architecture")
        oracle = pair if on_cpu_in_float64 else _load(args, "float64", "cpu")
        vocab_size = getattr(pair.target.config, "vocab_size", None)
        validate.check_eos_ids(args.eos_token_id, validate.PairLimits(pair.name, vocab_size, None, None))
        eos = pair.eos_token_id if args.eos_token_id == "pair" else args.eos_token_id
        prompts = load_prompts(args.prompts, pair.tokenizer, args.num_prompts, vocab_size=vocab_size)
    except (ValueError, OSError) as exc:  # UsageError, ModelFolderError, UnsupportedModel among them
        return _usage_error(str(exc))
    except Exception as exc:  # noqa: BLE001 - a pair that fails to load: one line, no traceback
        print(f"specaudit audit: loading the pair failed: {one_line(f'{type(exc).__name__}: {exc}')}", file=sys.stderr)
        return EXIT_DEPARTURE
    batch_size = args.batch_size[0]
    # every engine is built before any draw: a name, file or factory that fails is bad usage (exit 2), as in
    # the greedy audit's preflight
    built: dict[str, Any] = {}
    for spec in args.engine:
        try:
            built[spec] = (_recorded_samples(spec[len("recorded:"):]) if spec.startswith("recorded:")
                           else make_sampled_engine(spec, pair.target, pair.draft, params, seed=args.seed,
                                                    draft_tokens=args.draft_tokens, options=engine_options(args),
                                                    batch_size=batch_size))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad name, file or factory: one line, exit 2
            what = str(exc) if isinstance(exc, (ValueError, ImportError, OSError)) else f"{type(exc).__name__}: {exc}"
            return _usage_error(f"engine {spec}: {what}" if spec not in what else what)
    args.out.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "audit.json"
    # the greedy audit's schema (equivalence/runner.py): the config's mode and sampling settings, one run each
    audit: dict[str, Any] = {
        "specaudit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "config": {"mode": "sampled", "engines": list(args.engine), "pairs": [pair.name], "batch_sizes": [batch_size],
                   "dtypes": [dtype], "device": device, "prompts": args.prompts, "num_prompts": len(prompts),
                   "max_new_tokens": args.max_new_tokens, "draft_tokens": args.draft_tokens,
                   "eos_token_id": args.eos_token_id, "engine_options": engine_options(args), "timeout": args.timeout,
                   "sampling": params.describe(), "seed": args.seed, "samples": args.samples, "alpha": args.alpha,
                   # the oracle: the target's probabilities the tests hold the tokens against
                   "teacher_forcing": {"device": "cpu", "dtype": "float64"}},
        "complete": False, "runs": []}
    write_json(out, audit)
    base = {"pair": pair.name, "batch_size": batch_size, "dtype": dtype, "device": device, "num_prompts": len(prompts)}
    # the draw's chunks (run.draw): a bar over the samples moves after each
    chunk = max(batch_size, -(-args.samples // 20))
    try:
        _audit_each(built, audit, out, args, chunk, lambda spec, engine, bar: sampled_run(
            {"engine": spec, **base}, guarded_sampled_audit(
                spec, lambda: engine, oracle.target, prompts, params, timeout=args.timeout,
                vocab_size=vocab_size, batch_size=batch_size, device=device,
                recorded=engine if spec.startswith("recorded:") else None, samples=args.samples,
                max_new_tokens=args.max_new_tokens, eos_token_id=eos, seed=args.seed, alpha=args.alpha,
                draft=oracle.draft, run_target=None if oracle is pair else pair.target, chunk=chunk, progress=bar)))
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished engines are kept in {out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    audit["complete"] = True
    write_json(out, audit)
    reports = write_reports(audit, args.out)
    print(f"wrote {out}" + "".join(f", {path}" for path in reports.values()))
    return EXIT_DEPARTURE if any(not run["equivalent"] for run in audit["runs"]) else EXIT_PASS


def _audit_each(built: dict[str, Any], audit: dict[str, Any], out: Path, args: argparse.Namespace, chunk: int,
                audit_one: Any) -> None:
    """`audit_one(spec, engine, bar)` for each built engine, its run kept in `audit` and on disk at once
    (a crash or Ctrl-C loses no finished engine), its line printed; a bar over the samples on stderr."""
    from tqdm import tqdm

    from specaudit.equivalence.reports.sampled import run_report, summary_line
    from specaudit.equivalence.runner import write_json

    for spec, engine in built.items():
        recorded = engine if spec.startswith("recorded:") else None
        bar = None if args.no_progress or recorded is not None else tqdm(
            total=args.samples, unit="sample", desc=spec, file=sys.stderr, dynamic_ncols=True, leave=False,
            mininterval=0, miniters=1)  # at most about 20 chunks: every one is drawn
        try:
            run = audit_one(spec, engine, bar)
        finally:
            if bar is not None:
                bar.close()
        audit["runs"].append(run)
        write_json(out, audit)
        if run.get("failed"):
            print(f"{spec}: run failed", flush=True)
            print(f"failed: {spec}: {run['error']}", file=sys.stderr, flush=True)
        else:
            print(summary_line(spec, run_report(run)), flush=True)
