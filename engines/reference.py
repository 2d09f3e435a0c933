"""The ground truth: greedy autoregressive decoding of one prompt at a time, with a KV cache.

Contract (every engine): token ids in, token ids out. `generate` returns, per prompt, only the
new tokens: it stops after the first EOS (which is kept) or at exactly `max_new_tokens`. With request
parameters (`request_params`, one per prompt) each prompt is decoded by `decode_with_params`
(engines/requests/reference.py), the processors applied at every step; a sampled request (temperature
> 0) draws each token from the target's processed distribution with its own seeded stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

from transformers import DynamicCache, PreTrainedModel

from specaudit.engines.contract import request_limits
from specaudit.engines.limits import eos_ids
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.ops.layout import last_logits_only
from specaudit.engines.requests.reference import decode_with_params
from specaudit.engines.requests.rows import TakesRequestParams
from specaudit.engines.trace import Trace


@torch.no_grad()
def greedy_decode(
    model: PreTrainedModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    record_logits: bool = False,
) -> tuple[list[int], torch.Tensor | None]:
    """Decode one prompt greedily. Returns the new tokens and, if asked, the logits each was chosen from [n, V]."""
    if not prompt:
        raise ValueError("a prompt needs at least one token")
    device = model.device
    stop = eos_ids(eos_token_id)  # any of them ends the row
    cache = DynamicCache(config=model.config)  # the model's own cache (sliding layers keep their window)
    keep = last_logits_only(model)  # the prompt pass needs only its last position's logits
    inputs = torch.tensor([prompt], dtype=torch.long, device=device)
    position = torch.arange(len(prompt), device=device).unsqueeze(0)
    new_tokens: list[int] = []
    logits_rows: list[torch.Tensor] = []
    while len(new_tokens) < max_new_tokens:
        seen = int(position[0, -1]) + 1  # tokens in the cache after this pass
        mask = torch.ones(1, seen, dtype=torch.long, device=device)
        out = cached_forward(model, cache, input_ids=inputs, attention_mask=mask, position_ids=position, **keep)
        logits = out.logits[0, -1]  # [V]
        token = int(logits.argmax())
        new_tokens.append(token)
        if record_logits:
            logits_rows.append(logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits)
        if token in stop:
            break
        next_position = int(position[0, -1]) + 1
        inputs = torch.tensor([[token]], dtype=torch.long, device=device)
        position = torch.tensor([[next_position]], device=device)
    recorded = torch.stack(logits_rows) if record_logits and logits_rows else None
    return new_tokens, recorded


class ReferenceDecoder(TakesRequestParams):
    """Engine wrapper around `greedy_decode`, one prompt at a time. The draft is unused."""

    name = "reference"

    k = 0  # drafts nothing
    batch_size = 1

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None = None, *, record_logits: bool = False,
                 **_: object) -> None:
        self.target = target
        self.record_logits = record_logits
        self.last_trace: Trace | None = None

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        trace = Trace(num_prompts=len(prompts))
        outputs = []
        limits = request_limits(max_new_tokens, len(prompts))
        requests = self.row_requests(prompts, eos_token_id)
        for i, prompt in enumerate(prompts):
            if requests is None:
                tokens, logits = greedy_decode(self.target, prompt, limits[i], eos_token_id, self.record_logits)
            else:
                result = decode_with_params(self.target, prompt, requests.rows[i].params, limits[i], eos_token_id,
                                            requests.tokenizer, penalty_scope=requests.penalty_scope,
                                            record_logits=self.record_logits, sampling=requests.rows[i].sampling)
                tokens, logits = result.tokens, result.logits
            outputs.append(tokens)
            trace.logits[i] = logits
        self.last_trace = trace
        return outputs
