"""`specaudit ...` run in this process, with its exit status and output (for the CLI tests)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from specaudit.equivalence.cli import main


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*argv: str) -> Result:
    """`specaudit ARGV...`: the console script runs the same `main`."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return Result(code, stdout.getvalue(), stderr.getvalue())


def audit(*args: str, out: Path) -> Result:
    """`specaudit audit --no-progress ARGS... --out OUT`."""
    return cli("audit", "--no-progress", *args, "--out", str(out))


def runs(out: Path) -> list[dict]:
    return json.loads((out / "audit.json").read_text())["runs"]
