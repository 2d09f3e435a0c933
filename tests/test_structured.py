"""Structured outputs under speculation (engines/constraints/, docs/structured.md): the constrained reference
takes the argmax of the grammar-masked float64 row at every step and admits EOS only where the grammar accepts;
EQSPEC, EXSPEC and INPLACE (and the batched and reference engines) equal it under every constraint kind, rows
of a batch accepting different numbers of draft tokens; the draft's mask keeps acceptance up; every planted
grammar fault diverges, breaks its constraint and is named by its own class; the CLI refuses what it cannot
audit with one line."""

from __future__ import annotations

import json

import pytest
import torch
from cli_run import audit as cli_audit, runs
from hypothesis import HealthCheck, given, settings, strategies as st

from specaudit.engines.constraints import Constraint
from specaudit.engines.constraints.check import violation
from specaudit.engines.constraints.matcher import allowed_after, mask
from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_with_params
from specaudit.engines.constraints.check import output_bytes
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.testing.constraint_strategies import constraints
from specaudit.testing.faults.constrained import EXPECTED_CLASS, CONSTRAINT_FAULTS, DraftUnmasked

EOS = 258
N = 20
PROMPTS = [list(b"Hello"), list(b"The JSON is"), list(b"x"), list(b"answer: ")]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
ONE_OF_EACH = [Constraint("json_schema", json.dumps(SCHEMA), any_whitespace=False),
               Constraint("regex", r"[a-f]{2,5}-\d+"),
               Constraint("choice", choices=("alpha", "beta", "gamma")),
               Constraint("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"'),
               Constraint("json_object", any_whitespace=False),
               Constraint("grammar", 'start: "(" inner ")"\ninner: /[0-9]+/ | "(" inner ")"')]


@pytest.fixture(scope="module")
def pair():
    return zoo.load_pair("tiny-llama", dtype="float64")


@pytest.fixture(scope="module")
def kinds(pair):
    """Each constraint of ONE_OF_EACH on a prompt, with its reference."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(ONE_OF_EACH))]
    params = [RequestParams(constraint=c) for c in ONE_OF_EACH]
    refs = [decode_with_params(pair.target, p, q, N, EOS, pair.tokenizer) for p, q in zip(prompts, params)]
    return prompts, params, refs


def run(pair, engine_or_name, prompts, params, batch_size=3, draft_tokens=4, max_new_tokens=N):
    engine = (make_engine(engine_or_name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=draft_tokens)
              if isinstance(engine_or_name, str) else engine_or_name)
    engine.request_params, engine.request_tokenizer = list(params), pair.tokenizer
    return engine, engine.generate([list(p) for p in prompts], max_new_tokens, EOS)


def accepted(engine) -> int:
    return sum(sum(step.accepted_counts) for step in engine.last_trace.steps)


# --- the record and the text check ----------------------------------------------------------------

def test_constraint_round_trips_and_refuses_bad_input():
    for c in ONE_OF_EACH:
        assert Constraint.from_dict(json.loads(json.dumps(c.to_dict()))) == c
        assert RequestParams.from_dict(RequestParams(constraint=c).to_dict()).constraint == c
    assert ONE_OF_EACH[3].grammar_syntax == "ebnf" and ONE_OF_EACH[5].grammar_syntax == "lark"
    for bad in ({"kind": "yaml"}, {"kind": "json_schema", "schema": "{nope"}, {"kind": "choice"},
                {"kind": "regex", "text": "a", "backend": "outlines"}, {"kind": "regex", "text": "a", "colour": 1},
                {"kind": "json_object", "text": "x"}):
        with pytest.raises(ValueError):
            Constraint.from_dict(bad)
    assert RequestParams(constraint=ONE_OF_EACH[1], temperature=0.5).sampled  # sampled: tests/test_structured_sampled.py


def test_violation_reads_each_kind_from_the_text():
    schema, regex, choice, grammar, obj, lark = ONE_OF_EACH
    assert violation(schema, '{"name":"ab","n":3}', True) is None
    assert "leaves" in violation(schema, '{"name":"ab","n":"3"}', True)
    assert violation(schema, '{"name":"ab"', False) is None  # cut at its budget: a prefix is enough
    assert "not JSON" in violation(schema, '{"name":"ab"', True)
    assert violation(regex, "abc-12", True) is None and violation(regex, "abc-", True) is not None
    assert violation(choice, "beta", True) is None and violation(choice, "bet", True) is not None
    assert violation(grammar, "((12))", True) is None and violation(grammar, "((12)", True) is not None
    assert violation(lark, "((12))", True) is None and violation(lark, "(1a)", False) is not None
    assert violation(obj, '{"a":[1]}', True) is None and violation(obj, "[1]", True) is not None


# --- the reference -----------------------------------------------------------------------------------

def test_reference_takes_the_argmax_of_the_masked_row_and_satisfies_the_constraint(pair, kinds):
    prompts, params, refs = kinds
    for prompt, p, ref in zip(prompts, params, refs):
        assert ref.allowed is not None and len(ref.allowed) == len(ref.tokens)
        for position, token in enumerate(ref.tokens):
            row = mask(ref.logits[position], ref.allowed[position])
            assert int(row.argmax()) == token
            replayed = allowed_after(p.constraint, pair.tokenizer, row.shape[0], [EOS], ref.tokens[:position])
            assert torch.equal(replayed, ref.allowed[position])
        text, finished = output_bytes(ref.tokens, pair.tokenizer, [EOS])
        assert violation(p.constraint, text, finished) is None, (p.constraint, text)
    assert any(r.finish_reason == "stop" for r in refs) and any(r.finish_reason == "length" for r in refs)
    unmasked = decode_with_params(pair.target, prompts[2], RequestParams(), N, EOS, pair.tokenizer)
    assert unmasked.tokens != refs[2].tokens  # the constraint changed the output


def test_eos_is_admitted_only_where_the_grammar_accepts(pair):
    """A logit bias of +100 on EOS: unconstrained the row ends at once; under `ab(c)?` EOS waits for "ab"."""
    pulled = decode_with_params(pair.target, PROMPTS[0], RequestParams(logit_bias={EOS: 100.0}), N, EOS)
    assert pulled.tokens == [EOS]
    ref = decode_with_params(pair.target, PROMPTS[0], RequestParams(logit_bias={EOS: 100.0},
                             constraint=Constraint("regex", "ab(c)?")), N, EOS, pair.tokenizer)
    assert ref.tokens == [ord("a"), ord("b"), EOS]
    assert not bool(ref.allowed[0][EOS]) and not bool(ref.allowed[1][EOS]) and bool(ref.allowed[2][EOS])


# --- the engines ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["eqspec", "exspec", "inplace", "batched", "reference", "fixedshape"])
def test_own_engines_equal_the_constrained_reference_under_every_kind(pair, kinds, name):
    prompts, params, refs = kinds
    engine, outputs = run(pair, name, prompts, params)
    assert outputs == [r.tokens for r in refs]
    if name in ("eqspec", "exspec", "inplace"):
        counts = [c for step in engine.last_trace.steps if step.kind != "prefill" for c in step.accepted_counts]
        assert len(set(counts)) > 1  # ragged: rows accepted different numbers of draft tokens


def test_prompt_lookup_drafts_under_a_constraint_stay_exact(pair, kinds):
    prompts, params, refs = kinds
    engine = make_engine("eqspec", pair.target, None, batch_size=2, draft_tokens=3, drafter="prompt-lookup")
    _, outputs = run(pair, engine, prompts, params)
    assert outputs == [r.tokens for r in refs]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_constraints_on_speculative_engines_equal_the_reference(pair, data):
    drawn = [data.draw(constraints()) for _ in range(3)]
    name = data.draw(st.sampled_from(["eqspec", "exspec", "inplace"]))
    params = [RequestParams(constraint=c) for c in drawn]
    refs = [decode_with_params(pair.target, p, q, 12, EOS, pair.tokenizer).tokens for p, q in zip(PROMPTS, params)]
    _, outputs = run(pair, name, PROMPTS[:3], params, batch_size=3, max_new_tokens=12)
    assert outputs == refs


def test_the_drafts_mask_keeps_acceptance_up(pair, kinds):
    prompts, params, refs = kinds
    masked, masked_out = run(pair, "eqspec", prompts, params)
    unmasked, unmasked_out = run(pair, DraftUnmasked(pair.target, pair.draft, batch_size=3, draft_tokens=4),
                                 prompts, params)
    assert masked_out == unmasked_out == [r.tokens for r in refs]  # exact either way
    assert accepted(masked) > 2 * accepted(unmasked)


# --- planted faults ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", CONSTRAINT_FAULTS, ids=lambda f: f.__name__)
def test_each_grammar_fault_diverges_breaks_the_constraint_and_is_named(pair, fault):
    prompts = PROMPTS[:3]
    params = [RequestParams(constraint=c) for c in ONE_OF_EACH[:3]]
    engine = fault(pair.target, pair.draft, batch_size=3, draft_tokens=4)
    record = audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=N, eos_token_id=EOS, dtype="float64",
                         engine_name=fault.__name__, batch_size=3, requests=tuple(params)))
    assert not record["equivalent"] and record["structural_divergences"] > 0
    classes = [d["diagnosis"]["class"] for d in record["divergences"]]
    assert EXPECTED_CLASS[fault.__name__] in classes
    assert "constraint_violation" in classes
    named = {d["diagnosis"]["class"] for d in record["divergences"] if d["diagnosis"]["class"] != "constraint_violation"}
    assert named == {EXPECTED_CLASS[fault.__name__]}


def test_a_correct_engine_has_no_constraint_finding(pair):
    params = [RequestParams(constraint=c) for c in ONE_OF_EACH[:3]]
    engine = make_engine("eqspec", pair.target, pair.draft, batch_size=3, draft_tokens=4)
    record = audit_engine(engine, pair, PROMPTS[:3], RunSettings(max_new_tokens=N, eos_token_id=EOS, dtype="float64",
                         engine_name="eqspec", batch_size=3, requests=tuple(params)))
    assert record["equivalent"] and record["divergences"] == []


# --- the command line -------------------------------------------------------------------------------------

def test_cli_audits_and_refuses_constraints(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    common = ("--pair", "tiny-llama", "--num-prompts", "2", "--max-new-tokens", "10", "--no-adversarial",
              "--batch-size", "2")
    ok = cli_audit(*common, "--engine", "eqspec", "--json-schema", str(schema), "--no-any-whitespace", out=tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    [run_record] = runs(tmp_path / "ok")
    assert run_record["request_params"][0]["constraint"] == {"kind": "json_schema", "schema": SCHEMA,
                                                             "any_whitespace": False}
    planted = cli_audit(*common, "--engine", "specaudit.testing.faults.constrained:BonusTokenUnmasked",
                        "--regex", "[a-f]{2,5}-[0-9]+", out=tmp_path / "bad")
    assert planted.returncode == 1
    recording = tmp_path / "recorded.jsonl"
    recording.write_text(json.dumps({"prompt_ids": [72, 101], "output_ids": [97, 98]}) + "\n")
    refusals = [(("--engine", "eqspec", "--regex", "a", "--choice", "b"), "one constraint per audit"),
                (("--engine", "eqspec", "--json-schema", str(tmp_path / "missing.json")), "missing.json"),
                (("--engine", "eqspec", "--regex", "a", "--grammar-backend", "outlines"), "outlines"),
                (("--engine", "hf-assisted", "--regex", "a+"), "takes no structured-output constraint"),
                (("--engine", "llamacpp:http://127.0.0.1:9", "--regex", "a+"), "no regex"),
                (("--engine", f"recorded:{recording}", "--regex", "a", "--temperature", "0.5"), "a recording says nothing")]
    for flags, why in refusals:
        result = cli_audit(*common, *flags, out=tmp_path / "no")
        assert result.returncode == 2, (flags, result.stderr)
        assert why in result.stderr, (flags, result.stderr)
        assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1, result.stderr


def test_prompts_file_gives_each_prompt_its_own_constraint(tmp_path):
    from specaudit.equivalence.blackbox.requests_run import prompt_params

    lines = [{"prompt": "a", "params": {"constraint": {"kind": "regex", "text": "[0-9]+"}}},
             {"prompt": "b"},
             {"prompt": "c", "params": {"constraint": {"kind": "choice", "choices": ["x", "y"]}}}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    common = RequestParams(constraint=Constraint("json_object"))
    params = prompt_params(str(path), 3, common)
    assert [p.constraint.kind for p in params] == ["regex", "json_object", "choice"]


# --- servers' request fields ------------------------------------------------------------------------------

def test_each_dialect_sends_the_constraint_in_its_own_fields():
    from specaudit.engines.adapters import servers
    from specaudit.engines.adapters.request_fields import ParameterRefused

    schema, regex, choice, grammar, obj, lark = (RequestParams(constraint=c) for c in ONE_OF_EACH)
    body = servers.vllm_request([1, 2], 8, EOS, params=schema)
    assert body["structured_outputs"] == {"json": SCHEMA, "disable_any_whitespace": True}
    assert servers.vllm_request([1], 8, EOS, params=choice)["structured_outputs"] == {"choice": ["alpha", "beta", "gamma"]}
    assert servers.vllm_request([1], 8, EOS, params=obj)["structured_outputs"]["json_object"] is True
    guided = servers.VLLMEngine("http://127.0.0.1:9", structured_fields="guided").request([1], 8, EOS, regex)
    assert guided["guided_regex"] == ONE_OF_EACH[1].text and "structured_outputs" not in guided
    sampling = servers.sglang_request([1], 8, EOS, params=regex)["sampling_params"]
    assert sampling["regex"] == ONE_OF_EACH[1].text
    assert servers.sglang_request([1], 8, EOS, params=choice)["sampling_params"]["ebnf"] == 'root ::= "alpha" | "beta" | "gamma"'
    assert servers.llamacpp_request([1], 8, EOS, params=grammar)["grammar"] == ONE_OF_EACH[3].text
    for refused in (schema, regex, obj, lark):
        with pytest.raises(ParameterRefused):
            servers.llamacpp_request([1], 8, EOS, params=refused)
    assert servers.trtllm_request([1], 8, EOS, params=schema)["response_format"] == {"type": "json", "schema": SCHEMA}
    with pytest.raises(ParameterRefused):
        servers.sglang_request([1], 8, EOS, params=lark)


def test_an_unmasked_token_is_the_argmax_under_the_requests_other_processors():
    """A bonus token left unmasked under a logit bias is the biased argmax, not the raw one: the replay applies
    every processor of the request but the grammar before it asks what the unmasked row chooses."""
    from specaudit.engines.requests.reference import RequestResult
    from specaudit.equivalence.blackbox.constraints import constraint_cause

    vocab = 10
    raw = torch.zeros(1, vocab, dtype=torch.float64)
    raw[0, 5] = 3.0  # the raw argmax, which the grammar forbids
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[3] = True  # the grammar admits 3 alone: the reference's token
    reference = RequestResult(tokens=[3], finish_reason="length", stop_reason=None, text=None, logits=raw,
                              allowed=[allowed])
    biased = RequestParams(logit_bias=((7, 100.0),), constraint=Constraint("choice", choices=("a",)))
    cause = constraint_cause(0, biased, reference, [7], [EOS], None)
    assert cause is not None and cause.diagnosis_class == "constraint_unmasked"
    unbiased = RequestParams(constraint=Constraint("choice", choices=("a",)))
    assert constraint_cause(0, unbiased, reference, [5], [EOS], None).diagnosis_class == "constraint_unmasked"
    assert constraint_cause(0, unbiased, reference, [7], [EOS], None).diagnosis_class == "constraint_state"


def test_the_band_rules_a_constrained_divergence_on_the_masked_row():
    """Two admitted tokens tied exactly under the grammar, while the raw row's top two (both forbidden) lie far
    apart: a server that breaks the tie the other way made a near-tie, not a structural divergence. The ruling
    masks the reference's row with the grammar it chose under, as the reference did."""
    from specaudit.engines.requests.reference import RequestResult
    from specaudit.equivalence import rulings
    from specaudit.equivalence.blackbox.requests_run import _ruled

    vocab = 10
    raw = torch.zeros(1, vocab, dtype=torch.float64)
    raw[0, 7], raw[0, 8] = 10.0, 8.5  # forbidden: a margin of 1.5 between them
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[2, 4]] = True  # admitted, tied at 0.0: the reference takes the lower id
    reference = RequestResult(tokens=[2], finish_reason="length", stop_reason=None, text=None, logits=raw,
                              allowed=[allowed])
    params = RequestParams(constraint=Constraint("choice", choices=("a", "b")))
    band = rulings.noise_band("float32")
    tie = _ruled(0, [1], params, reference, [4], band, [EOS], "output", 1)
    assert tie.kind == "numerical" and tie.evidence["reference_margin"] == 0.0
    raw[0, 4] = -1.0  # the admitted token the server chose is now clearly below the reference's
    assert _ruled(0, [1], params, reference, [4], band, [EOS], "output", 1).kind == "structural"
