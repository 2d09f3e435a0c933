"""The outside-style engines (`tests/outside_styles.py`, issue 59 item 4) against the project's greedy reference
in float64 on tiny-gpt2 (the twins on tiny-llama too): each correct twin is exact, and each planted bug changes at
least one prompt's tokens (so the bug is real). Their diagnosis baseline: reports/outside-styles/README.md."""

from __future__ import annotations

import functools

import pytest

import outside_styles
from specaudit.engines.reference import ReferenceDecoder
from specaudit.testing.models import pair, prompts

NUM_PROMPTS, MAX_NEW, BATCH, K = 8, 10, 3, 3


@functools.lru_cache(maxsize=None)
def _reference(name: str, eos: int | None) -> list[list[int]]:
    p = pair(name)
    return ReferenceDecoder(p.target).generate(_prompts(), MAX_NEW, eos)


def _prompts() -> list[list[int]]:
    return [list(x) for x in prompts()[:NUM_PROMPTS]]


def _run(engine: str, name: str, eos: int | None) -> list[list[int]]:
    p = pair(name)
    make = getattr(outside_styles, engine)
    return make(p.target, p.draft, batch_size=BATCH, draft_tokens=K, pad_token_id=0).generate(_prompts(), MAX_NEW, eos)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])  # learned positions, rotary positions
@pytest.mark.parametrize("engine", outside_styles.CORRECT)
def test_correct_twin_is_exact(engine: str, name: str) -> None:
    assert _run(engine, name, None) == _reference(name, None)


@pytest.mark.parametrize("engine", outside_styles.CORRECT)
def test_correct_twin_is_exact_with_eos(engine: str) -> None:
    """An EOS the reference meets early in some rows (its third token of the first prompt): rows finish apart."""
    eos = _reference("tiny-gpt2", None)[0][2]
    assert _run(engine, "tiny-gpt2", eos) == _reference("tiny-gpt2", eos)


@pytest.mark.parametrize("engine", sorted(outside_styles.BUGGY))
def test_planted_bug_changes_tokens(engine: str) -> None:
    assert _run(engine, "tiny-gpt2", None) != _reference("tiny-gpt2", None)
