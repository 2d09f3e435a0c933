"""Expected acceptance under structured outputs (equivalence/acceptance/run.py): the draft-model replay masks
the draft's proposals with the grammar state along the output, as `ModelDrafter` does with `DraftMask`, and the
target's choices past an output's end with the grammar too. In float64 it equals the observed counts per draft
position exactly for EQSPEC, EXSPEC and INPLACE under every constraint kind; a drafter left unmasked
(`DraftUnmasked`: outputs exact) is "acceptance short" and fails `--require-acceptance`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import audit, runs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
LINES = [{"prompt": "Hello", "params": {"constraint": {"kind": "json_schema", "schema": SCHEMA, "any_whitespace": False}}},
         {"prompt": "The JSON is", "params": {"constraint": {"kind": "regex", "text": "[a-f]{2,5}-[0-9]+"}}},
         {"prompt": "x", "params": {"constraint": {"kind": "choice", "choices": ["alpha", "beta", "gamma"]}}},
         {"prompt": "answer: ", "params": {"constraint": {"kind": "grammar",
                                                          "text": 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"'}}},
         {"prompt": "Once upon", "params": {"constraint": {"kind": "json_object", "any_whitespace": False}}}]
COMMON = ("--pair", "tiny-llama", "--max-new-tokens", "24", "--batch-size", "3", "--draft-tokens", "4",
          "--no-adversarial")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("constrained") / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def test_the_replay_equals_the_observed_counts_under_every_kind(prompts: Path, tmp_path: Path) -> None:
    result = audit("--engine", "eqspec", "--engine", "exspec", "--engine", "inplace", "--prompts", str(prompts),
                   *COMMON, out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for run in runs(tmp_path):
        acceptance = run["acceptance"]
        assert acceptance["unavailable"] is None, acceptance["unavailable"]
        expected, observed = acceptance["expected"], acceptance["observed"]
        assert expected["exact"] and sum(observed["accepted_per_position"]) > 0
        assert expected["accepted_per_position"] == observed["accepted_per_position"], run["engine"]
        assert expected["drafts_per_position"] == observed["drafts_per_position"], run["engine"]
        assert acceptance["findings"] == [], acceptance["findings"]


def test_an_unmasked_drafter_is_short_and_gated(prompts: Path, tmp_path: Path) -> None:
    result = audit("--engine", "specaudit.testing.faults.constrained:DraftUnmasked", "--prompts", str(prompts),
                   "--require-acceptance", "0.9", *COMMON, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    assert run["equivalent"] and run["exact_matches"] == len(LINES)  # the outputs pass
    kinds = [finding["kind"] for finding in run["acceptance"]["findings"]]
    assert "acceptance short" in kinds, run["acceptance"]["findings"]
    assert run["acceptance"]["overall"]["ratio"] < 0.5
