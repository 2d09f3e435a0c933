"""The sampled audit against live servers (engines/adapters/sampled_servers.py), on fake vLLM servers
that really sample (tests/sampling_server.py): what each dialect is sent, a correct server passing with
its speculation counted, and sampling bugs behind a server caught (a wrong temperature, the bonus token
from the draft, seeds ignored). The real servers' sampled audits are in tests/test_llamacpp_e2e.py and
tests/test_vllm_e2e.py. Cost: 30 to 36 s per 300-sample audit below on the loaded 2-core machine (measured)."""

from __future__ import annotations


import pytest

from fake_server import FakeServer, SpeculationMetrics
from sampling_server import sampled_vllm_answer
from specaudit import read_report
from specaudit.cli import main
from specaudit.engines.adapters.sampled_servers import make_sampled_server, sampled_request, sampling_fields
from specaudit.engines.adapters.servers import LlamaCppEngine, SGLangEngine, TRTLLMEngine, VLLMEngine
from specaudit.engines.models.zoo import load_pair
from specaudit.engines.sampling.process import SamplingParams

PARAMS = SamplingParams(temperature=0.7, top_k=8)
# one prompt of one token (every sample shares the first context), 3 new tokens; the sizes of
# tests/test_sampling_audit.py: 300 samples catch the bonus drawn from the draft at top-k 8
COMMON = ["--pair", "tiny-llama", "--temperature", "0.7", "--top-k", "8", "--num-prompts", "1",
          "--max-new-tokens", "3", "--batch-size", "4", "--seed", "2"]


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny-llama")


def test_each_dialect_is_sent_the_sampling_fields_and_a_seed():
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.8)
    for engine, where in ((VLLMEngine("http://x"), None), (TRTLLMEngine("http://x"), None),
                          (LlamaCppEngine("http://x"), None), (SGLangEngine("http://x"), "sampling_params")):
        body = sampled_request(engine, [1, 2], 3, 258, params, seed=77)
        fields = body[where] if where else body
        assert (fields["temperature"], fields["top_k"], fields["top_p"], fields["min_p"]) == (0.9, 5, 0.8, 0.0)
        assert fields["sampling_seed" if engine.dialect == "sglang" else "seed"] == 77
        assert "logprobs" not in body
    llama = sampled_request(LlamaCppEngine("http://x"), [1], 3, 258, params, seed=None)
    # llama.cpp: temperature before the nucleus (vLLM's order), every other cut off, no seed sent
    assert llama["samplers"] == ["penalties", "top_k", "temperature", "min_p", "top_p"] and "seed" not in llama
    assert (llama["typical_p"], llama["xtc_probability"], llama["mirostat"], llama["n_probs"]) == (1.0, 0.0, 0, 0)
    # a cut that is off is the dialect's own "off"
    off = SamplingParams(temperature=1.0)
    assert sampling_fields("vllm", off, None)["top_k"] == -1 and sampling_fields("llamacpp", off, None)["top_k"] == 0


def _audit(url: str, out, samples: int, *extra: str) -> tuple[int, dict]:
    status = main(["audit", "--engine", f"vllm:{url}", *COMMON, "--samples", str(samples), "--out", str(out), *extra])
    (report,) = read_report(out).sampled.values()
    return status, report


def test_a_correct_sampling_server_passes_and_its_speculation_is_counted(pair, tmp_path):
    metrics = SpeculationMetrics("vllm")
    with FakeServer(sampled_vllm_answer(pair.target, pair.draft), metrics=metrics) as server:
        status, report = _audit(server.url, tmp_path, 300)
    assert status == 0 and report["verdict"] == "no departure found", report["worst_test"]
    assert report["seeds"]["same_seed_same_output"] and report["seeds"]["alone_equals_batch"]
    assert report["speculation"]["drafted_tokens"] > 0 and report["speculation"]["accepted_tokens"] > 0
    assert report["engine"]["seeded_requests"] and report["engine"]["concurrent_requests"] == 4
    seeds = [body["seed"] for _, body in server.requests[:300]]
    assert len(set(seeds)) == 300  # every sample its own seed
    assert server.max_in_flight > 1


@pytest.mark.parametrize("bug, samples", [("temperature_ignored", 300), ("bonus_from_draft", 300)])
def test_a_sampling_bug_behind_a_server_is_caught(pair, tmp_path, bug: str, samples: int):
    with FakeServer(sampled_vllm_answer(pair.target, pair.draft, bug=bug)) as server:
        status, report = _audit(server.url, tmp_path, samples)
    assert status == 1 and report["verdict"] == "departure" and report["p_value"] < 0.01, report["worst_test"]
    assert report["finding"]


def test_a_server_that_ignores_the_seed_breaks_the_seed_check(pair, tmp_path):
    with FakeServer(sampled_vllm_answer(pair.target, pair.draft, bug="seed_ignored")) as server:
        status, report = _audit(server.url, tmp_path, 40)
    assert status == 1 and report["verdict"] == "seed broken"
    assert not report["seeds"]["same_seed_same_output"]


def test_unseeded_requests_send_no_seed(pair):
    with FakeServer(sampled_vllm_answer(pair.target, pair.draft)) as server:
        engine = make_sampled_server(f"vllm:{server.url}", PARAMS, seed=0, batch_size=2, seed_requests=False)
        outputs = engine.generate([[5]] * 4, 2, pair.eos_token_id)
    assert len(outputs) == 4 and all(1 <= len(o) <= 2 for o in outputs)
    assert all("seed" not in body for _, body in server.requests)
