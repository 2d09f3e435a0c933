"""The request-parameter strategy: valid parameters, every family reachable alone, the plain request the
shrink target; and drawn parameters against the fake vLLM that decodes with the tiny model: a correct
server is clean whatever is drawn (a parameter vLLM cannot take by id is refused, not a divergence)."""

from __future__ import annotations

import pytest
from fake_server import FakeServer
from hex_tokenizer import HexTokenizer
from hypothesis import HealthCheck, example, find, given, settings
from request_server import vllm_answer

from specaudit.engines.adapters.servers import VLLMEngine
from specaudit.engines.models import zoo
from specaudit.engines.requests import RequestParams
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.testing.request_strategies import request_params

EOS = 258


@settings(max_examples=60, deadline=None)
@given(params=request_params(vocab_size=259, stop_token_candidates=[7, 9]))
def test_drawn_params_are_valid_and_round_trip(params):
    assert RequestParams.from_dict(params.to_dict()) == params
    assert all(0 <= t < 259 for t, _ in params.logit_bias)
    assert all(0 <= t < 259 for word in params.bad_words for t in word)


def test_every_family_is_reachable_and_plain_is_the_shrink_target():
    seen: set[str] = set()

    @settings(max_examples=150, database=None, deadline=None)
    @given(params=request_params(vocab_size=259, stop_token_candidates=[7]))
    def collect(params):
        seen.update(params.sent())

    collect()
    assert seen >= {"stop", "stop_token_ids", "min_tokens", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "logit_bias", "bad_words", "min_p", "top_k"}
    smallest = find(request_params(vocab_size=259), lambda p: True, settings=settings(database=None))
    assert smallest.is_plain() and smallest.logprobs is None
    with_bias = find(request_params(vocab_size=259), lambda p: bool(p.logit_bias), settings=settings(database=None))
    assert with_bias.sent() == ["logit_bias"] and with_bias.logit_bias == ((0, 0.0),)


@pytest.fixture(scope="module")
def pair():
    pair = zoo.load_pair("tiny-llama", dtype="float64")
    pair.tokenizer = HexTokenizer()
    return pair


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=request_params(vocab_size=259, stop_token_candidates=[7, EOS], max_abs_bias=20.0))
@example(params=RequestParams(stop=(".",), min_tokens=3))  # found by this test: the stop window inside min_tokens
def test_correct_server_is_clean_under_drawn_params(pair, params):
    prompt = list(b"Once")
    with FakeServer(vllm_answer(pair.target, pair.tokenizer, EOS)) as server:
        run = audit_engine(VLLMEngine(server.url), pair, [prompt], RunSettings(max_new_tokens=6, eos_token_id=EOS, dtype="float64",
                         engine_name="vllm:fake", batch_size=1, requests=(params,)))
    assert run["divergences"] == []
    if params.bad_words:
        assert run["refused_parameters"][0]["parameter"] == "bad_words"
    else:
        assert run["exact_matches"] == 1 and run["refused_parameters"] == []
