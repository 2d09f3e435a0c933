"""Argument types shared by the `specaudit` subcommands: each failure is one line naming the fix."""

from __future__ import annotations

import argparse
import json
from typing import Any

from specaudit.equivalence.errors import one_line

EXIT_EQUIVALENT, EXIT_DIVERGENT, EXIT_USAGE = 0, 1, 2


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows a default only where there is one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (problem and fix), exit status 2; no usage dump, no traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


DTYPE_CHOICES = ["float64", "float32", "bfloat16", "float16"]


def positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number: give one of at least 1") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is too small: give a whole number of at least 1")
    return number


def eos_token_ids(value: str, words: str = "pair (the pair's own EOS ids) or none") -> int | list[int]:
    """`--eos-token-id` as ids: `ID` (one id) or `A,B,...` (a set: stopping at any of them ends a row). Whether
    each id is in the vocabulary is checked against the pair (`validate.check_eos_ids`)."""
    parts = [part.strip() for part in value.split(",")]
    ids = []
    for part in parts:
        try:
            ids.append(int(part))
        except ValueError:
            what = f"{part!r} in {value!r} is not a token id" if len(parts) > 1 else f"{value!r} is not a token id"
            raise argparse.ArgumentTypeError(f"{what}: give a token id, ids separated by commas (A,B), or "
                                             f"{words}") from None
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{value!r} names an id twice: give each EOS id once")
    return ids[0] if len(ids) == 1 else ids


def dtype(value: str) -> str:
    if value not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}: use one of {', '.join(DTYPE_CHOICES)}")
    return value


def engine_option(value: str) -> tuple[str, Any]:
    """`KEY=VALUE` for an engine factory: the value as JSON when it parses, else the plain string."""
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    try:
        return key.replace("-", "_"), json.loads(raw)
    except json.JSONDecodeError:
        return key.replace("-", "_"), raw


def add_engine_path_options(group: Any) -> None:
    """`--no-cuda-graphs`, shared by `audit` and `bench` (read back by `engine_options`)."""
    group.add_argument("--no-cuda-graphs", action="store_true",
                       help="the fixed-shape engine (--engine fixedshape) runs its passes eagerly instead of "
                       "replaying them as CUDA graphs (engine option cuda_graphs=false); other engines ignore it")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every `--engine-option KEY=VALUE`, after `cuda_graphs=false` from `--no-cuda-graphs` (an explicit option wins)."""
    return {**({"cuda_graphs": False} if args.no_cuda_graphs else {}), **dict(args.engine_option)}
