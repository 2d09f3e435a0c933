"""A grammar after a reasoning section (`Constraint.reasoning_end`, a server's `--reasoning-parser`;
engines/constraints/matcher.py `ReasoningGate`): every token is admitted until the end marker, the grammar from
the token after it on. The constrained reference keeps the unconstrained output up to the marker and satisfies
the constraint after it; EQSPEC, EXSPEC and INPLACE equal it with the marker inside draft windows; the planted
fault of vLLM #34650 (a verify pass that began in reasoning is unmasked whole) diverges, breaks the constraint
and is named; the CLI refuses a marker without a constraint."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cli_run import audit as cli_audit, runs

from specaudit.engines.constraints import Constraint
from specaudit.engines.constraints.check import output_bytes, violation
from specaudit.engines.constraints.matcher import ReasoningGate, grammar_start, marker_ids, row_matcher
from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_with_params
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.testing.faults.constrained import GrammarLateAfterReasoning

EOS = 258
N = 24
PROMPTS = [list(b"Hello"), list(b"The JSON is"), list(b"Think first"), list(b"ok"), list(b"answer: ")]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
KINDS = [Constraint("regex", r"[a-f]{2,5}-\d+"), Constraint("json_schema", json.dumps(SCHEMA), any_whitespace=False),
         Constraint("choice", choices=("alpha", "beta", "gamma")), Constraint("regex", r"[0-9]{3,8}"),
         Constraint("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"')]


def with_marker(constraint: Constraint, marker: str) -> Constraint:
    return Constraint.from_dict({**constraint.to_dict(), "reasoning_end": marker})


@pytest.fixture(scope="module")
def pair():
    return zoo.load_pair("tiny-llama", dtype="float64")


@pytest.fixture(scope="module")
def vocab(pair) -> int:
    return int(pair.target.config.vocab_size)


def first_new_printable(prompt: list[int], tokens: list[int], *, after: int) -> int:
    """The index of the output's first printable byte at or past `after` that neither the prompt nor the output
    before it holds: a one-token marker whose first occurrence is known."""
    for k in range(after, len(tokens)):
        token = tokens[k]
        if 33 <= token <= 126 and token not in prompt and token not in tokens[:k]:
            return k
    raise AssertionError(f"no fresh printable byte in {tokens}")


@pytest.fixture(scope="module")
def cases(pair):
    """Per prompt: a constraint whose reasoning ends at a byte the unconstrained reference emits a few tokens in
    (so the marker lands inside a draft window), the index after it, and the constrained reference."""
    out = []
    for prompt, kind in zip(PROMPTS[:4], KINDS):
        free = decode_with_params(pair.target, prompt, RequestParams(), N, EOS, pair.tokenizer).tokens
        k = first_new_printable(prompt, free, after=2)
        params = RequestParams(constraint=with_marker(kind, chr(free[k])))
        ref = decode_with_params(pair.target, prompt, params, N, EOS, pair.tokenizer)
        out.append((prompt, params, k + 1, free, ref))
    return out


# --- the gate, token by token --------------------------------------------------------------------------

def test_the_gate_admits_everything_until_the_marker_and_the_grammar_after_it(pair, vocab):
    c = Constraint("regex", "[0-9]+", reasoning_end="</t>")
    assert marker_ids(c, pair.tokenizer) == tuple(b"</t>") and marker_ids(Constraint("regex", "a"), pair.tokenizer) == ()
    gate = row_matcher(c, pair.tokenizer, vocab, [EOS])
    assert isinstance(gate, ReasoningGate) and not gate.ended
    for token in b"x</":
        assert bool(gate.allowed().all()) and gate.advance(token)
    assert gate.advance(ord("t")) and not gate.ended and bool(gate.allowed().all())
    assert gate.advance(ord(">")) and gate.ended and gate.ended_at == 5
    allowed = gate.allowed()
    assert bool(allowed[ord("7")]) and not bool(allowed[ord("a")]) and not bool(allowed[EOS])
    assert not gate.advance(ord("a"))  # the grammar refuses it: not consumed
    assert gate.advance(ord("4")) and bool(gate.allowed()[EOS]) and gate.consumed == 6
    gate.rollback(2)  # the digit and the marker's last byte: back in the reasoning
    assert not gate.ended and bool(gate.allowed().all()) and gate.consumed == 4
    assert gate.advance(ord(">")) and gate.ended and not bool(gate.allowed()[EOS])  # the grammar from its start
    assert not row_matcher(c, pair.tokenizer, vocab, [EOS]).ended
    assert row_matcher(c, pair.tokenizer, vocab, [EOS], prompt=list(b"q</t>r")).ended  # the prompt ended it
    split = row_matcher(c, pair.tokenizer, vocab, [EOS], prompt=list(b"q</"))
    assert split.advance(ord("t")) and split.advance(ord(">")) and split.ended_at == 2  # begun in the prompt


def test_grammar_start_finds_the_first_marker_in_the_output_or_prompt():
    marker = tuple(b"</t>")
    assert grammar_start((), [1], [2, 3]) == 0
    assert grammar_start(marker, list(b"a</t>"), list(b"xyz")) == 0
    assert grammar_start(marker, list(b"a"), list(b"xy</t>12</t>3")) == 6
    assert grammar_start(marker, list(b"a</"), list(b"t>12")) == 2
    assert grammar_start(marker, list(b"a"), list(b"xy</t")) is None


def test_the_marker_round_trips_and_refuses_blank(pair):
    c = Constraint("regex", "[0-9]+", reasoning_end="</think>")
    assert Constraint.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.to_dict()["reasoning_end"] == "</think>" and "after </think>" in c.describe()
    assert RequestParams.from_dict(RequestParams(constraint=c).to_dict()).constraint == c
    for blank in (" ", "\n"):
        with pytest.raises(ValueError):
            Constraint("regex", "a", reasoning_end=blank)


# --- the reference -------------------------------------------------------------------------------------

def test_the_reference_keeps_the_reasoning_and_satisfies_the_constraint_after_the_marker(pair, cases):
    changed = 0
    for prompt, params, start, free, ref in cases:
        assert ref.tokens[:start] == free[:start]  # nothing masked before the marker
        assert grammar_start(marker_ids(params.constraint, pair.tokenizer), prompt, ref.tokens) == start
        for position in range(start):
            assert bool(ref.allowed[position].all())
        grammar_part = ref.tokens[start:]
        text, finished = output_bytes(grammar_part, pair.tokenizer, [EOS])
        assert violation(params.constraint, text, finished) is None, (params.constraint, text)
        changed += ref.tokens != free
        bare = Constraint.from_dict({k: v for k, v in params.constraint.to_dict().items() if k != "reasoning_end"})
        whole, whole_done = output_bytes(ref.tokens, pair.tokenizer, [EOS])
        assert violation(bare, whole, whole_done) is not None  # the reasoning itself is outside the grammar
    assert changed == len(cases)


def test_a_prompt_that_holds_the_marker_is_constrained_from_the_first_token(pair):
    c = Constraint("regex", r"[a-f]{2,5}-\d+", reasoning_end=":")
    ref = decode_with_params(pair.target, list(b"answer: "), RequestParams(constraint=c), N, EOS, pair.tokenizer)
    bare = decode_with_params(pair.target, list(b"answer: "), RequestParams(constraint=Constraint("regex", r"[a-f]{2,5}-\d+")),
                              N, EOS, pair.tokenizer)
    assert ref.tokens == bare.tokens


# --- the engines ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["eqspec", "exspec", "inplace", "batched"])
def test_own_engines_equal_the_reference_across_the_marker(pair, cases, name):
    prompts = [c[0] for c in cases]
    params = [c[1] for c in cases]
    engine = make_engine(name, pair.target, pair.draft, batch_size=3, draft_tokens=4)
    engine.request_params, engine.request_tokenizer = list(params), pair.tokenizer
    outputs = engine.generate([list(p) for p in prompts], N, EOS)
    assert outputs == [c[4].tokens for c in cases]
    if name != "batched":
        assert markers_inside_a_pass(engine, cases) > 0  # the premise: a marker inside a draft window


def markers_inside_a_pass(engine, cases) -> int:
    """How many rows' markers were emitted by a verify pass that emitted a token after them too."""
    at = engine.last_trace.emitted_at  # per row, the step that emitted each new token
    return sum(1 for row, case in enumerate(cases)
               if case[2] < len(at[row]) and at[row][case[2] - 1] == at[row][case[2]])


def test_the_grammar_late_after_reasoning_fault_diverges_and_is_named(pair, cases):
    prompts = [c[0] for c in cases]
    params = tuple(c[1] for c in cases)
    settings = RunSettings(max_new_tokens=N, eos_token_id=EOS, dtype="float64", engine_name="GrammarLateAfterReasoning",
                           batch_size=3, requests=params)
    good = make_engine("eqspec", pair.target, pair.draft, batch_size=3, draft_tokens=4)
    clean = audit_engine(good, pair, prompts, settings)
    assert clean["equivalent"] and clean["divergences"] == []
    fault = GrammarLateAfterReasoning(pair.target, pair.draft, batch_size=3, draft_tokens=4)
    record = audit_engine(fault, pair, prompts, settings)
    assert not record["equivalent"] and record["structural_divergences"] > 0
    classes = {d["diagnosis"]["class"] for d in record["divergences"]}
    assert "constraint_violation" in classes
    assert classes - {"constraint_violation"} <= {"constraint_unmasked", "constraint_state"}
    assert classes & {"constraint_unmasked", "constraint_state"}
    # without a marker the fault is EQSPEC
    bare = tuple(RequestParams(constraint=Constraint.from_dict({k: v for k, v in p.constraint.to_dict().items()
                                                                if k != "reasoning_end"})) for p in params)
    quiet = GrammarLateAfterReasoning(pair.target, pair.draft, batch_size=3, draft_tokens=4)
    assert audit_engine(quiet, pair, prompts, replace(settings, requests=bare))["equivalent"]


# --- the command line ----------------------------------------------------------------------------------

def test_cli_takes_a_marker_with_a_constraint_and_refuses_one_without(tmp_path):
    common = ("--pair", "tiny-llama", "--num-prompts", "2", "--max-new-tokens", "10", "--no-adversarial",
              "--batch-size", "2", "--engine", "eqspec")
    ok = cli_audit(*common, "--regex", "[0-9]+", "--reasoning-end", "e", out=tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    [record] = runs(tmp_path / "ok")
    assert record["request_params"][0]["constraint"] == {"kind": "regex", "text": "[0-9]+", "reasoning_end": "e"}
    refused = cli_audit(*common, "--reasoning-end", "</think>", out=tmp_path / "no")
    assert refused.returncode == 2 and "--reasoning-end" in refused.stderr
    searched = cli_audit(*common, "--search", "--budget", "2", "--reasoning-end", "e", out=tmp_path / "search")
    assert searched.returncode == 0, searched.stderr
    [record] = runs(tmp_path / "search")
    assert record["search"]["budget"]["reasoning_end"] == "e"
    blank = cli_audit(*common, "--search", "--budget", "2", "--reasoning-end", " ", out=tmp_path / "blank")
    assert blank.returncode == 2 and "--reasoning-end" in blank.stderr
