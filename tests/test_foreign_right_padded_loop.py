"""The foreign engine of `tests/foreign/right_padded_loop.py`, written after every other module of the corpus and
in the one layout none of them has (right padding: a gap of pads between a short prompt and its new tokens): its
buggy variants named by their cause on at least 90% of their structural divergences, never `cross_row`, the
correct variant exact, on absolute (tiny-gpt2) and rotary (tiny-llama) positions, by the provenance of what each
query read (the gap of pads visible, new tokens numbered by their column)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foreign.expect import EXPECTED, audit_module, problems

MODULE = "right_padded_loop"


@pytest.mark.parametrize("pair", ["tiny-gpt2", "tiny-llama"])
def test_variants_are_named_by_their_cause(pair: str, tmp_path: Path) -> None:
    runs = audit_module(MODULE, pair, tmp_path)
    assert {run["engine"].split(":")[1] for run in runs} == set(EXPECTED[MODULE])
    found = [problem for run in runs for problem in problems(run, EXPECTED[MODULE][run["engine"].split(":")[1]])]
    assert not found, "\n".join(found)
