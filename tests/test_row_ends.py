"""`layout.RowEndsLayer` (row ends): left-aligned rows that grow at their own ends give the same logits and caches
as the right-aligned layout, and a step, a leaving row or a joining row moves nothing else."""

from __future__ import annotations

import torch

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import layout, ragged
from specaudit.engines.exspec_cache import RowKV, stack_cache, unstack_cache
from specaudit.testing import models

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [2, 7, 3, 3, 9, 1, 1, 5, 6, 2, 8]]


def _own_cache(model, tokens: list[int]) -> RowKV:
    ids, lengths = ragged.left_pad([tokens], 0)
    cache, _ = batch_ops.prefill(model, ids, lengths)
    return unstack_cache(cache, [0], [0], [len(tokens)])[0]


def _row(cache, row: int, length: int) -> torch.Tensor:
    """Row `row`'s `length` cached columns as one tensor [L, 2, H, n, D], wherever the layout puts them."""
    width = ragged.cache_width(cache)
    start, end = (0, length) if layout.is_row_ends(cache) else (width - length, width)
    return unstack_cache(cache, [row], [start], [end])[0].tensor()


@torch.no_grad()
def test_a_step_on_row_ends_equals_the_right_aligned_step() -> None:
    pair = models.pair("tiny-llama")
    model = pair.target
    kvs = [_own_cache(model, p) for p in PROMPTS]
    cache_lengths = torch.tensor([len(p) for p in PROMPTS])
    right, left = stack_cache(model, kvs), stack_cache(model, kvs, row_ends=True, rows=4)
    assert layout.is_row_ends(left) and not layout.is_row_ends(right)
    inputs = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 8]])  # [B, k+1]
    expected = batch_ops.forward(model, right, inputs, cache_lengths)
    got = batch_ops.forward(model, left, inputs, cache_lengths)
    assert float((expected - got).abs().max()) < 1e-12
    accepted, keep = torch.tensor([1, 3, 0]), torch.tensor([0, 2])  # row 1 finished
    old_width = len(PROMPTS[2])
    batch_ops.realign(right, old_width, accepted, cache_lengths, keep)
    batch_ops.realign(left, old_width, accepted, cache_lengths, keep)
    for row, source in enumerate(keep.tolist()):
        kept = PROMPTS[source] + inputs[source, : int(accepted[source]) + 1].tolist()
        fresh = _own_cache(model, kept).tensor()
        assert float((_row(left, row, len(kept)) - fresh).abs().max()) < 1e-12
        assert float((_row(right, row, len(kept)) - fresh).abs().max()) < 1e-12
    # the next pass writes over the rejected columns: still the same logits as the realigned layout
    lengths = (cache_lengths + accepted + 1).index_select(0, keep)
    nxt = torch.tensor([[7, 7], [2, 2]])
    assert float((batch_ops.forward(model, right, nxt, lengths) - batch_ops.forward(model, left, nxt, lengths)).abs().max()) < 1e-12


@torch.no_grad()
def test_a_pass_on_row_ends_reads_the_host_once_whatever_its_layers() -> None:
    """The pass's end (max(c) + q) sizes every layer's view and the mask: read from the device once per pass.
    A read per layer made EXSPEC's held batch wait for the device once a layer (24 times a pass on the bench
    pair's target)."""
    from specaudit.engines.ops.dispatch import HostSyncs

    model = models.pair("tiny-llama").target
    kvs = [_own_cache(model, p) for p in PROMPTS]
    left = stack_cache(model, kvs, row_ends=True, rows=4)
    assert len(left.layers) > 1
    cache_lengths = torch.tensor([len(p) for p in PROMPTS])
    with HostSyncs() as syncs:
        batch_ops.forward(model, left, torch.tensor([[3, 1], [5, 9], [5, 3]]), cache_lengths)
    assert syncs.count == 1, syncs.calls


def _blocks(seed: int, lengths: list[int], layers: int = 2) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(2, n, 3, generator=g, dtype=torch.float64), torch.randn(2, n, 3, generator=g, dtype=torch.float64))
             for n in lengths] for _ in range(layers)]


def test_a_step_moves_no_row_that_stays_and_a_leaving_row_moves_only_the_rows_after_it() -> None:
    blocks = _blocks(0, [4, 6, 2])
    cache = layout.row_ends_cache(blocks, [4, 6, 2], 4)
    layer = cache.layers[0]
    buffers = [b.clone() for b in layer._buffers]
    pointers = [b.data_ptr() for b in layer._buffers]
    assert torch.equal(layer.keys[1, :, :6], blocks[0][1][0]) and float(layer.keys[2, :, 2:].abs().max()) == 0.0
    layout.settle_rows(cache, torch.tensor([5, 7, 3]), torch.tensor([0, 1, 2]))  # every row stays
    assert [b.data_ptr() for b in layer._buffers] == pointers
    assert all(torch.equal(a, b) for a, b in zip(buffers, layer._buffers))
    assert layer.keys.shape[:1] == (3,) and layer.keys.shape[-2] == 7
    layout.settle_rows(cache, torch.tensor([5, 3]), torch.tensor([0, 2]))  # row 1 leaves: row 2 moves down
    assert [b.data_ptr() for b in layer._buffers] == pointers
    assert torch.equal(layer._buffers[0][0], buffers[0][0]) and torch.equal(layer._buffers[1][1], buffers[1][2])
    assert layer.keys.shape[0] == 2 and layer.keys.shape[-2] == 5
    joining = _blocks(1, [9])
    layout.append_rows(cache, 2, joining, [9])  # into the free row: the same buffers
    assert [b.data_ptr() for b in layer._buffers] == pointers and layer.keys.shape[0] == 3
    assert torch.equal(layer.values[2, :, :9], joining[0][0][1]) and layer.keys.shape[-2] == 9
    assert torch.equal(layer._buffers[0][0], buffers[0][0])


def test_a_row_longer_than_the_room_grows_the_buffers_and_keeps_every_row() -> None:
    blocks = _blocks(2, [3, 5])
    cache = layout.row_ends_cache(blocks, [3, 5], 2)
    kept = [b[:2, :, :5].clone() for b in cache.layers[1]._buffers]
    joining = _blocks(3, [200])
    layout.append_rows(cache, 2, joining, [200])  # a third row, wider than the room
    layer = cache.layers[1]
    assert layer._buffers[0].shape[0] == 3 and layer._buffers[0].shape[-2] >= 200
    assert torch.equal(layer._buffers[0][:2, :, :5], kept[0]) and torch.equal(layer.keys[2], joining[1][0][0])
    new = torch.ones(3, 2, 400, 3, dtype=torch.float64)  # a pass past the room: grows again
    layer.write_at, layer.write_end = torch.tensor([3, 5, 200]), 200 + 400  # as `batch.forward` sets them
    keys, _ = layer.update(new, new)
    assert keys.shape[-2] == 600 and float(keys[0, :, 3:403].min()) == 1.0 and torch.equal(keys[0, :, :3], kept[0][0, :, :3])


def test_each_query_sees_its_own_row_up_to_itself_in_the_form_its_attention_takes() -> None:
    pair = models.pair("tiny-llama")
    lengths = torch.tensor([2, 5])
    mask = layout.row_ends_mask(pair.target, lengths, 2)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 2, 7)
    assert mask[0, 0, 0].tolist() == [True] * 3 + [False] * 4
    assert mask[0, 0, 1].tolist() == [True] * 4 + [False] * 3
    assert mask[1, 0, 1].tolist() == [True] * 7
    pair.target.set_attn_implementation("eager")
    try:
        additive = layout.row_ends_mask(pair.target, lengths, 2)
    finally:
        pair.target.set_attn_implementation("sdpa")
    assert additive.dtype == pair.target.dtype
    assert torch.equal(additive == 0, mask) and float(additive.min()) == torch.finfo(additive.dtype).min


def test_exspec_holds_row_ends_where_every_layer_is_full_attention_only() -> None:
    from specaudit.engines.drafters import ModelDrafter
    from specaudit.engines.exspec import ExspecPool

    for name, expected in (("tiny-llama", True), ("tiny-gemma3", False)):
        pair = models.pair(name)
        pool = ExspecPool(pair.target, ModelDrafter(pair.draft), batch_size=2, draft_tokens=3, window_size=2,
                          max_new_tokens=12, eos_token_id=None, pad_id=0)
        for prompt in models.prompts()[:2]:
            pool.admit(list(prompt))
        held = []
        with torch.no_grad():
            while pool.busy:
                pool.step()
                if pool._held is not None:
                    held.append(layout.is_row_ends(pool._held[0].target_cache))
        assert held and set(held) == {expected}, name


def test_rows_past_the_new_batch_size_fill_the_holes_leaving_rows_make() -> None:
    assert layout.fill_order(torch.tensor([0, 1, 3, 4, 5, 6, 7])).tolist() == [0, 1, 7, 3, 4, 5, 6]
    assert layout.fill_order(torch.tensor([2, 5, 6])).tolist() == [6, 5, 2]
    assert layout.fill_order(torch.tensor([0, 1, 2])).tolist() == [0, 1, 2]
    blocks = _blocks(4, [3, 4, 5, 6])
    cache = layout.row_ends_cache(blocks, [3, 4, 5, 6], 4)
    before = [b.clone() for b in cache.layers[0]._buffers]
    layout.settle_rows(cache, torch.tensor([3, 6, 5]), layout.fill_order(torch.tensor([0, 2, 3])))
    keys = cache.layers[0]._buffers[0]
    assert torch.equal(keys[0], before[0][0]) and torch.equal(keys[1], before[0][3]) and torch.equal(keys[2], before[0][2])
