"""Crash isolation: when a run fails, the prompts that make the engine fail, found by bisection.

`isolate_failures(run_subset, count, error)` is called after `generate` on all `count` prompts
raised `error`. It runs fresh engines on the halves of each failing set of prompts, breadth first,
within `ISOLATION_BUDGET` re-runs:

- a set that runs is judged as usual: its outputs are kept;
- a single prompt that fails is a failure finding: `{"prompt_index", "reason", "traceback"}`;
- a set that failed whole while both its halves ran fails only in combination: its outputs come from
  the halves, and a note says so;
- when the budget is spent, each prompt of a set still failing is a failure finding that says it
  was not isolated further.

A crash on one prompt therefore never hides the others. A time-out or an out-of-memory error is not
bisected (re-running halves would multiply the cost of what already failed): the run fails whole.
A live server is bisected the same way: each re-run sends only the requests of its prompts.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specaudit.engines.adapters._http import ServerDied, ServerUnreachable
from specaudit.equivalence.errors import RunTimeout, one_line

ISOLATION_BUDGET = 32  # re-runs per failed run

_TORCH_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def isolatable(exc: BaseException) -> bool:
    """A failure worth bisecting: an exception of the engine's, not a time-out, memory, a server out of
    reach or gone, or Ctrl-C."""
    return isinstance(exc, Exception) and not isinstance(
        exc, (RunTimeout, MemoryError, _TORCH_OOM, ServerUnreachable, ServerDied))


def failure_finding(index: int, exc: BaseException, note: str = "") -> dict[str, Any]:
    return {"prompt_index": index, "reason": one_line(f"{type(exc).__name__}: {exc}") + note,
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


@dataclass
class Isolation:
    outputs: list[list[int] | None]  # None for a prompt that failed
    failures: list[dict[str, Any]]
    reruns: int
    notes: list[str] = field(default_factory=list)


def isolate_failures(run_subset: Callable[[list[int]], list[list[int]]], count: int, error: BaseException,
                     budget: int = ISOLATION_BUDGET) -> Isolation:
    """Bisect the prompt set [0, count) that failed with `error`; see the module docstring."""
    outputs: list[list[int] | None] = [None] * count
    failures: list[dict[str, Any]] = []
    notes: list[str] = []
    pending: list[tuple[list[int], BaseException]] = [(list(range(count)), error)]
    used = 0
    while pending:
        indices, exc = pending.pop(0)
        if len(indices) == 1:
            failures.append(failure_finding(indices[0], exc))
            continue
        if used >= budget:
            note = f" (it failed in a set of {len(indices)} prompts; the re-run budget of {budget} ended the bisection)"
            failures += [failure_finding(i, exc, note) for i in indices]
            continue
        middle = len(indices) // 2
        both_ran = True
        for half in (indices[:middle], indices[middle:]):
            if used >= budget:
                pending.append((half, exc))
                both_ran = False
                continue
            used += 1
            try:
                result = run_subset(half)
            except Exception as half_error:  # noqa: BLE001 - the engine's own failure, bisected further
                if not isolatable(half_error):
                    raise
                pending.append((half, half_error))
                both_ran = False
                continue
            for i, out in zip(half, result):
                outputs[i] = [int(t) for t in out]
        if both_ran:
            notes.append(f"prompts {indices[0]} to {indices[-1]} failed together "
                         f"({one_line(f'{type(exc).__name__}: {exc}')}) but each half ran alone: the failure needs "
                         "them in one run")
    failures.sort(key=lambda f: f["prompt_index"])
    return Isolation(outputs, failures, used, notes)
