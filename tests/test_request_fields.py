"""Request parameters in each server's names (engines/adapters/request_fields.py), field by field, and what
each dialect reads beside the tokens; no model needed."""

from __future__ import annotations

import pytest

from specaudit.engines.adapters.request_fields import (ParameterRefused, llamacpp_chosen_logprobs, read_sglang,
                                                       refused_in_answer)
from specaudit.engines.adapters.servers import (
    llamacpp_parse, llamacpp_request, sglang_parse, sglang_request, trtllm_request, vllm_parse, vllm_request,
)
from specaudit.engines.requests import RequestParams

EOS = 258
PARAMS = RequestParams(stop=["ab"], stop_token_ids=[7], min_tokens=2, max_tokens=5, repetition_penalty=1.2,
                       presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: -4.0}, min_p=0.1, top_k=5,
                       logprobs=3)


def test_plain_requests_are_unchanged_by_no_params():
    assert vllm_request([1], 4, EOS) == vllm_request([1], 4, EOS, params=None)
    assert llamacpp_request([1], 4, EOS) == llamacpp_request([1], 4, EOS, params=None)


def test_vllm_and_trtllm_names():
    body = vllm_request([1, 2], 8, EOS, params=PARAMS)
    assert body["stop"] == ["ab"] and body["include_stop_str_in_output"] is False
    assert body["stop_token_ids"] == [EOS, 7] and body["min_tokens"] == 2 and body["max_tokens"] == 5
    assert (body["repetition_penalty"], body["presence_penalty"], body["frequency_penalty"]) == (1.2, 0.5, 0.25)
    assert body["logit_bias"] == {"3": -4.0} and body["min_p"] == 0.1 and body["top_k"] == 5 and body["logprobs"] == 3
    trt = trtllm_request([1, 2], 8, EOS, params=PARAMS)
    assert trt["min_tokens"] == 2 and trt["logprobs"] == 1 and trt["stop_token_ids"] == [EOS, 7]
    with pytest.raises(ParameterRefused, match="bad_words"):
        trtllm_request([1], 8, EOS, params=RequestParams(bad_words=[[1]], bad_words_text=["x"]))
    with pytest.raises(ParameterRefused, match="bad_words"):  # vLLM takes text
        vllm_request([1], 8, EOS, params=RequestParams(bad_words=[[1]]))
    assert vllm_request([1], 8, EOS, params=RequestParams(bad_words=[[1]], bad_words_text=["x"]))["bad_words"] == ["x"]


def test_sglang_and_llamacpp_names():
    body = sglang_request([1, 2], 8, EOS, params=PARAMS)
    sampling = body["sampling_params"]
    assert sampling["min_new_tokens"] == 2 and sampling["max_new_tokens"] == 5 and sampling["stop"] == ["ab"]
    assert sampling["stop_token_ids"] == [EOS, 7] and sampling["logit_bias"] == {"3": -4.0}
    assert body["top_logprobs_num"] == 3
    with pytest.raises(ParameterRefused, match="stop_token_ids"):  # the first field llama.cpp has no name for
        llamacpp_request([1], 8, EOS, params=PARAMS)
    body = llamacpp_request([1], 8, EOS, params=RequestParams(stop=["ab"], max_tokens=5, repetition_penalty=1.2,
                                                              logit_bias={3: -4.0}, logprobs=3))
    # penalties over the whole context, as a count (the prompt's token and the run's 8 new ones): b11549 refuses -1
    assert body["n_predict"] == 5 and body["repeat_penalty"] == 1.2 and body["repeat_last_n"] == 9
    assert body["logit_bias"] == [[3, -4.0]] and body["n_probs"] == 3 and body["stop"] == ["ab"]


def test_what_each_dialect_reads_beside_the_tokens():
    vllm = vllm_parse({"choices": [{"token_ids": [5, 6], "text": "xy", "finish_reason": "stop", "stop_reason": "y",
                                    "logprobs": {"token_logprobs": [-0.5, 0.0], "top_logprobs": [{"token_id:5": -0.5},
                                                                                                  {"token_id:6": 0.0}]}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert vllm.report == {"text": "xy", "finish_reason": "stop", "stop_reason": "y",
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "chosen_logprobs": [-0.5, 0.0]}
    llama = llamacpp_parse({"tokens": [5, 6], "content": "xy", "stop_type": "word", "stopping_word": "y",
                            "tokens_evaluated": 3, "tokens_predicted": 2,
                            "completion_probabilities": [{"id": 5, "logprob": 0.0, "top_logprobs": []},
                                                         {"id": 6, "logprob": 0.0, "top_logprobs": []}]})
    assert llama.logprobs is None  # no alternatives: not usable for the band
    assert llama.report["chosen_logprobs"] == [0.0, 0.0] and llama.report["finish_reason"] == "stop"
    assert llama.report["stop_reason"] == "y" and llama.report["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
    answer = {"text": "xy", "meta_info": {"finish_reason": {"type": "stop", "matched": 7}, "prompt_tokens": 3,
                                          "completion_tokens": 2, "output_token_logprobs": [[-0.1, 5, None], [-0.2, 7, None]]}}
    assert sglang_parse(answer).report == read_sglang(answer)
    assert read_sglang(answer)["stop_reason"] == 7 and read_sglang(answer)["chosen_logprobs"] == [-0.1, -0.2]


def test_a_400_naming_a_sent_field_is_a_refusal():
    assert refused_in_answer("sglang", PARAMS, "HTTP 400: min_new_tokens is not supported") == "min_tokens"
    assert refused_in_answer("vllm", RequestParams(top_k=3), "HTTP 400: prompt too long") is None
    both = RequestParams(stop=["x"], stop_token_ids=[7])
    assert refused_in_answer("vllm", both, "HTTP 400: stop_token_ids must be a list") == "stop_token_ids"
    assert refused_in_answer("vllm", both, "HTTP 400: 'stop' too long") == "stop"
    assert refused_in_answer("vllm", RequestParams(top_k=3), "HTTP 400: unknown field stop_k") is None


def test_llamacpp_log_probabilities_are_placed_by_their_bytes():
    """llama.cpp's entries are per complete UTF-8 character (tests/test_wild_llamacpp.py shows it on the
    tiny-llama pair): these 12 tokens came back with 9 entries; a lead byte (209, 202) has none, the
    next token's entry carries both bytes, and the trailing lone 202 has none."""
    tokens = [143, 129, 209, 104, 57, 130, 202, 99, 175, 33, 18, 202]
    runs = [[143], [129], [209, 104], [57], [130], [202, 99], [175], [33], [18]]
    probs = [{"id": run[-1], "bytes": run, "logprob": -0.5 - index, "top_logprobs": []} for index, run in enumerate(runs)]
    chosen = llamacpp_chosen_logprobs(probs, tokens)
    assert chosen == [-0.5, -1.5, None, -2.5, -3.5, -4.5, None, -5.5, -6.5, -7.5, -8.5, None]
    answer = {"tokens": tokens, "content": "", "stop_type": "limit", "completion_probabilities": probs}
    assert llamacpp_parse(answer).report["chosen_logprobs"] == chosen
    # an entry that names a token not within its bytes' reach cannot be placed: nothing is read
    assert llamacpp_chosen_logprobs([{"id": 104, "bytes": [104], "logprob": -1.0}], tokens) is None
    assert llamacpp_chosen_logprobs(probs[:2] + [{"id": 57, "bytes": [209, 104], "logprob": -1.0}], tokens) is None
    # without `bytes` (older builds) an entry covers one token
    assert llamacpp_chosen_logprobs([{"id": 143, "logprob": -1.0}, {"id": 129, "logprob": -2.0}], tokens[:2]) == [-1.0, -2.0]
