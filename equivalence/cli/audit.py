"""`specaudit audit`, `specaudit pairs` and `specaudit engines`: their parsers and what they run.

Exit status of `specaudit audit`: 0 when every audited engine is equivalent, 1 when any run has a
structural divergence (or its engine failed) or a gate failed or could not be applied (equivalence/gates.py),
2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specaudit.equivalence.cli import blackbox as cli_blackbox
from specaudit.equivalence.cli.args import COMMON, DTYPE_CHOICES, EXIT_USAGE, GroupHelp, named_group
from specaudit.equivalence.cli.args import add_engine_path_options, engine_options
from specaudit.equivalence.cli.args import dtype as _dtype
from specaudit.equivalence.cli.args import eos_token_ids
from specaudit.equivalence.cli.args import engine_option as _option
from specaudit.equivalence.cli.args import positive as _positive

if TYPE_CHECKING:
    from specaudit.equivalence.records import Audit

def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive: give a number of seconds above 0")
    return number


def _token_id(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token id, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"a token id is at least 0, got {number}")
    return number


def _eos(value: str) -> int | list[int] | None | str:
    if value in ("pair", "none"):
        return None if value == "none" else "pair"
    return eos_token_ids(value)


def _speculation(value: str) -> str:
    from specaudit.equivalence.acceptance.expected import parse_spec

    try:
        parse_spec(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--speculation {value!r}: ")) from None
    return value


def _baseline(value: str) -> str:
    from specaudit.equivalence.acceptance.run import load_baseline

    try:
        load_baseline(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--acceptance-baseline {value}: ")) from None
    return value


def _ratio(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number: give a ratio such as 0.9") from None
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value} is outside 0 < R <= 1: give a ratio of observed to expected "
                                         "acceptance such as 0.9") from None
    return number


def add_parsers(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """`audit`, `pairs` and `engines` on the `specaudit` parser's subcommands."""
    from specaudit.equivalence.cli.request_args import add_request_arguments
    from specaudit.equivalence.sampling import cli as sampling_cli
    from specaudit.equivalence.cli.search_args import add_search_arguments
    from specaudit.engines.registry import BUILTIN_ENGINES
    from specaudit.engines.models.zoo import builtin_pair_names

    audit = commands.add_parser(
        "audit", formatter_class=formatter, add_help=False,
        usage="%(prog)s --engine E [--pair P | --target PATH [--draft PATH] | --reference ENGINE]\n"
              "                       --out DIR [OPTION ...]",
        help="audit engines for output equivalence with greedy decoding",
        description="Run each engine on each model pair, batch size and dtype; compare every token (and, in "
                    "float64, every logit) with plain greedy decoding of one prompt at a time; attribute each "
                    "divergence; write OUT/audit.json, OUT/report.md and OUT/report.html.\n\n"
                    "One audit, three choices: the engine runs in this process, is a live server (vllm:URL, ...) "
                    "or a recording (recorded:FILE, audited on its own prompts); the oracle is the target's "
                    "weights (--pair, --target) or a served reference (--reference ENGINE, no weights); outputs "
                    "are judged as greedy tokens or, with --temperature, as samples. Every composition is "
                    "guarded alike (--timeout, the output contract, Ctrl-C keeps finished runs) and writes the "
                    "same audit.json and reports.",
        epilog="examples:\n"
               "  specaudit audit --engine eqspec --pair tiny-llama --batch-size 8 --dtype float64 --out out/\n"
               "  specaudit audit --engine mypkg.engine:make --target ./target --draft ./draft "
               "--prompts questions.jsonl --dtype bfloat16 --device cuda --out out/\n"
               "  specaudit audit --engine vllm:http://127.0.0.1:8000 --reference vllm:http://127.0.0.1:8001 "
               "--tokenizer ./target --timeout 600 --out out/\n"
               "  specaudit audit --engine recorded:samples.jsonl --pair tiny-llama --temperature 1 --out out/\n"
               "exit status: 0 equivalent, 1 structural divergence, departure, engine failure or a served reference "
               "that failed, 2 bad usage",
    )
    # the common case first (plain --help); every other option in a named group (--help=GROUP, --help=all)
    common = named_group(audit, COMMON, "common options (what to audit, and how much)", "")
    common.add_argument("-h", "--help", action=GroupHelp)
    common.add_argument("--engine", action="append", required=True, metavar="E",
                        help=f"engine to audit (repeatable): a built-in name ({', '.join(BUILTIN_ENGINES)}), "
                             "a recording recorded:FILE, a live server llamacpp:URL, vllm:URL, sglang:URL or "
                             "trtllm:URL (--batch-size N: N requests in flight), or package.module:factory, called "
                             "as factory(target, draft, batch_size=..., draft_tokens=..., **options)")
    common.add_argument("--pair", action="append", default=[], metavar="P",
                        help=f"built-in model pair (repeatable): {', '.join(builtin_pair_names())}")
    common.add_argument("--target", metavar="PATH", help="a local Hugging Face target model folder (safetensors)")
    common.add_argument("--draft", metavar="PATH",
                        help="its draft model folder (same tokenizer; a padded vocabulary of another size is "
                             "compared over the ids both have)")
    common.add_argument("--trust-remote-code", action="store_true", help="allow custom model code in --target/--draft")
    common.add_argument("--allow-pickle-weights", action="store_true",
                        help="allow --target/--draft weights that are not safetensors (*.bin, *.pt: pickle, which "
                             "can run code when loaded)")
    common.add_argument("--batch-size", nargs="+", type=_positive, default=[8], metavar="N", help="batch sizes")
    common.add_argument("--dtype", nargs="+", type=_dtype, default=["float64"], metavar="DTYPE",
                        help=f"dtypes ({', '.join(DTYPE_CHOICES)}); float64 is exact, so any mismatch is a bug")
    common.add_argument("--device", default="cpu",
                        help="torch device: cpu, cuda[:N], or auto: the target (and draft) split over this "
                             "machine's devices by accelerate's device_map=\"auto\" (pip install accelerate), for "
                             "a target larger than one device; the reference and the plain control run so placed")
    common.add_argument("--prompts", default="builtin", metavar="FILE|builtin",
                        help="prompt set: builtin, or JSONL with input_ids, prompt, text or Spec-Bench turns, or a "
                             "recording (its prompt_ids, each distinct prompt once)")
    common.add_argument("--num-prompts", type=_positive, default=None, metavar="N",
                        help="use the first N prompts (default: all)")
    common.add_argument("--max-new-tokens", type=_positive, default=32, metavar="N", help="new tokens per prompt")
    common.add_argument("--draft-tokens", type=_positive, default=4, metavar="K", help="draft tokens per step (k)")
    common.add_argument("--timeout", type=_seconds, default=3600.0, metavar="SECONDS",
                        help="per-run time limit, on every engine and server: a run past it is recorded as failed "
                             "and the audit goes on (its engine abandoned in a background thread, not killed; the "
                             "command still exits when the audit ends); a served reference past it ends the audit, "
                             "exit 1; the diagnosis's re-runs of a run share a second limit as long")
    common.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for audit.json and reports")

    prompts = named_group(audit, "prompts", "prompts and token ids",
                          "stop and pad ids, the adversarial prompts every audit adds")
    prompts.add_argument("--eos-token-id", type=_eos, default="pair", metavar="ID[,ID...]|pair|none",
                         help="stop tokens: the pair's own EOS ids (every id its target's generation config "
                              "declares), an id, a set of ids A,B (stopping at any of them ends a row), or none")
    prompts.add_argument("--pad-token-id", type=_token_id, default=None, metavar="ID",
                         help="the pad id the pair declares (its configs' pad_token_id) to the engines under audit "
                              "(default: the pair's own); the EOS id here audits the pad-equals-EOS set-up")
    prompts.add_argument("--no-adversarial", action="store_true",
                         help="leave out the adversarial prompts that every audit adds to each pair's prompts by "
                              "default (pad, EOS and BOS ids inside prompts, identical prompts, one-token prompts, "
                              "prompts past 1024 and 2048 tokens where the model allows them)")
    engines = named_group(audit, "engines", "in-process engines", "a factory's keywords, CUDA graphs")
    engines.add_argument("--engine-option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                         help="extra keyword for every engine factory (JSON value), e.g. window_size=16")
    add_engine_path_options(engines)
    cli_blackbox.add_audit_options(audit)  # servers, precision, reference

    diagnosis = named_group(audit, "diagnosis", "diagnosis (naming the cause of each structural divergence)",
                            "naming a structural divergence's cause: quick or full, a budget")
    diagnosis.add_argument("--diagnosis", choices=("quick", "full"), default="full",
                           help="full (default): checks, logit replays and re-runs of the engine (alone, beside a "
                                "copy, with another pad id); quick: checks and replays only, "
                                "no re-run: a class where they decide it, else unknown with what a re-run would "
                                "try. For a merge gate: quick, see docs/ci.md")
    diagnosis.add_argument("--diagnosis-budget", type=_seconds, default=None, metavar="SECONDS",
                           help="seconds per run for the diagnosis's re-runs; once spent, the remaining "
                                "divergences are diagnosed without re-runs (default: --timeout)")

    accept = named_group(audit, "acceptance", "acceptance per draft position (observed against expected)",
                         "acceptance per draft position: proposer, baseline, gate, payoff")
    accept.add_argument("--speculation", type=_speculation, default=None, metavar="SPEC",
                        help="the audited engine's proposer, for the expected acceptance: draft:k=K (the pair's draft "
                             "model, greedy) or ngram:k=K,min=N,max=M[,occurrence=earliest|latest] (prompt lookup; "
                             "earliest is vLLM's rule). Default: an in-process engine's own drafter; none for a "
                             "server or recording")
    accept.add_argument("--acceptance-baseline", type=_baseline, default=None, metavar="FILE",
                        help="an earlier audit.json: its observed per-position acceptance is the expectation, "
                             "compared with a two-sample test (wins over --speculation)")
    accept.add_argument("--require-acceptance", type=_ratio, default=None, metavar="R",
                        help="fail (exit 1) when a run's observed acceptance is below R x expected at some draft "
                             "position, significantly (Holm, alpha 0.01); 0 < R <= 1 (default: no gate)")
    accept.add_argument("--payoff", type=_positive, default=0, metavar="N",
                        help="also time the speculative engine against the plain one (--plain-engine, else the "
                             "plain control batched) on the same prompts, N times each: the ratio of tokens per "
                             "second and its spread; 'speculation slower than plain' when every repeat is below 1 "
                             "(default: 0, not measured)")

    add_request_arguments(audit)  # requests, structured
    sampling_cli.add_options(audit)  # sampling
    add_search_arguments(audit)  # search

    out = named_group(audit, "output", "output", "repro bundles, the progress bar")
    out.add_argument("--no-bundles", action="store_true",
                     help="do not write OUT/bundles/*.json (one self-contained repro bundle per divergence, "
                          "for any engine; re-check one with specaudit replay)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")

    pairs = commands.add_parser("pairs", help="list the built-in model pairs", formatter_class=formatter)
    pairs.add_argument("--acceptance", action="store_true",
                       help="also measure each pair's per-token acceptance on the built-in prompts (float64)")
    pairs.add_argument("--max-new-tokens", type=_positive, default=32, metavar="N",
                       help="continuation length for --acceptance")
    commands.add_parser("engines", help="list the built-in engines")


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The audit's one settings record (equivalence/pipeline/settings.py) from the command line; every
    combination that cannot run is one usage line here (exit 2), whichever the composition."""
    from specaudit.engines.models.zoo import builtin_pair_names
    from specaudit.engines.registry import black_box_prefix
    from specaudit.equivalence.cli.request_args import request_params_from_args
    from specaudit.equivalence.cli.search_args import search_settings_from_args
    from specaudit.equivalence.pipeline import sampled
    from specaudit.equivalence.pipeline.settings import AuditSettings, SamplingSettings, UserPair
    from specaudit.equivalence.sampling.cli import refusal as sampled_refusal

    refusal = (served_refusal(args)
               or (sampled_refusal(args) if args.temperature is not None else None))
    if refusal is not None:
        parser.error(refusal)
    sampling = None
    if args.temperature is not None:
        sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                    samples=args.samples, seed=args.seed, alpha=args.alpha)
    pairs: list[Any] = []
    if args.reference is None:
        if args.draft and not args.target:
            parser.error("--draft needs --target")
        black_boxes = all(black_box_prefix(name) for name in
                          args.engine + ([args.plain_engine] if args.plain_engine else []))
        if args.target and not args.draft and not black_boxes and sampling is None:
            parser.error("--target needs --draft, except when every --engine is a recording or a server "
                         "(recorded:, llamacpp:, vllm:, sglang:, trtllm:)")
        for name in args.pair:
            if name not in builtin_pair_names():
                parser.error(f"unknown pair {name!r}; built-in pairs: {', '.join(builtin_pair_names())} "
                             "(or give --target PATH --draft PATH)")
            pairs.append(name)
        if args.target:
            draft = args.draft or (args.target if sampling is not None else None)  # a sampled target drafts for itself
            pairs.append(UserPair(args.target, draft, args.trust_remote_code, args.allow_pickle_weights))
        if not pairs:
            parser.error("give at least one --pair, or --target and --draft")
    # the device, dtypes, engines, pairs and prompts are checked by the pipeline's preflight
    settings = AuditSettings(
        engines=args.engine, pairs=pairs, batch_sizes=args.batch_size, dtypes=args.dtype, device=args.device,
        prompts=args.prompts, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        draft_tokens=args.draft_tokens, eos_token_id=args.eos_token_id,
        engine_options=engine_options(args),
        timeout=args.timeout, engine_dtype=args.engine_dtype, logit_tolerance=args.logit_tolerance,
        bundles=not args.no_bundles, adversarial=not args.no_adversarial, pad_token_id=args.pad_token_id,
        require_speculation=args.require_speculation, plain_engine=args.plain_engine,
        speculation=args.speculation, acceptance_baseline=args.acceptance_baseline,
        require_acceptance=args.require_acceptance, payoff=args.payoff,
        diagnosis=args.diagnosis, diagnosis_budget=args.diagnosis_budget,
        # under sampling, --top-k is the sampler's cut; the other request parameters go to the sampled judge too
        request_params=request_params_from_args(args, parser),
        reference=args.reference, tokenizer=args.tokenizer,
        reference_batch_invariant=args.reference_batch_invariant,
        reference_top_logprobs=args.reference_top_logprobs, sampling=sampling,
        search=search_settings_from_args(args),
    )
    if sampling is not None:
        refused = sampled.refusal(settings)
        if refused is not None:
            parser.error(refused)
    return settings


def served_refusal(args: argparse.Namespace) -> str | None:
    """Why the options cannot go together with `--reference` (or its own options without it), or None."""
    if args.reference is None:
        for flag, given in (("--tokenizer", args.tokenizer is not None),
                            ("--reference-batch-invariant", args.reference_batch_invariant)):
            if given:
                return f"{flag} is an option of --reference: give --reference ENGINE, or drop {flag}"
        return None
    needs_weights = [flag for flag, given in (
        ("--target", args.target), ("--pair", args.pair), ("--draft", args.draft),
        ("--dtype", args.dtype != ["float64"]), ("--device", args.device != "cpu"),
        ("--plain-engine", args.plain_engine), ("--trust-remote-code", args.trust_remote_code),
        ("--allow-pickle-weights", args.allow_pickle_weights), ("--pad-token-id", args.pad_token_id is not None),
        ("--diagnosis-budget", args.diagnosis_budget is not None))
        if given]
    if needs_weights:
        what = "is the plain engine already" if needs_weights[0] == "--plain-engine" else "needs the weights in this process"
        return (f"--reference replaces the in-process reference, and {needs_weights[0]} {what}: drop "
                f"{needs_weights[0]}, or drop --reference and give --target")
    if args.reference_top_logprobs < 1:
        return "--reference-top-logprobs must be at least 1"
    return None


def run_audit_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`specaudit audit`, every composition: settings, the pipeline, the reports, the summary, the exit status."""
    from specaudit.engines.models.model_files import ModelFolderError
    from specaudit.engines.registry import EngineSpecError
    from specaudit.equivalence.errors import UsageError, one_line
    from specaudit.equivalence.pipeline.runner import EXIT_INTERRUPTED, EXIT_NOT_EQUIVALENT, exit_status, run_audit
    from specaudit.equivalence.gates import gate_failures
    from specaudit.equivalence.records.serialize import as_audit
    from specaudit.equivalence.reports.summary import summary_table, verdict_line

    settings = settings_from_args(args, parser)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        def progress(total: int):
            return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    interrupted = False
    try:
        audit = run_audit(settings, args.out, progress=progress)
    except (UsageError, EngineSpecError, ModelFolderError) as exc:  # found before any run: one line, exit 2
        print(f"specaudit audit: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        interrupted = True
        json_path = args.out / "audit.json"
        if not json_path.is_file():
            print("\ninterrupted before the audit started: nothing was written", file=sys.stderr)
            return EXIT_INTERRUPTED
        audit = json.loads(json_path.read_text())
        print("\ninterrupted: the finished runs are kept in audit.json", file=sys.stderr)
    record = as_audit(audit)  # read once: everything below reads the typed records
    written = _write_reports(record, args.out)
    failed_reference = (record.reference or {}).get("error")
    if failed_reference:  # nothing was judged: one line
        print(f"specaudit audit: {failed_reference}; no engine was audited (see {args.out / 'audit.json'})",
              file=sys.stderr)
        return EXIT_INTERRUPTED if interrupted else EXIT_NOT_EQUIVALENT
    print(summary_table(record))
    print(f"\nwrote {args.out / 'audit.json'}" + "".join(f", {p}" for p in written))
    print(verdict_line(record))
    for run in record.runs:
        if run.error:
            print(f"failed: {run.engine} {run.pair} B={run.batch_size} {run.dtype}: {run.error}", file=sys.stderr)
    for failure in gate_failures(record):  # one line per gate that failed runs or was not applied to them
        print(failure.message, file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else exit_status(record)


def _write_reports(audit: Audit | dict[str, Any], out: Path) -> list[Path]:
    from specaudit.equivalence.reports.markdown import write_reports

    return list(write_reports(audit, out).values())


def usage_errors_as_one_line(command: str, run: Any) -> int:
    """`run()`, with bad input it finds (a model folder, an engine name, a usage error) as one line, exit 2."""
    from specaudit.engines.models.model_files import ModelFolderError
    from specaudit.engines.registry import EngineSpecError
    from specaudit.equivalence.errors import UsageError, one_line

    try:
        return run()
    except (UsageError, ModelFolderError, EngineSpecError) as exc:
        print(f"specaudit {command}: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "audit":
        return run_audit_command(args, parser)
    if args.command == "pairs":
        from specaudit.engines.models import zoo

        for name in zoo.builtin_pair_names():
            if not args.acceptance:
                print(name)
                continue
            pair = zoo.load_pair(name)
            rate = zoo.measure_acceptance(pair, zoo.builtin_prompts(), args.max_new_tokens)
            print(f"{name:<16} {pair.info['family']:<10} acceptance {rate:.1%}", flush=True)
        return 0
    from specaudit.engines.registry import ENGINES, REQUESTS  # "engines"

    def can(entry: Any) -> str:
        sampled = ("sampled (request parameters)" if entry.sampled == REQUESTS
                   else "sampled" if entry.sampled else "")
        return ", ".join(part for part in ("greedy" if entry.greedy else "", sampled) if part)

    print("\n".join(f"{name:<18} {can(entry):<38} {entry.greedy or entry.sampled}" for name, entry in ENGINES.items()))
    return 0
