"""The harness's error classes and what each means for the exit status.

- `UsageError` (exit 2): bad input found before any run: a usage mistake (`UsageError`), bad
  prompt data (`DataError`, naming the file and line) or an unusable model (`ModelError`). The
  message is one line that names the problem and the fix.
- `EngineFailure` (a failed run, exit 1): an engine under audit raised, returned something that
  breaks the contract, or ran out of memory; `RunTimeout`: it ran past `--timeout`. The runner
  records either in `audit.json` and goes on with the next run.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad usage: exit 2 before any run, with a one-line message."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class DataError(UsageError):
    """A prompt set that cannot be used; the message names the file and line."""


class ModelError(UsageError):
    """A model (pair) that cannot be loaded or audited as given."""


class EngineFailure(RuntimeError):
    """An engine under audit failed during a run (recorded as a failed run)."""


class RunTimeout(EngineFailure):
    """An engine's `generate` ran past the per-run time limit."""


def one_line(message: str) -> str:
    """`message` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(message).split())


class ReferenceFailed(Exception):
    """A served reference that failed or hung: nothing can be judged; the audit ends with exit 1, one line."""
