"""Hypothesis strategies for request parameters under greedy decoding (engines/requests.py).

Like property_tests/strategies.py: keyword-only bounds, everything random from Hypothesis draws, and
shrinking toward the small case: each parameter left at its plain value unless the draw turns it on
(`st.booleans()` shrinks to False), small penalties and biases, one stop string, few banned words.

    from hypothesis import given
    from specaudit.testing.request_strategies import request_params

    @given(params=request_params(vocab_size=259))
    def test_server(params): ...
"""

from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st

from specaudit.engines.requests import RequestParams

STOP_ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"


@st.composite
def request_params(draw: st.DrawFn, *, vocab_size: int, stop_token_candidates: Sequence[int] = (),
                   max_stop_strings: int = 2, max_stop_length: int = 4, max_min_tokens: int = 8,
                   max_bias_tokens: int = 3, max_abs_bias: float = 10.0, max_bad_words: int = 2,
                   max_bad_word_length: int = 3, penalties: bool = True, stops: bool = True,
                   reported: bool = True) -> RequestParams:
    """One request's parameters over a vocabulary of `vocab_size` ids. Each family is drawn on or off
    (off is the shrink target): stop strings (`stops`), stop token ids from `stop_token_candidates`,
    `min_tokens`, repetition / presence / frequency penalties (`penalties`), a logit bias, banned token
    sequences, and (`reported`) `min_p` / `top_k` / `logprobs`, which change what is reported only."""
    values: dict = {}
    if stops and draw(st.booleans()):
        values["stop"] = tuple(draw(st.lists(st.text(STOP_ALPHABET, min_size=1, max_size=max_stop_length),
                                             min_size=1, max_size=max_stop_strings)))
    if stop_token_candidates and draw(st.booleans()):
        values["stop_token_ids"] = tuple(draw(st.lists(st.sampled_from(list(stop_token_candidates)),
                                                       min_size=1, max_size=2, unique=True)))
    if draw(st.booleans()):
        values["min_tokens"] = draw(st.integers(1, max_min_tokens))
    if penalties and draw(st.booleans()):
        values["repetition_penalty"] = draw(st.sampled_from([1.0, 1.1, 1.3, 1.5, 2.0, 0.8]))
        values["presence_penalty"] = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0, -0.5]))
        values["frequency_penalty"] = draw(st.sampled_from([0.0, 0.1, 0.4, 1.0, -0.3]))
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_bias_tokens, unique=True))
        biases = draw(st.lists(st.floats(-max_abs_bias, max_abs_bias, allow_nan=False, allow_infinity=False, width=32),
                               min_size=len(ids), max_size=len(ids)))
        values["logit_bias"] = tuple(zip(ids, biases))
    if draw(st.booleans()):
        values["bad_words"] = tuple(tuple(w) for w in draw(st.lists(
            st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_bad_word_length),
            min_size=1, max_size=max_bad_words)))
    if reported and draw(st.booleans()):
        values["min_p"] = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5]))
        values["top_k"] = draw(st.sampled_from([0, 1, 5, 40]))
        values["logprobs"] = draw(st.integers(0, 5))
    return RequestParams(**values)
