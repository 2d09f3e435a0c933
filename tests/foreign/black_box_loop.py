"""The padded loop of `padded_loop.py` declared a black box (`black_box = True`): the audit cannot watch what it
feeds the target, so its diagnosis has only the controlled re-runs (alone, beside a neighbour of the same length,
another pad id) and, last, replays judged on tokens."""

from __future__ import annotations

from typing import Any

from foreign import padded_loop


def _factory(bug: str | None):
    def make(target: Any, draft: Any = None, *, batch_size: int, **options: Any) -> padded_loop.PaddedLoop:
        engine = padded_loop._factory(bug)(target, draft, batch_size=batch_size, **options)
        engine.black_box = True
        return engine
    return make


correct = _factory(None)
pos_padded = _factory("pos_padded")
mask_padding = _factory("mask_padding")
