"""`specaudit audit` flags for request parameters: one set for every prompt (a prompts file's per-line
`params` objects override it field by field; equivalence/blackbox/requests_run.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specaudit.engines.constraints import Constraint
from specaudit.equivalence.cli.args import named_group
from specaudit.engines.requests import RequestParams


def _logit_bias(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID:BIAS such as 258:-5, got {value!r}") from None


def add_request_arguments(audit: argparse.ArgumentParser) -> None:
    """The request-parameter flags, in their own group."""
    group = named_group(
        audit, "requests", "request parameters (sent to live servers in each one's names; the reference applies the "
        "same; a prompts file line's `params` object overrides them for that prompt)",
        "request parameters: stops, penalties, logit bias, min_p, top_k...")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    group.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                       help="a stop token id besides EOS (repeatable)")
    group.add_argument("--min-tokens", type=int, default=0, metavar="N", help="no stop before N new tokens")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                       help="divide positive / multiply negative logits of tokens seen in prompt and output")
    group.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                       help="subtract X from the logit of every token already seen")
    group.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                       help="subtract X from a token's logit per time it was already seen")
    group.add_argument("--logit-bias", action="append", type=_logit_bias, default=[], metavar="ID:BIAS",
                       help="add BIAS to token ID's logit (repeatable; BIAS in [-100, 100])")
    group.add_argument("--bad-words", action="append", default=[], metavar="TEXT",
                       help="a banned word, as text (repeatable; resolved to token ids as vLLM does)")
    group.add_argument("--min-p", type=float, default=0.0, metavar="P", help="min_p (greedy: changes reported probabilities only; with --temperature: the sampler's cut, after the temperature)")
    group.add_argument("--top-k", type=int, default=0, metavar="K", help="top_k (greedy: changes reported probabilities only; with --temperature: the sampling cut; 0: off)")
    group.add_argument("--logprobs", type=int, default=None, metavar="N", help="top log-probabilities to ask for")
    add_constraint_arguments(audit)


def add_constraint_arguments(audit: argparse.ArgumentParser) -> None:
    """The structured-output flags (docs/structured.md): at most one constraint kind per audit."""
    group = named_group(
        audit, "structured", "structured outputs (one constraint for every prompt; a prompts file line's "
        "`params.constraint` overrides it; applied by the reference with xgrammar, as vLLM does)",
        "structured outputs: JSON schema or object, regex, choice, grammar")
    group.add_argument("--json-schema", metavar="FILE", default=None, help="output: JSON valid under the schema in FILE")
    group.add_argument("--json-object", action="store_true", help="output: any JSON object")
    group.add_argument("--regex", metavar="R", default=None, help="output: text matching R in full")
    group.add_argument("--choice", action="append", default=[], metavar="TEXT",
                       help="output: exactly one of the choices (repeatable)")
    group.add_argument("--grammar", metavar="FILE", default=None,
                       help="output: a sentence of the grammar in FILE (EBNF/GBNF or Lark)")
    group.add_argument("--grammar-syntax", choices=("auto", "ebnf", "lark"), default="auto",
                       help="--grammar's syntax (default: auto, Lark unless a line holds ::=, as vLLM reads it)")
    group.add_argument("--grammar-backend", default="xgrammar", choices=("xgrammar", "llguidance"),
                       help="the audited server's grammar engine, which the reference applies (default: xgrammar, "
                            "vLLM's and SGLang's; llguidance: what llama.cpp applies to --json-schema/--json-object)")
    group.add_argument("--no-any-whitespace", action="store_true",
                       help="JSON kinds: no whitespace between tokens (the server runs with vLLM's disable_any_whitespace)")
    group.add_argument("--reasoning-end", metavar="TEXT", default="",
                       help="the grammar applies after a reasoning section ending in TEXT (for example </think>; the "
                            "server runs with vLLM's --reasoning-parser); with --search, every drawn constraint carries it. Default: "
                            "none, the grammar from the first token (--search on an in-process engine draws markers "
                            "from the reference's own text)")


def constraint_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Constraint | None:
    """The flags' Constraint, or None; two kinds, an unreadable file or a bad constraint exit 2 with one line."""
    given = [name for name, on in (("--json-schema", args.json_schema is not None), ("--json-object", args.json_object),
                                   ("--regex", args.regex is not None), ("--choice", bool(args.choice)),
                                   ("--grammar", args.grammar is not None)) if on]
    if len(given) > 1:
        parser.error(f"structured outputs: one constraint per audit, got {' and '.join(given)} "
                     "(give prompts their own in the prompts file's params.constraint)")
    if not given:
        if getattr(args, "reasoning_end", "") and not getattr(args, "search", False):
            parser.error("--reasoning-end says where a constraint begins: give one (--json-schema, --regex, ...), "
                         "or --search, whose drawn constraints all carry it")
        return None
    common = {"backend": args.grammar_backend, "any_whitespace": not args.no_any_whitespace,
              "reasoning_end": getattr(args, "reasoning_end", "")}
    try:
        if args.json_schema is not None:
            return Constraint("json_schema", _read(args.json_schema, "--json-schema"), **common)
        if args.json_object:
            return Constraint("json_object", **common)
        if args.regex is not None:
            return Constraint("regex", args.regex, **common)
        if args.choice:
            return Constraint("choice", choices=tuple(args.choice), **common)
        return Constraint("grammar", _read(args.grammar, "--grammar"), syntax=args.grammar_syntax, **common)
    except (OSError, ValueError) as exc:
        parser.error(f"structured outputs: {exc}")
    return None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


def request_params_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RequestParams | None:
    """The flags' RequestParams, or None when none was given; a bad value is a usage error (exit 2)."""
    values: dict[str, Any] = {
        "stop": tuple(args.stop), "stop_token_ids": tuple(args.stop_token_id), "min_tokens": args.min_tokens,
        "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty, "logit_bias": tuple(args.logit_bias),
        "bad_words_text": tuple(args.bad_words), "min_p": args.min_p, "top_k": args.top_k, "logprobs": args.logprobs,
        "constraint": constraint_from_args(args, parser),
    }
    try:
        params = RequestParams(**values)
    except ValueError as exc:
        parser.error(f"request parameters: {exc}")
    return None if params.is_plain() and params.logprobs is None else params
