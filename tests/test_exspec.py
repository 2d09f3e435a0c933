"""EXSPEC against the reference decoder, in float64 on the CPU: tokens equal, logits within 1e-9.

The sweep covers every pair of factors among built-in pair, B in {1, 2, 4, 8, 16} and W in {B, 2B,
4B, 6B} (`SWEEP`: each pair at every B, each pair and each B at every W; 60 runs where the full
product is 240); each case draws B + 4 of the 19 prompts of at most 200 tokens with a seeded
`torch.Generator` (so W both exceeds and falls short of the pool), and the (sorted, drafter)
combination, the draft length k, the scripted schedule and the pad id rotate over the cases so that
every pair and every B meets all four (sorted, drafter) combinations. The long prompts (up to 915 tokens) have their own test.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specaudit.engines.models import zoo
from specaudit.engines.drafters import ModelDrafter, ScriptedDrafter
from specaudit.engines.exspec import EXSpec, ExspecPool, stack_cache, unstack_cache
from specaudit.engines.exspec_cache import RowKV
from specaudit.engines.registry import make_engine
from specaudit.testing import models

MAX_NEW_TOKENS = 16
SWEEP_MAX_NEW_TOKENS = 12  # the 60-case sweep: every row still runs several steps (k 1 to 6) and rows refill
LOGIT_TOLERANCE = 1e-9
BATCH_SIZES = (1, 2, 4, 8, 16)
WINDOW_FACTORS = (1, 2, 4, 6)
COMBINATIONS = ((False, "model"), (True, "scripted"), (True, "model"), (False, "scripted"))
DRAFT_LENGTHS = (4, 1, 3, 6, 2)


def schedules(k: int, first_prompt: int) -> dict:
    table = torch.randint(0, k + 2, (64, 64), generator=torch.Generator().manual_seed(7))
    return {
        "none": lambda prompt, step: 0,
        "all": lambda prompt, step: k,
        "alternating": lambda prompt, step: k * (step % 2),
        "one-row-full": lambda prompt, step: k if prompt == first_prompt else 1,
        "seeded": lambda prompt, step: int(table[prompt % 64, step % 64]),
    }


def short_prompts() -> list[int]:
    return [i for i, p in enumerate(models.prompts()) if len(p) <= 200]


def long_prompts() -> list[int]:
    return [i for i, p in enumerate(models.prompts()) if len(p) > 200]


def choose_prompts(pool: list[int], count: int, seed: int) -> list[int]:
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))
    return [pool[i] for i in order[:count].tolist()]


def run_and_compare(engine: EXSpec, name: str, indices: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> tuple[list[list[int]], list[list[int]], float]:
    """Run `engine` on the chosen prompts; returns (engine outputs, expected outputs, max |logit diff|)."""
    reference_outputs, reference_logits = models.reference(name)
    prompts = [list(models.prompts()[i]) for i in indices]
    outputs = engine.generate(prompts, max_new_tokens, eos_token_id)
    expected = []
    for i in indices:
        tokens = reference_outputs[i][:max_new_tokens]
        if eos_token_id is not None and eos_token_id in tokens:
            tokens = tokens[: tokens.index(eos_token_id) + 1]
        expected.append(tokens)
    error = 0.0
    for got, want, i in zip(engine.last_trace.logits, expected, indices):
        assert got is not None and got.shape[0] == len(want)
        error = max(error, float((got - reference_logits[i][: len(want)]).abs().max()))
    return outputs, expected, error


def make_exspec(name: str, indices: list[int], *, batch_size: int, window_size: int, sort_by_length: bool,
                drafter_kind: str, k: int, schedule: str = "seeded", pad_token_id: int | None = None) -> EXSpec:
    pair = models.pair(name)
    drafter = None
    if drafter_kind == "scripted":
        # the engine sees prompts 0..n-1; the script reads their reference outputs
        reference_outputs = [models.reference(name)[0][i] for i in indices]
        drafter = ScriptedDrafter(reference_outputs, schedules(k, 0)[schedule], pair.target.config.vocab_size)
    return EXSpec(pair.target, pair.draft, batch_size=batch_size, draft_tokens=k, window_size=window_size,
                  sort_by_length=sort_by_length, drafter=drafter, pad_token_id=pad_token_id, record_logits=True)


PAIRS = zoo.builtin_pair_names()
# pair p at the b-th batch size: window factor (p + b) mod 4, (sorted, drafter) combination (p - b) mod 4;
# for a fixed pair the 5 batch sizes reach all 4 of each, and for a fixed batch size the 12 pairs do
SWEEP = [(name, batch_size, WINDOW_FACTORS[(p + b) % 4]) for p, name in enumerate(PAIRS)
         for b, batch_size in enumerate(BATCH_SIZES)]


def combination(name: str, batch_size: int) -> tuple[bool, str]:
    return COMBINATIONS[(PAIRS.index(name) - BATCH_SIZES.index(batch_size)) % 4]


def test_the_sweep_covers_every_pair_of_factors() -> None:
    assert {(n, b) for n, b, _ in SWEEP} == set(itertools.product(PAIRS, BATCH_SIZES))
    assert {(n, f) for n, _, f in SWEEP} == set(itertools.product(PAIRS, WINDOW_FACTORS))
    assert {(b, f) for _, b, f in SWEEP} == set(itertools.product(BATCH_SIZES, WINDOW_FACTORS))
    assert {(n, combination(n, b)) for n, b, _ in SWEEP} == set(itertools.product(PAIRS, COMBINATIONS))
    assert {(b, combination(n, b)) for n, b, _ in SWEEP} == set(itertools.product(BATCH_SIZES, COMBINATIONS))


@pytest.mark.slow
@pytest.mark.parametrize("name,batch_size,factor", SWEEP, ids=[f"{n}-B{b}-W{f}B" for n, b, f in SWEEP])
def test_matches_reference(name: str, batch_size: int, factor: int) -> None:
    case = SWEEP.index((name, batch_size, factor))
    sort_by_length, drafter_kind = combination(name, batch_size)
    k = DRAFT_LENGTHS[case % len(DRAFT_LENGTHS)]
    schedule = list(schedules(k, 0))[case % 5]
    pad_token_id = 32 if case % 3 == 0 else None  # a pad id that is also a real token (a space)
    indices = choose_prompts(short_prompts(), min(batch_size + 4, len(short_prompts())), seed=case)
    engine = make_exspec(name, indices, batch_size=batch_size, window_size=factor * batch_size,
                         sort_by_length=sort_by_length, drafter_kind=drafter_kind, k=k, schedule=schedule,
                         pad_token_id=pad_token_id)
    outputs, expected, error = run_and_compare(engine, name, indices, SWEEP_MAX_NEW_TOKENS)
    assert outputs == expected, f"sorted={sort_by_length} drafter={drafter_kind} k={k} schedule={schedule}"
    assert error < LOGIT_TOLERANCE
    assert all(len(step.rows) <= batch_size for step in engine.last_trace.steps)


def test_long_prompts(pair_name: str) -> None:
    indices = choose_prompts(long_prompts(), 5, seed=11) + [0, 4, 12]
    engine = make_exspec(pair_name, indices, batch_size=4, window_size=8, sort_by_length=False,
                         drafter_kind="model", k=4)
    outputs, expected, error = run_and_compare(engine, pair_name, indices, MAX_NEW_TOKENS)
    assert outputs == expected
    assert error < LOGIT_TOLERANCE


def test_stops_at_eos_and_at_short_budgets(pair_name: str) -> None:
    reference_outputs, _ = models.reference(pair_name)
    indices = [0, 1, 2, 3, 8, 12, 13]  # prompts of 1, 2, 4, 4, 18, 92 and 380 tokens
    eos = reference_outputs[12][5]  # emitted mid-way by one prompt, perhaps earlier or never by others
    for max_new_tokens, eos_token_id in ((MAX_NEW_TOKENS, eos), (1, None), (2, eos)):
        engine = make_exspec(pair_name, indices, batch_size=4, window_size=8, sort_by_length=False,
                             drafter_kind="model", k=3)
        outputs, expected, error = run_and_compare(engine, pair_name, indices, max_new_tokens, eos_token_id)
        assert outputs == expected
        assert error < LOGIT_TOLERANCE
        if max_new_tokens == MAX_NEW_TOKENS:
            assert outputs[indices.index(12)][-1] == eos  # the budget was not what stopped it


def test_zero_budget_and_empty_prompts_list() -> None:
    pair = models.pair("tiny-llama")
    engine = EXSpec(pair.target, pair.draft, batch_size=2)
    assert engine.generate([[1, 2], [3]], 0, None) == [[], []]
    assert engine.generate([], 8, None) == []
    with pytest.raises(ValueError):
        engine.generate([[]], 4, None)


def test_trace_records_groups_fallbacks_and_stages() -> None:
    """Equal-length prompts that accept everything stay in lock step: same-length groups with no
    padding. Ragged acceptance over mixed lengths needs padded fallbacks."""
    name = "tiny-llama"
    indices = [2, 3, 7, 8] + [5, 6]  # two pairs of equal lengths (4, 4 and 18, 18), then 11 and 14
    engine = make_exspec(name, indices, batch_size=2, window_size=6, sort_by_length=True,
                         drafter_kind="scripted", k=3, schedule="all")
    outputs, expected, error = run_and_compare(engine, name, indices, MAX_NEW_TOKENS)
    assert outputs == expected and error < LOGIT_TOLERANCE
    trace = engine.last_trace
    groups = [s for s in trace.steps if s.kind == "group"]
    assert all(s.pad_lengths == [0] * len(s.rows) for s in groups)
    assert sum(len(s.rows) == 2 for s in groups) >= 4  # both equal-length pairs, in lock step
    for step in trace.steps:
        expected_stages = {"draft", "verify", "realign", "unstack"} | ({"stack"} if step.kind != "prefill" else set())
        assert set(step.seconds) == expected_stages

    ragged = make_exspec(name, list(range(12)), batch_size=4, window_size=8, sort_by_length=False,
                         drafter_kind="model", k=4)
    outputs, expected, error = run_and_compare(ragged, name, list(range(12)), MAX_NEW_TOKENS)
    assert outputs == expected and error < LOGIT_TOLERANCE
    kinds = ragged.last_trace.totals()["step_kinds"]
    assert kinds.get("fallback", 0) > 0 and kinds.get("prefill", 0) >= 3
    assert any(max(s.pad_lengths) > 0 for s in ragged.last_trace.steps if s.kind == "fallback")


def test_pool_respects_window_and_batch_size() -> None:
    pair = models.pair("tiny-qwen3")
    reference_outputs, _ = models.reference("tiny-qwen3")
    pool = ExspecPool(pair.target, ModelDrafter(pair.draft), batch_size=3, draft_tokens=2, window_size=5,
                      max_new_tokens=10, eos_token_id=None, pad_id=pair.pad_token_id)
    for i in range(9):
        pool.admit(list(models.prompts()[i]))
    with torch.no_grad():
        while pool.busy:
            record = pool.step()
            assert len(pool.window) <= 5 and len(record.rows) <= 3
            if record.kind == "group":  # no padding: every row had the same length
                assert record.pad_lengths == [0] * len(record.rows)
            if record.kind == "fallback":
                assert max(record.pad_lengths) > 0
    assert pool.step() is None
    assert pool.finished == {i: reference_outputs[i][:10] for i in range(9)}


def test_stack_and_unstack_are_inverse() -> None:
    pair = models.pair("tiny-gpt2")
    gen = torch.Generator().manual_seed(3)
    kvs = [torch.randn(4, 2, 4, n, 16, generator=gen, dtype=torch.float64) for n in (3, 1, 5)]
    cache = stack_cache(pair.target, [RowKV.from_tensor(kv) for kv in kvs])
    assert cache.layers[0].keys.shape == (3, 4, 5, 16)
    assert float(cache.layers[2].values[1, :, :4].abs().max()) == 0.0  # left padding is zero
    back = unstack_cache(cache, [0, 1, 2], [2, 4, 0], [5, 5, 5])
    assert all(torch.equal(a.tensor(), b) for a, b in zip(back, kvs))
    same = stack_cache(pair.target, [RowKV.from_tensor(kvs[2])] * 2)
    assert torch.equal(same.layers[3].keys[1], kvs[2][3, 0])


def test_a_planted_cache_fault_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison bites: cutting one column too few from a group's cache changes the output."""
    import specaudit.engines.exspec as exspec

    original = exspec.unstack_cache

    def short_by_one(cache, rows, starts, ends):
        return original(cache, rows, [s + 1 if e - s > 1 else s for s, e in zip(starts, ends)], ends)

    monkeypatch.setattr(exspec, "unstack_cache", short_by_one)
    indices = [2, 3, 7, 8]
    engine = make_exspec("tiny-llama", indices, batch_size=2, window_size=4, sort_by_length=True,
                         drafter_kind="scripted", k=2, schedule="all")
    reference_outputs, reference_logits = models.reference("tiny-llama")
    prompts = [list(models.prompts()[i]) for i in indices]
    outputs = engine.generate(prompts, MAX_NEW_TOKENS, None)
    error = max(float((got - reference_logits[i][: len(got)]).abs().max())
                for got, i in zip(engine.last_trace.logits, indices))
    assert outputs != [reference_outputs[i][:MAX_NEW_TOKENS] for i in indices] or error > LOGIT_TOLERANCE


def test_registry_builds_exspec_with_default_window() -> None:
    pair = models.pair("tiny-opt")
    engine = make_engine("exspec", pair.target, pair.draft, batch_size=3, draft_tokens=2, sort_by_length=True)
    assert isinstance(engine, EXSpec)
    assert (engine.batch_size, engine.k, engine.window_size, engine.sort_by_length) == (3, 2, 5, True)
    with pytest.raises(ValueError):
        EXSpec(pair.target, None)
    with pytest.raises(ValueError):
        EXSpec(pair.target, pair.draft, batch_size=2, window_size=0)


@pytest.mark.parametrize("pair_name", ["tiny-llama", "tiny-gpt2", "tiny-gemma3"])
@pytest.mark.parametrize("fallback,wait_steps,sort_by_length", [("masked", 0, False), ("masked", 2, True),
                                                                 ("realign", 1, False)])
def test_grouping_policies_stay_exact_with_per_request_budgets(pair_name: str, fallback: str, wait_steps: int,
                                                               sort_by_length: bool) -> None:
    """Every grouping policy, with requests of their own budgets: exactly the reference's tokens and
    logits; padded fallback steps happen (the masked fallback cuts them without realigning)."""
    pair = models.pair(pair_name)
    reference_outputs, reference_logits = models.reference(pair_name)
    indices = list(range(14))
    budgets = [1 + (5 * i) % 16 for i in indices]
    engine = EXSpec(pair.target, pair.draft, batch_size=3, draft_tokens=3, window_size=6, fallback=fallback,
                    wait_steps=wait_steps, sort_by_length=sort_by_length, pad_token_id=pair.pad_token_id,
                    record_logits=True)
    outputs = engine.generate([list(models.prompts()[i]) for i in indices], budgets, pair.eos_token_id)
    for got, logits, i, budget in zip(outputs, engine.last_trace.logits, indices, budgets):
        expected = reference_outputs[i][:budget]
        if pair.eos_token_id in expected:
            expected = expected[: expected.index(pair.eos_token_id) + 1]
        assert got == expected, f"prompt {i}"
        assert float((logits - reference_logits[i][: logits.shape[0]]).abs().max()) < LOGIT_TOLERANCE
    kinds = engine.last_trace.totals()["step_kinds"]
    assert kinds.get("fallback", 0) > 0
    assert any(max(s.pad_lengths) > 0 for s in engine.last_trace.steps if s.kind == "fallback")
