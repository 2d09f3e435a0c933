"""Each request's budget of new tokens: one `max_new_tokens` for all, or one per prompt."""

from __future__ import annotations

from typing import Sequence, Union

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


EosIds = Union[int, Sequence[int], None]  # an engine's `eos_token_id`: one id, a set of ids, or none


def eos_ids(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """The set of ids that end a row, in a fixed order: `None` -> (), one id -> (id,), a list -> its ids.

    A model's generation config may declare several EOS ids (Llama 3, Qwen, Gemma): stopping at any of
    them is correct, running past any of them is a bug.
    """
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.flatten().tolist()
    if not isinstance(eos_token_id, (list, tuple, set, frozenset)):
        return (int(eos_token_id),)  # one id (int, numpy integer)
    ids: list[int] = []
    for i in sorted(eos_token_id) if isinstance(eos_token_id, (set, frozenset)) else eos_token_id:
        if int(i) not in ids:
            ids.append(int(i))
    return tuple(ids)


def is_eos(tokens: torch.Tensor, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:
    """Boolean tensor of `tokens`' shape: which tokens are any of the EOS ids (all False with none)."""
    ids = eos_ids(eos_token_id)
    if not ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    if len(ids) == 1:
        return tokens == ids[0]
    return torch.isin(tokens, torch.tensor(ids, dtype=tokens.dtype, device=tokens.device))
