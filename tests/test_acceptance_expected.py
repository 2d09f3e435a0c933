"""Acceptance per draft position: expected (a replay of the proposer along the outputs) against observed
(the engine's own counts), the findings between them, and the gate (equivalence/acceptance/).

In float64 the replay of the draft model and of prompt lookup gives the project's engines' counts exactly,
per position, whatever the batch size; a draft-cache fault keeps every output exact and is named
"acceptance short" beside the draft-fidelity finding; `--require-acceptance` fails on it (exit 1).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from cli_run import audit, cli, runs
from specaudit.engines.reference import ReferenceDecoder
from specaudit.engines.registry import make_engine
from specaudit.equivalence.acceptance.expected import (DraftModelProposer, ExpectedAcceptance, NgramProposer,
                                                       parse_spec, replay)
from specaudit.equivalence.acceptance.findings import compare, unmet
from specaudit.equivalence.acceptance.observed import ObservedAcceptance, consistency, from_trace
from specaudit.testing.models import pair, prompts

NEW_TOKENS = 16
PROMPTS = 8


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> tuple[list[list[int]], list[list[int]]]:
    built = pair(name)
    chosen = [list(p) for p in prompts()[:PROMPTS]]
    return chosen, ReferenceDecoder(built.target).generate(chosen, NEW_TOKENS, built.eos_token_id)


@functools.lru_cache(maxsize=None)
def _expected(name: str, k: int) -> ExpectedAcceptance:
    chosen, outputs = _reference(name)
    return replay(DraftModelProposer(pair(name).draft), pair(name).target, chosen, outputs, k)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("engine", ["eqspec", "exspec", "inplace", "fixedshape"])
@pytest.mark.parametrize("batch_size", [1, 5])
def test_the_draft_model_replay_gives_the_engines_counts_exactly_per_position(name, engine, batch_size) -> None:
    built, k = pair(name), 3
    chosen, outputs = _reference(name)
    runner = make_engine(engine, built.target, built.draft, batch_size=batch_size, draft_tokens=k,
                         pad_token_id=built.pad_token_id)
    assert runner.generate(chosen, NEW_TOKENS, built.eos_token_id) == outputs
    observed, expected = from_trace(runner.last_trace), _expected(name, k)
    assert observed.accepted_per_position == expected.accepted_per_position
    assert observed.drafts_per_position == expected.drafts_per_position
    assert observed.verify_steps == expected.verify_steps
    assert 0 < expected.accepted_tokens < expected.drafted_tokens  # neither nothing nor everything accepted
    assert consistency(observed) == []
    assert compare(observed, expected, required=1.0).findings == ()


def test_the_replay_scores_drafts_past_a_rows_end_as_the_verify_pass_does() -> None:
    # the engines never clip k at the budget: a row's last step still verifies k drafts, and the target's
    # tokens past the output's end decide how many are accepted; cutting the continuation at the end loses them
    name, k = "tiny-llama", 3
    chosen, outputs = _reference(name)
    built = pair(name)
    full = _expected(name, k)
    cut = replay(_CutAtTheEnd(built.draft), built.target, chosen, outputs, k)
    runner = make_engine("eqspec", built.target, built.draft, batch_size=4, draft_tokens=k)
    runner.generate(chosen, NEW_TOKENS, built.eos_token_id)
    assert from_trace(runner.last_trace).accepted_per_position == full.accepted_per_position
    assert cut.accepted_per_position != full.accepted_per_position


class _CutAtTheEnd(DraftModelProposer):
    """The draft's proposals, but none counted past the output's end (the mistake the replay avoids)."""

    def proposals(self, continuation, emitted, k):
        count, tokens = super().proposals(continuation, emitted, k)
        known = len(continuation.tokens)

        def cut():
            for i, token in enumerate(tokens):
                yield token if emitted + i < known else -1
        return count, cut()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_ngram_replay_gives_prompt_lookups_counts_exactly(batch_size) -> None:
    name, k = "tiny-llama", 4
    built = pair(name)
    chosen, outputs = _reference(name)
    runner = make_engine("eqspec", built.target, built.draft, batch_size=batch_size, draft_tokens=k,
                         drafter="prompt-lookup")
    assert runner.generate(chosen, NEW_TOKENS, built.eos_token_id) == outputs
    observed = from_trace(runner.last_trace)
    expected = replay(NgramProposer(1, 3, "latest"), built.target, chosen, outputs, k)
    assert observed.drafts_per_position == expected.drafts_per_position  # fewer than k where the match ends
    assert observed.accepted_per_position == expected.accepted_per_position
    assert expected.drafts_per_position[0] > expected.drafts_per_position[-1]
    earliest = replay(NgramProposer(1, 3, "earliest"), built.target, chosen, outputs, k)
    assert earliest != expected  # the two rules propose differently on these outputs


def test_the_ngram_rule_takes_the_longest_suffix_and_vllms_earliest_occurrence() -> None:
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert NgramProposer(2, 2, "earliest").lookup(tokens, 2) == [4, 1]  # vLLM: [2, 3] first at 1
    assert NgramProposer(2, 2, "latest").lookup(tokens, 2) == [5, 1]  # the project's prompt lookup
    assert NgramProposer(1, 3, "earliest").lookup(tokens, 3) == [4, 1, 2]  # [1, 2, 3] beats shorter n-grams
    assert NgramProposer(1, 3, "earliest").lookup([7, 8, 9], 2) == []  # no earlier occurrence
    assert NgramProposer(2, 3, "earliest").lookup([5, 6, 5], 2) == []  # [5] alone is shorter than min
    assert NgramProposer(1, 2, "latest").lookup([4, 4, 4], 3) == [4]  # proposals end at the context's end


def test_speculation_specs_parse_or_refuse_in_one_line() -> None:
    spec = parse_spec("ngram:k=4,min=2,max=5")
    assert (spec.kind, spec.k, spec.min_ngram, spec.max_ngram, spec.occurrence) == ("ngram", 4, 2, 5, "earliest")
    assert parse_spec("draft:k=3").k == 3
    for bad in ("medusa:k=2", "ngram:min=2", "ngram:k=4,min=3,max=2", "draft:k=2,max=3", "ngram:k=x"):
        with pytest.raises(ValueError) as refused:
            parse_spec(bad)
        assert "\n" not in str(refused.value)


def _observed(accepted, drafts, **totals) -> ObservedAcceptance:
    return ObservedAcceptance(source="test", verify_steps=totals.get("steps", drafts[0]),
                              drafted_tokens=totals.get("drafted", sum(drafts)),
                              accepted_tokens=totals.get("accepted", sum(accepted)),
                              accepted_per_position=tuple(accepted), drafts_per_position=tuple(drafts),
                              emitted_tokens=totals.get("emitted"))


def _expectation(accepted, drafts, method="draft-model replay", exact=True) -> ExpectedAcceptance:
    return ExpectedAcceptance(method=method, exact=exact, k=len(drafts), verify_steps=drafts[0],
                              accepted_per_position=tuple(accepted), drafts_per_position=tuple(drafts))


def test_consistency_names_each_contradiction() -> None:
    assert consistency(_observed([60, 40, 20], [100, 100, 100], emitted=220)) == []
    problems = consistency(_observed([40, 60, 20], [100, 100, 90], drafted=300, emitted=500))
    assert any("rise from position 0" in p for p in problems)
    assert any("sum to 290, not the total 300" in p for p in problems)
    assert any("more tokens emitted (500)" in p for p in problems)
    assert any("more tokens accepted" in p for p in consistency(_observed([5], [4])))
    assert ObservedAcceptance.from_json(json.loads(json.dumps(_observed([3, 1], [4, 4]).to_json()))) == \
        _observed([3, 1], [4, 4])


def test_short_acceptance_is_found_per_position_with_holm_and_the_ratio_gate() -> None:
    expected = _expectation([300, 200, 100], [400, 400, 400])
    same = compare(_observed([300, 200, 100], [400, 400, 400]), expected)
    assert same.findings == () and same.overall["ratio"] == pytest.approx(1.0)
    short = compare(_observed([300, 200, 60], [400, 400, 400]), expected)
    kinds = {f.kind: f.positions for f in short.findings}
    assert kinds == {"acceptance short": (2,)}  # only position 2 is short
    assert short.positions[2].ratio == pytest.approx(0.6) and short.positions[2].ratio_high < 1
    # the gate: 0.6 x expected is below R = 0.9 significantly, above R = 0.5
    assert unmet({"acceptance": compare(_observed([300, 200, 60], [400, 400, 400]), expected, required=0.9).to_json()})
    assert not unmet({"acceptance": compare(_observed([300, 200, 60], [400, 400, 400]), expected,
                                            required=0.5).to_json()})
    assert not unmet({"acceptance": short.to_json()})  # no gate asked: a finding, no failure
    # a small shortfall on few proposals is chance, not a finding
    assert compare(_observed([7, 4, 2], [10, 10, 10]), _expectation([8, 5, 3], [10, 10, 10])).findings == ()


def test_excess_over_an_exact_expectation_is_impossible_and_over_an_estimate_a_note() -> None:
    observed = _observed([300, 290, 280], [400, 400, 400])
    exact = compare(observed, _expectation([300, 200, 100], [400, 400, 400]))
    assert [(f.kind, f.positions) for f in exact.findings] == [("acceptance impossible", (1, 2))]
    estimate = compare(observed, _expectation([300, 200, 100], [400, 400, 400], exact=False))
    assert [f.kind for f in estimate.findings] == ["acceptance above expected"]


def test_a_baseline_is_compared_with_a_two_sample_test() -> None:
    baseline = _expectation([300, 200, 100], [400, 400, 400], method="baseline", exact=False)
    assert compare(_observed([290, 195, 105], [400, 400, 400]), baseline).findings == ()
    found = compare(_observed([150, 100, 50], [400, 400, 400]), baseline)
    assert [(f.kind, f.positions) for f in found.findings] == [("acceptance short", (0, 1, 2))]
    # sampling error on both sides: the same counts against an exact expectation give a narrower interval
    exact = compare(_observed([150, 100, 50], [400, 400, 400]), _expectation([300, 200, 100], [400, 400, 400]))
    assert (found.positions[0].ratio_high - found.positions[0].ratio_low
            > exact.positions[0].ratio_high - exact.positions[0].ratio_low)


FAULTS = "specaudit.testing.faults:DraftCacheNotTrimmed"
SMALL = ["--pair", "tiny-llama", "--batch-size", "4", "--num-prompts", "6", "--max-new-tokens", "20",
         "--no-adversarial"]


def test_a_draft_cache_fault_is_named_acceptance_short_beside_draft_fidelity_and_fails_the_gate(tmp_path) -> None:
    result = audit("--engine", "eqspec", "--engine", FAULTS, *SMALL, "--require-acceptance", "0.9",
                   out=tmp_path)
    assert result.returncode == 1, result.stderr
    by_engine = {run["engine"]: run for run in runs(tmp_path)}
    correct, fault = by_engine["eqspec"], by_engine[FAULTS]
    assert correct["acceptance"]["findings"] == [] and correct["acceptance"]["expected"]["exact"]
    assert correct["acceptance"]["overall"]["ratio"] == pytest.approx(1.0)
    assert fault["exact_matches"] == fault["num_prompts"]  # every output exact
    assert "acceptance short" in {f["kind"] for f in fault["acceptance"]["findings"]}
    assert any(d.get("detected_by") == "draft" for d in fault["divergences"])  # the draft-fidelity finding
    gate = [line for line in result.stderr.splitlines() if line.startswith("acceptance short")]
    assert len(gate) == 1 and FAULTS in gate[0]
    verdict = [line for line in result.stdout.splitlines() if line.startswith("verdict:")]
    assert verdict and "acceptance short of 0.9 x expected in 1 run(s) (--require-acceptance: exit 1)" in verdict[-1]
    report = (tmp_path / "report.md").read_text()
    assert "## Acceptance per draft position" in report and "acceptance short at draft position" in report
    assert 'id="bar-observed-' in (tmp_path / "report.html").read_text()


def test_the_correct_engine_passes_the_gate_and_a_baseline_of_itself(tmp_path) -> None:
    first = audit("--engine", "eqspec", *SMALL, "--require-acceptance", "1", out=tmp_path / "a")
    assert first.returncode == 0, first.stderr
    again = audit("--engine", "inplace", *SMALL, "--acceptance-baseline", str(tmp_path / "a" / "audit.json"),
                  "--require-acceptance", "0.95", out=tmp_path / "b")
    assert again.returncode == 0, again.stderr
    record = runs(tmp_path / "b")[0]["acceptance"]
    assert record["expected"]["method"] == "baseline" and record["findings"] == []


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "x"])
def test_require_acceptance_outside_zero_to_one_is_refused_in_one_line(value, tmp_path) -> None:
    result = audit("--engine", "eqspec", *SMALL, "--require-acceptance", value, out=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--require-acceptance" in result.stderr


def test_an_unreadable_baseline_is_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "x.json").write_text("{}")
    result = cli("audit", "--engine", "eqspec", *SMALL, "--acceptance-baseline", str(tmp_path / "x.json"),
                 "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


pytest_plugins = ["pytester"]


def test_the_plugin_gate_fails_a_draft_cache_fault_and_passes_the_correct_engine(pytester) -> None:
    pytester.syspathinsert(Path(__file__).resolve().parent)
    args = ["-p", "no:cacheprovider", "--specaudit-pair", "tiny-llama", "--specaudit-batch-size", "4",
            "--specaudit-max-examples", "1", "--specaudit-max-new-tokens", "16", "--specaudit-no-adversarial",
            "--specaudit-require-acceptance", "0.9"]
    result = pytester.runpytest("--specaudit-engine", "eqspec", "--specaudit-engine", FAULTS, *args)
    result.assert_outcomes(passed=3, failed=1)  # both equivalence tests pass: the fault's outputs are exact
    result.stdout.fnmatch_lines([f"*{FAULTS} on tiny-llama, batch size 4: acceptance below 0.9 x expected*"])
    refused = pytester.runpytest("--specaudit-engine", "eqspec", *args[:-1], "2")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR


def _sleeping(seconds: float, tokens: int):
    import time

    def generate():
        time.sleep(seconds)
        return [[0] * tokens]
    return generate


def test_the_payoff_is_a_ratio_with_its_spread_and_names_a_slower_speculation() -> None:
    from specaudit.equivalence.acceptance.payoff import measure

    slower = measure(_sleeping(0.05, 10), _sleeping(0.005, 10), 3, "batched")
    assert slower.repeats == 3 and len(slower.ratios) == 3 and slower.ratio_high < 1
    assert slower.finding is not None and slower.finding.startswith("speculation slower than plain")
    faster = measure(_sleeping(0.005, 10), _sleeping(0.05, 10), 3, "batched")
    assert faster.ratio_low > 1 and faster.finding is None


def test_the_audit_reports_the_payoff_against_the_plain_control(tmp_path) -> None:
    result = audit("--engine", "eqspec", *SMALL, "--payoff", "2", out=tmp_path)
    assert result.returncode == 0, result.stderr  # the payoff never changes the verdict
    payoff = runs(tmp_path)[0]["acceptance"]["payoff"]
    assert payoff["plain_engine"] == "batched" and len(payoff["ratios"]) == 2
    assert payoff["ratio_low"] <= payoff["ratio_median"] <= payoff["ratio_high"]
    assert "payoff:" in (tmp_path / "report.md").read_text()


def test_counters_an_engine_keeps_itself_win_over_its_trace() -> None:
    from specaudit.engines.contract import Capabilities
    from specaudit.equivalence.acceptance.observed import of_run

    class Counting(Capabilities):
        last_acceptance = _observed([3, 1], [4, 4]).to_json()

    assert of_run(Counting(), None) == _observed([3, 1], [4, 4])
    totals = of_run(object(), None, {"drafted_tokens": 8, "accepted_tokens": 4, "source": "metrics"})
    assert (totals.drafted_tokens, totals.accepted_tokens, totals.accepted_per_position) == (8, 4, None)
    assert compare(totals, _expectation([3, 1], [4, 4])).unavailable == "no per-position counters were observed"


def test_a_replay_that_fails_leaves_the_run_without_an_expectation_not_without_its_verdict() -> None:
    from specaudit.equivalence.acceptance.run import acceptance_of_run

    record = acceptance_of_run(object(), None, None, target=object(), draft=object(), prompts=[[1, 2]],
                               outputs=[[3, 4, 5]], failed=set(), dtype="float64", k=2, spec="draft:k=2")
    assert record["expected"] is None and record["unavailable"].startswith("the draft-model replay failed")
    assert "\n" not in record["unavailable"]


def test_the_traces_acceptance_rate_is_the_one_definition_no_prefill_counted_as_drafted() -> None:
    built = pair("tiny-llama")
    chosen, _ = _reference("tiny-llama")
    runner = make_engine("eqspec", built.target, built.draft, batch_size=4, draft_tokens=3)
    runner.generate(chosen, NEW_TOKENS, built.eos_token_id)
    assert runner.last_trace.totals()["acceptance_rate"] == from_trace(runner.last_trace).rate
