"""When an engine runs on the static path, and `generate` there.

EQSPEC, EXSPEC and INPLACE take `static` (None: on CUDA where the models allow it; True: also on the CPU,
the eager twin CI runs; False: never) and `cuda_graphs` (capture the passes on CUDA; default True). The
static path needs dense models (`cache.static_supported`) and proposals that are the draft model's own
greedy choices, or a chooser with the device interface of `bench_pair.DeviceChooser`. The batch policy
stays the engine's own: EQSPEC decodes consecutive batches, INPLACE and EXSPEC refill a freed slot with
the next request. On the static path a row's cache never moves, so EQSPEC's realignment, INPLACE's holes
and EXSPEC's same-length groups have nothing left to do.
"""

from __future__ import annotations

from typing import Any

import torch

from specaudit.engines.limits import request_limits
from specaudit.engines.static import loop
from specaudit.engines.static.cache import static_supported
from specaudit.engines.trace import Trace


def draft_and_chooser(engine: Any) -> tuple[Any, Any] | None:
    """The engine's draft model and device chooser (None: greedy), when its drafter drafts with a model on
    the device ((None, None) for an engine that drafts nothing: `batched`, the reference); None otherwise
    (prompt lookup, scripted schedules, a host-side chooser)."""
    from specaudit.engines.drafters import ModelDrafter

    if getattr(engine, "k", None) == 0:
        return None, None
    drafter = getattr(engine, "drafter", None)
    draft = getattr(drafter, "draft", None)
    if draft is None:
        return None
    chooser = getattr(drafter, "chooser", None)
    if type(drafter) is ModelDrafter or (chooser is None and type(drafter).__name__ == "InplaceDrafter"):
        return draft, None
    if chooser is not None and getattr(chooser, "on_device", False):
        return draft, chooser
    return None


def why_not(engine: Any) -> str | None:
    """Why `engine` cannot run on the static path, or None when it can."""
    found = draft_and_chooser(engine)
    if found is None:
        return "its proposals do not come from a draft model's greedy choice on the device"
    if not static_supported(engine.target, *found[:1]):
        return "the static path takes dense models only (every layer full attention, no experts)"
    return None


def applies(engine: Any) -> bool:
    """The engine's `static` option: None runs the static path on CUDA where it can; True asks for it
    (a ValueError names what stands in the way)."""
    wanted = getattr(engine, "static", None)
    if wanted is False:
        return False
    reason = why_not(engine)
    if wanted is None:
        return reason is None and engine.target.device.type == "cuda"
    if reason is not None:
        raise ValueError(f"{engine.name}: static=True, but {reason}")
    return True


@torch.no_grad()
def generate(engine: Any, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: int | None, *,
             refill: bool) -> list[list[int]]:
    """`engine.generate` on the static path (see the module docstring)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = request_limits(max_new_tokens, len(prompts))
    draft, chooser = draft_and_chooser(engine)
    trace = Trace(num_prompts=len(prompts), draft_tokens=engine.k, proposals_from_draft_model=chooser is None)
    outputs: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    wanted = [i for i, n in enumerate(limits) if n > 0]
    if wanted:
        columns = max(len(prompts[i]) for i in wanted) + max(limits) + engine.k + 2  # prompt, new tokens, a verify pass
        batch = loop.StaticLoop(engine.target, draft, batch_size=min(getattr(engine, "batch_size", 1), len(wanted)), k=engine.k,
                                columns=columns, eos_token_id=eos_token_id,
                                graphs=getattr(engine, "cuda_graphs", True), record_logits=engine.record_logits,
                                chooser=chooser)
        sub_outputs: list[list[int]] = [[] for _ in wanted]
        sub_logits: list[list[torch.Tensor]] = [[] for _ in wanted]
        sub_trace = Trace(num_prompts=len(wanted), draft_tokens=engine.k)
        loop.run(batch, [prompts[i] for i in wanted], [limits[i] for i in wanted], sub_trace, sub_outputs, sub_logits,
                 refill=refill)
        for record in sub_trace.steps:
            record.rows = [wanted[r] for r in record.rows]
            trace.record(record)
        for new, old in enumerate(wanted):
            outputs[old], logits[old] = sub_outputs[new], sub_logits[new]
    if engine.record_logits:
        trace.logits = [torch.cat(parts) if parts else None for parts in logits]
    engine.last_trace = trace
    return outputs
