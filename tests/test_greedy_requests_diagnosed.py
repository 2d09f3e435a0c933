"""Under request parameters a greedy run is judged as every greedy run is (equivalence/audit.py `audit_engine`):
a planted position bug under a frequency penalty is diagnosed by its cause, with acceptance per draft position and
the plain control beside it; the correct engine under the same requests is exact."""

from __future__ import annotations

from typing import Any

import pytest

from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.engines.requests import RequestParams
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.testing.faults.positions import PositionIdsCountPadding

NEW_TOKENS = 10


class PositionsOverPaddingUnderRequests(PositionIdsCountPadding):
    """The planted position bug, taking request parameters as its inner EQSPEC does: what the audit sets
    (`request_params`, `request_tokenizer`) is set on the inner engine."""

    request_params = property(lambda self: self.inner.request_params,
                              lambda self, value: setattr(self.inner, "request_params", value))
    request_tokenizer = property(lambda self: self.inner.request_tokenizer,
                                 lambda self, value: setattr(self.inner, "request_tokenizer", value))


@pytest.fixture(scope="module")
def pair() -> zoo.ModelPair:
    return zoo.load_pair("tiny-gpt2")


def _audit(engine: Any, pair: zoo.ModelPair, prompts: list[list[int]]) -> dict[str, Any]:
    requests = tuple(RequestParams(frequency_penalty=0.5, presence_penalty=0.2) for _ in prompts)
    return audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                                           dtype="float64", engine_name="under-requests",
                                                           batch_size=4, requests=requests))


def test_a_planted_position_bug_under_penalties_is_named_by_its_cause(pair: zoo.ModelPair) -> None:
    prompts = zoo.builtin_prompts()[:8]
    engine = PositionsOverPaddingUnderRequests(pair.target, pair.draft, batch_size=4, draft_tokens=4)
    run = _audit(engine, pair, prompts)
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert structural, "the planted bug changes tokens under the penalties"
    named = [d["diagnosis"]["class"] for d in structural]
    assert named.count("position_ids") >= 0.9 * len(named), named
    assert run["request_params"][0]["frequency_penalty"] == 0.5
    # acceptance is replayed along the processed continuation, as for every greedy run
    assert run["acceptance"]["expected"] is not None and run["acceptance"]["observed"]["drafted_tokens"] > 0


def test_the_correct_engine_under_the_same_requests_is_exact(pair: zoo.ModelPair) -> None:
    prompts = zoo.builtin_prompts()[:8]
    engine = make_engine("eqspec", pair.target, pair.draft, batch_size=4, draft_tokens=4)
    run = _audit(engine, pair, prompts)
    assert run["equivalent"] and run["divergences"] == [] and run["exact_matches"] == len(prompts)
