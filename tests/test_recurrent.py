"""Recurrent state in the batched engines (`engines/recurrent.py`), on the built-in hybrid pairs.

- padding never enters a state: after a batched prefill of prompts of different lengths, each
  row's states equal those of its prompt prefilled alone (the engines prefill in equal-length
  groups; measured: a left-padded prefill also passes on these three families, because transformers
  zeroes padded hidden states before the recurrent layers, so this guards the property, not the grouping);
- rollback: after a pass over [pending, d1, d2] and `commit(accepted)`, each row's states equal
  those of feeding only its pending and accepted tokens, and rows never share a state;
- the reference decoder agrees with `model.generate` (greedy, float64).
"""

from __future__ import annotations

import pytest
import torch

from specaudit.engines import batch as batch_ops
from specaudit.engines import ragged, recurrent
from specaudit.engines.reference import greedy_decode
from specaudit.testing.models import pair

HYBRID = ["tiny-qwen3-next", "tiny-lfm2", "tiny-bamba"]
PROMPTS = [[5, 9, 13], [40, 41, 42, 43, 44, 45, 46], [7], [100, 3, 100, 3, 100]]


def _states(cache) -> list[torch.Tensor]:
    return [t for t in recurrent.snapshot(cache) if t is not None]


def _alone(model, tokens: list[int]):
    ids = torch.tensor([tokens])
    cache, _ = batch_ops.prefill(model, ids, torch.tensor([len(tokens)]))
    return cache


@pytest.mark.parametrize("name", HYBRID)
def test_padded_rows_hold_their_unpadded_state(name: str) -> None:
    model = pair(name).target
    tokens, lengths = ragged.left_pad(PROMPTS, pad_id=256)
    cache, _ = batch_ops.prefill(model, tokens, lengths)
    assert recurrent.tracks_states(cache) and _states(cache)
    for b, prompt in enumerate(PROMPTS):
        for batched, alone in zip(_states(cache), _states(_alone(model, prompt))):
            assert torch.allclose(batched[b], alone[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", HYBRID)
def test_commit_rolls_each_row_back_to_its_accepted_tokens(name: str) -> None:
    model = pair(name).target
    prompts = [PROMPTS[0], PROMPTS[3]]  # [B=2], different lengths
    fed = [[60, 61, 62], [70, 71, 72]]  # pending token and two draft tokens per row
    accepted = torch.tensor([0, 2])  # row 0 keeps its pending token only, row 1 all three
    tokens, lengths = ragged.left_pad(prompts, pad_id=256)
    cache, _ = batch_ops.prefill(model, tokens, lengths)
    batch_ops.forward(model, cache, torch.tensor(fed), lengths)  # per-position states kept
    assert len(cache.history) == 3
    recurrent.commit(cache, accepted)
    assert cache.history == []
    for b, prompt in enumerate(prompts):
        expected = _alone(model, prompt + fed[b][: int(accepted[b]) + 1])
        for got, want in zip(_states(cache), _states(expected)):
            assert torch.allclose(got[b], want[0], rtol=0, atol=1e-12)
    different = [not torch.equal(t[0], t[1]) for t in _states(cache)]
    assert all(different), "two rows hold the same state"


@pytest.mark.parametrize("name", HYBRID)
def test_reference_matches_generate_in_float64(name: str) -> None:
    model = pair(name).target
    for prompt in PROMPTS:
        ours, _ = greedy_decode(model, prompt, 12, None)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=256)
        assert out[0, len(prompt):].tolist() == ours
