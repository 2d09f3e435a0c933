"""The foreign engines of `tests/foreign/generate_chunks.py` (code written without the diagnosis in view): each
buggy variant named by its cause on at least 90% of its structural divergences, never `cross_row`;
the correct variant exact."""

from __future__ import annotations

from pathlib import Path

from foreign.expect import EXPECTED, audit_module, problems

MODULE = "generate_chunks"


def test_variants_are_named_by_their_cause(tmp_path: Path) -> None:
    runs = audit_module(MODULE, "tiny-gpt2", tmp_path)
    found = [problem for run in runs for problem in problems(run, EXPECTED[MODULE][run["engine"].split(":")[1]])]
    assert not found, "\n".join(found)
