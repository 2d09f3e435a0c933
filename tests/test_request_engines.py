"""Request parameters on the project's own engines (engines/requests/rows.py, through the acceptance rule):
in float64 every engine's tokens equal the reference's (`decode_with_params`) under drawn and chosen
parameters, rows of a batch accepting different numbers of draft tokens; a verify pass processed with
the committed history alone is caught and named; the CLI audits an own engine with request flags."""

from __future__ import annotations

import pytest
import torch
from cli_run import audit as cli_audit, runs
from hex_tokenizer import hex_pair
from hypothesis import HealthCheck, given, settings, strategies as st

from specaudit.engines import acceptance
from specaudit.engines.reference import greedy_decode
from specaudit.engines.registry import make_engine, takes_request_params
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_text, decode_with_params
from specaudit.engines.requests.rows import RowRequests
from specaudit.equivalence.blackbox.outputs import check_report
from specaudit.testing.request_strategies import request_params

EOS = 258
N = 12
OWN_ENGINES = ("reference", "batched", "eqspec", "exspec", "inplace", "fixedshape")
PROMPTS = [list(b"The cat sat"), list(b"Hello there"), list(b"ab"), list(b"Once upon a time in")]


@pytest.fixture(scope="module")
def pair():
    return hex_pair()


@pytest.fixture(scope="module")
def chosen_params(pair):
    """One request of each kind, built from the plain outputs so that each parameter acts: penalties with
    `min_tokens` and a pull toward EOS, a stop string completed inside the output, a stop id, a banned
    word and `max_tokens`, and `min_tokens` past which EOS wins (with `top_k`, `min_p`)."""
    plain = [greedy_decode(pair.target, p, N, EOS)[0] for p in PROMPTS]
    text = decode_text(pair.tokenizer, plain[1])
    return [RequestParams(repetition_penalty=1.3, min_tokens=3, logit_bias={EOS: 8.0}),
            RequestParams(stop=[text[9:13]], frequency_penalty=0.4, presence_penalty=0.2),
            RequestParams(stop_token_ids=[plain[2][4]], bad_words=[[plain[2][1]]], max_tokens=9),
            RequestParams(min_tokens=5, logit_bias={EOS: 30.0}, top_k=5, min_p=0.1)]


def references(pair, prompts, params, max_new_tokens=N):
    return [decode_with_params(pair.target, p, q, max_new_tokens, EOS, pair.tokenizer).tokens
            for p, q in zip(prompts, params)]


def run_engine(pair, name, prompts, params, batch_size, max_new_tokens=N, draft_tokens=3):
    engine = make_engine(name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=draft_tokens)
    engine.request_params, engine.request_tokenizer = list(params), pair.tokenizer
    return engine, engine.generate([list(p) for p in prompts], max_new_tokens, EOS)


def test_every_own_engine_declares_request_params():
    assert all(takes_request_params(name) for name in OWN_ENGINES)


@pytest.mark.parametrize("name", OWN_ENGINES)
def test_own_engine_equals_the_reference_under_request_params(pair, chosen_params, name):
    expected = references(pair, PROMPTS, chosen_params)
    assert expected[1][-1] != EOS and len(expected[1]) < N  # the stop string ended it
    assert len(expected[2]) <= 9 and expected[3][-1] == EOS and len(expected[3]) > 5
    engine, outputs = run_engine(pair, name, PROMPTS, chosen_params, batch_size=3)  # 3 rows: one refill or batch more
    assert outputs == expected
    if engine.k:  # rows of one step accepted different numbers of draft tokens
        steps = [s for s in engine.last_trace.steps if s.kind != "prefill" and len(s.rows) > 1]
        assert any(len(set(s.accepted_counts)) > 1 for s in steps)


def test_plain_params_run_the_plain_path(pair):
    engine, outputs = run_engine(pair, "eqspec", PROMPTS, [RequestParams()] * len(PROMPTS), batch_size=4)
    assert engine.active_requests is None
    plain = make_engine("eqspec", pair.target, pair.draft, batch_size=4, draft_tokens=3)
    assert outputs == plain.generate([list(p) for p in PROMPTS], N, EOS)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          database=None)
@given(data=st.data())
def test_drawn_params_on_own_engines_equal_the_reference(pair, data):
    name = data.draw(st.sampled_from(("eqspec", "exspec", "inplace", "fixedshape", "batched")), label="engine")
    prompts = PROMPTS[:3]
    params = [data.draw(request_params(vocab_size=259, stop_token_candidates=[33, 46, 200], max_min_tokens=6),
                        label=f"params {i}") for i in range(len(prompts))]
    _, outputs = run_engine(pair, name, prompts, params, batch_size=3, max_new_tokens=10)
    assert outputs == references(pair, prompts, params, 10)


def test_verify_positions_see_the_drafts_before_them(pair):
    """`min_tokens` = 2 after one committed token: position 0 (history of 1 token) bans EOS, position 1
    (the committed token and one draft token: 2) no longer does."""
    requests = RowRequests([[1, 2]], [RequestParams(min_tokens=2)], EOS)
    requests.rows[0].output.append(5)
    logits = torch.zeros(1, 3, 259, dtype=torch.float64)  # [B, k+1, V]
    logits[..., EOS] = 1.0
    drafts = torch.tensor([[7, 8]])  # [B, k]
    processed = requests.step([0]).process(logits, drafts)  # [B, k+1, V]
    assert processed[0, 0, EOS] == -float("inf") and processed[0, 1, EOS] == 1.0 and processed[0, 2, EOS] == 1.0
    verdict = acceptance.accept(logits, torch.tensor([[0, 9]]), 5, EOS, requests=requests.step([0]))
    assert verdict.accepted.tolist() == [1] and verdict.tokens[0, 1].item() == EOS and verdict.done.tolist() == [True]
    assert requests.rows[0].output == [5, 0, EOS]  # committed: the accepted draft, then EOS


def test_an_empty_report_raises_no_finding(pair, chosen_params):
    prompt, params = PROMPTS[1], chosen_params[1]
    reference = decode_with_params(pair.target, prompt, params, N, EOS, pair.tokenizer)
    assert check_report(1, prompt, params, reference, reference.tokens, {}, EOS, pair.tokenizer) == []


def test_cli_audits_an_own_engine_with_request_flags(tmp_path):
    flags = ("--pair", "tiny-llama", "--min-tokens", "3", "--repetition-penalty", "1.3", "--logit-bias", "258:30",
             "--batch-size", "4", "--num-prompts", "4", "--max-new-tokens", "12", "--no-adversarial")
    result = cli_audit("--engine", "eqspec", *flags, out=tmp_path / "ok")
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = runs(tmp_path / "ok")
    assert run["exact_matches"] == 4 and run["structural_divergences"] == 0
    assert run["speculation"]["drafted_tokens"] > 0  # read from the engine's trace

    planted = "specaudit.testing.faults.acceptance:VerifyWithCommittedHistory"
    result = cli_audit("--engine", planted, *flags, out=tmp_path / "planted")
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path / "planted")
    classes = {d["diagnosis"]["class"] for d in run["divergences"] if d["kind"] == "structural"}
    assert classes == {"logits_processor"}, run["divergences"]


@pytest.mark.parametrize("pair_name", ["tiny-lfm2", "tiny-gemma3"])
def test_request_params_on_recurrent_and_sliding_pairs(pair_name):
    """Rows rolled back to their last accepted token (short convolutions) and sliding windows: the same."""
    from specaudit.engines.models import zoo

    other = zoo.load_pair(pair_name, dtype="float64")
    eos = other.eos_token_id
    prompts = [list(b"The cat sat"), list(b"Hello there, my friend"), list(b"ab")]
    params = [RequestParams(repetition_penalty=1.5, min_tokens=4),
              RequestParams(frequency_penalty=0.5, presence_penalty=0.5, stop=["e"]),
              RequestParams(logit_bias={prompts[2][0]: 5.0}, bad_words=[[prompts[0][1]]], max_tokens=7)]
    expected = [decode_with_params(other.target, p, q, 10, eos, other.tokenizer).tokens for p, q in zip(prompts, params)]
    assert expected != [greedy_decode(other.target, p, 10, eos)[0] for p in prompts]  # the parameters act
    for name in ("eqspec", "exspec"):
        engine = make_engine(name, other.target, other.draft, batch_size=3, draft_tokens=3)
        engine.request_params, engine.request_tokenizer = params, other.tokenizer
        assert engine.generate([list(p) for p in prompts], 10, eos) == expected, name
