"""What a run below float64 may hold whichever way the CPUs round: every prompt exact but for numerical flips at
near-ties. Which near-tie flips, if any, is the kernels' choice (docs/development.md, "Tests under other CPU
kernels"), so a test of a server's float32 numerics asserts this, not that no flip happens."""

from __future__ import annotations


def exact_but_for_near_ties(run: dict, context: str = "") -> None:
    """Every prompt of `run` exact or diverging only numerically, each divergence with what decided it."""
    diverged = {d["prompt_index"] for d in run["divergences"]}
    assert run["exact_matches"] + len(diverged) == run["num_prompts"], context
    assert run["structural_divergences"] == 0, context
    for divergence in run["divergences"]:
        assert divergence["kind"] == "numerical" and divergence["decided_by"], (divergence, context)
