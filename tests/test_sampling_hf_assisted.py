"""transformers' assisted generation sampled (`hf-assisted` in the sampled audit,
engines/adapters/hf_assisted_sampled.py) on the installed transformers and the tiny pair: it passes,
its candidates were verified (speculation counted), its seed gives the same tokens, and it is sent the
request's sampling and nothing else. reports/sampling/README.md has the figures at 2000 samples.
Cost: 300 samples, 35 s on the loaded 2-core machine (measured)."""

from __future__ import annotations


import pytest

from specaudit import read_report
from specaudit.cli import main
from specaudit.engines.adapters.hf_assisted_sampled import HFAssistedSampled
from specaudit.engines.models.zoo import builtin_prompts, load_pair


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny-llama")


def test_hf_assisted_sampled_passes_the_sampled_audit_and_speculated(tmp_path):
    status = main(["audit", "--engine", "hf-assisted", "--pair", "tiny-llama", "--temperature", "0.7", "--top-k", "8",
                   "--samples", "300", "--num-prompts", "1", "--max-new-tokens", "3", "--draft-tokens", "2",
                   "--seed", "4", "--out", str(tmp_path)])
    report = read_report(tmp_path).sampled["hf-assisted"]
    assert status == 0 and report["verdict"] == "no departure found", report["worst_test"]
    assert report["impossible_count"] == 0  # nothing outside the top-k: the cut reached transformers
    speculation = report["speculation"]
    assert speculation["drafted_tokens"] > 0 and speculation["accepted_tokens"] > 0, speculation
    assert report["seeds"]["same_seed_same_output"] and report["seeds"]["alone_equals_batch"]


def test_hf_assisted_sampled_is_sent_only_the_request_sampling(pair):
    engine = HFAssistedSampled(pair.target, pair.draft, temperature=0.5, top_k=0, top_p=0.9, draft_tokens=2)
    options = engine.sampling_options()
    # top_k 0 is off (transformers' own default would cut at 50); no other processor
    assert (options["do_sample"], options["temperature"], options["top_k"], options["top_p"]) == (True, 0.5, 0, 0.9)
    assert options["min_p"] is None and options["typical_p"] == 1.0 and options["repetition_penalty"] == 1.0
    prompts = builtin_prompts()[:2]
    first = engine.generate(prompts, 4, pair.eos_token_id, seeds=[1, 2])
    assert first == engine.generate(prompts, 4, pair.eos_token_id, seeds=[1, 2])
    with pytest.raises(ValueError, match="temperature"):
        HFAssistedSampled(pair.target, pair.draft, temperature=0.0)
