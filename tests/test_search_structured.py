"""Structured outputs in the search (equivalence/search/strategies.py `drawn_constraints`): drawn only of the kinds
an engine takes (`pipeline.constraint_scope`), judged as the audit judges a constrained request. An engine that
leaves the bonus token unmasked passes the fixed audit (no constraint is sent) and the search finds it, named
`constraint_unmasked`, shrunk; EQSPEC under the same draws gives no finding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.equivalence.pipeline.settings import SearchSettings
from specaudit.equivalence.search.judging import Judging, JudgingSettings
from specaudit.equivalence.search.pipeline import constraint_scope
from specaudit.equivalence.search.run import search
from specaudit.testing.faults.constrained import BonusTokenUnmasked, GrammarLateAfterReasoning

EOS = 258
MAX_NEW = 16
POOL = [list(b"Hello"), list(b"The JSON is"), list(b"answer: ")]


@pytest.fixture(scope="module")
def pair():
    return zoo.load_pair("tiny-llama", dtype="float64")


def searched(pair, engine, name, tmp_path, examples, reasoning_end=""):
    judging = Judging(pair, engine, JudgingSettings(name, 3, "float64", MAX_NEW, EOS))
    return search(judging, search_settings=SearchSettings(examples=examples, seed=0, max_requests=3,
                                                          families=("constraint",), reasoning_end=reasoning_end),
                  pool=POOL, vocab_size=int(pair.target.config.vocab_size), out_dir=tmp_path, progress=False,
                  log=lambda line: None,
                  constraint_scope=constraint_scope(name, engine, pair.tokenizer, reasoning_end))


def test_an_unmasked_bonus_token_is_found_by_drawn_constraints_and_shrunk(pair, tmp_path):
    engine = BonusTokenUnmasked(pair.target, pair.draft, batch_size=3, draft_tokens=4)
    fixed = audit_engine(engine, pair, POOL, RunSettings(max_new_tokens=MAX_NEW, eos_token_id=EOS, dtype="float64",
                                                         engine_name="unmasked", batch_size=3))
    assert fixed["equivalent"], fixed["divergences"]

    result = searched(pair, engine, "unmasked", tmp_path, examples=20)
    assert result.findings, "the search found nothing"
    first = result.findings[0]
    assert ("constraint_unmasked", None) in first.signatures
    assert len(first.mix.requests) <= 3
    assert any(r.params.constraint is not None for r in first.mix.requests)
    assert result.run["search"]["coverage"]["constraints"]


def test_a_correct_engine_under_drawn_constraints_gives_no_finding(pair, tmp_path):
    engine = make_engine("eqspec", pair.target, pair.draft, batch_size=3, draft_tokens=4)
    result = searched(pair, engine, "eqspec", tmp_path, examples=20)
    assert not result.findings and result.run["equivalent"], result.run.get("divergences")
    assert sum(result.run["search"]["coverage"]["constraints"].values()) > 0


def test_each_engine_is_sent_only_the_constraints_it_takes(pair):
    class Plain:  # declares no `takes_constraints`
        pass

    assert constraint_scope("plain", Plain(), pair.tokenizer).kinds == ()
    assert constraint_scope("eqspec", make_engine("eqspec", pair.target, pair.draft, batch_size=2, draft_tokens=4),
                            pair.tokenizer).kinds == ("json_schema", "json_object", "regex", "choice", "grammar")
    assert constraint_scope("eqspec", make_engine("eqspec", pair.target, pair.draft, batch_size=2, draft_tokens=4), None).kinds == ()
    vllm = constraint_scope("vllm:http://127.0.0.1:1", None, pair.tokenizer)
    assert set(vllm.kinds) == {"json_schema", "json_object", "regex", "choice", "grammar"}
    assert vllm.syntaxes == ("ebnf",) and vllm.whitespace == (True,)
    llama = constraint_scope("llamacpp:http://127.0.0.1:1", None, pair.tokenizer)
    assert "regex" not in llama.kinds and {"choice", "grammar"} <= set(llama.kinds)
    assert llama.json_backend == "llguidance"


def test_a_grammar_ignored_after_reasoning_is_found_by_drawn_markers_and_shrunk(pair, tmp_path):
    """vLLM #34650: a pass that began in reasoning is unmasked whole. The fixed audit sends no constraint; the
    search draws markers from the reference's own text, finds it, and keeps the marker in the shrunk mix."""
    engine = GrammarLateAfterReasoning(pair.target, pair.draft, batch_size=3, draft_tokens=4)
    result = searched(pair, engine, "late", tmp_path, examples=30)
    assert result.findings, "the search found nothing"
    first = result.findings[0]
    classes = {signature[0] for signature in first.signatures}
    assert classes & {"constraint_unmasked", "constraint_state", "constraint_violation"}, classes
    assert any(r.params.constraint is not None and r.params.constraint.reasoning_end for r in first.mix.requests)
    assert result.run["search"]["coverage"]["constraints"]["after a reasoning end marker"] > 0


def test_a_servers_marker_goes_on_every_drawn_constraint(pair):
    vllm = constraint_scope("vllm:http://127.0.0.1:1", None, pair.tokenizer, "</think>")
    assert vllm.reasoning_end == "</think>"
    assert constraint_scope("vllm:http://127.0.0.1:1", None, pair.tokenizer).reasoning_end == ""
    eqspec = make_engine("eqspec", pair.target, pair.draft, batch_size=2, draft_tokens=4)
    assert constraint_scope("eqspec", eqspec, pair.tokenizer).reasoning_end is None  # drawn
    assert constraint_scope("eqspec", eqspec, pair.tokenizer, "e").reasoning_end == "e"


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_drawn_constraints_carry_the_scopes_marker_or_draw_one_from_the_text(data):
    from specaudit.engines.constraints import KINDS
    from specaudit.equivalence.search.strategies import ConstraintScope, Continuation, drawn_constraints

    continuation = Continuation(tokens=tuple(b"abc</t>{}"), text="abc</t>{}")
    fixed = data.draw(drawn_constraints(continuation=continuation, scope=ConstraintScope(kinds=KINDS,
                                                                                          reasoning_end="</think>")))
    assert fixed.reasoning_end == "</think>"
    none = data.draw(drawn_constraints(continuation=continuation, scope=ConstraintScope(kinds=KINDS)))
    assert none.reasoning_end == ""
    drawn = data.draw(drawn_constraints(continuation=continuation, scope=ConstraintScope(kinds=KINDS, reasoning_end=None)))
    assert drawn.reasoning_end == "" or drawn.reasoning_end in continuation.text[1:]
