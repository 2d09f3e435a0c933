"""The request parameters' logits processors (engines/requests.py): each against its documented formula,
written out element by element here, and against transformers' processor where the definition is the same."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from specaudit.engines import requests as rq
from specaudit.engines.requests import RequestParams

V = 12


def row(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, dtype=torch.float64) * 3  # [V], both signs


def test_repetition_penalty_formula_and_transformers():
    logits, seen, penalty = row(1), [0, 3, 3, 7, 11], 1.7
    got = rq.apply_repetition_penalty(logits, seen, penalty)
    for t in range(V):
        x = float(logits[t])
        want = (x / penalty if x > 0 else x * penalty) if t in seen else x
        assert float(got[t]) == pytest.approx(want, abs=0, rel=1e-15)
    hf = transformers.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), logits.clone().unsqueeze(0))[0]
    assert torch.equal(got, hf)


def test_frequency_presence_count_what_they_are_given():
    logits, output = row(2), [4, 4, 4, 9]
    got = rq.apply_frequency_presence(logits, output, frequency=0.5, presence=0.25)
    for t in range(V):
        count = output.count(t)
        assert float(got[t]) == float(logits[t]) - 0.5 * count - 0.25 * (count > 0)
    # vLLM counts the output only: the prompt's tokens are untouched unless the output has them
    params = RequestParams(frequency_penalty=1.0)
    vllm = rq.process(logits, prompt=[1, 2], output=[4], params=params, stop_ids=[]).greedy
    llama = rq.process(logits, prompt=[1, 2], output=[4], params=params, stop_ids=[], penalty_scope="context").greedy
    assert float(vllm[1]) == float(logits[1]) and float(llama[1]) == float(logits[1]) - 1.0
    assert float(vllm[4]) == float(llama[4]) == float(logits[4]) - 1.0


def test_logit_bias_adds_and_matches_single_token_sequence_bias():
    logits = row(3)
    got = rq.apply_logit_bias(logits, {2: 5.0, 6: -100.0})
    want = logits.clone()
    want[2] += 5.0
    want[6] -= 100.0
    assert torch.equal(got, want)
    hf = transformers.SequenceBiasLogitsProcessor([[[2], 5.0], [[6], -100.0]])(torch.tensor([[0, 1]]), logits.clone().unsqueeze(0))[0]
    assert torch.allclose(got, hf, rtol=0, atol=1e-12)


def test_min_tokens_bans_stop_ids_until_reached_and_matches_transformers():
    logits = row(4)
    early = rq.apply_min_tokens(logits, output_length=2, min_tokens=3, stop_ids=[5, 8])
    assert early[5] == -math.inf and early[8] == -math.inf
    assert torch.equal(early[[i for i in range(V) if i not in (5, 8)]], logits[[i for i in range(V) if i not in (5, 8)]])
    assert torch.equal(rq.apply_min_tokens(logits, output_length=3, min_tokens=3, stop_ids=[5, 8]), logits)
    prompt, output = [1, 2, 3], [4, 4]
    hf = transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 3, [5, 8])(
        torch.tensor([prompt + output]), logits.clone().unsqueeze(0))[0]
    assert torch.equal(early, hf)


def test_bad_words_match_the_output_tail_only():
    logits = row(5)
    words = [[7], [1, 2, 9], [3, 10]]
    got = rq.apply_bad_words(logits, words, output=[0, 1, 2])
    assert got[7] == -math.inf and got[9] == -math.inf  # one-token word always, [1, 2] is the tail
    assert got[10] == logits[10]  # [3] is not the tail
    # the prefix in the prompt does not count (vLLM looks at output tokens): nothing but the one-token word
    only_prompt = rq.apply_bad_words(logits, words, output=[])
    assert only_prompt[9] == logits[9] and only_prompt[7] == -math.inf
    # transformers looks at prompt + output; where the prefix lies in the output they agree
    hf = transformers.NoBadWordsLogitsProcessor(words)(torch.tensor([[5, 0, 1, 2]]), logits.clone().unsqueeze(0))[0]
    assert torch.equal(got, hf)


def test_min_p_and_top_k_never_remove_the_top_token_and_match_transformers():
    logits = row(6)
    top = int(logits.argmax())
    min_p = rq.apply_min_p(logits, 0.2)
    probs = torch.softmax(logits, -1)
    for t in range(V):
        assert (min_p[t] == -math.inf) == bool(probs[t] < 0.2 * probs.max())
    assert int(min_p.argmax()) == top
    hf = transformers.MinPLogitsWarper(0.2)(torch.tensor([[0]]), logits.clone().unsqueeze(0))[0]
    assert torch.equal(min_p, hf)
    top3 = rq.apply_top_k(logits, 3)
    assert int((top3 > -math.inf).sum()) == 3 and int(top3.argmax()) == top
    assert torch.equal(top3, transformers.TopKLogitsWarper(3)(torch.tensor([[0]]), logits.clone().unsqueeze(0))[0])
    # under greedy they leave the choice alone but change the reported distribution
    params = RequestParams(min_p=0.2, top_k=3)
    processed = rq.process(logits, [0], [], params, [])
    assert int(processed.greedy.argmax()) == int(processed.post_sampling.argmax()) == top
    assert float(rq.log_softmax(processed.post_sampling)[top]) > float(rq.log_softmax(processed.greedy)[top])


def test_process_order_is_vllms_bias_before_repetition_penalty():
    # a negative logit biased positive, then penalised: divided (the bias came first), not multiplied
    logits = torch.zeros(V, dtype=torch.float64)
    logits[3] = -1.0
    params = RequestParams(logit_bias={3: 3.0}, repetition_penalty=2.0)
    got = rq.process(logits, prompt=[3], output=[], params=params, stop_ids=[]).greedy
    assert float(got[3]) == (-1.0 + 3.0) / 2.0
    skipped = rq.process(logits, prompt=[3], output=[], params=params, stop_ids=[], skip="logit_bias").greedy
    assert float(skipped[3]) == -2.0


def test_params_round_trip_and_refuse_bad_values():
    params = RequestParams(stop="ab", stop_token_ids=[5], min_tokens=2, logit_bias={"7": -1.5, 3: 2},
                           bad_words=[[1, 2]], repetition_penalty=1.3, logprobs=3)
    assert params.stop == ("ab",) and params.logit_bias == ((3, 2.0), (7, -1.5))
    assert RequestParams.from_dict(params.to_dict()) == params
    assert set(params.sent()) == {"stop", "stop_token_ids", "min_tokens", "logit_bias", "bad_words", "repetition_penalty"}
    assert RequestParams().is_plain() and hash(params)
    with pytest.raises(ValueError, match="unknown request parameter"):
        RequestParams.from_dict({"stopp": ["x"]})
    with pytest.raises(ValueError, match="min_tokens"):
        RequestParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match="repetition_penalty"):
        RequestParams(repetition_penalty=0.0)
