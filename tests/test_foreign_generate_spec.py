"""The foreign engines of `tests/foreign/generate_spec.py` (code written without the diagnosis in view): each
buggy variant named by its cause on at least 90% of its structural divergences, never `cross_row`;
the correct variant exact."""

from __future__ import annotations

from pathlib import Path

from foreign.expect import EOS_ID, EXPECTED, STOP_VARIANTS, audit_module, problems

MODULE = "generate_spec"


def test_variants_are_named_by_their_cause(tmp_path: Path) -> None:
    variants = [v for v in EXPECTED[MODULE] if v not in STOP_VARIANTS]
    runs = audit_module(MODULE, variants, "tiny-gpt2", tmp_path / "plain")
    stops = ["correct"] + [v for v in EXPECTED[MODULE] if v in STOP_VARIANTS]
    if len(stops) > 1:
        runs += audit_module(MODULE, stops, "tiny-gpt2", tmp_path / "eos", eos=EOS_ID)
    found = [problem for run in runs for problem in problems(run, EXPECTED[MODULE][run["engine"].split(":")[1]])]
    assert not found, "\n".join(found)
