"""`layout.SpareColumnsLayer`: new columns written in place, the same keys and values as concatenation."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from specaudit.engines import layout


def _updates(layer: DynamicLayer, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [layer.update(k, v)[0].clone() for k, v in chunks]


def _chunks(seed: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 2, n, 4, generator=g, dtype=torch.float64),
             torch.randn(3, 2, n, 4, generator=g, dtype=torch.float64)) for n in sizes]


def test_updates_equal_concatenation_and_write_in_place() -> None:
    chunks = _chunks(0, [7, 1, 5, 1, 1, 80, 3])
    plain, spare = DynamicLayer(), DynamicLayer()
    spare.__class__ = layout.SpareColumnsLayer
    expected = _updates(plain, chunks[:2])
    got = _updates(spare, chunks[:2])
    pointer = spare.keys.data_ptr()
    expected += _updates(plain, chunks[2:5])
    got += _updates(spare, chunks[2:5])
    assert spare.keys.data_ptr() == pointer  # written into the spare columns: no new buffer
    expected += _updates(plain, chunks[5:])  # 80 columns: more than the room left, a new buffer
    got += _updates(spare, chunks[5:])
    assert spare.keys.data_ptr() != pointer
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    assert torch.equal(plain.values, spare.values)


def test_a_cache_replaced_or_cropped_by_an_engine_is_copied_or_overwritten_correctly() -> None:
    chunks = _chunks(1, [6, 2, 2, 4])
    plain, spare = DynamicLayer(), DynamicLayer()
    spare.__class__ = layout.SpareColumnsLayer
    for layer in (plain, spare):
        layer.update(*chunks[0])
        layer.update(*chunks[1])
        # an engine realigns: new tensors (rows reversed), then crops its last column
        layer.keys, layer.values = layer.keys.flip(0).contiguous(), layer.values.flip(0).contiguous()
        layer.update(*chunks[2])
        layer.keys, layer.values = layer.keys[..., :-1, :], layer.values[..., :-1, :]
        layer.update(*chunks[3])  # writes over the cropped column
    assert torch.equal(plain.keys, spare.keys) and torch.equal(plain.values, spare.values)


def test_spare_columns_leaves_other_layer_kinds_alone() -> None:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers.extend([DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4)])
    layout.spare_columns(cache)
    assert type(cache.layers[0]) is layout.SpareColumnsLayer
    assert type(cache.layers[1]) is DynamicSlidingWindowLayer
