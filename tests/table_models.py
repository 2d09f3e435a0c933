"""Models whose logits are set by hand: each position's logits depend on the token there alone, so every
choice, tie and gap is known in advance and holds on any machine (no matmul rounds them)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class TableModel(torch.nn.Module):
    """logits after token t = table[t] (a row of `vocab_size` values; a token missing from `table` gives zeros),
    stored in `dtype`. Values exact in that dtype stay exact: the model only looks them up."""

    def __init__(self, table: dict[int, list[float]], dtype: torch.dtype, vocab_size: int) -> None:
        super().__init__()
        rows = [table.get(t, [0.0] * vocab_size) for t in range(vocab_size)]
        self.register_buffer("table", torch.tensor(rows, dtype=dtype))
        self.config = SimpleNamespace(vocab_size=vocab_size)

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: object):
        return SimpleNamespace(logits=self.table[input_ids])  # [B, n, V]


class PositionTableModel(torch.nn.Module):
    """logits at position t = table[t] whatever the tokens (`table` [L, V]): one fixed step to enumerate."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table  # [L, V]
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        length = input_ids.shape[1]
        return SimpleNamespace(logits=self.table[:length].unsqueeze(0).expand(input_ids.shape[0], -1, -1))
