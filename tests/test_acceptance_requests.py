"""Acceptance per draft position for greedy runs with request parameters (equivalence/acceptance/run.py): the
draft proposes from its raw logits as the engines' drafters do, and past an output's end the target's
continuation is its processed greedy choice (penalties, bias, min_tokens on the tokens so far), as the engines'
verify pass compares the drafts with it. In float64 the replay gives the engines' counts exactly, per position;
without the processing past the end it does not (the premise is checked, not assumed). A draft masked by a
grammar, or a sampled request, has no replay: the record says why, never a number."""

from __future__ import annotations

import pytest

from cli_run import audit, runs
from specaudit.engines.limits import eos_ids
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_with_params
from specaudit.equivalence.acceptance.expected import DraftModelProposer, replay
from specaudit.equivalence.acceptance.run import request_choosers, unreplayable
from specaudit.equivalence.acceptance.observed import from_trace
from specaudit.engines.registry import make_engine
from specaudit.testing.models import pair, prompts

CASES = {
    "penalties": ["--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
                  "--logit-bias", "65:2.0", "--min-tokens", "6"],
    "stop ids": ["--stop-token-id", "101", "--repetition-penalty", "1.2"],
    "stop strings": ["--stop", "e", "--stop", "th"],
}
SMALL = ["--pair", "tiny-llama", "--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "20",
         "--no-adversarial", "--draft-tokens", "3"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_replay_with_request_parameters_gives_the_engines_counts_exactly(case, tmp_path) -> None:
    result = audit("--engine", "eqspec", "--engine", "exspec", *SMALL, *CASES[case], "--require-acceptance", "1",
                   out=tmp_path)
    assert result.returncode == 0, result.stderr
    for run in runs(tmp_path):
        record = run["acceptance"]
        assert run["exact_matches"] == run["num_prompts"] and record["unavailable"] is None
        assert record["expected"]["exact"] and record["findings"] == []
        observed, expected = record["observed"], record["expected"]
        assert observed["accepted_per_position"] == expected["accepted_per_position"]
        assert observed["drafts_per_position"] == expected["drafts_per_position"]
        assert 0 < sum(expected["accepted_per_position"]) < sum(expected["drafts_per_position"])
    assert "## Acceptance per draft position" in (tmp_path / "report.md").read_text()


def test_past_the_end_the_continuation_is_the_processed_target_s() -> None:
    """The premise of the case above: with a strong penalty, the raw argmax past the outputs' ends would give
    other counts than the engine's."""
    built, k, budget = pair("tiny-llama"), 4, 6
    chosen = [list(p) for p in prompts()[:16]]
    params = [RequestParams(repetition_penalty=3.0)] * len(chosen)
    outputs = [decode_with_params(built.target, p, r, budget, built.eos_token_id, built.tokenizer).tokens
               for p, r in zip(chosen, params)]
    engine = make_engine("eqspec", built.target, built.draft, batch_size=4, draft_tokens=k,
                         pad_token_id=built.pad_token_id)
    engine.request_params = params
    assert engine.generate(chosen, budget, built.eos_token_id) == outputs
    observed = from_trace(engine.last_trace)
    stops = [sorted(eos_ids(built.eos_token_id))] * len(chosen)
    processed = replay(DraftModelProposer(built.draft), built.target, chosen, outputs, k,
                       choosers=request_choosers(params, chosen, stops, "output"))
    raw = replay(DraftModelProposer(built.draft), built.target, chosen, outputs, k)
    assert processed.accepted_per_position == observed.accepted_per_position
    assert raw.accepted_per_position != observed.accepted_per_position


def test_no_number_where_the_replay_would_be_wrong() -> None:
    draft = DraftModelProposer(None)
    assert "temperature" in unreplayable([RequestParams(temperature=0.5)], draft, black_box=False)
    assert "not known" in unreplayable([RequestParams(repetition_penalty=1.2)], draft, black_box=True)
    assert unreplayable([RequestParams(repetition_penalty=1.2)], draft, black_box=False) is None
    from specaudit.engines.constraints import Constraint
    from specaudit.equivalence.acceptance.expected import NgramProposer

    grammar = RequestParams(constraint=Constraint(kind="regex", text="[a-z]+"))
    assert "grammar" in unreplayable([grammar], NgramProposer(), black_box=False)
    assert unreplayable([RequestParams(presence_penalty=1.0)], NgramProposer(), black_box=True) is None
