"""Judging past a numerical flip (`equivalence/audit.py`): after a flip that a precision control explains,
the engine's later tokens are judged against the reference continued on the engine's own prefix, so a bug
that shows after a rounding flip is still seen, ruled and named.

The engine here is a black-box one (a server's shape) whose outputs are written by hand from the float64
target: a near-tie flip within the declared band at position `p`, then the reference's own continuation
from that prefix, then a token far below the top at a later position `q`.
"""

from __future__ import annotations

import pytest
import torch

from specaudit.engines.reference import greedy_decode
from specaudit.engines.models.zoo import load_pair
from specaudit.equivalence.audit import RunSettings, audit_engine

NEW_TOKENS = 16


class Scripted:
    """A black-box engine that answers fixed outputs."""

    black_box = True

    def __init__(self, outputs: list[list[int]]) -> None:
        self.outputs = outputs

    def generate(self, prompts, max_new_tokens, eos_token_id):
        return [list(o) for o in self.outputs]


def _closest_tie(logits: torch.Tensor, upto: int) -> tuple[int, float, int]:
    """(position, gap, runner-up token) of the smallest top-2 gap among the first `upto` positions."""
    top2 = logits[:upto].topk(2, dim=-1)
    gaps = top2.values[:, 0] - top2.values[:, 1]  # [upto]
    position = int(gaps[1:].argmin()) + 1  # not the first token: the flip needs an agreed prefix to follow
    return position, float(gaps[position]), int(top2.indices[position, 1])


@pytest.fixture(scope="module")
def scripted_run():
    pair = load_pair("tiny-llama", dtype="float64")
    prompt = list(pair.tokenizer.encode("The quick brown fox"))[:12]
    reference, logits = greedy_decode(pair.target, prompt, NEW_TOKENS, None, record_logits=True)
    p, gap, runner_up = _closest_tie(logits, 8)
    flipped = reference[:p] + [runner_up]
    rest, rest_logits = greedy_decode(pair.target, prompt + flipped, NEW_TOKENS - len(flipped), None,
                                      record_logits=True)
    q = len(flipped) + 3  # the bug: a token far below the top, three tokens past the flip
    worst = int(rest_logits[3].argmin())
    bad = flipped + rest[:3] + [worst]
    tail, _ = greedy_decode(pair.target, prompt + bad, NEW_TOKENS - len(bad), None)
    engine = Scripted([bad + tail])
    band = gap * 1.5  # declared: the flip at p is inside it, the bug at q far outside
    assert float(rest_logits[3].max() - rest_logits[3][worst]) > 10 * band
    run = audit_engine(engine, pair, [prompt], RunSettings(max_new_tokens=NEW_TOKENS, eos_token_id=None, dtype="float64", logit_tolerance=band, batch_size=1, engine_name="scripted", diagnosis="quick"))
    return run, p, q, worst


def test_a_bug_after_a_numerical_flip_is_ruled_structural_against_the_continued_reference(scripted_run) -> None:
    run, p, q, worst = scripted_run
    by_position = {d["position"]: d for d in run["divergences"]}
    assert by_position[p]["kind"] == "numerical"
    later = by_position[q]
    assert later["kind"] == "structural" and later["engine_token"] == worst
    assert later["continued_after"] == p
    assert run["structural_divergences"] == 1 and not run["equivalent"]


def test_the_later_divergence_is_diagnosed(scripted_run) -> None:
    run, _, q, _ = scripted_run
    later = next(d for d in run["divergences"] if d["position"] == q)
    assert "diagnosis" in later and later["diagnosis"]["class"]


def test_the_next_difference_stops_where_a_correct_decoder_stops() -> None:
    from specaudit.equivalence.audit import next_difference

    # choices[j]: a correct decoder's token after the engine's first j tokens (one more than the output)
    engine = [5, 6, 7, 8]
    assert next_difference([5, 6, 7, 8, 9], engine, 0, 4, None) is None  # agrees to its budget
    found = next_difference([5, 6, 3, 8, 9], engine, 0, 4, None)
    assert (found.position, found.tokens) == (2, [5, 6, 3])  # a token a correct decoder does not choose
    found = next_difference([5, 6, 7, 8, 9], engine, 0, 8, None)
    assert (found.position, found.tokens) == (4, [5, 6, 7, 8, 9])  # ends early: a correct decoder goes on
    found = next_difference([5, 6, 7, 8, 9], engine, 0, 8, [2, 6])
    assert (found.position, found.tokens) == (2, [5, 6])  # runs past the second of two EOS ids
    assert next_difference([5, 6, 7, 8, 9], engine[:2], 0, 8, [2, 6]) is None  # stops at it
