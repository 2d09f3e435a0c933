"""Diagnosis on code it was not written with: causes before symptoms, experiments before coincidences.

- three bug shapes of the paper's published code planted as line edits of EQSPEC
  (`property_tests/faults/outside.py`) are named by their cause;
- a minimal port of the published EQSPEC and EXSPEC (`tests/paper_engines.py`, factories without a
  pad option) is diagnosed `prompt_truncated`, `pad_as_content`, `stop_eos` and `output_order`, with
  at most one `unknown`, although some prompts crash it (crash isolation);
- with the pad id equal to EOS, the published EQSPEC's empty rows are not a length rule.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from specaudit.equivalence.audit import audit_engine
from specaudit.testing import models
from specaudit.testing.faults.outside import EXPECTED_OUTSIDE_CLASS, OUTSIDE_FAULTS, PROMPT_LIMIT

from cli_run import audit, runs

PAD, EOS = 256, 258  # tiny-llama's pad and EOS ids


def _content(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


FAULT_PROMPTS = {
    "prompts_cut_at_limit": ([_content(1, 5), _content(2, PROMPT_LIMIT + 20), _content(3, 7)], PAD),
    "output_slice_by_pad_value": ([[PAD] + _content(4, 4) + [PAD] + _content(5, 3), _content(6, 6), _content(7, 3)], PAD),
    "leading_eos_finished": ([_content(8, 3), _content(9, 7), _content(10, 5)], EOS),  # pad id = EOS
}


def audit_fault(fault, prompts: list[list[int]], pad: int, max_new_tokens: int = 6) -> dict:
    pair = models.pair("tiny-llama", "float64")

    def build(pad_id: int):
        return fault(pair.target, pair.draft, batch_size=4, draft_tokens=3, pad_token_id=pad_id)

    def rerun(indices: list[int], pad_token_id: int | None) -> list[list[int]]:
        engine = build(pad if pad_token_id is None else pad_token_id)
        return engine.generate([prompts[i] for i in indices], max_new_tokens, EOS)

    return audit_engine(build(pad), pair, prompts, max_new_tokens=max_new_tokens, eos_token_id=EOS, dtype="float64",
                        engine_name=fault.slug(), batch_size=4, rerun=rerun, pad_token_id=pad)


@pytest.mark.parametrize("fault", OUTSIDE_FAULTS, ids=lambda f: f.slug())
def test_outside_fault_is_named_by_its_cause(fault) -> None:
    prompts, pad = FAULT_PROMPTS[fault.slug()]
    record = audit_fault(fault, prompts, pad)
    structural = [d for d in record["divergences"] if d["kind"] == "structural"]
    assert structural, f"{fault.slug()} left no structural divergence"
    classes = {d["diagnosis"]["class"] for d in structural}
    assert classes == {EXPECTED_OUTSIDE_CLASS[fault.slug()]}, [d["diagnosis"] for d in structural]
    assert all(d["diagnosis"].get("decided_by") for d in structural)


def _paper_prompts(path: Path) -> Path:
    """Ordinary prompts, then the triggers of the published code's bugs: a pad-only prompt, the pad
    id first and inside, the EOS id inside, a prompt past 512 tokens (the engines cut at 512 here)."""
    prompts = [_content(20 + i, n) for i, n in enumerate((5, 7, 3, 9, 6, 4))]
    prompts += [[PAD], [PAD] + _content(30, 4) + [PAD] + _content(31, 4), _content(32, 4) + [EOS] + _content(33, 4),
                _content(34, 530)]
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    return path


def _classes(run: dict) -> collections.Counter:
    return collections.Counter(d["diagnosis"]["class"] for d in run["divergences"] if d["kind"] == "structural")


def test_published_code_is_diagnosed_by_cause_despite_its_crashes(tmp_path: Path) -> None:
    prompts = _paper_prompts(tmp_path / "prompts.jsonl")
    result = audit("--engine", "paper_engines:make_eqspec", "--engine", "paper_engines:make_exspec",
                   "--engine-option", "max_input_len=512", "--engine-option", "sort_by_length=true",
                   "--pair", "tiny-llama", "--batch-size", "4", "--max-new-tokens", "8", "--no-adversarial",
                   "--prompts", str(prompts), out=tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    eqspec, exspec = runs(tmp_path / "out")
    assert not eqspec.get("error") and not exspec.get("error")
    found = _classes(eqspec)
    assert {"pad_as_content", "stop_eos", "prompt_truncated"} <= set(found), found
    assert found["unknown"] <= 1 and found["stop_length"] == 0, found
    # EXSPEC crashes on the pad-only prompt (index 6); the other prompts are judged and its sorted output
    # order is named
    assert [f["prompt_index"] for f in exspec["failures"]] == [6], exspec["failures"]
    assert "IndexError" in exspec["failures"][0]["reason"] and exspec["failures"][0]["traceback"]
    assert exspec["exact_matches"] + exspec["structural_divergences"] == len(exspec["prompts"]) - 1
    found = _classes(exspec)
    assert "output_order" in found and found["unknown"] <= 1, found
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Prompts that made the engine fail" in report and "prompt 6" in report


def test_pad_equal_to_eos_is_not_a_length_rule(tmp_path: Path) -> None:
    prompts = _paper_prompts(tmp_path / "prompts.jsonl")
    result = audit("--engine", "paper_engines:make_eqspec", "--engine-option", "max_input_len=512",
                   "--pad-token-id", str(EOS), "--pair", "tiny-llama", "--batch-size", "4", "--max-new-tokens", "8",
                   "--no-adversarial", "--prompts", str(prompts), out=tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path / "out")
    found = _classes(run)
    assert found["pad_as_content"] + found["stop_eos"] > sum(found.values()) / 2, found
    assert found["stop_length"] == 0 and found["unknown"] <= 1, found
