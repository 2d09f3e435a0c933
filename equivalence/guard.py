"""An engine under audit, behind a guard: a time limit per run and a check of what it returns.

`GuardedEngine(engine, timeout=..., vocab_size=...)` behaves as `engine` (attributes such as
`last_trace` and `record_logits` pass through; keywords of `generate` such as a sampled engine's
`seeds=` too), but its `generate`

- runs the engine's `generate` in a worker thread and waits at most `timeout` seconds; past that
  it raises `RunTimeout` and the audit goes on. Python cannot kill a thread, so a timed-out engine
  is abandoned, not stopped: its daemon thread keeps running (and using CPU, memory and the shared
  models, which it only reads if it follows the contract) until its `generate` returns or the
  process exits. A subprocess could be killed, but the factory receives the loaded models, which a
  subprocess would have to load again (minutes for a real model, and twice the memory). A
  KeyboardInterrupt or SystemExit raised inside the engine is re-raised in the caller. Thread-local
  state is the worker's own: grad mode is copied from the caller, and an engine that installs
  signal handlers inside `generate` cannot (Python allows that in the main thread only);
- checks the outputs: one list per prompt, each made of integer token ids in [0, vocab_size)
  (Python, NumPy or 0-d torch integers; not floats or booleans), and raises `EngineFailure` naming
  the prompt and position otherwise. Ids past `max_new_tokens` or past EOS are left to the comparison,
  which reports them as divergences.

`failure_message` words a failed run's one-line reason (out of memory, a server gone, a broken contract or
a time-out, an exception from inside or outside `generate`) for the greedy runner and the sampled audit alike.
"""

from __future__ import annotations

import functools
import numbers
import threading
from typing import Any

import torch

from specaudit.engines.adapters._http import ServerDied
from specaudit.equivalence.errors import EngineFailure, RunTimeout


class GuardedEngine:
    """`engine` with a per-run time limit and an output check on `generate`."""

    def __init__(self, engine: Any, *, timeout: float | None, vocab_size: int | None) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_timeout", timeout)
        object.__setattr__(self, "_vocab_size", vocab_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_engine"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None,
                 **keywords: Any) -> list[list[int]]:
        function = functools.partial(self._engine.generate, **keywords) if keywords else self._engine.generate
        outputs = call_with_timeout(function, (prompts, max_new_tokens, eos_token_id), self._timeout)
        return check_outputs(outputs, len(prompts), self._vocab_size)


def unguarded(engine: Any) -> Any:
    """The engine behind a `GuardedEngine` (`engine` itself when it is not guarded): for reading its
    `generate`'s signature."""
    return object.__getattribute__(engine, "_engine") if isinstance(engine, GuardedEngine) else engine


def call_with_timeout(function: Any, args: tuple, timeout: float | None) -> Any:
    """`function(*args)` in a daemon thread; `RunTimeout` after `timeout` seconds (None: no limit)."""
    result: dict[str, Any] = {}
    done = threading.Event()
    grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: the worker inherits the caller's

    def work() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                result["value"] = function(*args)
        except BaseException as exc:  # handed to the caller, KeyboardInterrupt included
            result["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=work, name="specaudit-engine", daemon=True)
    worker.start()
    if not done.wait(timeout):
        raise RunTimeout(f"generate() did not return within {timeout:g} s (--timeout); the run was abandoned")
    if "error" in result:
        error = result["error"]
        error.raised_inside_engine = True  # for the run's message: the engine raised it, not the audit
        raise error
    return result["value"]


def raised_inside_engine(exc: BaseException) -> bool:
    """Whether `exc` came out of an engine's own `generate` (through `call_with_timeout`)."""
    return bool(getattr(exc, "raised_inside_engine", False))


def _token(value: Any) -> int | None:
    """`value` as an int when it is an integer token id (not a float, not a bool), else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            return None
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def check_recorded_samples(recorded: list[tuple[list[int], Any]], vocab_size: int | None
                           ) -> list[tuple[list[int], list[int]]]:
    """A recording's samples (prompt, tokens) held to the output contract as an engine's outputs are."""
    checked = check_outputs([tokens for _, tokens in recorded], len(recorded), vocab_size)
    return [(prompt, tokens) for (prompt, _), tokens in zip(recorded, checked)]


def check_outputs(outputs: Any, num_prompts: int, vocab_size: int | None) -> list[list[int]]:
    """The engine's outputs as plain int lists, or `EngineFailure` saying what breaks the contract."""
    if isinstance(outputs, torch.Tensor):
        raise EngineFailure("generate() returned a tensor; the contract is one list of token ids per prompt")
    try:
        rows = list(outputs)
    except TypeError:
        raise EngineFailure(f"generate() returned {type(outputs).__name__}, not a list with one output per "
                            "prompt") from None
    if len(rows) != num_prompts:
        raise EngineFailure(f"generate() returned {len(rows)} outputs for {num_prompts} prompts; the contract is "
                            "one output per prompt, in order")
    checked: list[list[int]] = []
    for index, row in enumerate(rows):
        if isinstance(row, torch.Tensor):
            row = list(row.reshape(-1)) if row.dim() <= 1 else None
        if isinstance(row, (str, bytes)) or row is None or not hasattr(row, "__iter__"):
            raise EngineFailure(f"output {index} is {type(row).__name__}, not a list of token ids")
        tokens: list[int] = []
        for position, value in enumerate(row):
            token = _token(value)
            if token is None:
                raise EngineFailure(f"output {index}, position {position}: {value!r} "
                                    f"({type(value).__name__}) is not an integer token id")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                bound = f"0..{vocab_size - 1}" if vocab_size is not None else "0 or more"
                raise EngineFailure(f"output {index}, position {position}: token id {token} is outside the "
                                    f"vocabulary ({bound})")
            tokens.append(token)
        checked.append(tokens)
    return checked


# torch.OutOfMemoryError since torch 2.5; torch.cuda's (the same class there) in older releases
_TORCH_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def out_of_memory(exc: BaseException) -> bool:
    """A host MemoryError or a device allocation failure. On the CPU, Linux may kill the process
    before Python sees a MemoryError; what the audit wrote before stays on disk."""
    return isinstance(exc, (MemoryError, _TORCH_OOM))


def failure_message(engine_name: str, exc: BaseException, *, batch_size: int | None, device: str) -> str:
    """Why a guarded run failed, in one sentence (the greedy and the sampled audit's failed runs alike):
    out of memory, a server gone, a broken contract or time-out, an exception the engine raised, or one
    raised outside `generate()` (building the engine, or auditing its output)."""
    if out_of_memory(exc):
        where = f" at batch size {batch_size}" if batch_size is not None else ""
        return f"out of memory{where} on {device}: try a smaller --batch-size"
    if isinstance(exc, ServerDied):  # not "cannot reach": it answered, then went away
        return f"engine {engine_name}: {exc}"
    if isinstance(exc, EngineFailure):
        return f"engine {engine_name} failed: {exc}"
    if raised_inside_engine(exc):
        return f"engine {engine_name} raised {type(exc).__name__}: {exc}"
    return f"engine {engine_name}: {type(exc).__name__} outside generate(): {exc}"
