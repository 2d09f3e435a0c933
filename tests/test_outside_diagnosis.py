"""The diagnosis on the outside-style engines (`tests/outside_styles.py`): plain torch and transformers engines
that batch as they like. Each planted bug named by its cause on at least 90% of its structural divergences, never
`cross_row` (no row reads another's), never `acceptance_rule` for an engine that does not speculate; the correct
twin beside it clean. The observation is of the audited call itself: `arrivals` batches otherwise on every call
(a re-run is not the run), and is named all the same. In bfloat16 too (the twin then free of structural
divergences; flips inside the dtype's noise are numerical): a replay in float64 of the observed inputs confirms
the engine's token within the dtype's own noise, and the observed inputs rank before the pad-id re-run of
consecutive prompts and the output-order coincidence."""

from __future__ import annotations

from pathlib import Path

import pytest

import outside_styles
from cli_run import audit, runs

SETTINGS = ("--pair", "tiny-gpt2", "--batch-size", "3", "--num-prompts", "8", "--max-new-tokens", "12")
SPECULATING = {"spec_solo_draft"}


@pytest.mark.parametrize("engine,dtype", [("arrivals_positions_over_padding", "float64"),
                                          ("arrivals_padding_visible", "float64"),
                                          ("at_once_positions_over_padding", "float64"),
                                          ("buckets_padding_visible", "float64"),
                                          ("slots_padding_visible", "float64"),
                                          ("spec_solo_draft_positions_over_padding", "float64"),
                                          ("spec_solo_draft_padding_visible", "float64"),
                                          ("spec_solo_draft_stale_cache", "float64"),
                                          ("slots_positions_over_padding", "bfloat16"),
                                          ("right_padded_padding_visible", "bfloat16")])
def test_an_outside_engine_is_named_by_its_cause(engine: str, dtype: str, tmp_path: Path) -> None:
    twin, cause = outside_styles.BUGGY[engine]
    result = audit("--engine", f"outside_styles:{engine}", "--engine", f"outside_styles:{twin}", *SETTINGS,
                   "--dtype", dtype, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    buggy, correct = runs(tmp_path)
    assert correct["engine"].endswith(twin) and buggy["dtype"] == correct["dtype"] == dtype
    if dtype == "float64":
        assert not correct["divergences"], correct["divergences"]
    assert not [d for d in correct["divergences"] if d["kind"] == "structural"], correct["divergences"]
    structural = [d for d in buggy["divergences"] if d["kind"] == "structural"]
    classes = [d["diagnosis"]["class"] for d in structural]
    assert structural and classes.count(cause) >= 0.9 * len(classes), classes
    assert "cross_row" not in classes, classes
    if twin not in SPECULATING:
        assert "acceptance_rule" not in classes, classes
    tried = [line for d in structural for line in d["diagnosis"]["tried"]]
    assert not any("observation of the engine's inputs: not made" in line for line in tried), tried
    assert buggy["timing"]["observation_hooks"] > 0
