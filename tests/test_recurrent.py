"""Recurrent state in the batched engines (`engines/ops/recurrent.py`), on the built-in hybrid pairs.

- padding never enters a state: after a batched prefill of prompts of different lengths, each
  row's states equal those of its prompt prefilled alone (the engines prefill in equal-length
  groups; measured: a left-padded prefill also passes on these three families, because transformers
  zeroes padded hidden states before the recurrent layers, so this guards the property, not the grouping);
- rollback: after a pass over [pending, d1, d2] and `commit(accepted)`, each row's states equal
  those of feeding only its pending and accepted tokens, and rows never share a state;
- the reference decoder agrees with `model.generate` (greedy, float64);
- rows that draft fewer tokens than others, or none (a scripted drafter, prompt lookup): their pad
  slots never reach a state, and the engines stay exact (EQSPEC, EXSPEC, INPLACE);
- the stale-state fault is caught from steps with zero drafts alone;
"""

from __future__ import annotations

import pytest
import torch

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged, recurrent
from specaudit.engines.drafters import NO_DRAFT, PromptLookupDrafter
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.exspec import EXSpec
from specaudit.engines.inplace import InplaceEngine
from specaudit.engines.reference import greedy_decode
from specaudit.testing.faults import StateStaleAfterZeroDraftStep
from specaudit.testing.faults.hunt import audit_case
from specaudit.testing.models import pair
from specaudit.testing.properties import check_equivalence, check_scripted_acceptance
from specaudit.testing.strategies import NO_DRAFTS, AcceptanceSchedule, DecodingCase, Prompt

HYBRID = ["tiny-qwen3-next", "tiny-lfm2", "tiny-bamba"]
PROMPTS = [[5, 9, 13], [40, 41, 42, 43, 44, 45, 46], [7], [100, 3, 100, 3, 100]]


def _states(cache) -> list[torch.Tensor]:
    return [t for t in recurrent.snapshot(cache) if t is not None]


def _alone(model, tokens: list[int]):
    ids = torch.tensor([tokens])
    cache, _ = batch_ops.prefill(model, ids, torch.tensor([len(tokens)]))
    return cache


@pytest.mark.parametrize("name", HYBRID)
def test_padded_rows_hold_their_unpadded_state(name: str) -> None:
    model = pair(name).target
    tokens, lengths = ragged.left_pad(PROMPTS, pad_id=256)
    cache, _ = batch_ops.prefill(model, tokens, lengths)
    assert recurrent.tracks_states(cache) and _states(cache)
    for b, prompt in enumerate(PROMPTS):
        for batched, alone in zip(_states(cache), _states(_alone(model, prompt))):
            assert torch.allclose(batched[b], alone[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", HYBRID)
def test_commit_rolls_each_row_back_to_its_accepted_tokens(name: str) -> None:
    model = pair(name).target
    prompts = [PROMPTS[0], PROMPTS[3]]  # [B=2], different lengths
    fed = [[60, 61, 62], [70, 71, 72]]  # pending token and two draft tokens per row
    accepted = torch.tensor([0, 2])  # row 0 keeps its pending token only, row 1 all three
    tokens, lengths = ragged.left_pad(prompts, pad_id=256)
    cache, _ = batch_ops.prefill(model, tokens, lengths)
    batch_ops.forward(model, cache, torch.tensor(fed), lengths)  # per-position states kept
    assert len(cache.history) == 3
    recurrent.commit(cache, accepted)
    assert cache.history == []
    for b, prompt in enumerate(prompts):
        expected = _alone(model, prompt + fed[b][: int(accepted[b]) + 1])
        for got, want in zip(_states(cache), _states(expected)):
            assert torch.allclose(got[b], want[0], rtol=0, atol=1e-12)
    different = [not torch.equal(t[0], t[1]) for t in _states(cache)]
    assert all(different), "two rows hold the same state"


@pytest.mark.parametrize("name", HYBRID)
def test_reference_matches_generate_in_float64(name: str) -> None:
    model = pair(name).target
    for prompt in PROMPTS:
        ours, _ = greedy_decode(model, prompt, 12, None)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=256)
        assert out[0, len(prompt):].tolist() == ours


@pytest.mark.parametrize("name", HYBRID)
def test_a_row_padded_after_its_drafts_keeps_its_state(name: str) -> None:
    """A row that drafted fewer tokens than the step's longest proposal is fed pad ids after its own
    tokens; its states, live and per position, stay those of its real tokens, and a commit with
    nothing to undo keeps the live states."""
    model = pair(name).target
    prompts = [PROMPTS[0], PROMPTS[3]]
    fed = [[60, 61, 62], [70, 256, 256]]  # row 1 drafted nothing: its pending token, then pad ids
    real = torch.tensor([3, 1])
    tokens, lengths = ragged.left_pad(prompts, pad_id=256)
    cache, _ = batch_ops.prefill(model, tokens, lengths)
    batch_ops.forward(model, cache, torch.tensor(fed), lengths, real)
    assert cache.fed.tolist() == [3, 1]
    for position, entry in enumerate(cache.history):  # row 1 after its pending token at every position
        for got, want in zip([t for t in entry if t is not None], _states(_alone(model, prompts[1] + fed[1][:1]))):
            assert torch.allclose(got[1], want[0], rtol=0, atol=1e-12), position
    recurrent.commit(cache, torch.tensor([2, 0]))  # row 0 accepted both drafts, row 1 had none: nothing to undo
    assert cache.history == [] and cache.fed is None
    for b, prompt in enumerate(prompts):
        expected = _alone(model, prompt + fed[b][: int(real[b])])
        for got, want in zip(_states(cache), _states(expected)):
            assert torch.allclose(got[b], want[0], rtol=0, atol=1e-12)


ZERO_DRAFT_PROMPTS = (Prompt((5, 9, 13), "synthetic"), Prompt((40, 41, 42, 43, 44, 45, 46), "synthetic"),
                      Prompt((7,), "synthetic"), Prompt((100, 3, 100, 3, 100), "synthetic"))


@pytest.mark.parametrize("engine", [EQSpec, EXSpec, InplaceEngine], ids=["eqspec", "exspec", "inplace"])
@pytest.mark.parametrize("name", [*HYBRID, "tiny-llama"])
def test_steps_where_rows_draft_nothing_are_exact(name: str, engine) -> None:
    """Rows with no draft beside rows with k (the verify pass pads them), steps where no row drafts
    (a one-token pass), full acceptance beside them (nothing to roll back): token- and logit-exact."""
    schedule = AcceptanceSchedule(NO_DRAFTS, ((NO_DRAFT, 3, 1), (3, NO_DRAFT), (NO_DRAFT,), (0, NO_DRAFT, 3)))
    case = DecodingCase(pair=name, prompts=ZERO_DRAFT_PROMPTS, batch_size=3, draft_tokens=3, max_new_tokens=10,
                        schedule=schedule)
    report = check_equivalence(engine, case, drafter="scripted")
    assert report.max_logit_error is not None and report.max_logit_error < 1e-9
    check_scripted_acceptance(case, report)


@pytest.mark.parametrize("engine", [EQSpec, EXSpec], ids=["eqspec", "exspec"])
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-llama"])
def test_prompt_lookup_drafts_nothing_for_some_rows_and_stays_exact(name: str, engine) -> None:
    pair_ = pair(name)
    # half the byte values in one prompt: a new token often occurred earlier in its row, often not
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9], list(range(0, 256, 2)), [0]]
    reference = [greedy_decode(pair_.target, p, 12, None)[0] for p in prompts]
    run = engine(pair_.target, None, batch_size=4, draft_tokens=3, drafter="prompt-lookup",
                 pad_token_id=pair_.pad_token_id, record_logits=True)
    assert run.generate(prompts, 12, None) == reference
    drafted = [c for step in run.last_trace.steps if step.kind != "prefill" for c in step.drafted_counts]
    assert 0 in drafted and any(c > 0 for c in drafted), drafted
    if name == "tiny-llama":  # its outputs repeat themselves: some lookups are right
        assert any(sum(step.accepted_counts) for step in run.last_trace.steps), "no lookup accepted"


def test_prompt_lookup_finds_the_latest_earlier_ngram() -> None:
    lookup = PromptLookupDrafter(max_ngram=2).lookup
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2], 3) == [4, 1, 2]  # the latest earlier "1 2" is followed by 4
    assert lookup([1, 2, 3, 9], 3) == []  # "3 9" and "9" never occurred earlier
    assert lookup([7, 7], 4) == [7]  # what follows is cut at the row's end
    with pytest.raises(ValueError):
        InplaceEngine(pair("tiny-llama").target, None, drafter="prompt-lookup")


def test_stale_state_fault_is_caught_through_zero_draft_steps_alone() -> None:
    """The stale-state fault with no step of full acceptance: only the steps where no row drafted
    leave nothing to roll back, and the fault is caught and diagnosed `recurrent_state` from them."""
    schedule = AcceptanceSchedule(NO_DRAFTS, ((NO_DRAFT, 0),))
    case = DecodingCase(pair="tiny-lfm2", prompts=ZERO_DRAFT_PROMPTS[:1], batch_size=1, draft_tokens=2,
                        max_new_tokens=8, schedule=schedule)
    check_equivalence(EQSpec, case, drafter="scripted")  # the correct engine
    with pytest.raises(AssertionError) as caught:
        check_equivalence(StateStaleAfterZeroDraftStep, case, drafter="scripted")
    assert getattr(caught.value, "through", None) == "tokens"
    divergences = audit_case(StateStaleAfterZeroDraftStep, case)
    assert divergences and {d["diagnosis"]["class"] for d in divergences} == {"recurrent_state"}


@pytest.mark.precision  # torch's kernel is the other side: it rounds as the chosen CPU kernels do
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_convolutions_give_torch_cpu_kernel_values_bit_for_bit(dtype: torch.dtype) -> None:
    """Below float64 on the CPU the depthwise convolutions are explicit sums in float32 rounded once
    (`float64_recurrent.depthwise_conv1d`, 1000x faster); they must be the values torch's kernel gives."""
    from specaudit.engines.models.float64_recurrent import depthwise_conv1d

    generator = torch.Generator().manual_seed(0)
    for channels, length, kernel, padding in [(80, 12, 4, 3), (32, 4, 4, 0), (48, 7, 3, 2)]:
        x = torch.randn(3, channels, length, generator=generator).to(dtype)
        weight = torch.randn(channels, 1, kernel, generator=generator).to(dtype)
        bias = torch.randn(channels, generator=generator).to(dtype)
        for b in (bias, None):
            expected = torch.nn.functional.conv1d(x, weight, b, 1, padding, 1, channels)
            assert torch.equal(depthwise_conv1d(x, weight, b, 1, padding, 1, channels), expected)


@pytest.mark.precision
def test_a_hybrid_pair_in_bfloat16_on_the_cpu_says_its_convolutions_are_switched() -> None:
    bf16 = pair("tiny-lfm2", "bfloat16")
    assert "cpu_switches" in bf16.info and "Conv1d" in bf16.info["cpu_switches"]["target"][0]
