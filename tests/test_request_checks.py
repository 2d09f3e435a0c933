"""The request-parameter audit of a live server (equivalence/blackbox/requests_run.py) against a fake vLLM
that really decodes with the tiny model (tests/request_server.py): correct, it is clean under every
parameter; with each bug that shipped planted, the bug is caught and named by its class."""

from __future__ import annotations

import pytest
from hex_tokenizer import hex_pair
from fake_server import FakeServer
from request_server import vllm_answer

from specaudit.engines.adapters.servers import LlamaCppEngine, VLLMEngine
from specaudit.engines.models import zoo
from specaudit.engines.reference import greedy_decode
from specaudit.engines.requests.reference import decode_text
from specaudit.engines.requests import RequestParams
from specaudit.equivalence.audit import RunSettings, audit_engine

N = 10
EOS = 258


@pytest.fixture(scope="module")
def pair():
    return hex_pair()


@pytest.fixture(scope="module")
def prompts(pair):
    return [list(b"The cat sat"), list(b"Hello there")]


def audit(pair, prompts, params, bug=None, engine_class=VLLMEngine, answer=None):
    with FakeServer(answer or vllm_answer(pair.target, pair.tokenizer, EOS, bug)) as server:
        engine = engine_class(server.url)
        run = audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=N, eos_token_id=EOS, dtype="float64",
                         engine_name="vllm:fake", batch_size=1, requests=tuple(params)))
    return run, server


def classes(run):
    return sorted({(d.get("diagnosis") or {}).get("class") for d in run["divergences"] if d["kind"] == "structural"})


def stop_string_params(pair, prompts):
    """A stop string from the middle of each prompt's plain output (it completes inside the output)."""
    out = []
    for prompt in prompts:
        plain, _ = greedy_decode(pair.target, prompt, N, None)
        text = decode_text(pair.tokenizer, plain)
        out.append(RequestParams(stop=[text[7:12]]))
    return out


def mixed_params(pair, prompts):
    plain, _ = greedy_decode(pair.target, prompts[0], N, None)
    return [RequestParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3,
                          logit_bias={plain[1]: -30.0}),
            RequestParams(min_tokens=2, logit_bias={EOS: 60.0}, stop_token_ids=[7])]


def test_correct_server_is_clean_under_every_parameter(pair, prompts):
    for params in (stop_string_params(pair, prompts), mixed_params(pair, prompts)):
        run, server = audit(pair, prompts, params)
        assert run["divergences"] == [] and run["equivalent"], run["divergences"]
        assert run["exact_matches"] == len(prompts)
    body = server.requests[-1][1]
    assert body["min_tokens"] == 2 and body["logit_bias"] == {str(EOS): 60.0} and body["stop_token_ids"] == [EOS, 7]
    assert run["prompts"][1]["reference_finish"] == ["stop", None]  # EOS after min_tokens


def test_text_cut_at_stop_with_tokens_kept_after_it_is_stop_string(pair, prompts):
    run, _ = audit(pair, prompts, stop_string_params(pair, prompts), bug="stop_tail")
    assert classes(run) == ["stop_string"]
    found = [d for d in run["divergences"] if d["diagnosis"]["class"] == "stop_string"]
    assert len(found) == len(prompts) and all(d["decided_by"] == "stop-string-replay" for d in found)


def test_a_later_stop_string_taken_over_the_earliest_is_stop_string_and_says_so(pair, prompts):
    # prompt 0's output decodes "eb.67.21.67.ac...": "b.6" completes at new token 1, "21.6" at new token 3,
    # both inside the first burst of 4 tokens, where the planted bug takes the first in the list
    params = [RequestParams(stop=("21.6", "b.6"))]
    run, _ = audit(pair, prompts[:1], params, bug="stop_list_order")
    assert classes(run) == ["stop_string"] and run["structural_divergences"] == 1, run["divergences"]
    [found] = run["divergences"]
    assert (found["position"], found["evidence"]["stop"], found["evidence"]["tokens_after_stop"]) == (2, "b.6", 2)
    assert found["evidence"]["server_stop"] == "21.6" and found["evidence"]["server_stop_completed_by"] == 3
    assert found["evidence"]["earliest_stop_not_taken"]
    assert "did not take the earliest" in found["diagnosis"]["evidence"]
    # a stop string completed inside the burst alone: tokens kept after it, the server names the right one
    run, _ = audit(pair, prompts[:1], [RequestParams(stop=("b.6",))], bug="stop_list_order")
    [found] = run["divergences"]
    assert found["diagnosis"]["class"] == "stop_string" and "server_stop" not in found["evidence"], found


def test_logit_bias_skipped_at_some_positions_is_logits_processor(pair, prompts):
    run, _ = audit(pair, prompts[:1], mixed_params(pair, prompts)[:1], bug="bias_skipped")
    assert classes(run) == ["logits_processor"]
    [found] = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert found["evidence"]["processor"] == "logit_bias" and found["position"] % 2 == 1


def test_logprob_zero_for_every_token_is_logprob_report(pair, prompts):
    run, _ = audit(pair, prompts, stop_string_params(pair, prompts), bug="zero_logprobs")
    assert classes(run) == ["logprob_report"]
    assert all(d["evidence"]["all_zero"] for d in run["divergences"])


def test_wrong_finish_reason_and_usage_are_named(pair, prompts):
    # prompt 0 ends on EOS after min_tokens, prompt 1 on a stop string
    params = mixed_params(pair, prompts)[1:] + stop_string_params(pair, prompts)[1:]
    run, _ = audit(pair, prompts, params, bug="finish_wrong")
    assert classes(run) == ["finish_reason"] and run["structural_divergences"] == 2
    run, _ = audit(pair, prompts, params, bug="usage_wrong")
    assert classes(run) == ["usage_report"]


def test_refused_parameters_are_reported_not_divergences(pair, prompts):
    def refuses_min_p(path, body):
        if "min_p" in body:
            return 400, {"object": "error", "message": "min_p: not supported with speculative decoding"}
        return vllm_answer(pair.target, pair.tokenizer, EOS)(path, body)

    params = [RequestParams(min_p=0.1), RequestParams(bad_words=[[1, 2]])]  # ids alone: vLLM takes text
    run, server = audit(pair, prompts, params, answer=refuses_min_p)
    assert run["divergences"] == [] and run["equivalent"]
    assert [(r["prompt_index"], r["parameter"]) for r in run["refused_parameters"]] == [(0, "min_p"), (1, "bad_words")]
    assert len(server.requests) == 1  # the client-side refusal sent nothing
    # llama.cpp has no min_tokens: refused by the client
    run, _ = audit(pair, prompts[:1], [RequestParams(min_tokens=3)], engine_class=LlamaCppEngine,
                   answer=lambda path, body: (500, {}))
    assert run["refused_parameters"][0]["parameter"] == "min_tokens"


def test_a_request_that_errors_is_a_failure_of_its_prompt_not_a_divergence(pair, prompts):
    """Under request parameters, a server's error on one request is that prompt's failure (the run is not
    equivalent), never compared as an empty output; the other prompt is judged as usual."""
    def errors_on_the_second(path, body):
        if list(body.get("prompt") or []) == prompts[1]:
            return 500, {"object": "error", "message": "internal error"}
        return vllm_answer(pair.target, pair.tokenizer, EOS)(path, body)

    run, _ = audit(pair, prompts, [RequestParams(repetition_penalty=1.3)] * 2, answer=errors_on_the_second)
    assert [f["prompt_index"] for f in run["failures"]] == [1], run["failures"]
    assert run["divergences"] == [] and not run["equivalent"]
    assert [r.get("failed", False) for r in run["prompts"]] == [False, True] and run["exact_matches"] == 1


def test_audit_command_sends_flags_and_per_prompt_params(tmp_path):
    """`specaudit audit` against the fake vLLM: the flags' parameters for every prompt, a prompts file line's
    `params` over them; the correct server exits 0, the one reporting logprob 0.0 exits 1 with the class named."""
    import json

    from cli_run import audit as cli_audit, runs

    served = zoo.load_pair("tiny-llama", dtype="float64")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(b"The cat"), "params": {"min_tokens": 2, "logit_bias": {"258": 60}}})
                       + "\n" + json.dumps({"input_ids": list(b"Hello")}) + "\n")
    flags = ["--pair", "tiny-llama", "--batch-size", "1", "--max-new-tokens", "6", "--prompts", str(prompts),
             "--no-adversarial", "--repetition-penalty", "1.4", "--logprobs", "1"]
    for bug, code in ((None, 0), ("zero_logprobs", 1)):
        with FakeServer(vllm_answer(served.target, served.tokenizer, EOS, bug)) as server:
            result = cli_audit("--engine", f"vllm:{server.url}", *flags, out=tmp_path / str(bug))
        assert result.returncode == code, result.stdout + result.stderr
        [run] = runs(tmp_path / str(bug))
        bodies = [body for _, body in server.requests]
        assert [b["repetition_penalty"] for b in bodies] == [1.4, 1.4] and [b["logprobs"] for b in bodies] == [1, 1]
        assert bodies[0]["min_tokens"] == 2 and "min_tokens" not in bodies[1]
        assert run["request_params"][0] == {"min_tokens": 2, "repetition_penalty": 1.4, "logit_bias": {"258": 60.0},
                                            "logprobs": 1}
        assert run["prompts"][0]["reference_finish"] == ["stop", None]
    assert {d["diagnosis"]["class"] for d in run["divergences"]} == {"logprob_report"}


def test_llamacpp_dialect_names_and_its_speculative_zero_logprobs(pair, prompts):
    from request_server import llamacpp_answer

    plain, _ = greedy_decode(pair.target, prompts[0], N, None)
    params = [RequestParams(repetition_penalty=1.3, logit_bias={plain[1]: -30.0}, logprobs=2),
              stop_string_params(pair, prompts)[1]]
    run, server = audit(pair, prompts, params, engine_class=LlamaCppEngine,
                        answer=llamacpp_answer(pair.target, pair.tokenizer, EOS))
    assert run["divergences"] == [] and run["exact_matches"] == 2 and run["penalty_scope"] == "context"
    body = server.requests[0][1]
    # the whole context as a count (b11549 refuses -1)
    assert body["repeat_penalty"] == 1.3 and body["repeat_last_n"] == len(body["prompt"]) + N and body["n_probs"] == 2
    assert body["logit_bias"] == [[plain[1], -30.0]] and server.requests[1][1]["stop"] == list(params[1].stop)
    run, _ = audit(pair, prompts, params, engine_class=LlamaCppEngine,
                   answer=llamacpp_answer(pair.target, pair.tokenizer, EOS, zero_logprobs=True))
    assert classes(run) == ["logprob_report"] and all(d["evidence"]["all_zero"] for d in run["divergences"])
    # an EOS ending (not returned by llama.cpp) still has its finish checked
    eos_params = [RequestParams(logit_bias={EOS: 60.0})]  # EOS first: llama.cpp has no min_tokens
    run, _ = audit(pair, prompts[:1], eos_params, engine_class=LlamaCppEngine,
                   answer=llamacpp_answer(pair.target, pair.tokenizer, EOS))
    assert run["divergences"] == [] and run["prompts"][0]["reported_finish"] == ["stop", None]

    def says_limit(path, body):
        status, answer = llamacpp_answer(pair.target, pair.tokenizer, EOS)(path, body)
        return status, {**answer, "stop_type": "limit"}

    run, _ = audit(pair, prompts[:1], eos_params, engine_class=LlamaCppEngine, answer=says_limit)
    assert "finish_reason" in classes(run)


def test_min_tokens_skipped_at_some_positions_is_logits_processor(pair, prompts):
    params = [RequestParams(min_tokens=4, logit_bias={EOS: 60.0})]
    run, _ = audit(pair, prompts[:1], params, bug="min_tokens_skipped")
    assert classes(run) == ["logits_processor"]
    [found] = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert found["evidence"]["processor"] == "min_tokens" and found["engine_token"] == EOS


def test_min_tokens_applied_past_its_end_is_logits_processor(pair, prompts):
    """The stop ids masked one position too long (vLLM 0.32.0's bonus position): with the plain greedy
    token at new token 4 as a stop id and min_tokens 4, the reference ends on it there, the server
    takes the runner-up; the replay names min_tokens. (A stop id, not EOS raised by a logit bias: the
    runner-up would then also be "logit_bias not applied".)"""
    plain, _ = greedy_decode(pair.target, prompts[0], N, None)
    stop = plain[4]
    assert stop not in plain[:4]
    params = [RequestParams(min_tokens=4, stop_token_ids=[stop])]
    run, _ = audit(pair, prompts[:1], params, bug="min_tokens_past_end")
    assert classes(run) == ["logits_processor"]
    [found] = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert (found["position"], found["reference_token"]) == (4, stop) and found["engine_token"] != stop
    assert found["evidence"]["processor"] == "min_tokens" and found["evidence"]["applied_past_end"] is True


def test_request_params_for_an_in_process_engine_or_a_bad_params_line_are_usage_errors(tmp_path):
    from cli_run import audit as cli_audit

    result = cli_audit("--engine", "hf-batched", "--pair", "tiny-llama", "--stop", "ab", out=tmp_path / "a")
    assert result.returncode == 2 and "hf-batched takes token ids and limits alone" in result.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2], "params": {"stopp": ["x"]}}\n')
    result = cli_audit("--engine", "vllm:http://127.0.0.1:9", "--pair", "tiny-llama", "--prompts", str(prompts),
                       out=tmp_path / "b")
    assert result.returncode == 2 and "p.jsonl:1: params: unknown request parameter(s) stopp" in result.stderr
    result = cli_audit("--engine", "vllm:http://127.0.0.1:9", "--pair", "tiny-llama", "--logit-bias", "5:500",
                       out=tmp_path / "c")
    assert result.returncode == 2 and "[-100, 100]" in result.stderr


class ByteText:
    """Bytes decoded as UTF-8 (a lone continuation byte is U+FFFD), as a byte-level tokenizer decodes them."""

    def decode(self, ids, **_):
        return bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text, **_):
        return list(text.encode())


def _report_classes(returned, report, params=RequestParams(), reference=None):
    from specaudit.engines.requests.reference import RequestResult
    from specaudit.equivalence.blackbox.outputs import check_report

    reference = reference or RequestResult(list(returned), "length", None, ByteText().decode(returned))
    return [d.diagnosis.cls for d in check_report(0, list(b"ab"), params, reference, list(returned), report, EOS,
                                                     ByteText())]


def test_a_detokenizer_may_drop_bytes_that_never_form_a_character_and_nothing_else():
    returned = [0x80, 0x81] + list(b"xy") + [0x82]  # lone continuation bytes around real text
    assert _report_classes(returned, {"finish_reason": "length", "text": "xy"}) == []
    assert _report_classes(returned, {"finish_reason": "length", "text": "\ufffd\ufffdxy\ufffd"}) == []
    assert _report_classes(returned, {"finish_reason": "length", "text": "x"}) == ["text_report"]


def _byte_fallback_tokenizer():
    """A tokenizer whose 256 ids are `<0xNN>` byte tokens under a byte-fallback decoder (a llama/sentencepiece
    style tokenizer.json): it decodes a run of byte tokens that fails as UTF-8 to one U+FFFD per token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True))
    inner.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=inner)


def test_invalid_bytes_may_be_rendered_by_utf8s_own_replacement_rule():
    pytest.importorskip("xgrammar")  # the decoded vocabulary comes from the grammar engine
    from specaudit.engines.requests.reference import RequestResult
    from specaudit.equivalence.blackbox.outputs import check_report

    tokenizer = _byte_fallback_tokenizer()
    returned = [ord("k")] + [0x8F] * 5  # a letter, then lone continuation bytes
    decoded = tokenizer.decode(returned)
    assert decoded == "\ufffd" * 6  # the premise: the decoder swallows the valid byte into the run
    reference = RequestResult(list(returned), "length", None, decoded)

    def classes(text):
        return [d.diagnosis.cls for d in check_report(0, list(b"ab"), RequestParams(), reference, list(returned),
                                                         {"finish_reason": "length", "text": text}, EOS, tokenizer)]

    assert classes("k" + "\ufffd" * 5) == []  # llama.cpp's rendering: the bytes under UTF-8's rule
    assert classes(decoded) == []
    assert classes("kk" + "\ufffd" * 5) == ["text_report"]  # a letter the tokens do not hold
    assert classes("j" + "\ufffd" * 5) == ["text_report"]


def test_a_special_tokens_text_may_be_left_out_and_nothing_else():
    from specaudit.engines.requests.reference import RequestResult
    from specaudit.equivalence.blackbox.outputs import check_report
    from transformers import PreTrainedTokenizerFast

    tokenizer = _byte_fallback_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    returned = [bos, ord("x"), bos]
    reference = RequestResult(list(returned), "length", None, tokenizer.decode(returned))

    def classes(text):
        return [d.diagnosis.cls for d in check_report(0, list(b"ab"), RequestParams(), reference, list(returned),
                                                         {"finish_reason": "length", "text": text}, EOS, tokenizer)]

    assert classes("<s>x<s>") == [] and classes("x") == []  # with the special's text, or without (llama.cpp)
    assert classes("") == ["text_report"]  # the letter is not a special token


def test_a_stop_id_that_completes_a_stop_string_may_be_reported_as_either():
    from specaudit.engines.requests.reference import RequestResult

    returned = list(b"xyz")
    params = RequestParams(stop=("yz",), stop_token_ids=(ord("z"),))
    reference = RequestResult(returned, "stop", "yz", "x")
    for stop_reason in ("yz", ord("z")):
        assert _report_classes(returned, {"finish_reason": "stop", "stop_reason": stop_reason, "text": "x"},
                               params, reference) == [], stop_reason
    # a stop string that the last token does not complete is not a reason the request ended
    other = RequestParams(stop=("yz", "q"), stop_token_ids=(ord("z"),))
    assert _report_classes(returned, {"finish_reason": "stop", "stop_reason": "q", "text": "x"}, other,
                           reference) != []


def test_an_incremental_detokenizer_keeps_what_it_showed_before_an_invalid_run():
    """vLLM detokenizes with tokenizers' `DecodeStream`: letters shown before a byte run turns invalid stay in
    its text, the invalid run is never shown, and a special token after it starts a fresh stream."""
    pytest.importorskip("xgrammar")
    from tokenizers import AddedToken
    from specaudit.engines.requests.reference import RequestResult
    from specaudit.equivalence.blackbox.outputs import check_report

    tokenizer = _byte_fallback_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<s>", special=True)]})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    returned = [ord('"')] * 3 + [0xAF, 0x08, 0xE6] + [bos] + [0xF2, 0xB6]
    assert tokenizer.decode(returned).startswith("\ufffd\ufffd\ufffd")  # the premise: the quotes swallowed whole
    reference = RequestResult(list(returned), "length", None, tokenizer.decode(returned))

    def classes(text):
        return [d.diagnosis.cls for d in check_report(0, list(b"ab"), RequestParams(), reference, list(returned),
                                                         {"finish_reason": "length", "text": text}, EOS, tokenizer)]

    assert classes('"""<s>') == []  # what vLLM 0.32.0's detokenizer reports for such tokens
    assert classes('""""<s>') == ["text_report"]  # a quote the tokens do not hold
    assert classes('"""') == ["text_report"]  # the special token's text left out, the quotes kept: no decoder's
