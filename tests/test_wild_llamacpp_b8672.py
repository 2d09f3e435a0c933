"""An older llama.cpp release (PyPI `xllamacpp` 2026.4.8672.1 = llama.cpp b8672, the oldest 2026 wheel;
2026.4.8672 itself dies with SIGILL on this machine) against the pinned b11549.

On b8672, draft-model speculation returns fewer tokens than it generated when the length limit falls
inside an accepted block: `n_predict` 16 on the table model's alphabet cycle comes back as 15 tokens
(`klmnopqrstuvwxy`) while `tokens_predicted` and `timings` say 16 were produced; with `n_probs` 2, 12
(on a fresh server; where the blocks fall, and so how many are lost, moves with the draft's state).
A token accepted past EOS, or past a stop string, is counted in `tokens_predicted` (and past EOS kept
in the slot: `tokens_cached` one more than the plain server's), #28049's mechanism.
The server charges the whole accepted block to the slot's count before it emits the tokens and stops
emitting when the count reaches the limit (the same mechanism as ik_llama.cpp PR #2358, "responses
truncated below max_tokens with speculative decoding"). b11549 returns all 16 (tests/test_wild_llamacpp.py
runs the same prompt there); of the wheels between, b8929 still drops them and b9294 no longer does. #27972 (log-probability 0.0 after the first token) is on b8672 as on b11549.

b8672 enables speculation whenever a draft model is loaded (`--spec-type` has no "none" there), so
the plain server here is started without `-md`. The same audit of the pinned b11549 with the same
speculation finds the answers whole and counted right, and #27972 alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import cli_run
import llamacpp_models as lm
import wild_models as wm
import wild_requests as wr


VERSION = "2026.4.8672.1"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    done = subprocess.run(["bash", str(lm.REPO / "scripts" / "llamacpp.sh")], check=True, stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "XLLAMACPP_VERSION": VERSION})
    llama_dir = Path(done.stdout.strip().splitlines()[-1])
    pair = wm.table_pair()
    target, draft = wm.gguf_files(lm.llama_cpp_dir())  # converted once, by the pinned build's converter
    gguf = lm.GGUFPair(pair.folder, pair.target, pair.draft, target, draft)
    logs = tmp_path_factory.mktemp("b8672")
    plain = lm.LlamaServer(llama_dir, gguf, lm.EXACT_ARGS + ["--spec-type", "none"], logs / "plain.log")
    at = plain.command.index("-md")
    del plain.command[at:at + 2]
    speculative = lm.LlamaServer(llama_dir, gguf, lm.EXACT_ARGS + ["--spec-type", "draft-simple"], logs / "draft.log")
    # the pinned build, where the dropped block and the counts past EOS and stop strings are fixed
    pinned = lm.LlamaServer(lm.llama_cpp_dir(), gguf, lm.EXACT_ARGS + ["--spec-type", "draft-simple"],
                            logs / "pinned.log")
    with plain, speculative, pinned:
        yield llama_dir, plain, speculative, pinned


def _counted(finding: dict) -> int:
    """The `completion_tokens` a usage_report finding quotes."""
    match = re.search(r"completion_tokens (\d+)", finding["diagnosis"]["evidence"])
    assert match, finding
    return int(match.group(1))


def _completion(server: lm.LlamaServer, n_probs: int) -> dict:
    body = {"prompt": wr.CYCLE_PROMPT, "n_predict": NEW_TOKENS, "temperature": 0, "n_probs": n_probs,
            "return_tokens": True, "cache_prompt": False}
    answer = wr.post(server.url + "/completion", body)
    assert "http_error" not in answer, answer
    return answer


def test_b8672_drops_the_tokens_of_a_block_that_crosses_the_limit(servers):
    llama_dir, plain, speculative, _pinned = servers
    assert "b8672" in lm.build_info(llama_dir) or VERSION in lm.build_info(llama_dir)
    expected = _completion(plain, 0)
    assert expected["content"] == "klmnopqrstuvwxyz" and len(expected["tokens"]) == NEW_TOKENS
    assert expected.get("timings", {}).get("draft_n") is None  # no draft model: nothing drafted
    for n_probs in (0, 2):
        # how many come back depends on where the blocks fall, which the draft's state from earlier
        # requests moves (15 and 12 on a fresh server, in this order)
        actual = _completion(speculative, n_probs)
        kept = len(actual["tokens"])
        assert actual["timings"]["draft_n"] > 0 and actual["timings"]["draft_n_accepted"] > 0
        assert actual["tokens_predicted"] == NEW_TOKENS  # it generated them all ...
        assert 0 < kept < NEW_TOKENS and actual["tokens"] == expected["tokens"][:kept], actual["tokens"]  # ... returned fewer
        assert actual["content"] == expected["content"][:kept]
    # #27972 on this build too: every token after the first reported at p = 1
    report = actual["completion_probabilities"]
    assert report[0]["logprob"] < -0.1 and all(entry["logprob"] == 0.0 for entry in report[1:]), report


def test_audit_rules_the_dropped_and_overcounted_tokens_structural(servers, tmp_path):
    """One audit, three prompts: the cycle (16 tokens asked for: the block that crosses the limit is
    dropped), the digits (`789` EOS: one accepted token past EOS counted and kept in the slot, #28049's
    mechanism) and the cycle with stop string `mn` (the two accepted tokens past it counted). Every
    answer's log-probabilities are 0.0 after the first token (#27972)."""
    _llama_dir, plain, speculative, pinned = servers
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in (
        {"input_ids": wr.CYCLE_PROMPT}, {"input_ids": wr.DIGITS_PROMPT},
        {"input_ids": wr.CYCLE_PROMPT, "params": {"stop": ["mn"]}})))
    args = ("--target", str(wm.table_pair().target), "--prompts", str(prompts), "--no-adversarial",
            "--batch-size", "1", "--dtype", "float32", "--max-new-tokens", str(NEW_TOKENS), "--logprobs", "2")
    result = cli_run.audit("--engine", f"llamacpp:{speculative.url}", *args, out=tmp_path / "draft")
    assert result.returncode == 1 and "NOT equivalent" in result.stdout, result.stdout
    (run,) = cli_run.runs(tmp_path / "draft")
    assert [p["exact"] for p in run["prompts"]] == [False, True, True], result.stdout
    found = {(d["prompt_index"], d["diagnosis"]["class"]): d for d in run["divergences"]}
    assert all(d["kind"] == "structural" for d in run["divergences"]), run["divergences"]
    # 1. the cycle: the answer ends after `kept` of the 16 tokens, short of its budget, where the reference goes on
    tokens = found.get((0, "stop_length"))
    assert tokens is not None and tokens["engine_token"] is None, found
    kept = tokens["position"]
    assert 0 < kept < NEW_TOKENS and tokens["reference_token"] == ord("klmnopqrstuvwxyz"[kept]), tokens
    assert f"completion_tokens 16 for a 37-token prompt and {kept} returned" in found[(0, "usage_report")]["diagnosis"]["evidence"]
    # 2. the digits: `789` EOS exact, but more tokens counted than the 4 returned (5 here)
    assert _counted(found[(1, "usage_report")]) > 4 and "and 4 returned" in found[(1, "usage_report")]["diagnosis"]["evidence"]
    # 3. the stop string: `kl` exact, more tokens counted than the 4 generated up to the stop
    assert _counted(found[(2, "usage_report")]) > 4 and "and 4 returned" in found[(2, "usage_report")]["diagnosis"]["evidence"]
    for index in range(3):
        assert found[(index, "logprob_report")]["evidence"]["reported"] == 0.0  # #27972
    print(result.stdout)

    result = cli_run.audit("--engine", f"llamacpp:{plain.url}", *args, out=tmp_path / "plain")
    assert result.returncode == 0, result.stdout
    (run,) = cli_run.runs(tmp_path / "plain")
    assert run["exact_matches"] == 3 and run["divergences"] == [], result.stdout

    # b11549 with the same speculation: every answer whole and counted right; #27972 alone remains
    result = cli_run.audit("--engine", f"llamacpp:{pinned.url}", *args, out=tmp_path / "pinned")
    assert result.returncode == 1, result.stdout
    (run,) = cli_run.runs(tmp_path / "pinned")
    assert run["exact_matches"] == 3, result.stdout
    assert sorted((d["prompt_index"], d["diagnosis"]["class"]) for d in run["divergences"]) == [
        (0, "logprob_report"), (1, "logprob_report"), (2, "logprob_report")], run["divergences"]
    assert run["speculation"]["accepted_tokens"] > 0
