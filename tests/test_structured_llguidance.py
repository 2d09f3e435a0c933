"""Structured outputs with llguidance (`--grammar-backend llguidance`, engines/constraints/llguidance_matcher.py):
the grammar engine llama.cpp applies to a JSON schema. The reference masks with it and admits EOS only where the
grammar accepts; EQSPEC, EXSPEC and INPLACE equal that reference under every kind, rolling back rejected draft
tokens; a rolled-back matcher admits what a fresh one advanced over the kept tokens admits."""

from __future__ import annotations

import json

import pytest
import torch

from specaudit.engines.constraints import Constraint
from specaudit.engines.constraints.check import output_bytes, violation
from specaudit.engines.constraints.fields import dialect_refusal, llamacpp_fields
from specaudit.engines.constraints.llguidance_matcher import LLGuidanceMatcher, llguidance_grammar
from specaudit.engines.constraints.matcher import ConstraintError, RowMatcher, mask
from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_with_params
from cli_run import audit, usage_error

EOS = 258
N = 20
PROMPTS = [list(b"Hello"), list(b"The JSON is"), list(b"x"), list(b"answer: ")]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}
EACH = [Constraint("json_schema", json.dumps(SCHEMA), backend="llguidance"),
        Constraint("json_object", backend="llguidance"),
        Constraint("regex", r"[a-f]{2,5}-\d+", backend="llguidance"),
        Constraint("choice", choices=("alpha", "beta", "gamma"), backend="llguidance"),
        Constraint("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"', backend="llguidance")]


@pytest.fixture(scope="module")
def pair():
    return zoo.load_pair("tiny-llama", dtype="float64")


@pytest.fixture(scope="module")
def kinds(pair):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(EACH))]
    params = [RequestParams(constraint=c) for c in EACH]
    refs = [decode_with_params(pair.target, p, q, N, EOS, pair.tokenizer) for p, q in zip(prompts, params)]
    return prompts, params, refs


def test_the_json_kinds_are_the_grammar_llama_cpp_writes():
    assert llguidance_grammar(EACH[0]) == "%llguidance {}\nstart: %json " + json.dumps(SCHEMA, separators=(",", ":"))
    assert llamacpp_fields(EACH[0]) == {"json_schema": SCHEMA}
    assert dialect_refusal("llamacpp", Constraint("json_schema", json.dumps(SCHEMA))) is not None  # xgrammar's
    with pytest.raises(ConstraintError):
        LLGuidanceMatcher(Constraint("json_object", backend="llguidance", any_whitespace=False), None, 260, [EOS])


def test_the_reference_under_llguidance_takes_the_masked_argmax_and_satisfies_the_constraint(pair, kinds):
    prompts, params, refs = kinds
    for p, ref in zip(params, refs):
        assert isinstance(RowMatcher(p.constraint, pair.tokenizer, 260, [EOS]), LLGuidanceMatcher)
        for position, token in enumerate(ref.tokens):
            assert int(mask(ref.logits[position], ref.allowed[position]).argmax()) == token
        text, finished = output_bytes(ref.tokens, pair.tokenizer, [EOS])
        assert violation(p.constraint, text, finished) is None, (p.constraint, text)
        if finished:
            allowed_before_eos = ref.allowed[len(ref.tokens) - 1]
            assert bool(allowed_before_eos[EOS])


def test_eos_waits_for_an_accepting_state_under_llguidance(pair):
    ref = decode_with_params(pair.target, PROMPTS[0], RequestParams(logit_bias={EOS: 100.0},
                             constraint=Constraint("regex", "ab(c)?", backend="llguidance")), N, EOS, pair.tokenizer)
    assert ref.tokens == [ord("a"), ord("b"), EOS]


def test_a_rolled_back_matcher_is_a_fresh_one_advanced_over_the_kept_tokens(pair):
    text = list(b'{"name":"abc","n":12}')
    matcher = RowMatcher(EACH[0], pair.tokenizer, 260, [EOS])
    for token in text[:13]:  # {"name":"abc"
        assert matcher.advance(token)
    assert not matcher.advance(ord("x"))  # after the value's closing quote: a comma (or whitespace), never x
    for token in text[13:]:
        assert matcher.advance(token)
    assert matcher.advance(EOS) and matcher.terminated and not matcher.advance(ord("a"))
    matcher.rollback(len(text) + 1 - 13)  # the EOS and everything after {"name":"abc"
    fresh = RowMatcher(EACH[0], pair.tokenizer, 260, [EOS])
    for token in text[:13]:
        fresh.advance(token)
    assert matcher.consumed == 13 and not matcher.terminated
    assert torch.equal(matcher.allowed(), fresh.allowed())
    assert not bool(matcher.allowed()[EOS])  # the object is not closed


@pytest.mark.parametrize("name", ["eqspec", "exspec", "inplace"])
def test_own_engines_equal_the_llguidance_reference_under_every_kind(pair, kinds, name):
    prompts, params, refs = kinds
    engine = make_engine(name, pair.target, pair.draft, batch_size=3, draft_tokens=4)
    engine.request_params, engine.request_tokenizer = list(params), pair.tokenizer
    outputs = engine.generate([list(p) for p in prompts], N, EOS)
    assert outputs == [r.tokens for r in refs]


def test_the_cli_refuses_xgrammars_whitespace_rule_under_llguidance(tmp_path):
    usage_error(audit("--engine", "eqspec", "--pair", "tiny-llama", "--json-object", "--no-any-whitespace",
                      "--grammar-backend", "llguidance", "--num-prompts", "1", out=tmp_path), "--no-any-whitespace")
