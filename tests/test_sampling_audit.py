"""The sampled audit on the tiny pair: the correct engines pass, every planted sampling fault is caught
(at the sample size stated here, the same as in reports/sampling/README.md), the seed's promises hold,
greedy through the sampler is greedy, and recordings of sampled outputs are audited like engines."""

from __future__ import annotations


import pytest
import torch

from specaudit import read_report
from specaudit.cli import main
from specaudit.engines.adapters.recorded import write_recording
from specaudit.engines.models.zoo import builtin_prompts, load_pair
from specaudit.engines.reference import greedy_decode
from specaudit.engines.sampling.engine import SampledSpeculative, request_seeds
from specaudit.engines.sampling.process import SamplingParams
from specaudit.engines.registry import make_engine
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.sampling import make_fault_engine

# one prompt (one token: every sample shares the first context), three tokens, k = 2
PARAMS = SamplingParams(temperature=0.7, top_k=8)
NEW_TOKENS, K = 3, 2
# fault -> the sample size that catches it (reports/sampling/README.md has the table)
CAUGHT_AT = {
    "q_from_raw_logits": 600, "draft_draws_from_raw": 300, "residual_not_normalized": 300,
    "residual_not_clipped": 300, "bonus_from_draft": 300, "temperature_on_draft_only": 600,
    "top_k_on_draft_only": 300, "argmax_when_sampling": 300, "uniform_stuck_at_zero": 2000,
}


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny-llama")


def _audit(engine, pair, samples: int, seed: int = 1, **kwargs):
    return sampled_audit(engine, pair.target, builtin_prompts()[:1], PARAMS, samples=samples,
                         max_new_tokens=NEW_TOKENS, eos_token_id=pair.eos_token_id, seed=seed, **kwargs)


def _options(seed: int = 1) -> dict:
    return dict(temperature=PARAMS.temperature, top_k=PARAMS.top_k, top_p=PARAMS.top_p, seed=seed, draft_tokens=K)


@pytest.mark.parametrize("name", ["sampled-spec", "sampled-reference"])
def test_correct_engines_pass_and_keep_the_seed(pair, name: str) -> None:
    engine = make_engine(name, pair.target, pair.draft, sampling=PARAMS, seed=5, draft_tokens=K, batch_size=8)
    report = _audit(engine, pair, 300, seed=5)
    assert report["verdict"] == "no departure found", report["worst_test"]
    assert report["seeds"]["same_seed_same_output"] and report["seeds"]["alone_equals_batch"]
    assert 0 < report["detectable_tv_pooled"] < 0.2  # the power is stated, and it is not vacuous


@pytest.mark.parametrize("name", sorted(CAUGHT_AT))
def test_each_sampling_fault_is_caught(pair, name: str) -> None:
    engine = make_fault_engine(pair.target, pair.draft, fault=name, **_options())
    report = _audit(engine, pair, CAUGHT_AT[name], seed_checks=False)
    assert report["verdict"] == "departure" and report["p_value"] < 0.01
    assert report["finding"]


def test_a_random_stream_shared_across_rows_breaks_the_seed(pair) -> None:
    engine = make_fault_engine(pair.target, pair.draft, fault="shared_stream", **_options())
    seeds = _audit(engine, pair, 40)["seeds"]
    assert seeds["same_seed_same_output"] and not seeds["alone_equals_batch"]


def test_temperature_zero_through_the_sampler_is_greedy(pair) -> None:
    prompts = builtin_prompts()[:3]
    engine = SampledSpeculative(pair.target, pair.draft, temperature=0.0, draft_tokens=3)
    outputs = engine.generate(prompts, 8, pair.eos_token_id)
    assert outputs == [greedy_decode(pair.target, p, 8, pair.eos_token_id)[0] for p in prompts]


def test_a_request_gives_the_same_tokens_alone_and_in_a_batch(pair) -> None:
    prompts = builtin_prompts()[:3]
    engine = SampledSpeculative(pair.target, pair.draft, **_options())
    seeds = request_seeds(9, 3)
    together = engine.generate(prompts, 6, pair.eos_token_id, seeds=seeds)
    assert together == [engine.generate([p], 6, pair.eos_token_id, seeds=[s])[0] for p, s in zip(prompts, seeds)]
    assert together != engine.generate(prompts, 6, pair.eos_token_id, seeds=request_seeds(10, 3))


def _record(engine, pair, path, samples: int) -> None:
    requests = builtin_prompts()[:1] * samples  # one line per sample, the prompt repeated
    write_recording(path, requests, engine.generate(requests, NEW_TOKENS, pair.eos_token_id))


def test_recordings_are_audited_from_the_command_line(pair, tmp_path, capsys) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    _record(SampledSpeculative(pair.target, pair.draft, **_options(seed=2)), pair, good, 300)
    _record(make_fault_engine(pair.target, pair.draft, fault="temperature_on_draft_only", **_options()), pair, bad, 600)
    common = ["audit", "--pair", "tiny-llama", "--temperature", "0.7", "--top-k", "8", "--samples", "300",
              "--num-prompts", "1", "--seed", "2"]
    assert main(common + ["--engine", f"recorded:{good}", "--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--engine", f"recorded:{bad}", "--out", str(tmp_path / "b")]) == 1
    assert read_report(tmp_path / "b").sampled[f"recorded:{bad}"]["verdict"] == "departure"
    assert "departure" in capsys.readouterr().out


def test_bad_sampling_options_are_one_line_usage_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--pair", "tiny-llama", "--engine", "sampled-spec", "--temperature", "-1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:  # no pair: a usage line from the parser, as in every audit
        main(["audit", "--engine", "sampled-spec", "--temperature", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "--pair" in capsys.readouterr().err
    assert main(["audit", "--pair", "tiny-llama", "--engine", "no-such-engine", "--temperature", "1",
                 "--out", str(tmp_path)]) == 2
    assert "'no-such-engine' is no sampled engine" in capsys.readouterr().err
    # a project engine without a sampler is named as such, with the engines that sample
    assert main(["audit", "--pair", "tiny-llama", "--engine", "bsp", "--temperature", "1",
                 "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "'bsp' decodes greedily only" in error and "eqspec" in error and "fixedshape" in error, error
