"""The reference with request parameters (engines/requests/reference.py) against a brute-force
recomputation in float64: the whole sequence through the model at every step (no cache), the
processors applied, and the stopping rules written out plainly here."""

from __future__ import annotations

import pytest
from hex_tokenizer import hex_pair
import torch

from specaudit.engines import requests as rq
from specaudit.engines.reference import greedy_decode
from specaudit.engines.requests.reference import decode_text, decode_with_params
from specaudit.engines.requests import RequestParams

N = 12


@pytest.fixture(scope="module")
def pair():
    return hex_pair()


@pytest.fixture(scope="module")
def prompt(pair):
    return pair.tokenizer.encode("The cat sat on")


@torch.no_grad()
def brute_force(pair, prompt, params: RequestParams, max_new_tokens: int, scope: str = "output"):
    eos = [pair.eos_token_id]
    stop_ids = sorted(set(eos) | set(params.stop_token_ids))
    limit = params.max_tokens or max_new_tokens
    out: list[int] = []
    raw_lps: list[float] = []
    while True:
        ids = torch.tensor([prompt + out])
        raw = pair.target(input_ids=ids).logits[0, -1].to(torch.float64)  # the whole sequence, no cache
        row = raw.clone()
        if len(out) < params.min_tokens:
            row[stop_ids] = -float("inf")
        for word in params.bad_words:
            if len(word) == 1 or out[-(len(word) - 1):] == list(word[:-1]):
                row[word[-1]] = -float("inf")
        for token, bias in params.logit_bias:
            row[token] += bias
        for token in set(prompt + out):
            row[token] = row[token] / params.repetition_penalty if row[token] > 0 else row[token] * params.repetition_penalty
        counted = out if scope == "output" else prompt + out
        for token in set(counted):
            row[token] -= params.frequency_penalty * counted.count(token) + params.presence_penalty
        token = int(row.argmax())
        raw_lps.append(float(torch.log_softmax(raw, -1)[token]))
        out.append(token)
        if params.stop and len(out) > params.min_tokens:
            before, now = decode_text(pair.tokenizer, out[:-1]), decode_text(pair.tokenizer, out)
            for s in params.stop:
                at = now.find(s)
                while at >= 0 and at + len(s) <= len(before):  # an occurrence that ended earlier does not count
                    at = now.find(s, at + 1)
                if at >= 0:
                    return out, "stop", s, now[:at], raw_lps
        if len(out) >= limit:
            return out, "length", None, None, raw_lps
        if token in stop_ids:
            return out, "stop", None if token in eos else token, None, raw_lps


def check(pair, prompt, params, scope="output"):
    got = decode_with_params(pair.target, prompt, params, N, pair.eos_token_id, pair.tokenizer, penalty_scope=scope)
    tokens, finish, reason, text, raw_lps = brute_force(pair, prompt, params, N, scope)
    assert got.tokens == tokens
    assert (got.finish_reason, got.stop_reason) == (finish, reason)
    if text is not None:
        assert got.text == text
    assert got.logprobs["raw"] == pytest.approx(raw_lps, abs=1e-10)
    return got


def test_penalties_bias_and_bad_words_match_brute_force_and_change_the_output(pair, prompt):
    plain, _ = greedy_decode(pair.target, prompt, N, pair.eos_token_id)
    params = RequestParams(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4,
                           logit_bias={plain[2]: -2.0}, bad_words=[[plain[0], plain[1]]])
    got = check(pair, prompt, params)
    assert got.tokens != plain  # the parameters do something on this prompt
    context = check(pair, prompt, params, scope="context")  # llama.cpp's counting: the prompt's tokens too
    assert context.logprobs["processed"] != got.logprobs["processed"]
    assert got.logprobs["processed"] != got.logprobs["raw"]


def test_plain_params_equal_greedy_decode(pair, prompt):
    plain, _ = greedy_decode(pair.target, prompt, N, pair.eos_token_id)
    got = decode_with_params(pair.target, prompt, RequestParams(), N, pair.eos_token_id, pair.tokenizer)
    assert got.tokens == plain and got.logprobs["raw"] == got.logprobs["processed"]


def test_min_tokens_holds_back_a_biased_eos(pair, prompt):
    params = RequestParams(min_tokens=3, logit_bias={pair.eos_token_id: 80.0})
    got = check(pair, prompt, params)
    assert len(got.tokens) == 4 and got.tokens[-1] == pair.eos_token_id
    assert got.text == decode_text(pair.tokenizer, got.tokens[:3])  # the EOS's text is not in `text`


def test_stop_string_cuts_text_and_ends_tokens_at_the_completing_token(pair, prompt):
    plain, _ = greedy_decode(pair.target, prompt, N, None)
    text = decode_text(pair.tokenizer, plain)
    stop = text[10:16]  # starts inside the 4th token, ends inside the 6th
    params = RequestParams(stop=["zz", stop])
    got = check(pair, prompt, params)
    first = text.find(stop)
    ends_in = len(decode_text(pair.tokenizer, [])) + 1
    while len(decode_text(pair.tokenizer, plain[:ends_in])) < first + len(stop):
        ends_in += 1
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.tokens == plain[:ends_in] and got.text == text[:first]


def test_stop_string_inside_min_tokens_is_not_honoured(pair, prompt):
    plain, _ = greedy_decode(pair.target, prompt, N, None)
    text = decode_text(pair.tokenizer, plain)
    stop = text[0:4]  # ends in the 2nd token
    assert check(pair, prompt, RequestParams(stop=[stop])).tokens == plain[:2]
    got = check(pair, prompt, RequestParams(stop=[stop], min_tokens=3))
    assert len(got.tokens) > 2  # vLLM looks only once more than min_tokens tokens exist, in the new text


def test_stop_token_ids_and_max_tokens(pair, prompt):
    plain, _ = greedy_decode(pair.target, prompt, N, None)
    stop_id = plain[3]
    got = check(pair, prompt, RequestParams(stop_token_ids=[stop_id]))
    assert got.finish_reason == "stop" and got.stop_reason == stop_id and got.tokens == plain[: plain.index(stop_id) + 1]
    short = check(pair, prompt, RequestParams(max_tokens=2))
    assert short.tokens == plain[:2] and short.finish_reason == "length"


def test_min_p_and_top_k_change_only_the_post_sampling_logprobs(pair, prompt):
    plain = decode_with_params(pair.target, prompt, RequestParams(), N, pair.eos_token_id, pair.tokenizer)
    got = decode_with_params(pair.target, prompt, RequestParams(min_p=0.05, top_k=4), N, pair.eos_token_id,
                             pair.tokenizer)
    assert got.tokens == plain.tokens and got.logprobs["raw"] == plain.logprobs["raw"]
    assert all(a >= b for a, b in zip(got.logprobs["post_sampling"], plain.logprobs["post_sampling"]))
    assert got.logprobs["post_sampling"] != plain.logprobs["post_sampling"]
    assert rq.RequestParams(min_p=0.05).sent() == ["min_p"]
