"""End to end against a real llama.cpp server: by default the one prebuilt in PyPI's `xllamacpp`
(llama.cpp b11549); with SPECAUDIT_LLAMACPP=source, `llama-server` built here from the llama-cpp-python
0.3.36 sdist (llama.cpp 0c1e570).

The server serves a tiny GGUF target and draft converted from the built-in tiny-llama pair with
llama.cpp's own converter (tests/llamacpp_models.py), with draft-model speculation on
(`--spec-type draft-simple`, up to 4 draft tokens, 4 parallel slots), and `specaudit audit
--engine llamacpp:URL --target <the HF target folder>` audits it against HF float32 greedy decoding
of the same weights:

- with an f32 KV cache and flash attention off, every prompt must be token-exact but for float32 near-ties
  (exit 0; which near-tie flips, if any, is the two CPUs' kernels': none on the machines measured so far);
- with llama.cpp's defaults (f16 KV cache, flash attention auto), the audit rules every divergence
  against the declared f16 noise band: each must be `numerical`, with its evidence (the reference's
  top-2 margin, the engine token's gap, the band, and the float64 replay at the split).

Both check in the server's own counters that speculation ran (draft tokens accepted > 0) and that
the 4 concurrent requests were batched (more than one busy slot per decode on average).

Sampled (`specaudit audit --temperature 0.7 --top-k 8 --engine llamacpp:URL`): llama.cpp's speculative
mode with sampling, each request seeded, its tokens tested against the float64 target by teacher
forcing (equivalence/sampling/): no departure, drafts accepted, the same seed the same tokens.

The first run fetches the server and the converter (scripts/llamacpp.sh; test.sh runs it before
pytest starts): about 4 minutes for the prebuilt server, 7 to 26 minutes more to compile from
source. Later runs take the cached server and models.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import llamacpp_models as lm
from specaudit import read_report
from specaudit import cli


NUM_PROMPTS = 8  # built-in prompts; the audit adds its adversarial ones (up to 2100 tokens)
MAX_NEW_TOKENS = 32
BATCH_SIZE = 4  # concurrent requests, one per server slot (-np 4)


@pytest.fixture(scope="module")
def llama():
    llama_dir = lm.llama_cpp_dir()
    return llama_dir, lm.gguf_pair(llama_dir)


def _audit(url: str, target: Path, out: Path, *extra: str) -> tuple[int, dict, str]:
    """`specaudit audit --engine llamacpp:URL --target ...`, in this process (torch is loaded once)."""
    argv = ["audit", "--engine", f"llamacpp:{url}", "--target", str(target), "--batch-size", str(BATCH_SIZE),
            "--dtype", "float32", "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--no-progress", "--out", str(out), *extra]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(argv)
    audit_path = out / "audit.json"
    assert audit_path.is_file(), f"no audit.json (exit {status}):\n{printed.getvalue()}"
    return status, json.loads(audit_path.read_text()), printed.getvalue()


def _check_speculation_and_batching(server: lm.LlamaServer) -> dict[str, float]:
    metrics = server.metrics()
    assert metrics["spec_decode_num_draft_tokens_total"] > 0, metrics
    assert metrics["spec_decode_num_accepted_tokens_total"] > 0, metrics
    assert metrics["n_busy_slots_per_decode"] > 1, metrics
    return metrics


def _drafts(metrics: dict[str, float]) -> str:
    return (f"draft tokens accepted {metrics['spec_decode_num_accepted_tokens_total']:.0f} of "
            f"{metrics['spec_decode_num_draft_tokens_total']:.0f}, "
            f"{metrics['n_busy_slots_per_decode']:.2f} busy slots per decode")


def _one_run(audit: dict, output: str) -> dict:
    (run,) = audit["runs"]
    assert run.get("error") is None, f"{run['error']}\n{output}"
    assert run["num_prompts"] >= NUM_PROMPTS  # the built-in prompts and the audit's adversarial ones
    return run


def test_llamacpp_f32_cache_is_token_exact(llama, tmp_path):
    llama_dir, models = llama
    with lm.LlamaServer(llama_dir, models, lm.EXACT_ARGS, tmp_path / "server.log") as server:
        status, audit, output = _audit(server.url, models.hf_target, tmp_path / "audit")
        metrics = _check_speculation_and_batching(server)
    run = _one_run(audit, output)
    assert status == 0, output
    _only_near_ties(run, output)
    print(f"{lm.build_info(llama_dir)}; f32 cache, flash attention off: {run['exact_matches']}/{run['num_prompts']} exact; {_drafts(metrics)}")


def test_llamacpp_defaults_diverge_only_numerically(llama, tmp_path):
    llama_dir, models = llama
    with lm.LlamaServer(llama_dir, models, [], tmp_path / "server.log") as server:
        status, audit, output = _audit(server.url, models.hf_target, tmp_path / "audit", "--engine-dtype", "float16")
        metrics = _check_speculation_and_batching(server)
    run = _one_run(audit, output)
    assert status == 0, output
    assert run["noise_band"]["source"] == "declared-dtype" and run["noise_band"]["dtype"] == "float16"
    _only_near_ties(run, output)
    for divergence in run["divergences"]:
        assert divergence["evidence"]["noise_band_source"] == "declared-dtype", divergence
    print(f"{lm.build_info(llama_dir)}; defaults (f16 cache, flash attention auto): {run['exact_matches']}/{run['num_prompts']} exact, "
          f"{len(run['divergences'])} divergence(s), all numerical; margins "
          f"{sorted(round(d['evidence']['reference_margin'], 4) for d in run['divergences'])}; {_drafts(metrics)}")


def _only_near_ties(run: dict, output: str) -> None:
    """Every prompt exact but for numerical flips at near-ties, each with its evidence: the reference's top-2
    margin and the engine token's gap within the band, and the float64 replay seeing the same near-tie."""
    assert run["exact_matches"] + len({d["prompt_index"] for d in run["divergences"]}) == run["num_prompts"], output
    for divergence in run["divergences"]:
        assert divergence["kind"] == "numerical", divergence
        evidence = divergence["evidence"]
        assert 0 <= evidence["reference_margin"] <= evidence["noise_band"], divergence
        assert 0 <= evidence["engine_token_gap"] <= evidence["noise_band"], divergence
        # the float64 replay of the target on the common prefix sees the same near-tie
        assert 0 <= evidence["replay_float64_margin"] <= evidence["noise_band"], divergence
        assert {token for token, _ in evidence["replay_float64_top2"]} == {
            divergence["reference_token"], divergence["engine_token"]}, divergence


SAMPLED_PROMPT = list(b"the cat sat on the mat and the dog sat on the log; the cat sat on the")


def test_llamacpp_sampled_speculation_passes_the_sampled_audit(llama, tmp_path):
    """300 samples of one prompt, 6 new tokens each, 4 requests in flight (about 15 s of requests and
    10 s of teacher forcing on a quiet core); reports/sampling/README.md has 2000-sample runs."""
    llama_dir, models = llama
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": SAMPLED_PROMPT}) + "\n")
    with lm.LlamaServer(llama_dir, models, lm.EXACT_ARGS, tmp_path / "server.log") as server:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = cli.main(["audit", "--engine", f"llamacpp:{server.url}", "--target", str(models.hf_target),
                               "--prompts", str(prompts), "--num-prompts", "1", "--temperature", "0.7", "--top-k", "8",
                               "--samples", "300", "--max-new-tokens", "6", "--batch-size", str(BATCH_SIZE),
                               "--seed", "5", "--out", str(tmp_path / "audit")])
    (report,) = read_report(tmp_path / "audit").sampled.values()
    print(f"{lm.build_info(llama_dir)}; {printed.getvalue()}")
    assert status == 0 and report["verdict"] == "no departure found", printed.getvalue()
    assert report["impossible_count"] == 0  # nothing outside the top-k: the cut and its order reached the server
    assert report["speculation"]["drafted_tokens"] > 0 and report["speculation"]["accepted_tokens"] > 0, report
    assert report["seeds"]["same_seed_same_output"], report["seeds"]
