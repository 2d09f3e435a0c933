"""The doubled-bonus replay (`equivalence/diagnosis/doubled.py`) against the engine it must explain:
`tests/foreign/row_cache_spec.py:bonus_twice`, rebuilt from its output alone, is reproduced token for
token by the replay that counts the copy in the row's positions and caches' length; the correct twin's
output is not (its steps keep one bonus). Two prompts, 12 new tokens, k = 1 and 3: a few seconds."""

from __future__ import annotations

import pytest

from foreign import row_cache_spec
from specaudit.equivalence.api import load_pair
from specaudit.equivalence.diagnosis.doubled import doubled_bonus_inputs
from specaudit.equivalence.diagnosis.replay import replay_all

PROMPTS = [[50, 43, 50, 61], [100, 3]]
NEW = 12


def replayed(pair, prompt: list[int], output: list[int], k: int) -> list[int] | None:
    built = doubled_bonus_inputs(pair.draft, k, prompt, output, len(output) - 1, "count")
    if built is None:
        return None
    ids, positions, allowed, rows = built
    return replay_all(pair.target, ids, positions, allowed)[rows].argmax(-1).tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_doubled_bonus_replay_reproduces_the_engine(k: int) -> None:
    pair = load_pair("tiny-gpt2")
    doubled = row_cache_spec.bonus_twice(pair.target, pair.draft, batch_size=2, draft_tokens=k)
    correct = row_cache_spec.correct(pair.target, pair.draft, batch_size=2, draft_tokens=k)
    for prompt, bad, good in zip(PROMPTS, doubled.generate(PROMPTS, NEW, None), correct.generate(PROMPTS, NEW, None)):
        assert bad != good  # the bug shows on these prompts
        assert replayed(pair, prompt, bad, k) == bad
        assert replayed(pair, prompt, good, k) != good
