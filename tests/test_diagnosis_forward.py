"""The draft replays of the diagnosis's rebuilt steps (equivalence/diagnosis/forward.py): a cached replay over a
growing sequence chooses what a whole replay chooses, and feeds only the slots that changed."""

from __future__ import annotations

import random

import pytest
import torch

from specaudit.engines.models import zoo
from specaudit.equivalence.diagnosis.forward import GrowingReplay, PrefixReplay, plain_attention_cache, replay_all, replay_last
from specaudit.testing import models


def holey_sequences(seed: int, *, count_holes: bool, steps: int = 12):
    """(ids, positions, allowed) of a sequence that grows by 1-3 slots a step, some of them holes hidden from
    later queries, some hidden only after later slots saw them (a rejected proposal); positions count every
    slot, or only the kept ones."""
    rng = random.Random(seed)
    ids = [rng.randrange(200) for _ in range(20)]
    kept = [True] * len(ids)
    for step in range(steps):
        if rng.random() < 0.5:
            kept[-2] = False
        for _ in range(rng.randint(1, 3)):
            ids.append(rng.randrange(200))
            kept.append(rng.random() > 0.3)
        length = len(ids)
        kept_mask = torch.tensor(kept)  # [L]
        allowed = torch.ones(length, length, dtype=torch.bool).tril() & (kept_mask.unsqueeze(0) | torch.eye(length, dtype=torch.bool))
        positions = list(range(length)) if count_holes else (kept_mask.long().cumsum(0) - 1).clamp(min=0).tolist()
        yield list(ids), positions, allowed


@pytest.mark.parametrize("count_holes", [True, False], ids=["holes counted", "kept counted"])
@pytest.mark.parametrize("name", zoo.builtin_pair_names())
def test_a_growing_replay_chooses_what_a_whole_replay_chooses(name: str, count_holes: bool) -> None:
    draft = models.pair(name).draft
    growing = GrowingReplay(draft)
    for ids, positions, allowed in holey_sequences(len(name), count_holes=count_holes):
        cached, whole = growing.last(ids, positions, allowed), replay_last(draft, ids, positions, allowed)
        assert int(cached.argmax()) == int(whole.argmax())
        if growing.cacheable:  # another matmul shape: float64 rounding only
            assert float((cached - whole).abs().max()) < 1e-10
        else:
            assert torch.equal(cached, whole)


def test_only_the_changed_slots_are_fed() -> None:
    draft = models.pair("tiny-llama").draft
    assert plain_attention_cache(draft) and not plain_attention_cache(models.pair("tiny-lfm2").draft)
    fed: list[int] = []
    handle = draft.register_forward_pre_hook(lambda _module, _args, kwargs: fed.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        growing = GrowingReplay(draft)
        ids = list(range(1, 31))
        growing.last(ids, list(range(30)))
        growing.last(ids + [40], list(range(31)))  # one slot more
        growing.last(ids + [41, 42], list(range(32)))  # the last slot changed, one more
        shifted = list(range(28)) + [29, 30, 31, 32]  # positions changed from slot 28 on
        growing.last(ids + [41, 42], shifted)
    finally:
        handle.remove()
    assert fed == [30, 1, 2, 4]


def hypothesis_inputs(sequence: list[int], prompt_length: int):
    """Replays the diagnosis makes of one row: the plain sequence, new tokens numbered past 3 slots, every
    position shifted by one, a left padding of 2 visible, a hole in the new tokens masked and counted, each
    query of the new tokens also seeing the next token."""
    total = len(sequence)
    yield "plain", sequence, list(range(total)), None
    yield "shifted new tokens", sequence, list(range(prompt_length)) + [p + 3 for p in range(prompt_length, total)], None
    yield "constant shift", sequence, [p + 1 for p in range(total)], None
    yield "visible padding", [0, 0] + sequence, list(range(total + 2)), None
    holey = sequence[:prompt_length + 2] + [99] + sequence[prompt_length + 2:]
    allowed = torch.ones(total + 1, total + 1, dtype=torch.bool).tril()
    allowed[prompt_length + 3:, prompt_length + 2] = False  # the hole, seen by none after it
    yield "hole", holey, list(range(total + 1)), allowed
    ahead = torch.ones(total, total, dtype=torch.bool).tril(diagonal=1)
    ahead[:prompt_length] = torch.ones(prompt_length, total, dtype=torch.bool).tril()[:prompt_length]
    yield "one column ahead", sequence, list(range(total)), ahead


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-opt", "tiny-lfm2", "tiny-gemma3"])
def test_a_prefix_replay_gives_the_rows_a_whole_replay_gives(name: str) -> None:
    target = models.pair(name).target
    prompt, output = list(models.prompts()[9]), models.reference(name)[0][9][:8]
    sequence = prompt + output
    shared = PrefixReplay(target, sequence, list(range(len(sequence))))
    for what, ids, positions, allowed in hypothesis_inputs(sequence, len(prompt)):
        first = len(ids) - 6
        rows, whole = shared.rows(ids, positions, allowed, first=first), replay_all(target, ids, positions, allowed)
        assert rows.shape == whole[first:].shape, what
        assert torch.equal(rows.argmax(-1), whole[first:].argmax(-1)), what
        assert float((rows - whole[first:]).abs().max()) < 1e-10, what


def test_a_prefix_replay_feeds_from_the_first_slot_that_differs() -> None:
    target = models.pair("tiny-llama").target
    prompt, output = list(models.prompts()[9]), models.reference("tiny-llama")[0][9][:8]
    sequence = prompt + output
    fed: list[int] = []
    handle = target.register_forward_pre_hook(lambda _module, _args, kwargs: fed.append(kwargs["input_ids"].shape[1]),
                                              with_kwargs=True)
    try:
        shared = PrefixReplay(target, sequence, list(range(len(sequence))))
        for _what, ids, positions, allowed in hypothesis_inputs(sequence, len(prompt)):
            shared.rows(ids, positions, allowed, first=len(ids) - 6)
    finally:
        handle.remove()
    n, total = len(prompt), len(sequence)
    # the sequence once; the plain replay from its first asked row; shifted new tokens from the prompt's end; the
    # constant shift and the visible padding whole; the hole from where it is; the mask one column ahead from the
    # first query that sees otherwise (the first new token's: it sees the second)
    assert fed == [total, 6, total - n, total, total + 2, total + 1 - (n + 2), total - n]
