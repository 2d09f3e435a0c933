"""`specaudit audit`'s search flags (`--search`, `--budget`; `--seed` is the audit's own), and the settings they give
(equivalence/pipeline/settings.py `SearchSettings`; the search itself: equivalence/search/, docs/search.md)."""

from __future__ import annotations

import argparse
from typing import Any


def budget(value: str) -> tuple[int | None, float | None]:
    """`50` (examples), `10m` (minutes) or `90s` (seconds): (examples, minutes)."""
    text = value.strip().lower()
    try:
        if text.endswith("m"):
            minutes = float(text[:-1])
            if minutes > 0:
                return None, minutes
        elif text.endswith("s"):
            seconds = float(text[:-1])
            if seconds > 0:
                return None, seconds / 60
        else:
            examples = int(text)
            if examples >= 1:
                return examples, None
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{value!r}: give a number of examples (50), minutes (10m) or seconds (90s)")


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The "search" group of `specaudit audit`."""
    from specaudit.equivalence.cli.args import named_group

    group = named_group(parser, "search",
                        "search (the workload drawn instead of fixed: request mixes from Hypothesis, each "
                        "distinct failure shrunk)", "a search over request mixes instead of the fixed prompt set")
    group.add_argument("--search", action="store_true",
                       help="draw the requests instead of sending the prompt set: each request's prompt (fresh, "
                            "sharing a prefix with an earlier one, or identical), its parameters (stop strings from "
                            "the reference's own text, stop ids, max_tokens, min_tokens, penalties, logit bias, bad "
                            "words, logprobs, seeds) and its arrival (alone, in flight with others, after others), "
                            "judged as the audit judges; a failing mix is shrunk and written as "
                            "OUT/bundles/search-*.json, and the search goes on for failures of another kind "
                            "(docs/search.md). In-process engines and live servers")
    group.add_argument("--budget", type=budget, default=None, metavar="N|Nm",
                       help="with --search: examples to judge (default 50), or minutes (10m). --seed S seeds the "
                            "draws (default 0, printed): the same seed draws the same examples on the same code "
                            "and a fresh OUT")
    group.add_argument("--max-findings", type=int, default=4, metavar="N",
                       help="with --search: stop after N distinct failures, each shrunk to its own bundle "
                            "(default: %(default)s); a failure of a kind already found is not searched again")


def search_settings_from_args(args: argparse.Namespace) -> Any:
    """`SearchSettings` for `--search`, else None."""
    from specaudit.equivalence.pipeline.settings import SearchSettings

    if not getattr(args, "search", False):
        return None
    examples, minutes = args.budget if args.budget is not None else (50, None)
    return SearchSettings(examples=examples, minutes=minutes, seed=int(getattr(args, "seed", 0) or 0),
                          max_findings=int(getattr(args, "max_findings", 4)),
                          reasoning_end=getattr(args, "reasoning_end", "") or "")
