"""One acceptance rule (engines/acceptance.py) for every engine, and EOS sets in every engine.

A change to the one function changes EQSPEC, EXSPEC, INPLACE and the fixed-shape engine alike; a target
that ends rows at either of two EOS ids gets the reference's tokens from every engine.
"""

from __future__ import annotations

import pytest
import torch

from specaudit.engines import acceptance
from specaudit.engines.drafters import ModelDrafter
from specaudit.engines.models.bench_pair import CalibratedDrafter
from specaudit.engines.reference import greedy_decode
from specaudit.engines.registry import make_engine
from specaudit.testing.models import pair, prompts

SPECULATIVE = ("eqspec", "exspec", "inplace", "fixedshape")
EVERY_ENGINE = ("reference", "batched", *SPECULATIVE)


def test_the_rule_names_accepted_recovered_and_bonus_tokens_and_cuts_at_any_eos_and_the_room() -> None:
    V = 10
    targets = torch.tensor([[1, 2, 3, 4],  # all 3 drafts accepted, bonus 4
                            [1, 7, 3, 4],  # 1 accepted, recovered 7
                            [1, 2, 3, 4],  # all accepted, room 2
                            [8, 2, 9, 4]])  # 0 accepted... drafts below
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [8, 2, 9]])
    logits = torch.nn.functional.one_hot(targets, V).double()  # [B, k+1, V]
    room = torch.tensor([10, 10, 2, 10])
    verdict = acceptance.accept(logits, drafts, room, [9, 3])  # two EOS ids
    assert verdict.accepted.tolist() == [3, 1, 3, 3]
    assert torch.equal(verdict.tokens, targets)
    # row 0: EOS 3 at position 2 cuts it; row 1: 1 accepted + recovered 7; row 2: its room; row 3: EOS 9
    assert verdict.emitted.tolist() == [3, 2, 2, 3]
    assert verdict.done.tolist() == [True, False, True, True]
    assert verdict.ended_by_eos.tolist() == [True, False, False, True]
    assert acceptance.accept(logits, drafts, room, None).emitted.tolist() == [4, 2, 2, 4]
    own = torch.tensor([[True, False, False]] * 4)  # a pad slot is never accepted
    assert acceptance.accept(logits, drafts, room, None, own=own).accepted.tolist() == [1, 1, 1, 1]


def _replace_the_bonus_token(monkeypatch: pytest.MonkeyPatch) -> None:
    real = acceptance.accept

    def wrong_bonus(target_logits, drafts, room, eos_token_id, **options):
        verdict = real(target_logits, drafts, room, eos_token_id, **options)
        k, vocab = drafts.shape[1], target_logits.shape[-1]
        full = verdict.accepted == k  # [B] the rows whose last token is a bonus token
        tokens = verdict.tokens.clone()
        tokens[full, k] = (tokens[full, k] + 1) % vocab
        return real(None, drafts, room, eos_token_id, target_tokens=tokens, own=options.get("own"))

    monkeypatch.setattr(acceptance, "accept", wrong_bonus)


def test_a_change_to_the_acceptance_function_changes_every_speculative_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the target as its own draft every step accepts all k: each engine's output then holds bonus
    tokens, and a rule that gets the bonus token wrong makes every engine diverge from the reference."""
    p = pair("tiny-llama")
    cases = [list(x) for x in prompts()[:3]]
    expected = [greedy_decode(p.target, c, 9, None)[0] for c in cases]
    for name in SPECULATIVE:  # the unchanged rule is exact
        assert make_engine(name, p.target, p.target, batch_size=2, draft_tokens=2).generate(cases, 9, None) == expected
    _replace_the_bonus_token(monkeypatch)
    for name in SPECULATIVE:
        got = make_engine(name, p.target, p.target, batch_size=2, draft_tokens=2).generate(cases, 9, None)
        assert all(g != e for g, e in zip(got, expected)), name
        assert all(g[:3] == e[:3] and g[3] != e[3] for g, e in zip(got, expected)), name  # the first bonus, at 1 + k


def test_one_model_drafter_the_bench_drafter_is_a_model_drafter_with_a_chooser() -> None:
    assert issubclass(CalibratedDrafter, ModelDrafter)
    assert CalibratedDrafter.propose is ModelDrafter.propose and CalibratedDrafter.commit is ModelDrafter.commit


def _two_eos_ids(target, cases: list[list[int]], new_tokens: int) -> list[int]:
    """Two ids the reference emits, chosen so that each ends some row early: the first token of two rows
    whose outputs differ there."""
    outputs = [greedy_decode(target, c, new_tokens, None)[0] for c in cases]
    firsts = []
    for output in outputs:
        candidate = output[2]  # a third token: the row ends early, not at once
        if candidate not in firsts and all(candidate not in o[:2] for o in outputs):
            firsts.append(candidate)
    assert len(firsts) >= 2, outputs
    return firsts[:2]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_every_engine_stops_at_the_first_of_several_eos_ids(batch_size: int) -> None:
    p = pair("tiny-llama")
    cases = [list(x) for x in prompts()[:6]]
    eos = _two_eos_ids(p.target, cases, 12)
    unstopped = [greedy_decode(p.target, c, 12, None)[0] for c in cases]
    expected = [greedy_decode(p.target, c, 12, eos)[0] for c in cases]
    for output, full in zip(expected, unstopped):  # the reference stops at the first of either id
        stops = [i for i, t in enumerate(full) if t in eos]
        assert output == (full[:stops[0] + 1] if stops else full)
    assert {o[-1] for o in expected if len(o) < 12} == set(eos)  # both ids end a row early
    for name in EVERY_ENGINE:
        engine = make_engine(name, p.target, p.draft, batch_size=batch_size, draft_tokens=3)
        assert engine.generate(cases, 12, eos) == expected, name
        assert engine.generate(cases, 12, tuple(eos)) == expected, name
