"""A black box the audit cannot watch (`tests/foreign/black_box_loop.py`: the padded loop declared
`black_box = True`): no provenance, so its diagnosis rests on the controlled re-runs. The row exact alone and
divergent beside a neighbour of its padding whatever the neighbour, the re-run of its batch with another pad id
tells padding attended (read: its tokens change) from padding counted in its positions (they do not); no replay
judged on tokens picks between them. Rotary positions hide a row's constant shift, so the counted padding is
checked on absolute positions (tiny-gpt2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foreign.expect import SETTINGS, structural


@pytest.mark.parametrize("pair, variant, expected", [("tiny-llama", "mask_padding", "attention_mask"),
                                                     ("tiny-gpt2", "mask_padding", "attention_mask"),
                                                     ("tiny-gpt2", "pos_padded", "position_ids")])
def test_a_black_box_padding_bug_is_named_by_another_pad_id(pair: str, variant: str, expected: str,
                                                            tmp_path: Path) -> None:
    from cli_run import audit, runs

    result = audit("--engine", "foreign.black_box_loop:correct", "--engine", f"foreign.black_box_loop:{variant}",
                   "--pair", pair, *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    by_engine = {run["engine"].split(":")[1]: run for run in runs(tmp_path)}
    assert not structural(by_engine["correct"])
    found = structural(by_engine[variant])
    assert found
    for divergence in found:
        diagnosis = divergence["diagnosis"]
        assert diagnosis["class"] == expected, diagnosis
        assert "another pad id" in diagnosis["named_by"], diagnosis
        assert not any(step.startswith("provenance") and "not seen" not in step for step in diagnosis["tried"])
