"""Audit target: transformers' continuous batching (`model.generate_batch`, paged KV cache), greedy.

Contract (every engine): `generate(prompts, max_new_tokens, eos_token_id)` returns, per prompt,
only the new tokens, up to and including the first EOS, never more than `max_new_tokens`.

This is the batched serving path that transformers ships (5.x): requests are packed into one
flattened batch per forward pass (no padding), prefill is chunked, the KV cache lives in pages
shared between requests, and a finished request's slot is refilled from the queue at once. It asks
whether that scheduler keeps greedy decoding equivalent to one prompt at a time. The draft model is
unused (continuous batching does not speculate).

- `attention`: `sdpa` (default; transformers' paged SDPA path) or `eager` (`paged|eager`); the
  spellings `paged|sdpa` and `paged|eager` are accepted. The model's own attention implementation is
  put back after every call, because the `paged|` kernels refuse an ordinary forward pass (the
  reference decoder runs on the same model object).
- `batch_size` bounds the requests in one forward pass (`max_requests_per_batch`).
- The cache is sized from the workload (`num_blocks` pages of `page_size` tokens, enough for the
  `2 * batch_size` longest requests at once), not from the device's free memory, so that it runs on
  the CPU without memory probing; `num_blocks`, `page_size` and `max_batch_tokens` override it.
- `prefix_sharing` (default on, the library's default) lets requests with a common prompt prefix
  share cache pages.

transformers casts logits to float32 before it chooses a token (as in `generate`); with
`return_logprobs` (default on) it also returns the log-probability of each chosen token, kept per
prompt in `last_token_logprobs` (float32 values, one per output token; no alternatives are given).
Measured with transformers 5.23 on the CPU: token-exact on tiny-llama in float32 and float64.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from specaudit.engines.adapters._hf import cut_at_eos, resolve_pad_id
from specaudit.engines.limits import eos_ids

ATTENTION = {"sdpa": "sdpa", "paged|sdpa": "sdpa", "eager": "eager", "paged|eager": "eager"}
NO_EOS = -1  # transformers' continuous batching reads a negative EOS id as "never stop on EOS"


def _continuous_batching_config(**values: Any) -> Any:
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as exc:  # releases before continuous batching had its own config
        raise RuntimeError("hf-continuous needs a transformers release with ContinuousBatchingConfig "
                           "(5.x with model.generate_batch)") from exc
    return ContinuousBatchingConfig(**values)


class HFContinuous:
    """`target.generate_batch(prompts)` with a paged cache; the draft model is unused."""

    name = "hf-continuous"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        attention: str = "sdpa",
        return_logprobs: bool = True,
        prefix_sharing: bool = True,
        num_blocks: int | None = None,
        page_size: int = 256,
        max_batch_tokens: int | None = None,
        pad_token_id: int | None = None,
        **_: object,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if attention not in ATTENTION:
            raise ValueError(f"hf-continuous: attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        if not callable(getattr(target, "generate_batch", None)):
            raise RuntimeError("hf-continuous: this transformers release has no model.generate_batch")
        self.target = target
        self.batch_size = int(batch_size)
        self.attention = ATTENTION[attention]
        self.return_logprobs = _as_bool(return_logprobs)
        self.prefix_sharing = _as_bool(prefix_sharing)
        self.num_blocks = None if num_blocks is None else int(num_blocks)
        self.page_size = int(page_size)
        self.max_batch_tokens = None if max_batch_tokens is None else int(max_batch_tokens)
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.last_trace = None  # the scheduler's batches are not observable from outside
        # per prompt, the float32 log-probability of each output token, or None
        self.last_token_logprobs: list[list[float] | None] = []

    def describe(self) -> dict[str, Any]:
        return {"kind": "hf-continuous", "attention": "paged|eager" if self.attention == "eager" else "sdpa",
                "max_requests_per_batch": self.batch_size, "prefix_sharing": self.prefix_sharing,
                "page_size": self.page_size}

    def _cache_size(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, int]:
        pages = sorted((math.ceil((len(p) + max_new_tokens) / self.page_size) for p in prompts), reverse=True)
        num_blocks = self.num_blocks or sum(pages[: 2 * self.batch_size]) + 1
        max_batch_tokens = self.max_batch_tokens or max(256, max(len(p) for p in prompts) + self.batch_size)
        return num_blocks, max_batch_tokens

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.last_token_logprobs = [None] * len(prompts)
        if max_new_tokens <= 0 or not prompts:
            return [[] for _ in prompts]
        num_blocks, max_batch_tokens = self._cache_size(prompts, max_new_tokens)
        generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
            eos_token_id=list(eos_ids(eos_token_id)) or NO_EOS,  # the whole set: any id ends a request
        )
        cb_config = _continuous_batching_config(
            max_requests_per_batch=self.batch_size, num_blocks=num_blocks, page_size=self.page_size,
            max_batch_tokens=max_batch_tokens, allow_block_sharing=self.prefix_sharing,
            return_logprobs=self.return_logprobs, auto_switch_to_flash=False, use_cuda_graph=False,
        )
        original = self.target.config._attn_implementation
        try:
            if original != self.attention:
                self.target.set_attn_implementation(self.attention)
            results = self.target.generate_batch(
                [[int(t) for t in p] for p in prompts], generation_config=generation_config,
                continuous_batching_config=cb_config, max_new_tokens=max_new_tokens, warmup=False,
            )
        finally:
            if self.target.config._attn_implementation != original:
                self.target.set_attn_implementation(original)
        answers = list(results.values())  # in the order of the inputs
        failed = [f"{a.request_id}: {a.error}" for a in answers if a.error is not None]
        if failed or len(answers) != len(prompts):
            raise RuntimeError(f"hf-continuous: {len(prompts) - len(answers) + len(failed)} of {len(prompts)} "
                               f"requests failed or are missing ({'; '.join(failed[:3]) or 'no error given'})")
        outputs = []
        for index, answer in enumerate(answers):
            tokens = [int(t) for t in answer.generated_tokens]
            kept = cut_at_eos(tokens, eos_token_id, max_new_tokens)
            outputs.append(tokens[:kept])
            if self.return_logprobs and len(answer.logprobs) >= kept:
                self.last_token_logprobs[index] = [float(x) for x in answer.logprobs[:kept]]
        return outputs


def _as_bool(value: object) -> bool:
    """Engine options arrive as strings from `--engine-option KEY=VALUE`."""
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {value!r}")
    return bool(value)
