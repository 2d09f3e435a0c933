"""INPLACE equals greedy decoding under the public property (`check_equivalence`), float64.

Hypothesis draws the cases (acceptance schedules through a `ScriptedDrafter`, the model drafter,
EOS at any step, prompts of length 1 and skewed lengths, a pad id that is also a real token,
batch sizes 1-12, k 1-8, every built-in pair). A low compaction threshold makes compactions happen
inside the drawn runs, so both the holes and the compaction are exercised.
"""

from __future__ import annotations

from hypothesis import given, settings

from specaudit.engines.inplace import InplaceEngine
from specaudit.testing import strategies as sst
from specaudit.testing.profiles import examples
from specaudit.testing.properties import check_equivalence, check_scripted_acceptance

cases = sst.decoding_cases(max_prompts=12, max_new_tokens=20, max_prompt_length=40, max_pool_length=200)


@settings(max_examples=examples(0.5))
@given(case=cases)
def test_inplace_equivalence_property_scripted(case) -> None:
    report = check_equivalence(InplaceEngine, case, drafter="scripted", compact_fraction=0.1)
    check_scripted_acceptance(case, report)


@settings(max_examples=examples(0.3))
@given(case=cases)
def test_inplace_equivalence_property_model_drafter(case) -> None:
    check_equivalence(InplaceEngine, case, drafter="model")
