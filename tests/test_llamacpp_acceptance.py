"""Observed acceptance from a real llama.cpp server (b11549, PyPI `xllamacpp`) against the expected replay.

Two servers of the tiny-llama GGUF target with draft-model speculation (`--spec-type draft-simple`, 4 draft
tokens per step: `--spec-draft-n-min 4 --spec-draft-n-max 4`, so a step either drafts 4 or none, and the
drafts per position follow from the counters; f32 KV cache, flash attention off): `near` with the pair's
own draft, `far` with another checkpoint of the same vocabulary (the table pair's draft,
tests/wild_models.py). Each audited with the pair's draft stated (`--draft`, `--speculation draft:k=4
--require-acceptance 0.5`, 8 built-in prompts, 32 new tokens):

- every output exact in both;
- `near`: no acceptance finding, exit 0 (measured: 116 of 344 accepted, per position 52, 32, 19, 13 of 86
  against the replay's 62, 36, 22, 14 of 102: ratio 1.03);
- `far`: "acceptance short", exit 1 (measured: 1 accepted);
- the observed counters, read from `/metrics` (drafts, draft tokens, accepted tokens, accepted per position),
  agree with the responses' `timings.draft_n` / `draft_n_accepted` (no "acceptance counters inconsistent"),
  and the returned tokens count every decode step: returned - one per request (the prefill's) - accepted
  >= verify steps with a draft (a step whose draft llama.cpp dropped below its confidence floor has none).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import llamacpp_models as lm
import wild_models as wm
from specaudit import cli

K = 4
NEW_TOKENS = 32
PROMPTS = 8
DRAFT_ARGS = ["--spec-type", "draft-simple", "--spec-draft-n-min", str(K), "--spec-draft-n-max", str(K)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llama_dir = lm.llama_cpp_dir()
    pair = lm.gguf_pair(llama_dir)
    _target, far_draft = wm.gguf_files(llama_dir)
    far = lm.GGUFPair(pair.folder, pair.hf_target, pair.hf_draft, pair.gguf_target, far_draft)
    folder = tmp_path_factory.mktemp("llamacpp-acceptance")
    results = {}
    for name, served_pair in (("near", pair), ("far", far)):
        with lm.LlamaServer(llama_dir, served_pair, lm.EXACT_ARGS + DRAFT_ARGS, folder / f"{name}.log") as server:
            argv = ["audit", "--engine", f"llamacpp:{server.url}", "--target", str(pair.hf_target),
                    "--draft", str(pair.hf_draft), "--speculation", f"draft:k={K}", "--require-acceptance", "0.5",
                    "--dtype", "float32", "--num-prompts", str(PROMPTS), "--no-adversarial", "--max-new-tokens",
                    str(NEW_TOKENS), "--batch-size", "4", "--no-progress", "--out", str(folder / name)]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                status = cli.main(argv)
        results[name] = (status, json.loads((folder / name / "audit.json").read_text())["runs"][0], printed.getvalue())
    return results


def kinds(run: dict) -> list[str]:
    return [finding["kind"] for finding in run["acceptance"]["findings"]]


def test_outputs_exact_and_counters_consistent(served):
    for name, (_status, run, printed) in served.items():
        assert run["exact_matches"] == run["num_prompts"] == PROMPTS, (name, printed)
        observed, speculation = run["acceptance"]["observed"], run["speculation"]
        assert "acceptance counters inconsistent" not in kinds(run), (name, run["acceptance"]["findings"])
        assert observed["verify_steps"] > 0 and observed["drafted_tokens"] == K * observed["verify_steps"], observed
        assert observed["drafts_per_position"] == [observed["verify_steps"]] * K, observed
        per_request = speculation["per_request"]
        assert sum(r["drafted_tokens"] for r in per_request) == observed["drafted_tokens"]
        assert sum(r["accepted_tokens"] for r in per_request) == observed["accepted_tokens"]
        decode_steps = sum(speculation["returned_tokens"]) - PROMPTS - observed["accepted_tokens"]
        assert decode_steps >= observed["verify_steps"], (name, decode_steps, observed)
    near = served["near"][1]["acceptance"]["observed"]
    assert sum(near["accepted_per_position"]) == near["accepted_tokens"] > 0, near


def test_a_wrong_draft_checkpoint_is_short_and_gated(served):
    status, run, printed = served["far"]
    assert status == 1, printed
    assert run["equivalent"] and run["exact_matches"] == PROMPTS  # the outputs pass
    assert "acceptance short" in kinds(run), run["acceptance"]["findings"]
    status, run, printed = served["near"]
    assert status == 0, printed
    assert "acceptance short" not in kinds(run), run["acceptance"]["findings"]
    assert run["acceptance"]["overall"]["ratio"] > 0.8, run["acceptance"]["overall"]
