"""The engine contract, and the one `generate` shared by engines that take consecutive batches.

Contract: `generate(prompts, max_new_tokens, eos_token_id) -> list[list[int]]`, per prompt only
the new tokens: the first EOS kept and nothing after it, never more than `max_new_tokens`.
`eos_token_id` is one id, a sequence of ids or None (`limits.eos_ids`): a row ends at the first token
that is any of them.
The built-in engines (reference, batched, EQSPEC, EXSPEC, INPLACE, fixedshape) also take `max_new_tokens` as
one budget per prompt (`request_limits`), so that rows of a batch end at different steps, as
requests of a server do; a row's budget is read by its prompt index (`row_limits`). They take request
parameters too (`requests.rows.TakesRequestParams`): set `request_params`, one per prompt, before
`generate`, and each row is decoded under its own (engines/requests/rows.py).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from specaudit.engines.capabilities import DEFAULTS, Capabilities
from specaudit.engines.limits import request_limits, row_limits  # noqa: F401 (re-exported)
from specaudit.engines.requests.rows import RowRequests, TakesRequestParams
from specaudit.engines.trace import Trace


@runtime_checkable
class Engine(Protocol):
    """What every engine must have: one call from prompts to each prompt's new tokens (module docstring)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]: ...


def capability(engine: object, name: str) -> Any:
    """The engine's capability `name` (one of `Capabilities`), or its declared default."""
    return getattr(engine, name, DEFAULTS[name])


def declares(engine: object, name: str) -> bool:
    """Whether the engine itself has capability `name` (an attribute the audit may set, or counters of its
    own), not only the default `Capabilities` gives it."""
    if name not in DEFAULTS:
        raise KeyError(f"{name!r} is no engine capability: {', '.join(DEFAULTS)}")
    if name in getattr(engine, "__dict__", {}):
        return True
    for cls in type(engine).__mro__:
        if cls is Capabilities:
            return False
        if name in vars(cls):
            return True
    return hasattr(engine, name)  # a wrapper that hands attributes on (the guard): what it wraps has it


class ConsecutiveBatches(Capabilities):
    """`generate` for engines that decode prompts in consecutive batches of `batch_size`.

    A subclass sets `batch_size`, `k`, `record_logits` and implements `_run_batch`, which appends
    each row's new tokens to `outputs[row]`, its logits [n, V] to `logits[row]` when recorded, and
    its steps to `trace`. A subclass that also derives from `TakesRequestParams` takes request
    parameters: `active_requests` holds the call's (None: plain greedy requests), which `_run_batch`
    hands to the acceptance rule.
    """

    batch_size: int
    k: int
    record_logits: bool
    last_trace: Trace | None
    active_requests: RowRequests | None = None

    def _run_batch(self, prompts: list[list[int]], rows: list[int], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                   trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        raise NotImplementedError

    def _run_all(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: int | Sequence[int] | None,
                 trace: Trace, outputs: list[list[int]], logits: list[list[torch.Tensor]]) -> None:
        """Every prompt, in consecutive batches of `batch_size` (an engine that refills rows overrides it)."""
        for start in range(0, len(prompts), self.batch_size):
            rows = list(range(start, min(start + self.batch_size, len(prompts))))
            self._run_batch(prompts, rows, max_new_tokens, eos_token_id, trace, outputs, logits)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        trace = Trace(num_prompts=len(prompts), draft_tokens=self.k,
                      proposals_from_draft_model=self.proposals_from_draft_model)
        outputs: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        if not isinstance(max_new_tokens, int):
            max_new_tokens = request_limits(max_new_tokens, len(prompts))
        if isinstance(self, TakesRequestParams):
            self.active_requests = self.row_requests(prompts, eos_token_id)
        if self.active_requests is not None:  # each request's own max_tokens
            max_new_tokens = self.active_requests.budgets(max_new_tokens)
        if not isinstance(max_new_tokens, int) or max_new_tokens > 0:
            self._run_all(prompts, max_new_tokens, eos_token_id, trace, outputs, logits)
        if self.record_logits:
            trace.logits = [torch.cat(parts) if parts else None for parts in logits]
        self.last_trace = trace
        return outputs
