"""Divergence kinds of whole runs: low-precision flips of a correct engine carry their evidence, a buggy
engine stays structural (the rulings themselves: tests/test_precision.py).

Whether a correct engine flips a token in bfloat16 depends on the machine's kernels, so the flip is built:
the prompt is the prefix of a built-in prompt whose next token is the float64 target's tightest near-tie
(a fact of the weights in float64, the same on any machine), and the engine answers it with the other
token of that tie, then decodes on correctly: what another machine's rounding may do."""

from __future__ import annotations

import functools

import pytest
import torch

from specaudit.engines.models import zoo
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.reference import greedy_decode
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.equivalence.rulings import dtype_noise

pytestmark = pytest.mark.precision  # what it sees rounds below float64: run under other kernels too

NUM_PROMPTS, MAX_NEW = 16, 24
MAX_PREFIX = 64  # the near-tie is looked for among the first tokens of each built-in prompt


@functools.lru_cache(maxsize=None)
def near_tie_prompt(pair_name: str) -> tuple[list[int], tuple[int, int], float]:
    """The prefix of a built-in prompt (4 tokens or more) after which the float64 target's top two tokens lie
    closest, relative to the top: (prefix, the two tokens, their float64 gap)."""
    target = zoo.load_pair(pair_name).target
    best: tuple[float, list[int], tuple[int, int], float] | None = None
    for prompt in zoo.builtin_prompts():
        prompt = prompt[:MAX_PREFIX]
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt])).logits[0]  # [n, V]: after every prefix at once
        top = logits.topk(2, -1)
        for end in range(4, len(prompt) + 1):
            values, tokens = top.values[end - 1], top.indices[end - 1]
            gap = float(values[0] - values[1])
            relative = gap / max(1.0, abs(float(values[0])))
            if best is None or relative < best[0]:
                best = (relative, prompt[:end], (int(tokens[0]), int(tokens[1])), gap)
    assert best is not None
    return best[1], best[2], best[3]


class FlippedAtNearTie:
    """EQSPEC, except that on the near-tie prompt (the last one) it answers the tie with the token the audit
    dtype's reference does not choose, then decodes on from there as EQSPEC does."""

    def __init__(self, engine: EQSpec, target: torch.nn.Module, tie: tuple[int, int]) -> None:
        self.engine, self.target, self.tie = engine, target, tie

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: None) -> list[list[int]]:
        outputs = self.engine.generate(prompts, max_new_tokens, eos_token_id)
        self.last_trace = self.engine.last_trace  # the batch's steps; the last row's tokens are replaced below
        prompt = prompts[-1]
        with torch.no_grad():
            chosen = greedy_decode(self.target, prompt, 1, None)[0][0]  # as the audit's reference decodes it
        other = self.tie[1] if chosen == self.tie[0] else self.tie[0]
        rest = self.engine.generate([prompt + [other]], max_new_tokens - 1, eos_token_id)[0]
        outputs[-1] = [other] + rest
        return outputs


@functools.lru_cache(maxsize=None)
def low_precision_run(pair_name: str, dtype: str, flip: bool = False) -> dict:
    pair = zoo.load_pair(pair_name, dtype=dtype)
    replay = zoo.load_pair(pair_name).target
    engine = EQSpec(pair.target, pair.draft, batch_size=8, draft_tokens=4, pad_token_id=pair.pad_token_id)
    prompts = zoo.builtin_prompts()[:NUM_PROMPTS]
    if flip:
        prefix, tie, _ = near_tie_prompt(pair_name)
        prompts = prompts[:NUM_PROMPTS - 1] + [prefix]
        engine = FlippedAtNearTie(engine, pair.target, tie)
    return audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=MAX_NEW, eos_token_id=None, dtype=dtype, engine_name="eqspec", batch_size=8),
                        replay_target=replay)


@pytest.mark.parametrize("pair_name", ["tiny-gpt2", "tiny-llama"])
def test_the_float64_near_tie_lies_within_bfloat16_noise(pair_name: str) -> None:
    """The premise of the flip below, in float64 alone: the two tokens are far closer than bfloat16's noise."""
    prefix, tie, gap = near_tie_prompt(pair_name)
    with torch.no_grad():
        top = float(zoo.load_pair(pair_name).target(input_ids=torch.tensor([prefix])).logits[0, -1].max())
    assert tie[0] != tie[1] and 0.0 <= gap < dtype_noise("bfloat16", top) / 16


@pytest.mark.parametrize("pair_name", ["tiny-gpt2", "tiny-llama"])
def test_bfloat16_flips_of_the_correct_engine_carry_margin_and_float64_replay(pair_name: str) -> None:
    run = low_precision_run(pair_name, "bfloat16", flip=True)
    flipped = NUM_PROMPTS - 1
    assert any(d["prompt_index"] == flipped and d["position"] == 0 for d in run["divergences"])
    for divergence in run["divergences"]:
        evidence = divergence["evidence"]
        assert divergence["margin"] is not None and divergence["margin"] <= evidence["dtype_noise"]
        assert evidence["replay_float64_margin"] is not None and len(evidence["replay_float64_top2"]) == 2
        assert max(evidence["replay_float64_gaps"].values()) <= evidence["dtype_noise"]
        assert divergence["kind"] == "numerical", evidence["reason"]
        if divergence["prompt_index"] != flipped:  # the built flip is no step of EQSPEC's trace
            assert divergence["step"] is not None and divergence["accepted_history"] is not None
    assert run["equivalent"]


def test_float32_correct_engine_is_equivalent_with_small_logit_error() -> None:
    """Whether float32 flips a near-tie is the machine's; that a flip is ruled numerical, and the logits stay
    close, is not."""
    run = low_precision_run("tiny-llama", "float32")
    assert run["equivalent"] and all(d["kind"] == "numerical" for d in run["divergences"])
    assert run["exact_matches"] + len({d["prompt_index"] for d in run["divergences"]}) == NUM_PROMPTS
    assert run["max_logit_error"] < 1e-4 and run["logit_tolerance"] is None


def test_bfloat16_run_of_a_buggy_engine_is_structural() -> None:
    """BSP's positions drift: in bfloat16 its logits leave the noise band before its tokens flip."""
    from specaudit.engines.adapters.bsp import BSPEngine

    pair = zoo.load_pair("tiny-llama", dtype="bfloat16")
    engine = BSPEngine(pair.target, pair.draft, batch_size=4, draft_tokens=4, pad_token_id=pair.pad_token_id)
    run = audit_engine(engine, pair, zoo.builtin_prompts()[:8], RunSettings(max_new_tokens=16, eos_token_id=None, dtype="bfloat16", engine_name="bsp", batch_size=4),
                       replay_target=zoo.load_pair("tiny-llama").target)
    assert run["divergences"] and not run["equivalent"]
    # each of its rows is ruled by what the controls measure there; a row its drift has not reached yet may
    # flip a near-tie as a correct engine would, so not every divergence need be structural, but most are
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert len(structural) * 2 > len(run["divergences"]), [d["evidence"]["reason"] for d in run["divergences"]]


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
