"""End to end: a hybrid model (LFM2: short convolutions beside attention) served by a real llama.cpp
server with draft-model speculation, audited token-exact.

The tiny LFM2 target and its noisy draft (tests/hybrid_models.py, seeded) are converted to GGUF f32
and served by the server of tests/test_llamacpp_e2e.py (prebuilt by default) with
`--spec-type draft-simple`, up to 4 draft tokens, 4 parallel slots, f32 KV caches and flash
attention off. A recurrent layer's state absorbs rejected draft tokens and must be rolled back, so
this is the case where speculation in a server can break. `specaudit audit --engine llamacpp:URL
--target <LFM2 HF folder> --dtype float32` must find every prompt token-exact but for float32 near-ties (none measured so far), and the server's
counters must show that it drafted, accepted and batched.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import hybrid_models as hm
import llamacpp_models as lm
from near_ties import exact_but_for_near_ties
from specaudit import cli

FAMILY = "lfm2"
NUM_PROMPTS = 8  # built-in prompts; the audit adds its adversarial ones (up to 2100 tokens)
MAX_NEW_TOKENS = 32
BATCH_SIZE = 4


@pytest.fixture(scope="module")
def lfm2():
    llama_dir = lm.llama_cpp_dir()
    return llama_dir, hm.hybrid_pair(llama_dir, FAMILY)


def test_llamacpp_lfm2_speculation_is_token_exact(lfm2, tmp_path):
    llama_dir, pair = lfm2
    out = tmp_path / "audit"
    argv = ["audit", "--engine", "llamacpp:URL", "--target", str(pair.hf_target), "--batch-size", str(BATCH_SIZE),
            "--dtype", "float32", "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--no-progress", "--out", str(out)]
    printed = io.StringIO()
    with lm.LlamaServer(llama_dir, pair, lm.EXACT_ARGS, tmp_path / "server.log") as server:
        argv[2] = f"llamacpp:{server.url}"
        with contextlib.redirect_stdout(printed):
            status = cli.main(argv)
        metrics = server.metrics()
    output = printed.getvalue()
    assert (out / "audit.json").is_file(), f"no audit.json (exit {status}):\n{output}"
    (run,) = json.loads((out / "audit.json").read_text())["runs"]
    assert run.get("error") is None, f"{run['error']}\n{output}"
    assert status == 0, output
    assert run["num_prompts"] > NUM_PROMPTS  # the built-in prompts and the audit's adversarial ones
    exact_but_for_near_ties(run, output)
    assert metrics["spec_decode_num_draft_tokens_total"] > 0, metrics
    assert metrics["spec_decode_num_accepted_tokens_total"] > 0, metrics
    # some drafts were rejected, so the recurrent state had rejected tokens to roll back
    assert metrics["spec_decode_num_accepted_tokens_total"] < metrics["spec_decode_num_draft_tokens_total"], metrics
    assert metrics["n_busy_slots_per_decode"] > 1, metrics
    print(f"{lm.build_info(llama_dir)}; LFM2, f32 caches: {run['exact_matches']}/{run['num_prompts']} exact; "
          f"draft tokens accepted {metrics['spec_decode_num_accepted_tokens_total']:.0f} of "
          f"{metrics['spec_decode_num_draft_tokens_total']:.0f}, "
          f"{metrics['n_busy_slots_per_decode']:.2f} busy slots per decode")
