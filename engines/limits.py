"""Each request's budget of new tokens: one `max_new_tokens` for all, or one per prompt."""

from __future__ import annotations

from typing import Sequence

import torch


def request_limits(max_new_tokens: int | Sequence[int], num_prompts: int) -> list[int]:
    """Each prompt's budget of new tokens: one int for all, or one per prompt (each at least 1)."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * num_prompts
    limits = [int(n) for n in max_new_tokens]
    if len(limits) != num_prompts:
        raise ValueError(f"{len(limits)} per-request max_new_tokens for {num_prompts} prompts: give one per prompt")
    if any(n < 1 for n in limits):
        raise ValueError("every per-request max_new_tokens must be at least 1")
    return limits


def row_limits(max_new_tokens: int | Sequence[int], rows: list[int], device: torch.device) -> int | torch.Tensor:
    """The budget of each row of a batch: the int itself, or `[B]` from the per-prompt list by row."""
    if isinstance(max_new_tokens, int):
        return max_new_tokens
    return torch.tensor([max_new_tokens[r] for r in rows], dtype=torch.long, device=device)  # [B]
