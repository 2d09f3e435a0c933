"""`specaudit`: audit batched speculative decoding engines against greedy decoding.

The command's entry point. Each subcommand's parser and runner live with what it drives:
`audit`, `pairs`, `engines`, `record`, `diff` and `replay` in `specaudit.equivalence.cli`,
`bench` in `specaudit.bench.cli`. This module only joins them, so the audit never imports the bench.
"""

from __future__ import annotations

import argparse
import sys

from specaudit.equivalence.cli.args import EXIT_USAGE, Formatter, Parser


def build_parser() -> argparse.ArgumentParser:
    from specaudit import __version__
    from specaudit.bench import cli as bench_cli
    from specaudit.equivalence.cli import audit as audit_cli
    from specaudit.equivalence.cli import blackbox as blackbox_cli

    parser = Parser(prog="specaudit", description=__doc__.split("\n\n")[0], formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"specaudit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    audit_cli.add_parsers(commands, Formatter)
    blackbox_cli.add_parsers(commands, Formatter)
    bench_cli.add_parser(commands, Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command's exit status. Run as the process's own entry (`argv` None), it also makes sure the process
    ends: a run abandoned past `--timeout` (a hung server's request) leaves a worker thread behind, and the
    status is returned by ending the process at once rather than waiting for that thread."""
    status = _run(argv)
    if argv is None:
        _exit_past_abandoned_work(status)
    return status


def _run(argv: list[str] | None) -> int:
    from specaudit.bench import cli as bench_cli
    from specaudit.equivalence.cli import audit as audit_cli
    from specaudit.equivalence.cli import blackbox as blackbox_cli

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("audit", "pairs", "engines"):
        return audit_cli.run(args, parser)
    if args.command in blackbox_cli.COMMANDS:
        return blackbox_cli.run(args)
    if args.command == "bench":
        return audit_cli.usage_errors_as_one_line("bench", lambda: bench_cli.run(args, parser))
    parser.print_help()
    return EXIT_USAGE


def _exit_past_abandoned_work(status: int) -> None:
    """`os._exit(status)` after flushing, when threads other than the main one are still alive (an engine
    abandoned past its time limit, its requests in flight): the interpreter would wait for them at exit."""
    import os
    import threading

    if any(thread is not threading.main_thread() and thread.is_alive() and not thread.daemon
           for thread in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
