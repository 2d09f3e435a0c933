"""A black box the audit cannot watch (`tests/foreign/black_box_loop.py`: the padded loop declared
`black_box = True`): no provenance, so its diagnosis rests on the controlled re-runs. Padding attended is told
from padding counted by the re-run of the batch with another pad id (attended padding is read, so the row's
tokens change), not by a replay judged on tokens."""

from __future__ import annotations

from pathlib import Path

from foreign.expect import SETTINGS, structural


def test_attended_padding_in_a_black_box_is_named_by_another_pad_id(tmp_path: Path) -> None:
    from cli_run import audit, runs

    result = audit("--engine", "foreign.black_box_loop:correct", "--engine", "foreign.black_box_loop:mask_padding",
                   "--pair", "tiny-llama", *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    by_engine = {run["engine"].split(":")[1]: run for run in runs(tmp_path)}
    assert not structural(by_engine["correct"])
    found = structural(by_engine["mask_padding"])
    assert found
    for divergence in found:
        diagnosis = divergence["diagnosis"]
        assert diagnosis["class"] == "attention_mask", diagnosis
        assert "another pad id" in diagnosis["named_by"], diagnosis
        assert not any(step.startswith("provenance") and "not seen" not in step for step in diagnosis["tried"])
