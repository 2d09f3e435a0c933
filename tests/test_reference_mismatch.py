"""The plain engine proves the reference's request processing (rulings/plain.py `rule_processed`): where the
plain engine, under the same constraint, makes the speculative engine's divergence beyond the noise band, the
reference's grammar is not the server's. Those divergences are `reference_mismatch`, never the engine's bug:
no cause is named, the run's own verdict stays equivalent, and the audit exits 1 as not shown equivalent.

The engines (tests/grammar_elsewhere.py) apply JSON constraints with the other whitespace rule than the audit
is told (`--no-any-whitespace`), as a server started with another structured-output configuration would."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import audit, runs, usage_error

SETTINGS = ("--pair", "tiny-llama", "--json-object", "--no-any-whitespace", "--num-prompts", "6",
            "--max-new-tokens", "16", "--batch-size", "3")
ELSEWHERE = "grammar_elsewhere:EqspecOtherWhitespace"
PLAIN_ELSEWHERE = "grammar_elsewhere:BatchedOtherWhitespace"


def test_a_plain_engine_with_the_same_other_grammar_makes_every_divergence_a_reference_mismatch(tmp_path: Path) -> None:
    result = audit("--engine", ELSEWHERE, "--plain-engine", PLAIN_ELSEWHERE, *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    assert run["divergences"], "the whitespace rules must differ somewhere for the premise to hold"
    assert {d["kind"] for d in run["divergences"]} == {"reference_mismatch"}, run["divergences"]
    assert all(d["decided_by"] == "plain-control" and "diagnosis" not in d for d in run["divergences"])
    assert run["equivalent"] and run["structural_divergences"] == 0
    assert run["reference_mismatches"] == len(run["divergences"])
    assert run["plain_engine"]["reference_mismatches"] == len(run["divergences"])
    assert "reference" in result.stdout.strip().splitlines()[-1]
    report = (tmp_path / "report.md").read_text()
    assert "REFERENCE MISMATCH" in report.upper()


def test_the_same_engine_beside_a_plain_engine_with_the_references_grammar_is_its_own_bug(tmp_path: Path) -> None:
    result = audit("--engine", ELSEWHERE, "--plain-engine", "batched", *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    assert run["structural_divergences"] > 0 and not run["equivalent"]
    assert not any(d["kind"] == "reference_mismatch" for d in run["divergences"])
    assert run["plain_engine"]["exact_matches"] == run["num_prompts"]


def test_a_correct_engine_beside_its_plain_twin_under_a_constraint_passes(tmp_path: Path) -> None:
    result = audit("--engine", "eqspec", "--plain-engine", "batched", *SETTINGS, out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    assert run["divergences"] == [] and run["plain_engine"]["exact_matches"] == run["num_prompts"]


@pytest.mark.parametrize("plain", ["hf-batched"])
def test_a_plain_engine_that_takes_no_request_parameters_is_refused(plain: str, tmp_path: Path) -> None:
    usage_error(audit("--engine", "eqspec", "--plain-engine", plain, *SETTINGS, out=tmp_path), plain)
