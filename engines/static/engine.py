"""The fixed-shape engine (`--engine fixedshape`): speculative decoding on passes of fixed shape.

An engine of its own, audited and benched under its own name; EQSPEC, EXSPEC and INPLACE never run
it. Its algorithm (`loop.py`): a batch of `batch_size` slots whose caches never move (`cache.StaticCache`,
each row written at its own end), the acceptance of `engines/acceptance.py`, one host read per step.
Options:

- `refill` (default True): a freed slot takes the next request at once; False runs consecutive batches
  (each slot idle once done until the whole batch is).
- `cuda_graphs` (default True): on CUDA every pass shape is captured once as a CUDA graph and replayed;
  False (or the CPU) runs the same passes eagerly (`capture.eager`), the twin CI tests.
- `drafter`: None drafts with the draft model's greedy choices; a `ModelDrafter` (or INPLACE's drafter)
  with a chooser that works on the device (the bench's `CalibratedChooser`) drafts with its choices.

Lifetime: the engine keeps one `loop.StaticLoop` per (batch, length bucket) and reuses it, buffers and
prepared passes included, across `generate` calls: each pass shape (role, batch, query length, bucket) is
captured once for the engine's lifetime, in one memory pool, so a bench's warm-up call captures and its
timed calls only replay (`captures` counts them). A request's slot length is its own need (prompt, budget,
one verify pass) rounded up to a power of two (`length_bucket`): requests of a call are decoded bucket by
bucket, shortest first, so a long prompt sizes only the slots of its own bucket. Dense models only (every
layer full attention, no experts: their routing reads the host): anything else is refused with the reason.

Request parameters (`request_params`, engines/requests/rows.py): the acceptance rule processes the verify
pass's logits of the rows that have them row by row and position by position, driven from the host outside
the captured passes (which reads each step's tokens and which slots run); the passes and their shapes are the
plain path's, and that path runs unchanged when no request asks anything.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.drafters import Chooser, Drafter
from specaudit.engines.limits import EosIds, request_limits
from specaudit.engines.requests.rows import TakesRequestParams
from specaudit.engines.static import loop
from specaudit.engines.static.cache import static_supported
from specaudit.engines.static.capture import Capture, default_capture
from specaudit.engines.trace import Trace

MIN_BUCKET = 64  # the shortest slot, in columns


def length_bucket(columns: int) -> int:
    """The slot length of a request that needs `columns` columns: the next power of two, at least `MIN_BUCKET`."""
    bucket = MIN_BUCKET
    while bucket < columns:
        bucket *= 2
    return bucket


def drafter_parts(drafter: Drafter | str | None, draft: PreTrainedModel | None) -> tuple[PreTrainedModel | None, Chooser | None]:
    """The draft model and the device chooser (None: greedy) of `drafter` (None: `draft`'s greedy choices);
    a ValueError for a drafter whose proposals are not a draft model's on the device."""
    if drafter is None:
        return draft, None
    model, chooser = (drafter.draft, drafter.chooser) if isinstance(drafter, Drafter) else (None, None)
    if model is None:
        raise ValueError(f"fixedshape drafts with a draft model on the device, not with {drafter!r} (prompt lookup "
                         "and scripted drafters read the host: use eqspec or exspec)")
    if chooser is not None and not chooser.on_device:
        raise ValueError("fixedshape takes a chooser that works on the device (on_device = True) only")
    return model, chooser


class FixedShapeEngine(TakesRequestParams):
    """Speculative decoding on fixed-shape passes (see the module docstring)."""

    name = "fixedshape"

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, batch_size: int = 8,
                 draft_tokens: int = 4, drafter: Any = None, refill: bool = True, cuda_graphs: bool = True,
                 record_logits: bool = False, capture: Capture | None = None, **_: object) -> None:
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be at least 1")
        self.draft, self.chooser = drafter_parts(drafter, draft)
        if self.draft is None:
            raise ValueError("fixedshape needs a draft model")
        if not static_supported(target, self.draft):
            raise ValueError("fixedshape takes dense models only (every layer full attention, no experts); "
                             "use eqspec, exspec or inplace for this pair")
        self.target, self.batch_size, self.k = target, batch_size, draft_tokens
        self.refill, self.cuda_graphs, self.record_logits = refill, cuda_graphs, record_logits
        self.capture = capture if capture is not None else default_capture(target.device, cuda_graphs)
        on_cuda_graphs = self.capture is not None and target.device.type == "cuda" and cuda_graphs
        self.pool = torch.cuda.graph_pool_handle() if on_cuda_graphs else None  # one pool for every graph
        self.loops: dict[tuple[int, int], loop.StaticLoop] = {}  # (batch, length bucket) -> its loop
        self.last_trace: Trace | None = None

    def set_drafter(self, drafter: Any) -> None:
        """Draft with `drafter` from the next call on (the bench's fresh seeded chooser for each timed call),
        keeping the loops and their prepared passes; it must draft with the same draft model."""
        model, chooser = drafter_parts(drafter, self.draft)
        if model is not self.draft:
            raise ValueError("set_drafter: the drafter must draft with the engine's own draft model")
        self.chooser = chooser

    @property
    def proposals_from_draft_model(self) -> bool:
        return self.chooser is None

    @property
    def captures(self) -> Counter[tuple[str, int, int, int]]:
        """Pass shapes (role, B, q, L) prepared over the engine's lifetime, each with its count."""
        return sum((batch.captures for batch in self.loops.values()), Counter())

    def _loop(self, batch_size: int, bucket: int) -> loop.StaticLoop:
        key = (batch_size, bucket)
        if key not in self.loops:
            self.loops[key] = loop.StaticLoop(self.target, self.draft, batch_size=batch_size, k=self.k, columns=bucket,
                                              capture=self.capture, pool=self.pool)
        return self.loops[key]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | Sequence[int],
                 eos_token_id: EosIds) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        limits = request_limits(max_new_tokens, len(prompts))
        row_requests = self.row_requests(prompts, eos_token_id)
        if row_requests is not None:  # each request's own max_tokens
            limits = row_requests.budgets(limits)
        trace = Trace(num_prompts=len(prompts), draft_tokens=self.k, proposals_from_draft_model=self.chooser is None)
        outputs: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        buckets: dict[int, list[int]] = {}
        for i, n in enumerate(limits):
            if n > 0:  # prompt, new tokens, a verify pass past the last one
                buckets.setdefault(length_bucket(len(prompts[i]) + n + self.k + 2), []).append(i)
        for bucket in sorted(buckets):
            requests = buckets[bucket]
            batch = self._loop(min(self.batch_size, len(requests)), bucket)
            batch.reset(eos_token_id, self.record_logits, self.chooser, row_requests)
            loop.run(batch, prompts, limits, requests, trace, outputs, logits, refill=self.refill)
        if self.record_logits:
            trace.logits = [torch.cat(parts) if parts else None for parts in logits]
        self.last_trace = trace
        return outputs
