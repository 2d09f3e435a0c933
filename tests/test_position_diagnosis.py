"""Two position-id bugs written outside the project (`tests/position_engines.py`): every structural
divergence they cause is diagnosed `position_ids` by a reproducing replay, never by the coincidence
that the engine's token is the draft's own choice; their correct twins are exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import audit, runs
from specaudit.equivalence.diagnosis.core import PROVENANCE

ENGINES = ["position_engines:make_positions_over_padding", "position_engines:make_positions_over_rejected",
           "position_engines:make_positions_over_padding_twin", "position_engines:make_positions_over_rejected_twin"]


# the adversarial prompts on one pair (tiny-gpt2: its 1024 positions make the long prompt ~500 tokens); on
# tiny-qwen3 the long one has 2100 tokens, and replaying its divergences took 35 of that case's 47 s
ADVERSARIAL = {"tiny-gpt2": [], "tiny-qwen3": ["--no-adversarial"]}


@pytest.mark.parametrize("pair", sorted(ADVERSARIAL))
def test_position_bugs_are_named_position_ids_and_their_twins_are_exact(pair: str, tmp_path: Path) -> None:
    args = [arg for engine in ENGINES for arg in ("--engine", engine)]
    result = audit(*args, "--pair", pair, "--batch-size", "4", "--num-prompts", "4", "--max-new-tokens", "16",
                   *ADVERSARIAL[pair], out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    padding, rejected, padding_twin, rejected_twin = runs(tmp_path)
    for run in (padding, rejected):
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        assert structural, f"{run['engine']} showed no divergence"
        classes = {d["diagnosis"]["class"] for d in structural}
        assert classes == {"position_ids"}, [(d["prompt_index"], d["diagnosis"]) for d in structural
                                             if d["diagnosis"]["class"] != "position_ids"]
        assert all(d["diagnosis"]["named_by"] in ("a reproducing replay", PROVENANCE) for d in structural)
        if len(structural) > 1:  # one mechanism, said so
            assert all(d["diagnosis"].get("shared") for d in structural)
    for twin in (padding_twin, rejected_twin):
        assert twin["equivalent"] and not twin["divergences"] and not twin["failures"], twin["engine"]
