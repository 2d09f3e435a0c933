"""EQSPEC equals greedy decoding token by token, and in float64 logit by logit (< 1e-9).

Hypothesis draws the hard cases (acceptance schedules through a `ScriptedDrafter`, the model
drafter, EOS at any step, prompts of length 1 and very skewed lengths, a pad id that is also a
real token, batch sizes 1-16, k 1-8, every built-in pair); a deterministic sweep with the model
drafter covers every pair of factors: every built-in pair with every k 1..8, every pair with every
batch size {1, 2, 4, 8, 16}, and every batch size with every k (`SWEEP`: 96 runs where the full
product is 480; an interaction of all three at once is Hypothesis's to find).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from specaudit.engines.models import zoo
from specaudit.engines.eqspec import EQSpec
from specaudit.testing import models
from specaudit.testing import strategies as sst
from specaudit.testing.profiles import examples
from specaudit.testing.properties import check_equivalence, check_scripted_acceptance
from specaudit.testing.strategies import AcceptanceSchedule, DecodingCase, EosChoice, Prompt

PAIRS = zoo.builtin_pair_names()
SWEEP_BATCH_SIZES = (1, 2, 4, 8, 16)
SWEEP_DRAFT_TOKENS = tuple(range(1, 9))
SWEEP_MAX_NEW_TOKENS = 12  # 96 runs: k up to 8 still leaves every row two steps or more
SWEEP_MAX_PROMPT_LENGTH = 200

cases = sst.decoding_cases(max_prompts=16, max_new_tokens=24, max_prompt_length=48, max_pool_length=200)


def builtin(index: int) -> Prompt:
    return Prompt(models.prompts()[index], f"builtin[{index}]")


def longest_and_shortest_builtin() -> tuple[Prompt, Prompt]:
    pool = models.prompts()
    order = sorted(range(len(pool)), key=lambda i: len(pool[i]))
    return builtin(order[-1]), builtin(order[0])


def full_batch_everything_accepted() -> DecodingCase:
    prompts = tuple(Prompt(tuple(range(1 + row)), "synthetic") for row in range(16))
    return DecodingCase(pair="tiny-qwen3", prompts=prompts, batch_size=16, draft_tokens=8, max_new_tokens=20,
                        schedule=AcceptanceSchedule("all", ((8,),) * 16), eos=EosChoice(row=5, position=11))


def pad_id_inside_the_prompts() -> DecodingCase:
    prompts = (Prompt((7, 7, 7, 3), "synthetic"), Prompt((7,), "synthetic"), Prompt((3, 7, 256, 7, 7, 7, 7), "synthetic"))
    return DecodingCase(pair="tiny-gpt2", prompts=prompts, batch_size=3, draft_tokens=3, max_new_tokens=12,
                        schedule=AcceptanceSchedule("random", ((0, 3), (1,), (3, 2, 0))), pad_token_id=7)


def very_skewed_lengths() -> DecodingCase:
    longest, shortest = longest_and_shortest_builtin()
    return DecodingCase(pair="tiny-llama", prompts=(longest, shortest), batch_size=2, draft_tokens=4,
                        max_new_tokens=16, schedule=AcceptanceSchedule("alternating", ((0, 4), (4, 0))))


@settings(max_examples=examples(0.75))
@given(case=cases)
@example(case=full_batch_everything_accepted())
@example(case=pad_id_inside_the_prompts())
@example(case=very_skewed_lengths())
def test_eqspec_matches_reference_with_scripted_schedules(case: DecodingCase) -> None:
    report = check_equivalence(EQSpec, case, drafter="scripted")
    note(f"max logit error {report.max_logit_error}, steps {report.steps}")
    check_scripted_acceptance(case, report)


@settings(max_examples=examples(0.75))
@given(case=cases)
def test_eqspec_matches_reference_with_the_model_drafter(case: DecodingCase) -> None:
    report = check_equivalence(EQSpec, case, drafter="model")
    note(f"max logit error {report.max_logit_error}, steps {report.steps}")


@pytest.mark.parametrize("kind", (*sst.SCHEDULE_KINDS, sst.NO_DRAFTS))
@settings(max_examples=examples(0.5))
@given(data=st.data())
def test_eqspec_matches_reference_for_each_schedule_kind(kind: str, data: st.DataObject) -> None:
    case = data.draw(sst.decoding_cases(max_prompts=8, max_prompt_length=32, max_pool_length=120,
                                        schedule_kinds=(kind,)), label="case")
    report = check_equivalence(EQSpec, case, drafter="scripted")
    check_scripted_acceptance(case, report)


@settings(max_examples=examples(1.0))
@given(case=sst.first_step_finisher_cases(max_rows=8, max_prompt_length=32, max_pool_length=200))
def test_a_row_finishing_at_its_first_step_leaves_the_others_exact(case: DecodingCase) -> None:
    report = check_equivalence(EQSpec, case, drafter="scripted")
    assert isinstance(case.eos, EosChoice)
    finisher = case.eos.row
    assert len(report.reference[finisher]) <= case.eos.position + 1
    note(f"finisher row {finisher} emitted {len(report.outputs[finisher])}; others {[len(o) for o in report.outputs]}")


@settings(max_examples=examples(0.5))
@given(case=sst.decoding_cases(max_prompts=16, max_prompt_length=1, prompt_styles=("synthetic",)))
def test_prompts_of_length_one(case: DecodingCase) -> None:
    assert all(len(p.tokens) == 1 for p in case.prompts)
    check_equivalence(EQSpec, case, drafter="scripted")


def sweep_prompts(batch_size: int, k: int) -> tuple[Prompt, ...]:
    """`batch_size` built-in prompts up to 200 tokens (lengths 1 to ~180), rotating with k so the
    sweep covers every such prompt."""
    pool = models.prompts()
    usable = [i for i, p in enumerate(pool) if len(p) <= SWEEP_MAX_PROMPT_LENGTH]
    start = (3 * k + batch_size) % len(usable)
    return tuple(builtin(usable[(start + i) % len(usable)]) for i in range(batch_size))


def pairwise_sweep() -> list[tuple[str, int, int]]:
    """(pair, batch size, k) covering every pair of factors: the batch size of pair p at k is the
    ((p + k) mod 5)-th, so for a fixed pair the 8 values of k reach all 5 batch sizes, and for a fixed k
    the 12 pairs do too."""
    return [(pair, SWEEP_BATCH_SIZES[(p + k) % len(SWEEP_BATCH_SIZES)], k)
            for p, pair in enumerate(PAIRS) for k in SWEEP_DRAFT_TOKENS]


SWEEP = pairwise_sweep()


def test_the_sweep_covers_every_pair_of_factors() -> None:
    assert {(p, k) for p, _, k in SWEEP} == {(p, k) for p in PAIRS for k in SWEEP_DRAFT_TOKENS}
    assert {(p, b) for p, b, _ in SWEEP} == {(p, b) for p in PAIRS for b in SWEEP_BATCH_SIZES}
    assert {(b, k) for _, b, k in SWEEP} == {(b, k) for b in SWEEP_BATCH_SIZES for k in SWEEP_DRAFT_TOKENS}


@pytest.mark.slow
@pytest.mark.parametrize("pair,batch_size,k", SWEEP, ids=[f"{p}-{b}-{k}" for p, b, k in SWEEP])
def test_sweep_every_pair_batch_size_and_k_with_the_model_drafter(pair: str, batch_size: int, k: int) -> None:
    case = DecodingCase(pair=pair, prompts=sweep_prompts(batch_size, k), batch_size=batch_size, draft_tokens=k,
                        max_new_tokens=SWEEP_MAX_NEW_TOKENS)
    report = check_equivalence(EQSpec, case, drafter="model")
    assert report.max_logit_error is not None and report.max_logit_error < 1e-9
