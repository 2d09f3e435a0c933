"""Structured outputs on a real llama.cpp server (b11549, PyPI `xllamacpp`) with draft-model speculation.

Two servers of the tiny-llama GGUF pair (f32 GGUF and KV cache, flash attention off): `spec` with
`--spec-type draft-simple` (4 draft tokens a step) and `plain` with `--spec-type none`. Each audited under a
JSON schema (sent as `json_schema`; the reference applies llguidance, the engine llama.cpp applies to it:
`--grammar-backend llguidance`), a GBNF grammar and a choice (sent as `grammar`):

- every token of both servers equals the in-process float32 reference, and the plain server has no finding;
- the speculative server drafted (its counters moved) and its only findings are `logprob_report`: llama.cpp
  reports log-probability 0 for tokens of a verify step (its issue #27972, reports/wild), not a token bug;
- a JSON schema with xgrammar's rules (the default backend) is refused for llama.cpp: exit 2, one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llamacpp_models as lm
from cli_run import audit, runs, usage_error

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
GRAMMAR = Path(__file__).resolve().parent.parent / "reports" / "structured" / "expr.gbnf"
DRAFT_ARGS = ["--spec-type", "draft-simple", "--spec-draft-n-min", "4", "--spec-draft-n-max", "4"]
PROMPTS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    llama_dir = lm.llama_cpp_dir()
    pair = lm.gguf_pair(llama_dir)
    logs = tmp_path_factory.mktemp("llamacpp-structured")
    with lm.LlamaServer(llama_dir, pair, lm.EXACT_ARGS + DRAFT_ARGS, logs / "spec.log") as spec, \
            lm.LlamaServer(llama_dir, pair, lm.EXACT_ARGS + ["--spec-type", "none"], logs / "plain.log") as plain:
        yield pair, spec, plain


def _flags(kind: str, tmp_path: Path) -> list[str]:
    if kind == "json_schema":
        schema = tmp_path / "schema.json"
        schema.write_text(json.dumps(SCHEMA))
        return ["--json-schema", str(schema), "--grammar-backend", "llguidance"]
    if kind == "grammar":
        return ["--grammar", str(GRAMMAR)]
    return ["--choice", "alpha", "--choice", "beta", "--choice", "gamma delta"]


@pytest.mark.parametrize("kind", ["json_schema", "grammar", "choice"])
def test_speculative_llama_cpp_is_exact_under_a_constraint(servers, kind, tmp_path):
    pair, spec, plain = servers
    result = audit("--engine", f"llamacpp:{spec.url}", "--engine", f"llamacpp:{plain.url}",
                   "--target", str(pair.hf_target), "--dtype", "float32", "--batch-size", "4",
                   "--max-new-tokens", "32", "--num-prompts", str(PROMPTS), "--no-adversarial",
                   *_flags(kind, tmp_path), out=tmp_path / "audit")
    speculative, plain_run = runs(tmp_path / "audit")
    for run in (speculative, plain_run):
        assert run["exact_matches"] == PROMPTS, (run["engine"], result.stdout)
        assert all(p["params"]["constraint"]["kind"] == kind for p in run["prompts"])
    assert plain_run["divergences"] == [], plain_run["divergences"]
    classes = {d["diagnosis"]["class"] for d in speculative["divergences"]}
    assert classes <= {"logprob_report"}, speculative["divergences"]
    assert speculative["speculation"]["drafted_tokens"] > 0, speculative["speculation"]


def test_a_json_schema_under_xgrammars_rules_is_refused_for_llama_cpp(servers, tmp_path):
    pair, spec, _plain = servers
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    usage_error(audit("--engine", f"llamacpp:{spec.url}", "--target", str(pair.hf_target), "--json-schema", str(schema),
                      "--num-prompts", "1", out=tmp_path / "audit"), "llguidance")
