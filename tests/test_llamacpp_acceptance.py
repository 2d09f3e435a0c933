"""Observed acceptance from a real llama.cpp server (b11549, PyPI `xllamacpp`) against the expected replay.

Two servers of the tiny-llama GGUF target with draft-model speculation (`--spec-type draft-simple`, up to 4
draft tokens, f32 KV cache, flash attention off): `near` with the pair's own draft, `far` with another
checkpoint of the same vocabulary (the table pair's draft, tests/wild_models.py). One audit of both
(`--target`, 8 built-in prompts, 32 new tokens): every output exact, and each run's `acceptance` read from
`/metrics` (drafts, draft tokens, accepted tokens, accepted per position) agreeing with the responses'
`timings.draft_n` / `draft_n_accepted` (no `acceptance_inconsistencies`).

Against the draft model's replay along the reference (equivalence/acceptance/expected.py): llama.cpp stops
drafting when the draft's confidence drops, so it never accepts more than the replay, which always proposes
k; measured 125 of the replay's 134 with the pair's draft, 1 with the other checkpoint. The test asks `near`
for at least 80% of the replay and `far` for less than 10%. The returned tokens also count every decode
step: returned - one per request (the prefill's) - accepted = decode steps >= verify steps with a draft
(measured 102 = the replay's 102 steps, 99 of them with a draft).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import llamacpp_models as lm
import wild_models as wm
from specaudit import cli

K = 4
NEW_TOKENS = 32
PROMPTS = 8
EOS = 258  # the byte tokenizer's


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llama_dir = lm.llama_cpp_dir()
    pair = lm.gguf_pair(llama_dir)
    _target, far_draft = wm.gguf_files(llama_dir)
    far = lm.GGUFPair(pair.folder, pair.hf_target, pair.hf_draft, pair.gguf_target, far_draft)
    folder = tmp_path_factory.mktemp("llamacpp-acceptance")
    args = lm.EXACT_ARGS + ["--spec-type", "draft-simple"]
    near_server = lm.LlamaServer(llama_dir, pair, args, folder / "near.log")
    far_server = lm.LlamaServer(llama_dir, far, args, folder / "far.log")
    with near_server, far_server:
        argv = ["audit", "--engine", f"llamacpp:{near_server.url}", "--engine", f"llamacpp:{far_server.url}",
                "--target", str(pair.hf_target), "--dtype", "float32", "--num-prompts", str(PROMPTS),
                "--no-adversarial", "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "4", "--no-progress",
                "--out", str(folder / "audit")]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = cli.main(argv)
    audit = json.loads((folder / "audit" / "audit.json").read_text())
    runs = {name: next(r for r in audit["runs"] if r["engine"] == f"llamacpp:{server.url}")
            for name, server in (("near", near_server), ("far", far_server))}
    return pair, runs, status, printed.getvalue()


def test_outputs_exact_and_counters_consistent(served):
    _pair, runs, status, printed = served
    assert status == 0, printed
    for name, run in runs.items():
        assert run["exact_matches"] == run["num_prompts"] == PROMPTS, (name, printed)
        observed, speculation = run["acceptance"], run["speculation"]
        assert run["acceptance_inconsistencies"] == [], (name, run["acceptance_inconsistencies"])
        assert observed["verify_steps"] > 0 and observed["drafted_tokens"] > 0, (name, observed)
        per_request = speculation["per_request"]
        assert sum(r["drafted_tokens"] for r in per_request) == observed["drafted_tokens"]
        assert sum(r["accepted_tokens"] for r in per_request) == observed["accepted_tokens"]
        decode_steps = sum(speculation["returned_tokens"]) - PROMPTS - observed["accepted_tokens"]
        assert decode_steps >= observed["verify_steps"], (name, decode_steps, observed)
    near = runs["near"]["acceptance"]
    assert near["accepted_per_position"] is not None and sum(near["accepted_per_position"]) == near["accepted_tokens"]


def test_a_wrong_draft_checkpoint_shows_in_acceptance_alone(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specaudit.equivalence.acceptance.expected import DraftModelProposer, replay
    from specaudit.equivalence.prompts import load_prompts

    pair, runs, _status, _printed = served
    tokenizer = AutoTokenizer.from_pretrained(str(pair.hf_target))
    target = AutoModelForCausalLM.from_pretrained(str(pair.hf_target), dtype=torch.float64).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(pair.hf_draft), dtype=torch.float64).eval()
    prompts = load_prompts("builtin", tokenizer, PROMPTS)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:  # the reference's outputs, which the servers' equal (the test above)
            sequence = list(prompt)
            for _ in range(NEW_TOKENS):
                sequence.append(int(target(torch.tensor([sequence])).logits[0, -1].argmax()))
                if sequence[-1] == EOS:
                    break
            outputs.append(sequence[len(prompt):])
    expected = replay(DraftModelProposer(draft), target, prompts, outputs, K)
    near, far = runs["near"]["acceptance"], runs["far"]["acceptance"]
    assert expected.accepted_tokens > 50, expected
    assert near["accepted_tokens"] >= 0.8 * expected.accepted_tokens, (near, expected)
    assert far["accepted_tokens"] < 0.1 * expected.accepted_tokens, (far, expected)
    assert runs["far"]["exact_matches"] == PROMPTS  # and yet every output is exact
