"""Acceptance under sampling (equivalence/acceptance/sampled.py): per draft position, the expected accepted
count is the sum of alpha = sum_x min(p, q) over the verify steps that reached it, with variance
sum alpha (1 - alpha), and the findings test observed against it (equivalence/acceptance/findings.py).

- exact: the standard rejection sampler accepts draft j with probability sum min(p_j, q_j) given the drafts
  before it accepted (every outcome enumerated, equivalence/sampling/exact.py);
- the test's size and power, by simulation of the sequential Bernoullis it models;
- the verify steps and counts read off a trace;
- end to end through `specaudit audit --temperature`: EQSPEC and EXSPEC sampled show no finding; a draft cache
  that keeps rejected tokens (outputs still distributed as the target's) is `acceptance short` and fails
  `--require-acceptance`, with the chart in report.html.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from cli_run import audit, runs, usage_error
from specaudit.equivalence.sampling.exact import step_outcomes
from specaudit.engines.sampling.process import SamplingParams, process_logits
from specaudit.engines.sampling.rules import SpeculativeRule
from specaudit.engines.trace import StepRecord, Trace
from specaudit.equivalence.acceptance.findings import compare, unmet
from specaudit.equivalence.acceptance.observed import from_trace
from specaudit.equivalence.acceptance.sampled import expectation, observed_of, overlaps, verify_steps

FAULT = "acceptance_sampled_engines:draft_cache_not_trimmed"


def test_the_rejection_sampler_accepts_each_draft_with_the_overlap_of_p_and_q() -> None:
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.9, top_k=5)
    target, draft = torch.randn(3, 7, generator=generator, dtype=torch.float64), torch.randn(
        2, 7, generator=generator, dtype=torch.float64)  # [k+1, V], [k, V]: a fixed table, k = 2
    outcomes = step_outcomes(SpeculativeRule(), target, draft, params)
    reached_second = sum(prob for emitted, prob in outcomes.items() if len(emitted) >= 2)  # draft 0 accepted
    both = sum(prob for emitted, prob in outcomes.items() if len(emitted) == 3)
    p, q = process_logits(target, params), process_logits(draft, params)
    alpha = overlaps([p[:2]], [q])[0]  # [2]
    assert reached_second == pytest.approx(float(alpha[0]), abs=1e-12)
    assert both / reached_second == pytest.approx(float(alpha[1]), abs=1e-12)
    assert 0.05 < float(alpha[0]) < 0.95  # neither always nor never accepted


def _simulated(alphas: list[list[float]], scale: float, rng: random.Random):
    """Steps that draw each position's acceptance as a Bernoulli(scale x alpha) until the first rejection; one
    sample per step, whose output shows every reached position."""
    from specaudit.equivalence.acceptance.sampled import VerifyStep

    steps, outputs, tables = [], [], []
    for index, row in enumerate(alphas):
        accepted = 0
        while accepted < len(row) and rng.random() < scale * row[accepted]:
            accepted += 1
        steps.append(VerifyStep(index, 0, len(row), accepted, accepted + 1))
        outputs.append([0] * (len(row) + 1))
        tables.append(torch.tensor(row + [0.5], dtype=torch.float64))
    return steps, outputs, tables


def test_the_sampled_test_holds_its_size_and_sees_a_tenth_of_the_acceptance_lost() -> None:
    """300 steps of k = 3 with alphas in [0.5, 0.95]: under the model 200 runs give at most 6 false findings
    (alpha 0.01 family-wise: 2 expected; 6 has probability below 0.02; measured: 0, the continuity correction is
    conservative); the same steps at 0.9 x alpha are short in at least 130 of 200 (power about 0.8, measured 160:
    the shortfall at position 0, about 22 of 218 expected, is 3 standard deviations of sqrt(sum alpha (1 - alpha))
    = 7.3, against Holm's 2.7 at the first step)."""
    rng = random.Random(11)
    false, found = 0, 0
    for _ in range(200):
        alphas = [[rng.uniform(0.5, 0.95) for _ in range(3)] for _ in range(300)]
        for scale in (1.0, 0.9):
            steps, outputs, tables = _simulated(alphas, scale, rng)
            expected, counted = expectation(steps, outputs, tables, exact=True)
            short = any(f.kind == "acceptance short" for f in compare(counted, expected).findings)
            false += short and scale == 1.0
            found += short and scale == 0.9
    assert false <= 6 and found >= 130, (false, found)


def test_the_expectation_sums_alpha_over_the_reached_positions_and_leaves_out_what_the_output_hides() -> None:
    from specaudit.equivalence.acceptance.sampled import VerifyStep

    # one sample of 4 tokens: a step after 1 token accepts 2 of 3 drafts; the next, after 4, is cut by the budget
    # (it accepted 1 draft the row never emitted: position 1's prefix is hidden)
    steps = [VerifyStep(0, 1, 3, 2, 3), VerifyStep(0, 4, 3, 1, 0)]
    alpha = torch.tensor([0.0, 0.9, 0.8, 0.7, 0.6], dtype=torch.float64)
    expected, counted = expectation(steps, [[5, 6, 7, 8, 9]], [alpha], exact=True)
    assert expected.accepted_per_position == pytest.approx((0.9 + 0.6, 0.8, 0.7))
    assert expected.variance_per_position == pytest.approx((0.09 + 0.24, 0.16, 0.21))
    assert counted.accepted_per_position == (2, 1, 0) and counted.drafts_per_position == (2, 1, 2)
    assert expected.drafts_per_position == counted.drafts_per_position
    assert "1 reached draft position" in expected.note


def test_verify_steps_of_a_trace_give_its_counts() -> None:
    trace = Trace(num_prompts=2, draft_tokens=3)
    trace.record(StepRecord(0, "prefill", [0, 1], [0, 0], [0, 0], [1, 1]))
    trace.record(StepRecord(1, "batch", [0, 1], [0, 0], [3, 1], [4, 2]))
    trace.record(StepRecord(2, "batch", [1], [0], [0], [1], drafted_counts=[2]))
    steps = verify_steps(trace, first=10)
    assert [(s.sample, s.start, s.drafted, s.accepted) for s in steps] == [(10, 1, 3, 3), (11, 1, 3, 1),
                                                                            (11, 3, 2, 0)]
    mine, theirs = observed_of(steps, "x"), from_trace(trace)
    assert (mine.accepted_per_position, mine.drafts_per_position, mine.emitted_tokens) == (
        theirs.accepted_per_position, theirs.drafts_per_position, theirs.emitted_tokens)


SAMPLED = ["--pair", "tiny-llama", "--temperature", "1.0", "--samples", "128", "--batch-size", "32",
           "--draft-tokens", "3", "--max-new-tokens", "8", "--num-prompts", "4"]


def test_sampled_engines_meet_the_overlap_and_a_stale_draft_cache_is_short(tmp_path) -> None:
    """128 samples of 8 tokens, k = 3: about 320 verify steps; at position 0 the fault loses 85 of 336 expected
    acceptances against sqrt(V) = 6.8 (z = -12.5 at this seed, where Holm's first step needs -2.7); the correct
    engines' z are 0.7, 0.7 and 0.0, their overall ratio interval about +-4% wide (reports/acceptance/README.md)."""
    result = audit("--engine", "eqspec", "--engine", "exspec", "--engine", FAULT, *SAMPLED,
                   "--require-acceptance", "0.9", out=tmp_path)
    assert result.returncode == 1, result.stderr
    by_engine = {run["engine"]: run for run in runs(tmp_path)}
    for name in ("eqspec", "exspec"):
        record = by_engine[name]["acceptance"]
        assert record["expected"]["method"] == "sampled overlap" and record["expected"]["exact"]
        assert record["findings"] == [] and record["below_required"] == [], record["findings"]
        assert record["overall"]["ratio_low"] < 1 < record["overall"]["ratio_high"]
        assert by_engine[name]["verdict"] == "no departure found"
        assert not unmet(by_engine[name])
    fault = by_engine[FAULT]
    assert not fault["sampled"]["departs"]  # its tokens are distributed as the target's
    short = [f for f in fault["acceptance"]["findings"] if f["kind"] == "acceptance short"]
    assert short and 0 in short[0]["positions"]
    assert unmet(fault) and 0 in fault["acceptance"]["below_required"]
    gate = [line for line in result.stderr.splitlines() if line.startswith("acceptance short")]
    assert len(gate) == 1 and FAULT in gate[0]
    report = (tmp_path / "report.md").read_text()
    assert "## Acceptance per draft position" in report and "(sampled overlap)" in report
    assert "acceptance short at draft position" in report
    assert 'id="bar-observed-' in (tmp_path / "report.html").read_text()
    assert (tmp_path / "charts" / "sampled-acceptance-positions.svg").is_file()


def test_under_request_parameters_the_overlap_is_of_the_processed_target(tmp_path) -> None:
    """A repetition penalty of 2 moves the target's p far from the draft's q (the drafter draws from its raw
    logits, the target's are processed on each position's history): the expectation follows, no finding."""
    result = audit("--engine", "eqspec", *SAMPLED, "--repetition-penalty", "2.0", "--require-acceptance", "0.9",
                   out=tmp_path)
    assert result.returncode == 0, result.stderr
    record = runs(tmp_path)[0]["acceptance"]
    assert record["expected"]["method"] == "sampled overlap" and record["findings"] == []
    assert record["overall"]["ratio_low"] < 1 < record["overall"]["ratio_high"]


def test_a_baseline_of_a_sampled_run_and_the_options_it_refuses(tmp_path) -> None:
    first = audit("--engine", "eqspec", *SAMPLED, "--samples", "64", out=tmp_path / "a")
    assert first.returncode == 0, first.stderr
    again = audit("--engine", "eqspec", *SAMPLED, "--samples", "64", "--seed", "1", "--acceptance-baseline",
                  str(tmp_path / "a" / "audit.json"), out=tmp_path / "b")
    assert again.returncode == 0, again.stderr
    record = runs(tmp_path / "b")[0]["acceptance"]
    assert record["expected"]["method"] == "baseline" and record["findings"] == []
    assert json.loads((tmp_path / "a" / "audit.json").read_text())["runs"][0]["acceptance"]["positions"]
    usage_error(audit("--engine", "eqspec", *SAMPLED, "--speculation", "draft:k=3", out=tmp_path / "c"),
                "--speculation", "sampled")
    usage_error(audit("--engine", "eqspec", *SAMPLED, "--payoff", "2", out=tmp_path / "d"), "--payoff")


pytest_plugins = ["pytester"]


def test_the_plugin_s_sampled_test_gates_acceptance(pytester) -> None:
    from pathlib import Path

    pytester.syspathinsert(Path(__file__).resolve().parent)
    args = ["-p", "no:cacheprovider", "--specaudit-pair", "tiny-llama", "--specaudit-temperature", "1.0",
            "--specaudit-samples", "128", "--specaudit-sampled-new-tokens", "8", "--specaudit-sampled-draft-tokens",
            "3", "--specaudit-batch-size", "32", "--specaudit-seed", "3", "--specaudit-require-acceptance", "0.9",
            "-k", "specaudit-sampled"]
    result = pytester.runpytest_inprocess("--specaudit-engine", "eqspec", "--specaudit-engine", FAULT, *args)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*{FAULT} on tiny-llama, sampled at temperature 1: acceptance below 0.9 x expected*"])


def test_the_served_sampled_door_keeps_the_server_s_counters_and_says_why_no_expectation(tmp_path) -> None:
    """`--temperature 1 --reference vllm:URL` (no weights): the run's acceptance record holds what the server
    counted and, with no draft distribution to teacher-force, no expectation and the reason; so `--require-acceptance`
    cannot be applied, and fails the audit with one line saying what would apply it (equivalence/gates.py)."""
    from fake_server import FakeServer
    from served_lm import EOS, ToyLM, server_answer

    rng = random.Random(52)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [rng.randrange(0, 250) for _ in range(5)]}) + "\n"
                               for _ in range(4)))
    lm = ToyLM()
    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm)) as spec:
        result = audit("--engine", f"vllm:{spec.url}", "--reference", f"vllm:{plain.url}", "--prompts", str(prompts),
                       "--eos-token-id", str(EOS), "--max-new-tokens", "6", "--temperature", "1", "--samples", "40",
                       "--batch-size", "4", "--require-acceptance", "0.9", out=tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr  # the gate was asked for and could not be applied
    (gate,) = [line for line in result.stderr.splitlines() if line.startswith("--require-acceptance")]
    assert "was not applied" in gate and "teacher-force" in gate and "give --acceptance-baseline FILE" in gate
    record = runs(tmp_path / "out")[0]["acceptance"]
    assert record["expected"] is None and "teacher-force" in record["unavailable"]
    assert record["positions"] == [] and not unmet({"acceptance": record})
