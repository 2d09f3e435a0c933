"""A server-shaped continuous batcher for plain greedy decoding: requests wait in a queue, at most
`batch_size` of them hold a slot; each tick the active requests are left-padded into one batch and
recomputed whole (no cache), each gets one token, finished requests free their slot and queued ones
take it before the next tick. Answers are collected per request id.

Variants (`bug=`):

- None: correct;
- "pos_padded": position ids are the column index over the padded batch;
- "mask_padding": the padding is attended (no attention mask);
- "answer_by_slot": answers are returned in the order the requests finished;
- "stop_on_any_eos": a tick in which any request emits EOS finishes every active request;
- "one_more": a request is retired one tick late (max_new_tokens + 1 tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Request:
    rid: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)


class ContinuousBatcher:
    def __init__(self, model: Any, slots: int, pad_id: int, bug: str | None) -> None:
        self.model, self.slots, self.pad_id, self.bug = model, slots, pad_id, bug

    @torch.no_grad()
    def _tick(self, active: list[Request]) -> list[int]:
        seqs = [r.prompt + r.tokens for r in active]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[self.pad_id] * (width - len(s)) + s for s in seqs], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.model.device)
        if self.bug == "pos_padded":
            positions = torch.arange(width, device=ids.device).expand_as(ids)
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self.bug == "mask_padding":
            mask = torch.ones_like(mask)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        return logits.argmax(-1).tolist()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        queue = deque(Request(i, list(p)) for i, p in enumerate(prompts))
        active: list[Request] = []
        answers: dict[int, list[int]] = {}
        finished_order: list[list[int]] = []
        limit = max_new_tokens + (1 if self.bug == "one_more" else 0)
        while queue or active:
            while queue and len(active) < self.slots:
                active.append(queue.popleft())
            chosen = self._tick(active)
            any_eos = False
            for request, token in zip(active, chosen):
                request.tokens.append(token)
                any_eos |= eos_token_id is not None and token == eos_token_id
            still = []
            for request in active:
                ended = (len(request.tokens) >= limit
                         or (eos_token_id is not None and request.tokens[-1] == eos_token_id)
                         or (self.bug == "stop_on_any_eos" and any_eos))
                if ended:
                    answers[request.rid] = request.tokens
                    finished_order.append(request.tokens)
                else:
                    still.append(request)
            active = still
        if self.bug == "answer_by_slot":
            return finished_order
        return [answers[i] for i in range(len(prompts))]


def _factory(bug: str | None):
    def make(target: Any, draft: Any, *, batch_size: int, pad_token_id: int | None = None, **_: Any) -> ContinuousBatcher:
        return ContinuousBatcher(target, batch_size, 0 if pad_token_id is None else int(pad_token_id), bug)
    return make


correct = _factory(None)
pos_padded = _factory("pos_padded")
mask_padding = _factory("mask_padding")
answer_by_slot = _factory("answer_by_slot")
stop_on_any_eos = _factory("stop_on_any_eos")
one_more = _factory("one_more")
