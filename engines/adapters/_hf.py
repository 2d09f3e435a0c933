"""Helpers shared by the Hugging Face `generate` adapters.

`generate` fills every generation option left at `None` from the model's own
`generation_config` (transformers 5.x `_prepare_generation_config`), so "no EOS" cannot be said by
passing `eos_token_id=None`: the model's configured EOS would come back. The adapters therefore
set the options they need on the model's `generation_config` for the duration of one call and put
the original back afterwards.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.limits import EosIds, eos_ids


@contextlib.contextmanager
def patched_generation_config(model: PreTrainedModel, **values: Any) -> Iterator[None]:
    """Set `values` on `model.generation_config` inside the block; restore the original after."""
    original = model.generation_config
    patched = copy.deepcopy(original)
    for key, value in values.items():
        setattr(patched, key, value)
    model.generation_config = patched
    try:
        yield
    finally:
        model.generation_config = original


def resolve_pad_id(model: PreTrainedModel, pad_token_id: int | None) -> int:
    """The pad id to hand `generate`: the option, else the model's, else 0."""
    if pad_token_id is not None:
        return int(pad_token_id)
    pad = model.config.pad_token_id
    return int(pad) if pad is not None else 0


def cut_at_eos(tokens: list[int], eos_token_id: EosIds, max_new_tokens: int) -> int:
    """Number of tokens to keep: up to and including the first EOS (any id of the set), never more than
    `max_new_tokens`."""
    n = min(len(tokens), max_new_tokens)
    stop = eos_ids(eos_token_id)
    return next((i + 1 for i, token in enumerate(tokens[:n]) if token in stop), n)


def hf_eos(eos_token_id: int | Sequence[int] | None) -> int | list[int] | None:
    """The EOS set as `generate` takes it: None, one id, or a list (transformers stops at any of them)."""
    ids = eos_ids(eos_token_id)
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def as_float(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are kept as float32 (as the reference decoder records them)."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


class LogitsTap:
    """Keeps the logits of every forward pass of `model` inside a `with` block, in the model's dtype.

    `generate` casts logits to float32 before it chooses a token, so the logits it returns are not
    what the model computed; the tap keeps what the model computed, for a full-precision comparison.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.calls: list[torch.Tensor] = []  # per forward pass, logits [B, q, V]
        self._handle = None

    def __enter__(self) -> "LogitsTap":
        def hook(_module: Any, _args: Any, output: Any) -> None:
            logits = getattr(output, "logits", None)
            if logits is not None:
                self.calls.append(logits.detach())

        self._handle = self.model.register_forward_hook(hook)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
