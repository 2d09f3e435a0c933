"""INPLACE and BATCHED against the reference decoder, in float64: tokens equal, logits within 1e-9.

INPLACE keeps rejected draft slots as masked holes and compacts only past a threshold, so the
sweep runs each pair with the default threshold, with compaction after every step
(`compact_fraction=0`) and with none at all (`compact_fraction=1e9`). Its draft cache must hold
exactly the accepted tokens too: with the model drafter its proposals equal EQSPEC's, step by
step. The Hypothesis cases are in `tests/property/test_inplace_property.py`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specaudit.engines.ops import ragged
from specaudit.engines.batched import BatchedGreedy
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.inplace import InplaceEngine, compact, needs_compaction, windowed_by_column
from specaudit.engines.registry import make_engine
from specaudit.testing import models

MAX_NEW_TOKENS = 16
LOGIT_TOLERANCE = 1e-9
PROMPTS = (0, 3, 5, 8, 11, 14, 17, 20, 23)  # short and long prompts of the built-in set (1 to ~900 tokens)


def _run(engine, name: str) -> tuple[list[list[int]], list[list[int]], float]:
    reference_outputs, reference_logits = models.reference(name)
    prompts = [list(models.prompts()[i]) for i in PROMPTS]
    outputs = engine.generate(prompts, MAX_NEW_TOKENS, None)
    expected = [reference_outputs[i][:MAX_NEW_TOKENS] for i in PROMPTS]
    worst = 0.0
    for got, i in zip(engine.last_trace.logits, PROMPTS):
        worst = max(worst, float((got - reference_logits[i][: got.shape[0]]).abs().max()))
    return outputs, expected, worst


def test_inplace_equals_reference_on_every_pair(pair_name: str) -> None:
    pair = models.pair(pair_name)
    engine = make_engine("inplace", pair.target, pair.draft, batch_size=4, draft_tokens=3,
                         pad_token_id=pair.pad_token_id, record_logits=True)
    outputs, expected, worst = _run(engine, pair_name)
    assert outputs == expected
    assert worst < LOGIT_TOLERANCE


@pytest.mark.parametrize("pair_name", ["tiny-llama", "tiny-opt", "tiny-gemma3", "tiny-qwen3-next", "tiny-lfm2", "tiny-bamba"])
@pytest.mark.parametrize("compact_fraction", [0.0, 1e9], ids=["every-step", "never"])
def test_inplace_compaction_threshold(pair_name: str, compact_fraction: float) -> None:
    pair = models.pair(pair_name)
    engine = InplaceEngine(pair.target, pair.draft, batch_size=5, draft_tokens=4, pad_token_id=pair.pad_token_id,
                           record_logits=True, compact_fraction=compact_fraction)
    outputs, expected, worst = _run(engine, pair_name)
    assert outputs == expected
    assert worst < LOGIT_TOLERANCE
    windowed = windowed_by_column(pair.target) or windowed_by_column(pair.draft)
    if compact_fraction == 0.0:
        assert engine.compactions > 0
    else:  # a sliding window is applied by column: such a model compacts every hole
        assert (engine.compactions > 0) == windowed


@pytest.mark.parametrize("batch_size", [1, 16])
def test_inplace_proposals_equal_eqspec(batch_size: int) -> None:
    """Greedy drafting from a draft cache with holes proposes what EQSPEC's realigned cache does."""
    pair = models.pair("tiny-qwen3")
    prompts = [list(models.prompts()[i]) for i in PROMPTS]
    runs = []
    for engine in (InplaceEngine(pair.target, pair.draft, batch_size=batch_size, draft_tokens=4, record_logits=True),
                   EQSpec(pair.target, pair.draft, batch_size=batch_size, draft_tokens=4, record_logits=True)):
        outputs = engine.generate(prompts, MAX_NEW_TOKENS, None)
        runs.append((outputs, [(s.rows, s.proposed, s.accepted_counts) for s in engine.last_trace.steps if s.kind != "prefill"]))
    assert runs[0] == runs[1]
    assert any(count > 0 for _, _, counts in runs[0][1] for count in counts)


def test_batched_equals_reference_on_every_pair(pair_name: str) -> None:
    pair = models.pair(pair_name)
    engine = BatchedGreedy(pair.target, batch_size=4, pad_token_id=pair.pad_token_id, record_logits=True)
    outputs, expected, worst = _run(engine, pair_name)
    assert outputs == expected
    assert worst < LOGIT_TOLERANCE


def test_batched_stops_each_row_at_eos_and_budget() -> None:
    pair = models.pair("tiny-llama")
    prompts = [list(models.prompts()[i]) for i in PROMPTS]
    reference_outputs, _ = models.reference("tiny-llama")
    eos = reference_outputs[PROMPTS[2]][3]  # a token some row emits early
    outputs = BatchedGreedy(pair.target, batch_size=3).generate(prompts, 7, eos)
    for got, i in zip(outputs, PROMPTS):
        expected = reference_outputs[i][:7]
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert got == expected


def test_compact_right_aligns_the_real_columns_in_order() -> None:
    gen = torch.Generator().manual_seed(3)
    valid = torch.rand(3, 9, generator=gen) < 0.5  # [B, W]
    valid[:, -1] = True
    keys = torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64)  # [B, H, W, D]
    dynamic = DynamicCache(config=models.pair("tiny-llama").target.config)
    dynamic.update(keys.clone(), keys.clone() * 2, 0)
    new_valid = compact(dynamic, valid)
    layer = ragged.cache_layers(dynamic)[0]
    counts = valid.sum(1)
    assert new_valid.shape[1] == int(counts.max())
    for b in range(3):
        real = keys[b][:, valid[b]]  # [H, n, D]
        n = int(counts[b])
        assert torch.equal(layer.keys[b][:, new_valid.shape[1] - n:], real)
        assert torch.equal(layer.values[b][:, new_valid.shape[1] - n:], real * 2)
        assert bool((layer.keys[b][:, : new_valid.shape[1] - n] == 0).all())
        assert new_valid[b].sum() == n and bool(new_valid[b, new_valid.shape[1] - n:].all())
    assert needs_compaction(valid, counts, 0.0) == (valid.shape[1] > int(counts.max()))
    assert not needs_compaction(valid, counts, 1.0)


# INPLACE's own bug classes, planted as line edits of engines/inplace.py (the fault zoo's mechanism).
# Both must be caught. The diagnosis names the position fault; holes made visible (rejected draft
# columns attended to) are not yet modelled by its replays, so that one is only required to be caught.
INPLACE_FAULTS = {
    "holes-visible": ("mask = torch.cat([valid, queries], dim=1).long()  # [B, W + q]",
                      "mask = torch.cat([torch.ones_like(valid), queries], dim=1).long()", None),
    "positions-count-holes": ("positions = ragged.position_ids(cache_lengths, inputs.shape[1])  # [B, q]",
                              "positions = ragged.position_ids(torch.full_like(cache_lengths, valid.shape[1]), "
                              "inputs.shape[1])",
                              "position_ids"),
}


@pytest.mark.parametrize("fault", sorted(INPLACE_FAULTS))
def test_planted_inplace_faults_are_caught(fault: str) -> None:
    from collections import Counter

    from specaudit.equivalence.audit import RunSettings, audit_engine
    from specaudit.testing.faults.mutation import LineChange, mutant_modules

    old, new, expected_class = INPLACE_FAULTS[fault]
    module = mutant_modules(f"inplace_{fault.replace('-', '_')}",
                            (LineChange("specaudit.engines.inplace", old, new),))["specaudit.engines.inplace"]
    pair = models.pair("tiny-llama")
    prompts = [list(p) for p in models.prompts()[:6]]
    engine = module.InplaceEngine(pair.target, pair.draft, batch_size=3, draft_tokens=3,
                                  pad_token_id=pair.pad_token_id, record_logits=True)
    run = audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=10, eos_token_id=pair.eos_token_id, dtype="float64", engine_name=f"inplace-{fault}", batch_size=3))
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert len(structural) >= 3, f"{fault}: the audit found {len(structural)} structural divergences"
    if expected_class is not None:
        classes = Counter(d["diagnosis"]["class"] for d in structural)
        assert classes.most_common(1)[0][0] == expected_class, f"{fault}: diagnosed as {dict(classes)}"


@pytest.mark.parametrize("pair_name", ["tiny-llama", "tiny-gpt2", "tiny-gemma3"])
@pytest.mark.parametrize("batch_size,compact_fraction", [(3, 0.25), (5, 0.0), (4, 1e9)])
def test_inplace_refills_freed_rows_exactly(pair_name: str, batch_size: int, compact_fraction: float) -> None:
    """Per-request budgets make rows end at different steps; each freed row takes the next prompt
    while the others keep decoding, and every prompt still gets exactly its greedy tokens."""
    pair = models.pair(pair_name)
    reference_outputs, reference_logits = models.reference(pair_name)
    indices = list(range(16))
    prompts = [list(models.prompts()[i]) for i in indices]
    budgets = [1 + (7 * i) % 16 for i in indices]  # 1 to 16, scattered
    engine = InplaceEngine(pair.target, pair.draft, batch_size=batch_size, draft_tokens=3,
                           pad_token_id=pair.pad_token_id, record_logits=True, compact_fraction=compact_fraction)
    outputs = engine.generate(prompts, budgets, pair.eos_token_id)
    for got, i, budget in zip(outputs, indices, budgets):
        expected = reference_outputs[i][:budget]
        if pair.eos_token_id in expected:
            expected = expected[: expected.index(pair.eos_token_id) + 1]
        assert got == expected, f"prompt {i}"
    for got, i in zip(engine.last_trace.logits, indices):
        assert float((got - reference_logits[i][: got.shape[0]]).abs().max()) < LOGIT_TOLERANCE
    steps = engine.last_trace.steps
    assert all(len(s.rows) <= batch_size for s in steps)
    # a refill: a step runs rows that a consecutive batching would have put in different batches
    assert any(len({r // batch_size for r in s.rows}) > 1 for s in steps if s.kind != "prefill")
    assert sum(s.kind == "prefill" for s in steps) > -(-len(prompts) // batch_size)


def test_inplace_without_refill_runs_consecutive_batches() -> None:
    pair = models.pair("tiny-llama")
    prompts = [list(models.prompts()[i]) for i in PROMPTS]
    engine = InplaceEngine(pair.target, pair.draft, batch_size=4, draft_tokens=3, pad_token_id=pair.pad_token_id,
                           refill=False)
    outputs = engine.generate(prompts, [3, 9, 5, 16, 2, 11, 7, 4, 13], pair.eos_token_id)
    assert [len(o) for o in outputs] == [3, 9, 5, 16, 2, 11, 7, 4, 13]
    assert all(len({r // 4 for r in s.rows}) == 1 for s in engine.last_trace.steps)
