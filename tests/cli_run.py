"""`specaudit ...` run in this process, with its exit status and output (for the CLI tests)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from specaudit.cli import main


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


def usage_error(result: Result, *fragments: str) -> str:
    """Assert exit 2 with exactly one line on stderr that holds every fragment; return the line."""
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]
