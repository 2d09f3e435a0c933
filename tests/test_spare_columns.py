"""`layout.SpareColumnsLayer`: new columns written in place, the same keys and values as concatenation;
caches realigned, stacked or cut by the engines keep their room and are not copied twice."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from specaudit.engines.ops import layout


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


def _cache(keys: torch.Tensor, values: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layers.append(DynamicLayer())
    cache.layers[0].update(keys, values)
    return cache


def test_a_realigned_cache_has_room_and_the_next_pass_writes_into_it() -> None:
    from specaudit.engines import batch
    from specaudit.engines.ops import ragged

    (keys, values), (new_keys, new_values) = _chunks(2, [9, 3])
    keep_end, new_lengths, rows = torch.tensor([9, 7]), torch.tensor([4, 6]), torch.tensor([2, 0])
    plain, roomy = _cache(keys, values), _cache(keys, values)
    ragged.realign_cache(plain, keep_end, new_lengths, rows=rows)
    batch.realign_with_room(roomy, keep_end, new_lengths, rows=rows)
    layer = roomy.layers[0]
    assert type(layer) is layout.SpareColumnsLayer
    assert torch.equal(layer.keys, plain.layers[0].keys) and torch.equal(layer.values, plain.layers[0].values)
    pointer = layer.keys.data_ptr()
    layer.update(new_keys[:2], new_values[:2])
    assert layer.keys.data_ptr() == pointer  # the pass wrote into the spare columns: no second copy
    assert torch.equal(layer.keys, torch.cat([plain.layers[0].keys, new_keys[:2]], dim=2))
    assert torch.equal(layer.values, torch.cat([plain.layers[0].values, new_values[:2]], dim=2))


def test_right_aligned_equals_left_padding_and_concatenation() -> None:
    from specaudit.engines.ops import ragged

    g = torch.Generator().manual_seed(4)
    blocks = [torch.randn(rows, 2, n, 3, generator=g, dtype=torch.float64) for rows, n in ((2, 5), (1, 1), (3, 8))]
    out = ragged.right_aligned(blocks, 8, spare=4)
    assert out.shape == (6, 2, 12, 3)
    expected = torch.cat([ragged.widen_left(b, 8, 2) for b in blocks])
    assert torch.equal(out[:, :, :8], expected)


def test_exspec_rows_are_views_and_their_next_stack_has_room() -> None:
    from specaudit.engines.ops import ragged
    from specaudit.engines.exspec_cache import stack_cache, unstack_cache
    from specaudit.testing import models

    pair = models.pair("tiny-gpt2")
    layers = len(ragged.cache_layers(layout.full_history_cache(pair.target)))
    g = torch.Generator().manual_seed(5)
    batch_keys = [torch.randn(3, 4, 6, 16, generator=g, dtype=torch.float64) for _ in range(2 * layers)]
    cache = layout.full_history_cache(pair.target)
    for i, layer in enumerate(ragged.cache_layers(cache)):
        layout.hold_columns(layer, batch_keys[2 * i], batch_keys[2 * i + 1], 6)
    rows = unstack_cache(cache, [0, 2], [1, 3], [6, 5])
    assert rows[0].layers[0][0].data_ptr() == batch_keys[0][0, :, 1].data_ptr()  # a view: nothing copied
    assert rows[1].width == 2 and torch.equal(rows[1].layers[1][1], batch_keys[3][2, :, 3:5])
    stacked = stack_cache(pair.target, rows)
    layer = ragged.cache_layers(stacked)[0]
    assert type(layer) is layout.SpareColumnsLayer and layer.keys.shape[-2] == 5
    assert torch.equal(layer.keys[1, :, 3:], batch_keys[0][2, :, 3:5]) and float(layer.keys[1, :, :3].abs().max()) == 0.0
    pointer = layer.keys.data_ptr()
    layer.update(torch.zeros(2, 4, 1, 16, dtype=torch.float64), torch.zeros(2, 4, 1, 16, dtype=torch.float64))
    assert layer.keys.data_ptr() == pointer


def test_joined_caches_have_room_and_the_next_pass_writes_into_it() -> None:
    from specaudit.engines.ops import ragged

    (keys, values), (other_keys, other_values), (new_keys, new_values) = _chunks(6, [4, 7, 1])
    cache, other = _cache(keys, values), _cache(other_keys[:2], other_values[:2])
    ragged.join_cache_rows(cache, other, 7, layout.spare_width(7), layout.hold_columns)
    layer = cache.layers[0]
    assert torch.equal(layer.keys, torch.cat([ragged.widen_left(keys, 7, 2), other_keys[:2]]))
    assert torch.equal(layer.values, torch.cat([ragged.widen_left(values, 7, 2), other_values[:2]]))
    pointer = layer.keys.data_ptr()
    layer.update(torch.cat([new_keys, new_keys[:2]]), torch.cat([new_values, new_values[:2]]))
    assert layer.keys.data_ptr() == pointer and layer.keys.shape[-2] == 8
