"""hf-continuous: transformers' continuous batching (`generate_batch`, paged cache) as an audit target."""

from __future__ import annotations

import pytest
import torch

import specaudit
from specaudit.engines.models import zoo
from specaudit.engines.adapters.hf_continuous import HFContinuous
from specaudit.engines.reference import greedy_decode


def test_audit_is_token_exact_on_tiny_llama_float64(tmp_path):
    report = specaudit.audit("hf-continuous", pairs=["tiny-llama"], batch_sizes=[4], num_prompts=8,
                             max_new_tokens=16, out=tmp_path)
    (run,) = report.data["runs"]
    assert report.equivalent, report.divergences
    assert run["engine"] == "hf-continuous" and run["exact_matches"] == run["num_prompts"] >= 8


@pytest.fixture(scope="module")
def llama64():
    return zoo.load_pair("tiny-llama", dtype="float64")


@pytest.mark.parametrize("attention", ["sdpa", "paged|eager"])
def test_outputs_logprobs_and_stopping_match_the_reference(llama64, attention):
    pair = llama64
    prompts = [p[:40] for p in zoo.builtin_prompts()[:5]] + [[pair.eos_token_id]]  # ragged, EOS as content
    max_new = 12
    reference = [greedy_decode(pair.target, p, max_new, pair.eos_token_id, record_logits=True) for p in prompts]
    implementation = pair.target.config._attn_implementation
    engine = HFContinuous(pair.target, None, batch_size=2, attention=attention)
    outputs = engine.generate(prompts, max_new, pair.eos_token_id)
    # the paged kernels refuse a plain forward: the model's own attention must be back
    assert pair.target.config._attn_implementation == implementation
    assert outputs == [tokens for tokens, _ in reference]
    for (tokens, logits), logprobs in zip(reference, engine.last_token_logprobs):
        # the log-probability of each chosen token, from float32 casts of the logits
        expected = torch.log_softmax(logits.to(torch.float64), dim=-1)[torch.arange(len(tokens)), tokens]
        assert logprobs is not None and len(logprobs) == len(tokens)
        assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), expected, atol=1e-5)


def test_no_eos_runs_to_max_new_tokens(llama64):
    pair = llama64
    prompts = [[pair.eos_token_id, 65], [66]]
    engine = HFContinuous(pair.target, None, batch_size=2)
    outputs = engine.generate(prompts, 6, None)
    assert outputs == [greedy_decode(pair.target, p, 6, None)[0] for p in prompts]
    assert [len(o) for o in outputs] == [6, 6]


def test_bad_attention_is_refused(llama64):
    with pytest.raises(ValueError, match="attention"):
        HFContinuous(llama64.target, None, attention="flash")
