"""The diagnosis on the outside-style engines (`tests/outside_styles.py`): plain torch and transformers engines
that batch as they like. Each planted bug named by its cause on at least 90% of its structural divergences, never
`cross_row` (no row reads another's), never `acceptance_rule` for an engine that does not speculate; the correct
twin beside it clean. The observation is of the audited call itself: `arrivals` batches otherwise on every call
(a re-run is not the run), and is named all the same."""

from __future__ import annotations

from pathlib import Path

import pytest

import outside_styles
from cli_run import audit, runs

SETTINGS = ("--pair", "tiny-gpt2", "--batch-size", "3", "--num-prompts", "8", "--max-new-tokens", "12")
SPECULATING = {"spec_solo_draft"}


@pytest.mark.parametrize("engine", ["arrivals_positions_over_padding", "arrivals_padding_visible",
                                    "at_once_positions_over_padding", "buckets_padding_visible",
                                    "slots_padding_visible"])
def test_an_outside_engine_is_named_by_its_cause(engine: str, tmp_path: Path) -> None:
    twin, cause = outside_styles.BUGGY[engine]
    result = audit("--engine", f"outside_styles:{engine}", "--engine", f"outside_styles:{twin}", *SETTINGS,
                   out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    buggy, correct = runs(tmp_path)
    assert correct["engine"].endswith(twin) and not correct["divergences"], correct["divergences"]
    structural = [d for d in buggy["divergences"] if d["kind"] == "structural"]
    classes = [d["diagnosis"]["class"] for d in structural]
    assert structural and classes.count(cause) >= 0.9 * len(classes), classes
    assert "cross_row" not in classes, classes
    if twin not in SPECULATING:
        assert "acceptance_rule" not in classes, classes
    tried = [line for d in structural for line in d["diagnosis"]["tried"]]
    assert not any("observation of the engine's inputs: not made" in line for line in tried), tried
    assert buggy["timing"]["observation_hooks"] > 0
