"""Adversarial prompts: in every audit by default, each with its reason, and exact for correct engines."""

from __future__ import annotations

import pytest

import specaudit
from specaudit.engines.models.zoo import builtin_pair_names
from specaudit.equivalence.adversarial import adversarial_prompts

CORRECT_ENGINES = ["reference", "eqspec", "exspec", "hf-batched"]


def test_the_set_covers_each_case_and_respects_the_position_limit() -> None:
    filler = list(range(40, 90))
    roomy, skipped = adversarial_prompts(filler, pad_token_id=256, eos_token_id=258, bos_token_id=257,
                                         max_positions=4096, max_new_tokens=32, draft_tokens=4)
    cases = [p.case for p in roomy]
    assert cases.count("identical") == 4 and len({tuple(p.tokens) for p in roomy if p.case == "identical"}) == 1
    assert {"longer-than-2048", "pad-only", "pad-inside", "eos-inside", "bos-inside"} <= set(cases)
    assert not skipped and all(p.why for p in roomy)
    by_case = {p.case: p.tokens for p in roomy}
    assert len(by_case["longer-than-2048"]) > 2048
    assert by_case["pad-only"] == [256] and by_case["pad-inside"][0] == 256 and 256 in by_case["pad-inside"][1:]
    assert 258 in by_case["eos-inside"][1:-1] and by_case["bos-inside"].count(257) == 2
    # the one-token row follows the long one: one batch of 4 mixes them
    assert cases[4:6] == ["longer-than-2048", "pad-only"]
    middle, _ = adversarial_prompts(filler, pad_token_id=256, eos_token_id=258, bos_token_id=257,
                                    max_positions=2048, max_new_tokens=32, draft_tokens=4)
    assert [len(p.tokens) for p in middle if p.case == "longer-than-1024"] == [1100]

    tight, skipped = adversarial_prompts(filler, pad_token_id=None, eos_token_id=None, bos_token_id=None,
                                         max_positions=1024, max_new_tokens=32, draft_tokens=4)
    longest = max(len(p.tokens) for p in tight)
    assert longest + 32 + 4 + 1 <= 1024 and "long" in [p.case for p in tight]
    assert len(skipped) == 5  # the two long cases, pad, EOS, BOS


@pytest.mark.parametrize("pair", builtin_pair_names())
def test_correct_engines_are_exact_on_the_adversarial_prompts(pair: str) -> None:
    # batch size 2: the long prompt and the one-token prompt share a batch, at half the memory of 4
    report = specaudit.audit(CORRECT_ENGINES, pairs=[pair], batch_sizes=[2], num_prompts=1, max_new_tokens=3,
                             draft_tokens=2)
    for run in report.runs:
        assert not run.get("error"), run.get("error")
        info = run["adversarial"]
        assert info["first_index"] == 1 and run["num_prompts"] == 1 + len(info["cases"]) >= 8
        assert run["exact_matches"] == run["num_prompts"] and run["divergences"] == [], run["engine"]


def test_pad_equal_to_eos_and_the_opt_out() -> None:
    report = specaudit.audit(["eqspec"], pairs=["tiny-gpt2"], batch_sizes=[4], num_prompts=2, max_new_tokens=4,
                             draft_tokens=2, pad_token_id=258)
    run = report.runs[0]
    assert report.data["config"]["pad_token_id"] == 258 and run["exact_matches"] == run["num_prompts"]
    pad_only = next(c for c in run["adversarial"]["cases"] if c["case"] == "pad-only")
    assert "258" in pad_only["why"]
    plain = specaudit.audit(["eqspec"], pairs=["tiny-gpt2"], batch_sizes=[4], num_prompts=2, max_new_tokens=4,
                            draft_tokens=2, adversarial=False)
    assert plain.runs[0]["num_prompts"] == 2 and plain.runs[0]["adversarial"] is None
