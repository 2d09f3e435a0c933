"""`--diagnosis quick` and `--diagnosis-budget`: the quick diagnosis runs no re-run of the engine and names
what the checks and replays decide, as the full one does; a spent budget stops the re-runs; each run
says how its time split."""

from __future__ import annotations

from pathlib import Path

from cli_run import audit, runs

ENGINES = ["position_engines:make_positions_over_padding", "position_engines:make_positions_over_rejected"]
ARGS = ["--pair", "tiny-qwen3", "--batch-size", "4", "--num-prompts", "4", "--max-new-tokens", "16", "--no-adversarial"]
# a planted fault that trims every row to the batch's smallest acceptance: alone each prompt is exact
CROSS_ROW = ["--engine", "specaudit.testing.faults:CacheTrimmedToSmallestAcceptance", "--pair", "tiny-llama",
             "--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "12", "--no-adversarial"]


def _classes(out: Path) -> list[list[tuple[int, int, str, str]]]:
    return [[(d["prompt_index"], d["position"], d["diagnosis"]["class"], d["diagnosis"].get("named_by"))
             for d in run["divergences"] if d["kind"] == "structural"] for run in runs(out)]


def test_quick_names_what_the_replays_decide_without_rerunning(tmp_path: Path) -> None:
    engines = [arg for engine in ENGINES for arg in ("--engine", engine)]
    full = audit(*engines, *ARGS, out=tmp_path / "full")
    quick = audit(*engines, *ARGS, "--diagnosis", "quick", out=tmp_path / "quick")
    assert full.returncode == quick.returncode == 1, quick.stdout + quick.stderr
    full_classes, quick_classes = _classes(tmp_path / "full"), _classes(tmp_path / "quick")
    assert all(full_classes) and full_classes == quick_classes  # decided by replays: the same in both
    for run in runs(tmp_path / "quick"):
        assert run["timing"]["diagnosis_mode"] == "quick" and run["timing"]["reruns"] == 0.0
        assert run["timing"]["replays"] > 0 and run["timing"]["engine"] > 0
    assert "Where the time went" in (tmp_path / "quick" / "report.md").read_text()


def test_quick_says_what_a_rerun_would_have_tried(tmp_path: Path) -> None:
    """A divergence only a re-run decides (`cross_row`: alone the prompt is exact) is not named by a quick
    diagnosis, which says the re-runs were left out; the full one names it."""
    full = audit(*CROSS_ROW, out=tmp_path / "full")
    quick = audit(*CROSS_ROW, "--diagnosis", "quick", out=tmp_path / "quick")
    assert full.returncode == quick.returncode == 1
    (full_run,), (quick_run,) = runs(tmp_path / "full"), runs(tmp_path / "quick")
    full_named = {d["diagnosis"]["class"] for d in full_run["divergences"] if d["kind"] == "structural"}
    quick_named = [d["diagnosis"] for d in quick_run["divergences"] if d["kind"] == "structural"]
    assert "cross_row" in full_named and full_run["timing"]["reruns"] > 0
    assert quick_named and quick_run["timing"]["reruns"] == 0.0
    for found in quick_named:
        assert found["class"] != "cross_row"
        if found["class"] == "unknown":
            assert any("quick diagnosis" in line for line in found["tried"]), found["tried"]


def test_a_spent_budget_starts_no_rerun(tmp_path: Path) -> None:
    result = audit(*CROSS_ROW, "--diagnosis-budget", "0.000001", out=tmp_path)
    assert result.returncode == 1
    (run,) = runs(tmp_path)
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert structural and all(d["diagnosis"]["class"] != "cross_row" for d in structural)
    assert any("budget" in line for d in structural for line in d["diagnosis"]["tried"])
