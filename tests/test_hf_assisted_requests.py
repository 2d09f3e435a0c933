"""`hf-assisted` and `hf-prompt-lookup` with request parameters (engines/adapters/hf_assisted.py): what they
send equals the reference's definition on a random pair, and what transformers defines otherwise is refused."""

from __future__ import annotations

import pytest

import wild_models as wm
from specaudit.engines.adapters.hf_assisted import HFAssisted, HFPromptLookup
from specaudit.engines.models import zoo
from specaudit.engines.registry import takes_request_params
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_with_params

PROMPTS = [[5, 9, 5, 9, 5, 9, 5, 9, 5], [17, 200, 3, 17, 200, 3, 17], [66, 67, 68, 69, 70, 71, 72, 66, 67]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def pair():
    return zoo.load_pair("tiny-llama", dtype="float64")


def test_both_engines_declare_request_params():
    assert takes_request_params("hf-assisted") and takes_request_params("hf-prompt-lookup")


@pytest.mark.parametrize("factory", [HFAssisted, HFPromptLookup])
def test_sent_parameters_give_the_reference_tokens(pair, factory):
    # each one changes the plain greedy answer of some prompt here (checked below), so a wrong mapping shows
    plain = [decode_with_params(pair.target, p, RequestParams(), NEW_TOKENS, pair.eos_token_id).tokens for p in PROMPTS]
    params = [RequestParams(logit_bias={plain[0][2]: -4.0, 77: 3.0}, max_tokens=7),
              RequestParams(repetition_penalty=1.5),
              RequestParams(min_tokens=4, stop_token_ids=(plain[2][2],), bad_words=((plain[2][1],),))]
    engine = factory(pair.target, pair.draft, draft_tokens=3, pad_token_id=pair.pad_token_id)
    engine.request_params = params
    got = engine.generate(PROMPTS, NEW_TOKENS, pair.eos_token_id)
    assert engine.last_refused == []
    for prompt, p, tokens, before in zip(PROMPTS, params, got, plain):
        want = decode_with_params(pair.target, prompt, p, NEW_TOKENS, pair.eos_token_id).tokens
        assert want != before, p  # the parameter mattered
        assert tokens == want, p


def test_what_transformers_defines_otherwise_is_refused(pair):
    engine = HFAssisted(pair.target, pair.draft, draft_tokens=3, pad_token_id=pair.pad_token_id)
    engine.request_params = [RequestParams(presence_penalty=1.0), RequestParams(frequency_penalty=0.5),
                             RequestParams(bad_words=((3, 4),)), RequestParams(stop=("ab",)), RequestParams()]
    got = engine.generate(PROMPTS[:1] * 5, 4, pair.eos_token_id)
    refused = {index: exc for index, exc in engine.last_refused}
    assert {i: e.parameter for i, e in refused.items()} == {0: "presence_penalty", 1: "frequency_penalty",
                                                           2: "bad_words", 3: "stop"}
    assert "tokenizer" in refused[3].why  # a built-in pair has no transformers tokenizer
    assert got[:4] == [[]] * 4 and len(got[4]) == 4


def test_stop_strings_that_transformers_would_match_differently_are_refused():
    table = wm.table_pair()
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(table.target, dtype="float64")
    engine = HFPromptLookup(target, None, draft_tokens=4, pad_token_id=256)
    prompt = list(b"abcdefghijklmnopqrstuvwxyz abcdef")
    engine.request_params = [RequestParams(stop=("fgh",)), RequestParams(stop=("kl",), min_tokens=2),
                             RequestParams(stop=("jk",))]
    got = engine.generate([prompt] * 3, 8, wm.EOS)
    refused = {index: exc for index, exc in engine.last_refused}
    assert sorted(refused) == [0, 1] and all(e.parameter == "stop" for e in refused.values())
    assert "across the prompt" in refused[0].why and "min_tokens" in refused[1].why
    # inside the output and completed by the target's own token (the block's last): sent, and honoured
    assert bytes(got[2]) == b"ghijk"
