"""A publicly reported llama.cpp bug, reproduced on the pinned prebuilt server (PyPI `xllamacpp`
2026.10.11549, llama.cpp b11549, the newest release on PyPI when this was written: no fixed build
exists to contrast with).

llama.cpp #27972 (open; the fix proposed in PR #27196, open): with draft-model speculation, the
server reports `logprob` 0.0 (p = 1) and no `top_logprobs` for every token after the first of a
request, on `/completion` (`n_probs`) and on `/v1/completions` (`logprobs`). The tokens are right;
only the report is wrong. The same server without speculation (`--spec-type none`) reports the
target's log-probabilities. n-gram speculation (`ngram-simple`) on the same build zeroes the
tokens that follow its first draft: the bug is in the server's speculative path, whatever drafts.

The model is the table model of tests/wild_models.py (each greedy token at about -0.21, its second
choice at about -1.71), converted to GGUF f32 and served with an f32 KV cache and flash attention
off, so the plain server's numbers are the target's to float32 rounding.

`specaudit audit --logprobs 2` against the same servers rules the speculative ones a structural
`logprob_report` and the plain one clean.
"""

from __future__ import annotations

import json

import pytest

import cli_run
import llamacpp_models as lm
import wild_models as wm
import wild_requests as wr
from specaudit.engines.adapters.request_fields import llamacpp_chosen_logprobs


NEW_TOKENS = 16
# ngram-simple drafts after a 12-token match (its default size_n), so its prompt holds the cycle twice
TWO_CYCLES = wr.ids(wr.ALPHABET * 2) + wr.CYCLE_PROMPT


@pytest.fixture(scope="module")
def table_gguf() -> tuple:
    llama_dir = lm.llama_cpp_dir()
    pair = wm.table_pair()
    target, draft = wm.gguf_files(llama_dir)
    return llama_dir, lm.GGUFPair(pair.folder, pair.target, pair.draft, target, draft)


@pytest.fixture(scope="module")
def plain_server(table_gguf, tmp_path_factory):
    llama_dir, pair = table_gguf
    with _served(llama_dir, pair, "none", tmp_path_factory.mktemp("plain") / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def draft_server(table_gguf, tmp_path_factory):
    llama_dir, pair = table_gguf
    with _served(llama_dir, pair, "draft-simple", tmp_path_factory.mktemp("draft") / "server.log") as server:
        yield server


def _completion(server: lm.LlamaServer, prompt: list[int] = wr.CYCLE_PROMPT) -> dict:
    body = {"prompt": prompt, "n_predict": NEW_TOKENS, "temperature": 0, "n_probs": 2,
            "return_tokens": True, "cache_prompt": False}
    answer = wr.post(server.url + "/completion", body)
    assert "http_error" not in answer, answer
    return answer


def _openai_logprobs(server: lm.LlamaServer) -> list[dict]:
    body = {"prompt": wr.CYCLE_PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 2}
    answer = wr.post(server.url + "/v1/completions", body)
    assert "http_error" not in answer, answer
    return answer["choices"][0]["logprobs"]["content"]


def _served(llama_dir, pair, spec_type: str, log) -> lm.LlamaServer:
    return lm.LlamaServer(llama_dir, pair, lm.EXACT_ARGS + ["--spec-type", spec_type], log)


def test_draft_speculation_reports_logprob_zero_after_the_first_token(table_gguf, plain_server, draft_server):
    llama_dir, _pair = table_gguf
    expected = _completion(plain_server)
    expected_openai = _openai_logprobs(plain_server)
    before = draft_server.metrics()
    actual = _completion(draft_server)
    actual_openai = _openai_logprobs(draft_server)
    after = draft_server.metrics()
    accepted = after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"]
    assert accepted > 0, "no draft token was accepted: the request never ran the speculative path"

    # the tokens are exact: the bug is in the report only
    assert actual["tokens"] == expected["tokens"] and len(expected["tokens"]) == NEW_TOKENS
    plain_report = expected["completion_probabilities"]
    spec_report = actual["completion_probabilities"]
    assert [entry["id"] for entry in spec_report] == [entry["id"] for entry in plain_report]
    # the plain server: every token has its target log-probability (about -0.21 here) and 2 alternatives
    assert all(entry["logprob"] < -0.1 and len(entry["top_logprobs"]) == 2 for entry in plain_report), plain_report
    # the speculative server: the first token (sampled from the prompt's pass) is reported right ...
    assert spec_report[0]["logprob"] == pytest.approx(plain_report[0]["logprob"], abs=1e-4)
    assert len(spec_report[0]["top_logprobs"]) == 2
    # ... and every later one as p = 1 with no alternatives
    assert all(entry["logprob"] == 0.0 and entry["top_logprobs"] == [] for entry in spec_report[1:]), spec_report
    # the OpenAI-compatible endpoint reports the same
    assert all(entry["logprob"] < -0.1 for entry in expected_openai)
    assert [entry["logprob"] for entry in actual_openai[1:]] == [0.0] * (len(actual_openai) - 1)
    print(f"{lm.build_info(llama_dir)}: {accepted:.0f} drafts accepted; plain logprobs "
          f"{[round(entry['logprob'], 3) for entry in plain_report[:4]]}..., "
          f"draft-simple {[entry['logprob'] for entry in spec_report[:4]]}...")


def test_ngram_speculation_reports_logprob_zero_for_its_accepted_drafts(table_gguf, plain_server, tmp_path):
    """n-gram speculation (`ngram-simple`) on the same build: it drafts only after a 12-token match,
    so the first tokens of the answer are sampled one at a time and reported right; the tokens after
    drafting starts come back as p = 1 with no alternatives. The bug is in the server's speculative
    path, not in one drafter."""
    llama_dir, pair = table_gguf
    expected = _completion(plain_server, TWO_CYCLES)
    with _served(llama_dir, pair, "ngram-simple", tmp_path / "ngram.log") as speculative:
        actual = _completion(speculative, TWO_CYCLES)
        accepted = speculative.metrics()["spec_decode_num_accepted_tokens_total"]
        result, run = _audit_logprobs(speculative, tmp_path / "audit", TWO_CYCLES)
    assert accepted > 0
    assert actual["tokens"] == expected["tokens"]
    plain_report, spec_report = expected["completion_probabilities"], actual["completion_probabilities"]
    assert all(entry["logprob"] < -0.1 for entry in plain_report), plain_report
    zeroed = [index for index, entry in enumerate(spec_report) if entry["logprob"] == 0.0 and entry["top_logprobs"] == []]
    right = [index for index, (got, want) in enumerate(zip(spec_report, plain_report))
             if got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)]
    assert len(zeroed) > 0 and sorted(zeroed + right) == list(range(NEW_TOKENS)), (zeroed, right)
    assert right[0] == 0 and zeroed[-1] == NEW_TOKENS - 1  # right before drafting starts, zeros after
    print(f"ngram-simple: {accepted:.0f} drafts accepted; right at {right}, 0.0 at {zeroed}")
    # the audit of the same server: tokens exact, a structural logprob_report at the zeroed positions
    assert result.returncode == 1 and run["exact_matches"] == 1, result.stdout
    (finding,) = run["divergences"]
    assert finding["kind"] == "structural" and finding["diagnosis"]["class"] == "logprob_report", finding
    assert finding["evidence"]["positions_off"] == zeroed, finding["evidence"]
    print(finding["diagnosis"]["evidence"])


def test_log_probabilities_are_grouped_by_complete_utf8_characters(tmp_path):
    """Not a speculation bug, but what a `logprob_report` check must know: llama.cpp reports one
    `completion_probabilities` entry per complete UTF-8 character, not per token. A byte token that
    starts a multi-byte character gets no entry of its own; the entry of the token that completes
    the character carries that token's id and the bytes of both; a trailing incomplete character
    gets none. So entries are aligned to tokens by their `bytes`, not by position (the plain
    server, no speculation; the tiny-llama pair, whose byte tokenizer emits such bytes)."""
    llama_dir = lm.llama_cpp_dir()
    pair = lm.gguf_pair(llama_dir)
    with _served(llama_dir, pair, "none", tmp_path / "plain.log") as plain:
        body = {"prompt": "The cat sat on the mat. The cat sat on the mat. The cat", "n_predict": 12,
                "temperature": 0, "n_probs": 1, "return_tokens": True, "cache_prompt": False}
        answer = wr.post(plain.url + "/completion", body)
    tokens, entries = answer["tokens"], answer["completion_probabilities"]
    assert len(tokens) == 12 and len(entries) < len(tokens), (tokens, entries)
    # every entry's bytes are a run of consecutive tokens (byte ids), ending with the entry's token
    position = 0
    for entry in entries:
        run = entry["bytes"]
        assert tokens[position:position + len(run)] == run and run[-1] == entry["id"], (position, entry, tokens)
        position += len(run)
    dropped = tokens[position:]  # a character still incomplete when generation stopped
    assert dropped == [] or (dropped[0] >= 0xC0 and len(dropped) < 4), dropped  # a lead byte and at most 2 more
    assert any(len(entry["bytes"]) > 1 for entry in entries)
    # the audit's reader places each entry on its token by these bytes; the tokens without one get None
    chosen = llamacpp_chosen_logprobs(entries, tokens)
    assert chosen is not None and [value for value in chosen if value is not None] == [e["logprob"] for e in entries]
    assert chosen.count(None) == len(tokens) - len(entries)


def _audit_logprobs(server: lm.LlamaServer, tmp_path, prompt: list[int] = wr.CYCLE_PROMPT) -> tuple[cli_run.Result, dict]:
    """`specaudit audit --engine llamacpp:URL --target TABLE_TARGET --logprobs 2` on one prompt."""
    tmp_path.mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": prompt}) + "\n")
    result = cli_run.audit("--engine", f"llamacpp:{server.url}", "--target", str(wm.table_pair().target),
                           "--prompts", str(prompts), "--no-adversarial", "--batch-size", "1", "--dtype", "float32",
                           "--max-new-tokens", str(NEW_TOKENS), "--logprobs", "2", out=tmp_path / "audit")
    (run,) = cli_run.runs(tmp_path / "audit")
    assert run.get("error") is None, (run["error"], result.stdout)
    return result, run


def test_audit_rules_the_zero_logprobs_structural_logprob_report(draft_server, plain_server, tmp_path):
    """The audit itself, with log-probabilities requested: the speculative server's tokens are exact,
    and its report of them is a structural `logprob_report` (p = 1 where the reference has about
    -0.21); the same audit of the same build without speculation is clean."""
    result, run = _audit_logprobs(draft_server, tmp_path / "draft")
    assert result.returncode == 1, result.stdout
    assert run["exact_matches"] == run["num_prompts"] == 1, result.stdout
    (finding,) = run["divergences"]
    assert finding["kind"] == "structural" and finding["diagnosis"]["class"] == "logprob_report", finding
    evidence = finding["evidence"]
    # the first token (sampled from the prompt's pass) is right; every drafted one after it is 0.0
    assert evidence["positions_off"] == list(range(1, NEW_TOKENS)), evidence
    assert evidence["reported"] == 0.0 and evidence["expected"] < -0.1, evidence
    print(result.stdout)

    result, run = _audit_logprobs(plain_server, tmp_path / "plain")
    assert result.returncode == 0, result.stdout
    assert run["exact_matches"] == run["num_prompts"] == 1 and run["divergences"] == [], result.stdout
    print(result.stdout)


def test_served_reference_rules_the_zero_logprobs_logprob_report_without_weights(draft_server, plain_server, tmp_path):
    """The same bug with no weights in the audit: the plain server of the same build is the reference
    (`--reference llamacpp:URL`); the speculative server's tokens equal its own, and its report of their
    log-probabilities (0.0 after the first) is a structural `logprob_report` against the plain server's."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": wr.CYCLE_PROMPT}) + "\n")
    result = cli_run.audit("--engine", f"llamacpp:{draft_server.url}", "--reference", f"llamacpp:{plain_server.url}",
                           "--tokenizer", str(wm.table_pair().target), "--prompts", str(prompts), "--no-adversarial",
                           "--batch-size", "1", "--max-new-tokens", str(NEW_TOKENS), out=tmp_path / "audit")
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = cli_run.runs(tmp_path / "audit")
    # the tokens agree; the report check's finding is the one divergence, in the greedy schema
    assert run["exact_matches"] == run["num_prompts"] == 1, run
    (finding,) = run["divergences"]
    assert (finding["diagnosis"]["class"], finding["decided_by"], finding["kind"]) == (
        "logprob_report", "logprob-compare", "structural")
    assert finding["diagnosis"]["named_by"] == "logprob-compare" and not finding["diagnosis"]["needs_weights"]
    assert finding["evidence"]["positions_off"] == list(range(1, NEW_TOKENS)), finding
    print(result.stdout)
