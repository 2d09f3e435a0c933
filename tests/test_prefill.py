"""`batch.prefill` in groups of near-equal length: the grouping, and each row as if prefilled alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.batch import prefill_groups
from specaudit.testing.models import pair


def _cost(groups: list[list[int]], lengths: list[int], overhead: int) -> int:
    return sum(overhead + len(g) * max(lengths[r] for r in g) for g in groups)


def _best_by_brute_force(lengths: list[int], overhead: int) -> int:
    """The least cost over every way of cutting the rows, sorted by length, into runs."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    best = None
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for row, cut in zip(order[1:], cuts):
            if cut:
                groups.append(current)
                current = []
            current.append(row)
        groups.append(current)
        cost = _cost(groups, lengths, overhead)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("lengths", [[5], [3, 3, 3], [1, 2, 4, 4, 9, 11, 14, 18], [18, 16, 27, 25, 92, 380, 183, 915],
                                     [275, 88, 364, 365, 469, 284, 92, 761], [7, 700, 7, 700, 70]])
@pytest.mark.parametrize("overhead", [0, 16, 64, 10_000])
def test_groups_cover_every_row_once_at_the_least_cost(lengths: list[int], overhead: int) -> None:
    groups = prefill_groups(lengths, overhead)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    assert _cost(groups, lengths, overhead) == _best_by_brute_force(lengths, overhead)
    if overhead == 0:  # padding costs and a pass is free: only equal lengths share a pass
        assert all(len({lengths[r] for r in g}) == 1 for g in groups)
    if overhead == 10_000:  # a pass costs more than any padding: one pass
        assert len(groups) == 1


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_grouped_prefill_gives_each_row_its_prefill_alone(name: str) -> None:
    """Prompts of 1 to 300 tokens (several groups) in float64: every row's cached keys and values and its
    last logits equal its prompt's prefilled alone; the columns left of a row's prompt are zero."""
    model = pair(name).target
    generator = torch.Generator().manual_seed(3)
    lengths = [1, 300, 4, 290, 60, 2, 120]
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    assert len(prefill_groups(lengths)) > 1
    tokens, lengths_t = ragged.left_pad(prompts, pad_id=256)
    cache, last = batch_ops.prefill(model, tokens, lengths_t)
    width = tokens.shape[1]
    for b, prompt in enumerate(prompts):
        alone, alone_last = batch_ops.prefill(model, torch.tensor([prompt]), torch.tensor([len(prompt)]))
        assert torch.allclose(last[b], alone_last[0], rtol=0, atol=1e-10)
        assert last[b].argmax() == alone_last[0].argmax()
        for layer, single in zip(ragged.cache_layers(cache), ragged.cache_layers(alone)):
            for batched, one in ((layer.keys, single.keys), (layer.values, single.values)):
                assert torch.allclose(batched[b, :, width - len(prompt):], one[0], rtol=0, atol=1e-10)
                assert not batched[b, :, : width - len(prompt)].any()
