"""The standard speculative sampler is exact, and every planted sampling fault is caught and named:
the exact distribution of one step (`equivalence/sampling/exact.py`) against the target's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import find

from specaudit.engines.sampling.process import SamplingParams, process_logits
from specaudit.engines.sampling.rules import SpeculativeRule, rejection_sample_row
from specaudit.equivalence.sampling.exact import step_departure, step_outcomes
from specaudit.testing.faults.sampling import NOT_FAULTS, SAMPLING_FAULTS
from specaudit.testing.sampling_strategies import SamplingCase, sampling_cases

EXACT = 1e-6
FAST = settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def departure_of(rule: SpeculativeRule, case: SamplingCase) -> float:
    return step_departure(rule, case.target_logits, case.draft_logits, case.params).total_variation


@FAST
@given(case=sampling_cases())
def test_standard_rule_is_exact(case: SamplingCase) -> None:
    assert departure_of(SpeculativeRule(), case) < EXACT


@FAST
@given(case=sampling_cases())
def test_processing_applied_to_the_target_only_is_still_exact(case: SamplingCase) -> None:
    for rule in NOT_FAULTS.values():
        assert departure_of(rule(), case) < EXACT, rule.name


@pytest.mark.parametrize("name", sorted(SAMPLING_FAULTS))
def test_each_fault_is_found(name: str) -> None:
    rule = SAMPLING_FAULTS[name]()
    # the first case found is enough (no shrinking: it costs minutes and names nothing more)
    found = find(sampling_cases(), lambda case: departure_of(rule, case) > 1e-3,
                 settings=settings(max_examples=1000, deadline=None, database=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
    assert departure_of(rule, found) > 1e-3
    assert departure_of(SpeculativeRule(), found) < EXACT  # the same case passes the correct rule


def test_greedy_is_the_exact_greedy_rule() -> None:
    gen = torch.Generator().manual_seed(3)
    target, draft = torch.randn(4, 7, generator=gen, dtype=torch.float64), torch.randn(4, 7, generator=gen, dtype=torch.float64)
    outcomes = step_outcomes(SpeculativeRule(), target, draft, SamplingParams(temperature=0.0))
    assert len(outcomes) == 1  # no randomness left
    (emitted, probability), = outcomes.items()
    drafts = draft[:3].argmax(-1).tolist()
    expected = []
    for j in range(4):  # accept while the draft is the target's argmax, then the argmax
        expected.append(int(target[j].argmax()))
        if j == 3 or drafts[j] != expected[-1]:
            break
    assert list(emitted) == expected and probability == 1.0


def test_top_k_and_top_p_keep_ties() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    assert (process_logits(logits, SamplingParams(1.0, top_k=2)) > 0).tolist() == [True, True, True, False]
    probs = torch.softmax(logits, -1)
    # top_p just above p(0): the head {0} is not enough, so both tied tokens at 1.0 join it
    kept = process_logits(logits, SamplingParams(1.0, top_p=float(probs[0]) + 1e-9)) > 0
    assert kept.tolist() == [True, True, True, False]


def test_the_exact_check_sees_a_departure_in_the_second_position_only() -> None:
    """A sampler that is right at position 1 and wrong after an accepted draft: caught at position 1 (0-based)."""

    def late_fault(p, q, drafts, draws):
        emitted = rejection_sample_row(p, q, drafts, draws)
        return emitted if len(emitted) < 2 else emitted[:1] + [int(p[1].argmax())]

    target = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.5]], dtype=torch.float64)
    worst = step_departure(SpeculativeRule(verify=late_fault), target, target.clone(), SamplingParams(1.0))
    assert worst.position == 1 and worst.total_variation > 0.3


def test_top_p_by_sorting_agrees_with_the_pairwise_rule() -> None:
    """Vocabularies above 512 take the sort-based top-p; it keeps the same tokens, ties included."""
    from specaudit.engines.sampling.process import _keep_top_p

    gen = torch.Generator().manual_seed(4)
    logits = torch.randint(-3, 3, (5, 600), generator=gen).to(torch.float64)  # many ties
    probs = torch.softmax(logits, -1)
    above = (probs.unsqueeze(-2) * (probs.unsqueeze(-2) > probs.unsqueeze(-1))).sum(-1)
    for top_p in (0.3, 0.5, 0.9):
        assert torch.equal(_keep_top_p(probs, top_p), above < top_p)


def test_the_batched_sampler_names_accepted_recovered_and_bonus_tokens() -> None:
    from specaudit.engines.sampling.rules import rejection_sample, seeded_draws

    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],  # row 0: draft 1 accepted, bonus 2
                      [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)  # row 1: draft 1 rejected, 0 recovered
    q = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 1.0, 0.0]]], dtype=torch.float64)
    out = rejection_sample(p, q, torch.tensor([[1], [1]]), [seeded_draws(0), seeded_draws(1)])
    assert out.accepted == [[1], []] and out.final == [2, 0] and out.bonus == [True, False]
    assert out.as_tensor(1).tolist() == [[1, 2], [0, -1]]


def test_an_acceptance_rounded_below_one_opens_no_branch() -> None:
    """A top-p cut that keeps the same tokens in p and q, whose probabilities round apart in the last bit: the
    acceptance p / q is 1 - 1e-16 there, and the branch that rejection would open (a residual of zeros) is no
    outcome of any sampler. A random search once drew this case; the enumeration raised on it."""
    inf = float("inf")
    target = torch.tensor([[2.0, 0.0, -1.0], [-2.5, 2.0, 0.5], [-1.0, 2.0, -inf], [0.0, -inf, 1.0]], dtype=torch.float64)
    draft = torch.tensor([[1.75, 0.25, -1.25], [-2.75, 2.25, 0.75], [-0.75, 2.25, -inf], [0.25, -inf, 0.75]],
                         dtype=torch.float64)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    assert step_departure(SAMPLING_FAULTS["residual_not_clipped"](), target, draft, params).total_variation < EXACT
    assert step_departure(SpeculativeRule(), target, draft, params).total_variation < EXACT
