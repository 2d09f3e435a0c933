"""The foreign engines of `tests/foreign/row_cache_spec.py` (code written without the diagnosis in view): each
buggy variant named by its cause on at least 90% of its structural divergences, never `cross_row`;
the correct variant exact."""

from __future__ import annotations

from pathlib import Path

from foreign.expect import EXPECTED, audit_module, problems

MODULE = "row_cache_spec"


def test_variants_are_named_by_their_cause(tmp_path: Path) -> None:
    runs = audit_module(MODULE, "tiny-gpt2", tmp_path)
    found = [problem for run in runs for problem in problems(run, EXPECTED[MODULE][run["engine"].split(":")[1]])]
    assert not found, "\n".join(found)


def test_a_counter_past_rejected_slots_that_also_crops_the_caches_is_named_on_rotary_positions(tmp_path: Path) -> None:
    """On tiny-llama's rotary positions a constant shift is invisible, so what shows of `pos_rejected` is the
    counter running ahead of the caches it crops: some rejected entries stay visible beside wrong positions.
    Each divergence must still be named `position_ids` (one was `unknown` before the replay that rebuilds
    both caches as the counter crops them)."""
    from cli_run import audit, runs

    result = audit("--engine", f"foreign.{MODULE}:pos_rejected", "--engine", f"foreign.{MODULE}:correct",
                   "--pair", "tiny-llama", "--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "12",
                   "--no-adversarial", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    found = [problem for run in runs(tmp_path) for problem in problems(run, EXPECTED[MODULE][run["engine"].split(":")[1]])]
    assert not found, "\n".join(found)
    buggy = next(run for run in runs(tmp_path) if run["engine"].endswith(":pos_rejected"))
    assert all(d["diagnosis"]["class"] == "position_ids" for d in buggy["divergences"] if d["kind"] == "structural")
