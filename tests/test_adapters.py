"""The audit-target adapters (engines/adapters): contract, and what each shows in float64.

Measured on the built-in pairs, float64 CPU (see each test):
- hf-batched and hf-assisted are token-exact. Their recorded logits differ from the reference by
  float32 rounding only, because `generate` casts the model's logits to float32 before choosing;
  the logits the model computed match the reference to ~1e-14.
- bsp is exact on tiny-opt (OPT derives positions from the attention mask) and wrong on every
  other pair, at batch size 1 too: positions keep counting masked (rejected) columns.
- dsd is wrong at every batch size: it emits the first rejected draft token, so its output is the
  draft model's own greedy decoding. With the target's token emitted instead
  (`take_target_token=True`) it is exact at batch size 1 and wrong at batch size 4, where padded
  rows attend to padding and rows' caches are trimmed to the batch's smallest acceptance.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specaudit.engines.ops import layout
from specaudit.engines.models import zoo
from specaudit.engines.adapters.bsp import BSPEngine
from specaudit.engines.adapters.dsd import DSDEngine
from specaudit.engines.adapters.hf_assisted import HFAssisted
from specaudit.engines.adapters.hf_batched import HFBatched
from specaudit.engines.reference import ReferenceDecoder
from specaudit.engines.registry import make_engine
from specaudit.testing import models

PROMPT_INDICES = (0, 3, 6, 12)  # 1, 4, 14 and 94 bytes: padding from 0 to 93 columns
MAX_NEW = 12
FLOAT32_EPS = 2.0**-23


def prompts() -> list[list[int]]:
    return [list(models.prompts()[i]) for i in PROMPT_INDICES]


@functools.lru_cache(maxsize=None)
def reference(pair_name: str, eos: int | None = None, max_new: int = MAX_NEW):
    """Reference outputs and logits on `prompts()`."""
    decoder = ReferenceDecoder(models.pair(pair_name).target, record_logits=True)
    outputs = decoder.generate(prompts(), max_new, eos)
    return outputs, decoder.last_trace.logits


@functools.lru_cache(maxsize=None)
def draft_greedy(pair_name: str) -> list[list[int]]:
    """The draft model's own greedy outputs on `prompts()`."""
    return ReferenceDecoder(models.pair(pair_name).draft).generate(prompts(), MAX_NEW, None)


def draft_ever_rejected(pair_name: str) -> bool:
    """Whether greedy speculation on `prompts()` meets a rejection: the draft's greedy output
    differs from the target's. Defects that act only after a rejection need one to show."""
    return draft_greedy(pair_name) != reference(pair_name)[0]


def build(cls, pair_name: str, **options):
    pair = models.pair(pair_name)
    return cls(pair.target, pair.draft, pad_token_id=pair.pad_token_id, **options)


def logit_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """Per prompt, the largest logit difference over the positions both have."""
    errors = []
    for a, b in zip(got, want):
        n = min(a.shape[0], b.shape[0])
        errors.append(float((a[:n] - b[:n]).abs().max()))
    return errors


def first_divergence(out: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))


def check_contract(outputs: list[list[int]], n_prompts: int, max_new: int, eos: int | None) -> None:
    assert len(outputs) == n_prompts
    for out in outputs:
        assert 1 <= len(out) <= max_new
        if eos is not None and eos in out:
            assert out.index(eos) == len(out) - 1, "tokens after EOS"
        else:
            assert len(out) == max_new, "stopped early without EOS"


def check_trace(engine, outputs: list[list[int]]) -> None:
    emitted = [0] * len(outputs)
    for step in engine.last_trace.steps:
        for row, n in zip(step.rows, step.emitted_counts):
            emitted[row] += n
    assert emitted == [len(o) for o in outputs]


def eos_from_reference(pair_name: str) -> int:
    """A token the reference emits mid-way through the first prompt: used as the EOS id."""
    outputs, _ = reference(pair_name)
    return outputs[0][4]


# --- Hugging Face generate: token-exact in float64 -------------------------------------------------


@pytest.mark.parametrize("cls,batch_size", [(HFBatched, 4), (HFAssisted, 1)], ids=["hf-batched", "hf-assisted"])
def test_hf_adapters_are_token_exact_in_float64(pair_name: str, cls, batch_size: int) -> None:
    if cls is HFAssisted and "recurrent" in layout.attention_layer_kinds(models.pair(pair_name).target):
        with pytest.raises(layout.UnsupportedModel, match="hf-assisted"):  # transformers refuses stateful models
            build(cls, pair_name, batch_size=batch_size)
        return
    ref, ref_logits = reference(pair_name)
    engine = build(cls, pair_name, batch_size=batch_size, record_logits=True)
    out = engine.generate(prompts(), MAX_NEW, None)
    check_contract(out, len(PROMPT_INDICES), MAX_NEW, None)
    check_trace(engine, out)
    assert out == ref
    # generate chooses from float32 casts of the model's logits: only that rounding separates them
    for got, want in zip(engine.last_generate_logits, ref_logits):
        assert got.dtype == torch.float32
        assert torch.all((got.double() - want).abs() <= FLOAT32_EPS * want.abs() + 1e-30)
    # what the model computed, batched (left padding, generate's own position ids and masks), is exact
    assert max(logit_error(engine.last_trace.logits, ref_logits)) < 1e-12


@pytest.mark.parametrize("cls", [HFBatched, HFAssisted], ids=["hf-batched", "hf-assisted"])
def test_hf_adapters_stop_at_eos_and_max_new_tokens(cls) -> None:
    pair_name = "tiny-llama"
    eos = eos_from_reference(pair_name)
    ref, _ = reference(pair_name, eos)
    assert ref[0][-1] == eos and len(ref[0]) <= 5
    engine = build(cls, pair_name, batch_size=3)
    out = engine.generate(prompts(), MAX_NEW, eos)
    check_contract(out, len(PROMPT_INDICES), MAX_NEW, eos)
    assert out == ref
    assert engine.generate(prompts(), 1, eos) == [r[:1] for r in ref]
    assert engine.generate(prompts(), 0, eos) == [[] for _ in PROMPT_INDICES]


def test_hf_adapters_leave_generation_configs_as_they_were() -> None:
    pair = models.pair("tiny-gpt2")
    before = (pair.target.generation_config.to_dict(), pair.draft.generation_config.to_dict())
    HFAssisted(pair.target, pair.draft, draft_tokens=2).generate(prompts()[:1], 3, None)
    HFBatched(pair.target, pair.draft).generate(prompts()[:2], 3, None)
    assert (pair.target.generation_config.to_dict(), pair.draft.generation_config.to_dict()) == before


# --- BSP: positions counted over masked columns -----------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 4])
def test_bsp_diverges_on_position_counting_pairs(batch_size: int) -> None:
    for pair_name in ("tiny-gpt2", "tiny-llama"):
        ref, ref_logits = reference(pair_name)
        engine = build(BSPEngine, pair_name, batch_size=batch_size, record_logits=True)
        out = engine.generate(prompts(), MAX_NEW, None)
        check_contract(out, len(PROMPT_INDICES), MAX_NEW, None)
        check_trace(engine, out)
        if batch_size == 1 and not draft_ever_rejected(pair_name):
            continue  # one row, no padding: positions drift only after a rejection
        assert out != ref, f"bsp matched the reference on {pair_name} at batch size {batch_size}"
        assert max(logit_error(engine.last_trace.logits, ref_logits)) > 1e-9


@pytest.mark.parametrize("batch_size", [1, 4])
def test_bsp_is_exact_where_positions_come_from_the_mask(batch_size: int) -> None:
    # OPT derives position ids from the attention mask, so masked columns are not counted there
    ref, ref_logits = reference("tiny-opt")
    engine = build(BSPEngine, "tiny-opt", batch_size=batch_size, record_logits=True)
    out = engine.generate(prompts(), MAX_NEW, None)
    assert out == ref
    assert max(logit_error(engine.last_trace.logits, ref_logits)) < 1e-12


def test_bsp_stops_at_eos() -> None:
    engine = build(BSPEngine, "tiny-gpt2", batch_size=4)
    free = engine.generate(prompts(), MAX_NEW, None)
    eos = free[0][3]
    out = engine.generate(prompts(), MAX_NEW, eos)
    check_contract(out, len(PROMPT_INDICES), MAX_NEW, eos)
    # finished rows keep running in the batch, so the computation is the same: outputs are cut
    assert out == [f[: f.index(eos) + 1] if eos in f else f for f in free]
    check_trace(engine, out)


# --- DSD: rejected draft token accepted, padding attended, cache trimmed to the minimum -------------


def test_dsd_at_batch_size_1_diverges_only_through_the_rejected_draft_token(pair_name: str) -> None:
    ref, ref_logits = reference(pair_name)
    engine = build(DSDEngine, pair_name, batch_size=1, record_logits=True)
    out = engine.generate(prompts(), MAX_NEW, None)
    check_contract(out, len(PROMPT_INDICES), MAX_NEW, None)
    check_trace(engine, out)
    assert (out != ref) == draft_ever_rejected(pair_name)
    if "recurrent" in layout.attention_layer_kinds(models.pair(pair_name).target):
        return  # DSD trims caches by columns: a recurrent state keeps its rejected tokens, so logits drift too
    for o, r, got, want in zip(out, ref, engine.last_trace.logits, ref_logits):
        i = first_divergence(o, r)
        if i == len(r):
            continue
        # exact up to and including the divergence, where the target chose the reference token
        # and DSD emitted the draft's instead
        assert float((got[: i + 1] - want[: i + 1]).abs().max()) < 1e-12
        assert int(got[i].argmax()) == r[i] != o[i]


def test_dsd_output_is_the_draft_models_own_greedy_output() -> None:
    # every emitted token is a draft token, and the draft decodes greedily from its own tokens
    for pair_name in ("tiny-gpt2", "tiny-llama"):
        out = build(DSDEngine, pair_name, batch_size=4).generate(prompts(), MAX_NEW, None)
        assert out == draft_greedy(pair_name)


def test_dsd_with_the_target_token_is_exact_at_batch_size_1() -> None:
    # the batching defects alone (padding attended, cache trimmed to the minimum) are harmless
    # without padding and with one row
    for pair_name in ("tiny-gpt2", "tiny-qwen3"):
        ref, ref_logits = reference(pair_name)
        engine = build(DSDEngine, pair_name, batch_size=1, take_target_token=True, record_logits=True)
        assert engine.generate(prompts(), MAX_NEW, None) == ref
        assert max(logit_error(engine.last_trace.logits, ref_logits)) < 1e-12


def test_dsd_with_the_target_token_diverges_at_batch_size_4() -> None:
    for pair_name in ("tiny-gpt2", "tiny-llama"):
        ref, ref_logits = reference(pair_name)
        for reuse_cache in (True, False):
            engine = build(DSDEngine, pair_name, batch_size=4, take_target_token=True, reuse_cache=reuse_cache,
                           record_logits=True)
            out = engine.generate(prompts(), MAX_NEW, None)
            check_contract(out, len(PROMPT_INDICES), MAX_NEW, None)
            check_trace(engine, out)
            assert out != ref
            assert max(logit_error(engine.last_trace.logits, ref_logits)) > 1e-9


def test_dsd_cache_trim_changes_the_target_logits_only_in_a_batch() -> None:
    def run(batch_size: int, reuse_cache: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        engine = build(DSDEngine, "tiny-gpt2", batch_size=batch_size, reuse_cache=reuse_cache,
                       take_target_token=True, record_logits=True)
        return engine.generate(prompts(), MAX_NEW, None), engine.last_trace.logits

    (out_1, logits_1), (out_1_full, logits_1_full) = run(1, True), run(1, False)
    assert out_1 == out_1_full and max(logit_error(logits_1, logits_1_full)) < 1e-12
    (_, logits_4), (_, logits_4_full) = run(4, True), run(4, False)
    assert max(logit_error(logits_4, logits_4_full)) > 1e-6


def test_dsd_stops_at_eos() -> None:
    engine = build(DSDEngine, "tiny-gpt2", batch_size=4)
    eos = engine.generate(prompts(), MAX_NEW, None)[0][3]
    out = engine.generate(prompts(), MAX_NEW, eos)
    check_contract(out, len(PROMPT_INDICES), MAX_NEW, eos)
    check_trace(engine, out)
    assert engine.generate(prompts(), 0, eos) == [[] for _ in PROMPT_INDICES]


# --- registry -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf-assisted", "hf-batched", "bsp", "dsd"])
def test_adapters_build_through_the_registry(name: str) -> None:
    pair = models.pair("tiny-gpt2")
    engine = make_engine(name, pair.target, pair.draft, batch_size=2, draft_tokens=3,
                         pad_token_id=zoo.ByteTokenizer.pad_token_id, record_logits=False)
    out = engine.generate(prompts()[:2], 3, None)
    check_contract(out, 2, 3, None)
