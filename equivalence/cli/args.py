"""Argument types shared by the `specaudit` subcommands: each failure is one line naming the fix."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from specaudit.equivalence.errors import one_line

EXIT_EQUIVALENT, EXIT_DIVERGENT, EXIT_USAGE = 0, 1, 2


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default where it has one worth showing: not for a flag (store_true), a required
    option, a default of None or of nothing, nor where the help already says what the default is. A list
    default is shown as it is typed (`float64`, not `['float64']`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (action.required or default is None or default is False or default is argparse.SUPPRESS
                or (isinstance(default, (list, tuple)) and not default) or action.nargs == 0
                or not action.option_strings or "default" in text.lower()):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, GroupHelp):  # not argparse's "-h [GROUP], --help [GROUP]"
            return ", ".join(action.option_strings[:-1] + [f"{action.option_strings[-1]}[={action.metavar}]"])
        return super()._format_action_invocation(action)


COMMON, ALL = "common", "all"  # the --help=GROUP of the common options (plain --help) and of every option


@dataclass(frozen=True)
class HelpGroup:
    """A named group of a command's options: `--help=NAME` shows it alone, plain `--help` its one line."""

    name: str  # what --help=NAME takes
    summary: str  # its line in plain --help's list of groups
    group: argparse._ArgumentGroup | None  # the group that holds its options (None: `all`, listed only)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (problem and fix), exit status 2; no usage dump, no traceback.

    A parser given named groups (`named_group`, the first one COMMON) shows on `--help` its common options and
    one line for each other group; `--help=GROUP` one group, `--help=all` every option (`GroupHelp`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_groups: list[HelpGroup] = []  # in the order --help=all shows them

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        return self.format_group_help(COMMON) if self.help_groups else super().format_help()

    def help_group_names(self) -> list[str]:
        return [group.name for group in self.help_groups] + [ALL]

    def format_group_help(self, name: str) -> str:
        """The help of group `name`: COMMON the description, the common options, a line per other group and
        the epilog; ALL every group between the description and the epilog; another group alone. A name that
        is no group is a usage error (one line, exit 2)."""
        chosen = name.strip().lower()
        if chosen not in self.help_group_names():
            self.error(f"unknown help group {name!r}: give --help=GROUP with GROUP one of "
                       f"{', '.join(self.help_group_names())}")
        whole = chosen in (COMMON, ALL)
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        if whole:
            formatter.add_text(self.description)
        for group in self.help_groups if chosen == ALL else [g for g in self.help_groups if g.name == chosen]:
            title = group.group.title if chosen != ALL or group.name == COMMON else \
                f"{group.group.title} [--help={group.name}]"
            formatter.start_section(title)
            formatter.add_text(group.group.description)
            formatter.add_arguments(group.group._group_actions)
            formatter.end_section()
        if chosen == COMMON:
            others = [g for g in self.help_groups if g.name != COMMON] + [HelpGroup(ALL, "every option", None)]
            width = max(len(g.name) for g in others) + 2
            formatter.start_section("more options: --help=GROUP shows a group")
            formatter.add_text("\n".join(f"{g.name:<{width}}{g.summary}" for g in others))
            formatter.end_section()
        if whole:
            formatter.add_text(self.epilog)
        else:
            formatter.add_text(f"(the common options: {self.prog} --help; every option: {self.prog} --help=all)")
        return formatter.format_help()


class GroupHelp(argparse.Action):
    """`-h`, `--help[=GROUP]`: print one group's help (plain: the common options and the list of groups), exit 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "this help; --help=GROUP: one of the groups below")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs="?", const=COMMON,
                         metavar="GROUP", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        grouped = isinstance(parser, Parser) and parser.help_groups
        parser._print_message(parser.format_group_help(values) if grouped else parser.format_help(), sys.stdout)
        parser.exit()


def named_group(parser: argparse.ArgumentParser, name: str, title: str, summary: str) -> Any:
    """A group of `parser`'s options that `--help=NAME` shows alone; `summary` is its line in plain `--help`.
    On a parser that is not a `Parser`, a plain argument group."""
    group = parser.add_argument_group(title)
    if isinstance(parser, Parser):
        if name == ALL or any(known.name == name for known in parser.help_groups):
            raise ValueError(f"help group {name!r} is named twice")
        parser.help_groups.append(HelpGroup(name, summary, group))
    return group


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
