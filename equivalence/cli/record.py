"""`specaudit record`: a live server's outputs on a prompt set, written as a recording.

Two recordings of one server (speculation on, then off) compared with `specaudit diff` is the
speculative-versus-plain check; a recording audited with `--engine recorded:FILE` is checked
against a reference on another machine. Each line holds `prompt_ids`, `output_ids`, the server's
per-token top log-probabilities where it gives real ones (`top_logprobs`), the server's own speculation
counters for the request where its answer carries them (`acceptance`: engines/adapters/server_metrics.py),
and the settings (`max_new_tokens`, `eos_token_id`, `engine`) that `recorded:` checks against the audit's.

Prompts: `--prompts FILE` with token ids (`input_ids`) needs nothing else; text prompts and the
built-in set are tokenised with `--tokenizer PATH` (a local Hugging Face tokenizer) or a built-in
pair's tokenizer (`--pair P`). Exit status: 0 written, 1 the server failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from specaudit.engines.contract import capability


def add_parser(commands: Any, formatter: type) -> None:
    record = commands.add_parser(
        "record", formatter_class=formatter, help="write a live server's outputs as a recording (JSONL)",
        description=__doc__.split("\n\n")[0].replace("`specaudit record`: ", ""),
        epilog="example:\n  specaudit record --engine llamacpp:http://127.0.0.1:8080 --tokenizer ./target "
               "--prompts questions.jsonl --max-new-tokens 64 --out spec.jsonl\n"
               "exit status: 0 written, 1 the server failed, 2 bad usage")
    record.add_argument("--engine", required=True, metavar="E",
                        help="a live server: llamacpp:URL, vllm:URL, sglang:URL or trtllm:URL")
    record.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra keyword for the engine (JSON value), e.g. timeout=600 or model=NAME")
    record.add_argument("--out", required=True, type=Path, metavar="FILE.jsonl", help="the recording to write")
    source = record.add_argument_group("prompts")
    source.add_argument("--prompts", default="builtin", metavar="FILE|builtin",
                        help="prompt set: builtin, or JSONL with input_ids, prompt, text or Spec-Bench turns")
    source.add_argument("--num-prompts", type=int, default=None, metavar="N", help="the first N prompts (default: all)")
    source.add_argument("--pair", metavar="P", help="tokenise with this built-in pair's tokenizer (bytes)")
    source.add_argument("--tokenizer", metavar="PATH", help="tokenise with this local Hugging Face tokenizer")
    how = record.add_argument_group("decoding")
    how.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="new tokens per prompt")
    how.add_argument("--eos-token-id", default="auto", metavar="ID[,ID...]|none|auto",
                     help="stop tokens: an id, a set of ids A,B (any of them ends a row), none, or auto (the "
                          "pair's EOS; with --tokenizer, every EOS id its folder's generation config declares, "
                          "else the tokenizer's)")
    how.add_argument("--batch-size", type=int, default=8, metavar="N", help="requests in flight at once")


def _eos_ids(value: str) -> int | list[int]:
    from specaudit.equivalence.cli.args import eos_token_ids

    try:
        return eos_token_ids(value, "none or auto")
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--eos-token-id: {exc}") from None


def _tokenizer(args: argparse.Namespace) -> tuple[Any | None, int | None]:
    from specaudit.engines.models import zoo

    if args.pair and args.tokenizer:
        raise ValueError("give --pair or --tokenizer, not both")
    if args.pair:
        if args.pair not in zoo.builtin_pair_names():
            raise ValueError(f"unknown pair {args.pair!r}: use one of {', '.join(zoo.builtin_pair_names())}")
        tokenizer = zoo.ByteTokenizer()
        return tokenizer, tokenizer.eos_token_id
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        except Exception as exc:  # whatever the library raises: the folder holds no usable tokenizer
            raise ValueError(f"no tokenizer in {args.tokenizer!r} ({type(exc).__name__}): give a local Hugging "
                             "Face model or tokenizer folder") from None
        # a model folder's generation config may declare several EOS ids (the server stops at each)
        from specaudit.engines.models.model_files import declared_eos_ids

        declared = declared_eos_ids(args.tokenizer)
        if declared:
            return tokenizer, declared[0] if len(declared) == 1 else declared
        return tokenizer, tokenizer.eos_token_id
    return None, None


def run(args: argparse.Namespace) -> int:
    import json

    from specaudit.engines.adapters._http import ServerError
    from specaudit.engines.adapters.recorded import write_recording
    from specaudit.engines.registry import black_box_prefix, make_engine
    from specaudit.equivalence.prompts import load_prompts

    prefix = black_box_prefix(args.engine)
    if prefix is None or prefix == "recorded":
        raise ValueError(f"--engine {args.engine!r}: record takes a live server (llamacpp:URL, vllm:URL, sglang:URL, "
                         "trtllm:URL); audit any other engine with specaudit audit")
    if args.max_new_tokens < 1 or args.batch_size < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise ValueError("--max-new-tokens, --batch-size and --num-prompts must be at least 1")
    tokenizer, default_eos = _tokenizer(args)
    if tokenizer is None and args.prompts == "builtin":
        raise ValueError("the built-in prompts are text: give --pair P or --tokenizer PATH, or --prompts FILE "
                         "with input_ids")
    if args.eos_token_id == "auto":
        if default_eos is None and tokenizer is not None:
            raise ValueError("the tokenizer names no EOS: give --eos-token-id ID or none")
        eos = default_eos
    else:
        eos = None if args.eos_token_id == "none" else _eos_ids(args.eos_token_id)
    prompts = load_prompts(args.prompts, tokenizer, args.num_prompts)
    options = {}
    for item in args.engine_option:
        key, _, raw = item.partition("=")
        try:
            options[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            options[key.replace("-", "_")] = raw
    engine = make_engine(args.engine, None, None, batch_size=args.batch_size, draft_tokens=0, **options)
    try:
        outputs = engine.generate(prompts, args.max_new_tokens, eos)
    except ServerError as exc:
        print(f"specaudit record: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    completions = capability(engine, "last_completions") or []
    counted = [{"acceptance": c.acceptance.to_json()} if c is not None and c.acceptance is not None else None
               for c in completions]
    write_recording(args.out, prompts, outputs, capability(engine, "last_logprobs"),
                    metadata={"max_new_tokens": args.max_new_tokens, "eos_token_id": eos, "engine": args.engine},
                    per_line=counted if any(counted) else None)
    print(f"wrote {len(prompts)} prompts' outputs ({sum(map(len, outputs))} tokens) to {args.out}")
    return 0
