"""Every function of `engines/ops/ragged.py` against a naive model made of Python lists.

The naive model keeps each row as a plain list (tokens, or one number per cached position) and
does by hand, row by row, what the tensor functions do in one vectorised gather. Pad ids are
drawn from the rows' own tokens too: rows are told apart from padding by lengths alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from transformers import DynamicCache

from specaudit.engines.ops import ragged
from specaudit.testing.profiles import examples
from specaudit.testing.strategies import MAX_BATCH_SIZE, MAX_DRAFT_TOKENS

VOCAB = 259
tokens_st = st.integers(0, VOCAB - 1)
many = settings(max_examples=examples(10))


@st.composite
def ragged_rows(draw: st.DrawFn, *, min_rows: int = 1, max_rows: int = MAX_BATCH_SIZE, max_length: int = 24,
                min_length: int = 0) -> list[list[int]]:
    num_rows = draw(st.integers(min_rows, max_rows))
    return draw(st.lists(st.lists(tokens_st, min_size=min_length, max_size=max_length), min_size=num_rows, max_size=num_rows))


@st.composite
def rows_and_pad(draw: st.DrawFn, **bounds: int) -> tuple[list[list[int]], int]:
    """Rows and a pad id that is, when the rows have any tokens, often one of their own tokens."""
    rows = draw(ragged_rows(**bounds))
    real = sorted({t for row in rows for t in row})
    pad = draw(st.sampled_from(real) if real and draw(st.booleans()) else tokens_st)
    return rows, pad


# --- the naive model ----------------------------------------------------------------------


def naive_left_pad(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(len(r) for r in rows)
    return [[pad] * (width - len(r)) + list(r) for r in rows]


def naive_mask(lengths: list[int], width: int) -> list[list[bool]]:
    return [[column >= width - n for column in range(width)] for n in lengths]


@dataclass
class FakeLayer:
    keys: torch.Tensor | None
    values: torch.Tensor | None


@dataclass
class FakeCache:
    layers: list[FakeLayer]


def cache_from_rows(rows: list[list[float]], width: int, heads: int = 2, dim: int = 3, layers: int = 2) -> FakeCache:
    """A right-aligned cache whose keys and values at a row's real position hold that row's number
    (offset per layer, head and channel so nothing lines up by chance); padding holds -1."""
    made = []
    for layer in range(layers):
        keys = torch.full((len(rows), heads, width, dim), -1.0, dtype=torch.float64)
        for b, row in enumerate(rows):
            for j, value in enumerate(row):
                column = width - len(row) + j
                for h in range(heads):
                    keys[b, h, column] = torch.tensor([value + 1000 * layer + 100 * h + 10_000 * c for c in range(dim)])
        made.append(FakeLayer(keys, -keys))
    return FakeCache(made)


def naive_cache_rows(cache: FakeCache, layer: int, lengths: list[int]) -> list[list[float]]:
    keys = cache.layers[layer].keys
    width = keys.shape[2]
    return [[float(keys[b, 0, width - n + j, 0]) - 1000 * layer for j in range(n)] for b, n in enumerate(lengths)]


# --- tests --------------------------------------------------------------------------------


@many
@given(rows_and_pad())
def test_left_pad_matches_lists_and_unpad_round_trips(rows_pad: tuple[list[list[int]], int]) -> None:
    rows, pad = rows_pad
    tokens, lengths = ragged.left_pad(rows, pad)
    assert tokens.tolist() == naive_left_pad(rows, pad)
    assert lengths.tolist() == [len(r) for r in rows]
    assert ragged.unpad(tokens, lengths) == rows


@many
@given(rows_and_pad(), st.data())
def test_append_and_repad_matches_lists(rows_pad: tuple[list[list[int]], int], data: st.DataObject) -> None:
    rows, pad = rows_pad
    k = data.draw(st.integers(1, MAX_DRAFT_TOKENS + 1), label="new tokens per row")
    new = data.draw(st.lists(st.lists(tokens_st, min_size=k, max_size=k), min_size=len(rows), max_size=len(rows)), label="new tokens")
    counts = data.draw(st.lists(st.integers(0, k), min_size=len(rows), max_size=len(rows)), label="counts")
    tokens, lengths = ragged.left_pad(rows, pad)
    out, out_lengths = ragged.append_and_repad(tokens, lengths, torch.tensor(new), torch.tensor(counts), pad)
    expected = [row + extra[:n] for row, extra, n in zip(rows, new, counts)]
    assert out_lengths.tolist() == [len(r) for r in expected]
    assert out.tolist() == naive_left_pad(expected, pad), "repadded to the new longest row, pad on the left"
    assert ragged.unpad(out, out_lengths) == expected


@many
@given(rows_and_pad(min_length=1), st.data())
def test_repeated_steps_never_accumulate_padding(rows_pad: tuple[list[list[int]], int], data: st.DataObject) -> None:
    rows, pad = rows_pad
    tokens, lengths = ragged.left_pad(rows, pad)
    expected = [list(r) for r in rows]
    for step in range(data.draw(st.integers(1, 4), label="steps")):
        counts = data.draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)), label=f"counts {step}")
        new = torch.full((len(rows), 3), pad)
        tokens, lengths = ragged.append_and_repad(tokens, lengths, new, torch.tensor(counts), pad)
        expected = [row + [pad] * n for row, n in zip(expected, counts)]
        assert tokens.shape[1] == max(len(r) for r in expected)
        assert ragged.unpad(tokens, lengths) == expected


@many
@given(st.lists(st.integers(0, 40), min_size=1, max_size=MAX_BATCH_SIZE), st.integers(0, 8))
def test_padding_mask_and_attention_mask_match_lists(lengths: list[int], query_length: int) -> None:
    width = max(lengths)
    mask = ragged.padding_mask(torch.tensor(lengths), width)
    assert mask.tolist() == naive_mask(lengths, width)
    attention = ragged.attention_mask(torch.tensor(lengths), width, query_length)
    expected = [[int(m) for m in row] + [1] * query_length for row in naive_mask(lengths, width)]
    assert attention.tolist() == expected


@many
@given(st.lists(st.integers(0, 40), min_size=1, max_size=MAX_BATCH_SIZE), st.integers(0, 16), st.integers(1, MAX_DRAFT_TOKENS + 1))
def test_masks_on_a_wider_cache_and_position_ids(lengths: list[int], extra_width: int, query_length: int) -> None:
    width = max(lengths) + extra_width
    attention = ragged.attention_mask(torch.tensor(lengths), width, query_length)
    assert attention.tolist() == [[0] * (width - n) + [1] * n + [1] * query_length for n in lengths]
    positions = ragged.position_ids(torch.tensor(lengths), query_length)
    assert positions.tolist() == [[n + i for i in range(query_length)] for n in lengths]


@st.composite
def realign_plans(draw: st.DrawFn, *, max_rows: int = MAX_BATCH_SIZE, min_width: int = 0, max_width: int = 30) -> tuple[int, list[int], list[int]]:
    """(source width, keep_end per row, new length per row) with 0 <= new_length <= keep_end <= width."""
    num_rows = draw(st.integers(1, max_rows))
    width = draw(st.integers(min_width, max_width))
    keep_end = draw(st.lists(st.integers(0, width), min_size=num_rows, max_size=num_rows))
    new_lengths = [draw(st.integers(0, end)) for end in keep_end]
    return width, keep_end, new_lengths


@many
@given(realign_plans())
def test_realign_index_matches_per_row_slicing(plan: tuple[int, list[int], list[int]]) -> None:
    width, keep_end, new_lengths = plan
    source, valid = ragged.realign_index(torch.tensor(keep_end), torch.tensor(new_lengths))
    new_width = max(new_lengths)
    assert source.shape == valid.shape == (len(keep_end), new_width)
    assert valid.tolist() == naive_mask(new_lengths, new_width)
    for b, (end, n) in enumerate(zip(keep_end, new_lengths)):
        real = [int(s) for s, v in zip(source[b], valid[b]) if v]
        assert real == list(range(end - n, end)), f"row {b}"
    assert int(source.min()) >= 0 if source.numel() else True


@many
@given(realign_plans(min_width=1), st.data())
def test_realign_cache_matches_per_row_slicing(plan: tuple[int, list[int], list[int]], data: st.DataObject) -> None:
    width, keep_end, new_lengths = plan
    num_rows = len(keep_end)
    # each row's real cached positions: its last `real[b]` columns, covering the kept ones
    real = [data.draw(st.integers(width - end + n, width), label=f"real length {b}")
            for b, (end, n) in enumerate(zip(keep_end, new_lengths))]
    rows = [[float(b * 100 + j) for j in range(n)] for b, n in enumerate(real)]
    cache = cache_from_rows(rows, width)
    select = data.draw(st.booleans(), label="select rows")
    kept = sorted(data.draw(st.sets(st.integers(0, num_rows - 1), min_size=1), label="kept rows")) if select else list(range(num_rows))
    plan_end = torch.tensor([keep_end[b] for b in kept])
    plan_lengths = torch.tensor([new_lengths[b] for b in kept])
    note(f"rows {rows}, kept {kept}")
    ragged.realign_cache(cache, plan_end, plan_lengths, rows=torch.tensor(kept) if select else None)
    expected = []
    for b in kept:
        column_of_first = width - len(rows[b])
        end, n = keep_end[b], new_lengths[b]
        expected.append([rows[b][c - column_of_first] for c in range(end - n, end)])
    new_width = max(new_lengths[b] for b in kept)
    assert ragged.cache_width(cache) == new_width
    for layer in range(len(cache.layers)):
        assert naive_cache_rows(cache, layer, [len(e) for e in expected]) == expected
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert keys.shape == (len(kept), 2, new_width, 3)
        assert torch.equal(values, -keys)
        padding = ~torch.tensor(naive_mask([len(e) for e in expected], new_width), dtype=torch.bool)
        assert bool((keys[padding.unsqueeze(1).expand(-1, 2, -1)] == 0).all()), "padding columns are zeroed"


@settings(max_examples=examples(2))
@given(realign_plans(min_width=1, max_rows=4, max_width=12))
def test_realign_cache_on_a_transformers_cache_matches_per_row_slicing(plan: tuple[int, list[int], list[int]]) -> None:
    width, keep_end, new_lengths = plan
    rows = [[float(b * 100 + j) for j in range(width)] for b in range(len(keep_end))]
    plain = cache_from_rows(rows, width, layers=3)
    cache = DynamicCache()
    for index, layer in enumerate(plain.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), index)
    ragged.realign_cache(cache, torch.tensor(keep_end), torch.tensor(new_lengths))
    assert cache.get_seq_length() == ragged.cache_width(cache) == max(new_lengths)
    expected = [row[end - n: end] for row, end, n in zip(rows, keep_end, new_lengths)]
    for layer in range(3):
        assert naive_cache_rows(cache, layer, new_lengths) == expected, f"layer {layer}"
        assert torch.equal(cache.layers[layer].values, -cache.layers[layer].keys)


@many
@given(st.integers(1, 6), st.integers(0, 5), st.integers(0, 3))
def test_cache_width_skips_empty_layers(num_rows: int, width: int, empty_layers: int) -> None:
    filled = cache_from_rows([[1.0] * min(width, 1)] * num_rows, width, layers=1).layers
    empty = [FakeLayer(None, None) for _ in range(empty_layers)]
    cache = FakeCache(empty + filled)
    assert ragged.cache_width(cache) == width
    ragged.realign_cache(cache, torch.full((num_rows,), width), torch.full((num_rows,), min(width, 1)))
    assert all(layer.keys is None for layer in cache.layers[:empty_layers])


@many
@given(rows_and_pad(min_length=1), st.data())
def test_one_speculative_step_on_tokens_and_cache_agrees(rows_pad: tuple[list[list[int]], int], data: st.DataObject) -> None:
    """The engine's step as the naive model sees it: the cache holds every token but the pending
    last one; after verifying [pending, k drafts] each row keeps old cache + pending + accepted."""
    rows, pad = rows_pad
    k = data.draw(st.integers(1, MAX_DRAFT_TOKENS), label="k")
    accepted = data.draw(st.lists(st.integers(0, k), min_size=len(rows), max_size=len(rows)), label="accepted")
    drafts = data.draw(st.lists(st.lists(tokens_st, min_size=k + 1, max_size=k + 1), min_size=len(rows), max_size=len(rows)), label="targets")
    tokens, lengths = ragged.left_pad(rows, pad)
    cached = [[float(t) for t in row[:-1]] for row in rows]
    cache = cache_from_rows(cached, tokens.shape[1] - 1)
    # the verify pass appends k+1 columns for every row
    old_width = ragged.cache_width(cache)
    for layer, extra in zip(cache.layers, cache_from_rows([[float(t) for t in [row[-1], *d[:k]]] for row, d in zip(rows, drafts)], k + 1).layers):
        layer.keys = torch.cat([layer.keys, extra.keys], dim=2)
        layer.values = torch.cat([layer.values, extra.values], dim=2)
    counts = torch.tensor(accepted)
    ragged.realign_cache(cache, old_width + counts + 1, lengths - 1 + counts + 1)
    new_tokens, new_lengths = ragged.append_and_repad(tokens, lengths, torch.tensor(drafts), counts + 1, pad)
    expected_rows = [row + d[: a + 1] for row, d, a in zip(rows, drafts, accepted)]
    assert ragged.unpad(new_tokens, new_lengths) == expected_rows
    expected_cache = [[float(t) for t in row[:-1]] for row in expected_rows]
    assert naive_cache_rows(cache, 0, [len(r) for r in expected_cache]) == expected_cache
