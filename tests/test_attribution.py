"""Divergence kinds of whole runs: low-precision flips of a correct engine carry their evidence, a buggy
engine stays structural (the rulings themselves: tests/test_precision.py)."""

from __future__ import annotations

import functools

import pytest

from specaudit.engines.models import zoo
from specaudit.engines.eqspec import EQSpec
from specaudit.equivalence.audit import audit_engine

NUM_PROMPTS, MAX_NEW = 16, 24


@functools.lru_cache(maxsize=None)
def low_precision_run(pair_name: str, dtype: str) -> dict:
    pair = zoo.load_pair(pair_name, dtype=dtype)
    replay = zoo.load_pair(pair_name).target
    engine = EQSpec(pair.target, pair.draft, batch_size=8, draft_tokens=4, pad_token_id=pair.pad_token_id)
    return audit_engine(engine, pair, zoo.builtin_prompts()[:NUM_PROMPTS], max_new_tokens=MAX_NEW,
                        eos_token_id=None, dtype=dtype, replay_target=replay, engine_name="eqspec", batch_size=8)


@pytest.mark.parametrize("pair_name", ["tiny-gpt2", "tiny-llama"])
def test_bfloat16_flips_of_the_correct_engine_carry_margin_and_float64_replay(pair_name: str) -> None:
    run = low_precision_run(pair_name, "bfloat16")
    assert run["divergences"], "bfloat16 on these tiny pairs is expected to flip near-ties"
    for divergence in run["divergences"]:
        evidence = divergence["evidence"]
        assert divergence["margin"] is not None and divergence["margin"] <= evidence["dtype_noise"]
        assert evidence["replay_float64_margin"] is not None and len(evidence["replay_float64_top2"]) == 2
        assert max(evidence["replay_float64_gaps"].values()) <= evidence["dtype_noise"]
        assert divergence["kind"] == "numerical", evidence["reason"]
        assert divergence["step"] is not None and divergence["accepted_history"] is not None
    assert run["equivalent"]


def test_float32_correct_engine_is_token_exact_with_small_logit_error() -> None:
    run = low_precision_run("tiny-llama", "float32")
    assert run["exact_matches"] == NUM_PROMPTS and not run["divergences"]
    assert run["max_logit_error"] < 1e-4 and run["logit_tolerance"] is None


def test_bfloat16_run_of_a_buggy_engine_is_structural() -> None:
    """BSP's positions drift: in bfloat16 its logits leave the noise band before its tokens flip."""
    from specaudit.engines.adapters.bsp import BSPEngine

    pair = zoo.load_pair("tiny-llama", dtype="bfloat16")
    engine = BSPEngine(pair.target, pair.draft, batch_size=4, draft_tokens=4, pad_token_id=pair.pad_token_id)
    run = audit_engine(engine, pair, zoo.builtin_prompts()[:8], max_new_tokens=16, eos_token_id=None,
                       dtype="bfloat16", replay_target=zoo.load_pair("tiny-llama").target, engine_name="bsp",
                       batch_size=4)
    assert run["divergences"] and not run["equivalent"]
    assert all(d["kind"] == "structural" for d in run["divergences"]), [d["evidence"]["reason"] for d in run["divergences"]]


def test_draft_fidelity_finds_a_proposal_the_draft_would_not_make() -> None:
    from specaudit.equivalence.draft_fidelity import first_draft_mismatches

    pair = zoo.load_pair("tiny-gpt2")
    engine = EQSpec(pair.target, pair.draft, batch_size=4, draft_tokens=3, pad_token_id=pair.pad_token_id,
                    record_logits=True)
    prompts = zoo.builtin_prompts()[:4]
    outputs = engine.generate(prompts, 12, None)
    trace = engine.last_trace
    assert trace.proposals_from_draft_model
    assert first_draft_mismatches(trace, pair.draft, prompts, outputs, skip=set()) == {}
    step = next(s for s in trace.steps if s.kind == "batch")
    step.proposed[1][0] = (step.proposed[1][0] + 1) % 256  # the first proposal is always checkable
    found = first_draft_mismatches(trace, pair.draft, prompts, outputs, skip=set())
    assert list(found) == [step.rows[1]] and found[step.rows[1]]["step"] == trace.steps.index(step)
